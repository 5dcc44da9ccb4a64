"""The `zipage` command line: replay, calibrate, generate, trace, report, compare, plan.

Every subcommand maps flags onto the same objects the Python API uses (`ZipageConfig`,
`ReplaySettings`). A `ZipageError` — anything a user can cause — prints one line and exits 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from zipage.errors import ZipageError
from zipage.flags import add_engine_flags, add_knob_flags, config_from_args, settings_from_args

# Exit statuses (docs/engine.md): 0 every request completed; 1 a `zipage compare --max-error`
# gate failed; 2 a mistake in the input, nothing ran; 3 the run finished and wrote its results,
# but some requests failed (e.g. too long for --max-model-len); 130 interrupted; 141 stdout
# closed early.
EXIT_OK = 0
EXIT_GATE = 1  # zipage compare: a --max-error gate was exceeded
EXIT_USAGE = 2
EXIT_REQUESTS_FAILED = 3

SUMMARY_ROWS = [
    ("requests", "requests", "{}"), ("completed", "completed", "{}"), ("failed", "failed", "{}"),
    ("output tokens", "output_tokens", "{:,}"), ("makespan (s)", "makespan_s", "{:,.1f}"),
    ("throughput (tok/s)", "tps", "{:,.1f}"), ("mean TTFT (s)", "mean_ttft_s", "{:,.3f}"),
    ("p90 TTFT (s)", "ttft_p90_s", "{:,.3f}"), ("mean TPOT (ms)", "mean_tpot_ms", "{:.2f}"),
    ("peak running", "peak_running", "{}"), ("mean running", "mean_running", "{:.1f}"),
    ("preemptions", "preemptions", "{:,}"), ("compressions", "compressions", "{:,}"),
    ("max blocks after compression", "max_blocks_after_compress", "{}"),
    ("mean kept budget (tokens)", "mean_kept_budget", "{:,.0f}"),
    ("N_max (blocks per request)", "n_max", "{}"),
    # M bounds the requests that hold a query slot; hybrid scheduling runs more without one.
    ("query slots M", "max_concurrency", "{}"),
    ("KV blocks", "num_blocks", "{:,}"), ("steps", "steps", "{:,}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
]


# ---------------------------------------------------------------- zipage replay

def cmd_replay(args: argparse.Namespace) -> int:
    from zipage.trace_import import load_trace_file

    trace = load_trace_file(args.trace)
    settings = settings_from_args(args)
    if args.out is not None:
        from zipage.rundir import check_run_out_dir

        check_run_out_dir(args.out)
    # On stderr, only at a terminal: never mixed into --json's stdout.
    show_progress = _progress_wanted(args)
    engine = "gpu" if args.gpu else args.engine
    # The simulator streams its run into --out itself (`_simulate_streamed`).
    streamed = engine == "sim" and args.step_times is None
    if args.step_times is not None:
        from zipage.sim.step_replay import replay_step_times

        summary, run = replay_step_times(trace, args.step_times, progress=show_progress)
    elif streamed:
        summary, run = _simulate_streamed(trace, settings, args, show_progress)
    else:
        summary, run = _replay_on_engine(trace, settings, engine, args, show_progress)
    summary = {"trace": trace.name, **summary}
    if args.out is not None and not streamed:
        from zipage.analysis.timeline import plot_run
        from zipage.rundir import write_run

        write_run(args.out, summary, run.steps, run.requests, run.decision_log,
                  decisions=args.decisions, finish=plot_run)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
        if "decisions_match" in summary:
            difference = summary["first_decision_difference"]
            print("  decisions: " + ("identical to the engine's, step for step"
                                     if summary["decisions_match"] else
                                     "not compared (the run has no decision log)"
                                     if not summary["decisions_compared"] else
                                     f"DIFFER from step {difference['step']}" if difference
                                     else "DIFFER: the engine ran steps the replay did not"))
        failed = [request for request in run.requests if request.error]
        for request in failed[:5]:
            print(f"  failed: {request.error}")
        if len(failed) > 5:
            print(f"  ... and {len(failed) - 5} more" + (" (requests.csv)" if args.out else ""))
        if args.out is not None:
            from zipage.rundir import DECISION_FORMATS

            log = DECISION_FORMATS[args.decisions]
            print(f"wrote {args.out}/summary.json, steps.csv, requests.csv, "
                  + (f"{log}, " if log else "") + "timeline.png")
    return run_status(summary)


def _simulate_streamed(trace, settings, args: argparse.Namespace, progress: bool):
    """The simulator's run, streamed: with --out its records are written to the run directory
    as they are made (summary.json and the timeline at the end), without it only the summary is
    gathered, so memory follows the requests in flight, not the trace's length."""
    from zipage.core.recorder import RecordSink
    from zipage.sim.simulate import simulate

    if args.out is None:
        return simulate(trace, settings, progress=progress, sink=RecordSink())
    from zipage.analysis.timeline import plot_run
    from zipage.rundir import RunWriter

    writer = RunWriter(args.out, args.decisions)
    try:
        summary, run = simulate(trace, settings, progress=progress,
                                log_decisions=_log_decisions(args), sink=writer)
    except BaseException:
        writer.discard()
        raise
    writer.close({"trace": trace.name, **summary}, finish=plot_run)
    return summary, run


def run_status(summary: dict) -> int:
    """0 when every request completed, EXIT_REQUESTS_FAILED when any failed."""
    return EXIT_OK if summary["failed"] == 0 else EXIT_REQUESTS_FAILED


NO_CUDA_FIX = "use --engine cpu for the CPU path (small models) or run the simulator (no flag)"


def _require_torch(engine: str, given: str = "--gpu", fix: str = NO_CUDA_FIX) -> None:
    """torch, and a CUDA device for `engine` "gpu"; `given` names how the user asked for the
    GPU and `fix` what to do instead, in the error."""
    try:
        import torch
    except ImportError as error:
        raise ZipageError("the real engine needs torch: pip install 'zipage[engine]' (on a "
                          "machine without a GPU first: pip install torch==2.13.0 --index-url "
                          "https://download.pytorch.org/whl/cpu; docs/engine.md)") from error
    if engine == "gpu" and not torch.cuda.is_available():
        raise ZipageError(f"{given}: no CUDA device is visible; {fix}")


def _engine_given(args: argparse.Namespace) -> str:
    """How --engine got its value, for an error: the user's flag, or the default."""
    if args.engine is None:
        args.engine = "gpu"
        return "--engine gpu (the default)"
    return f"--engine {args.engine}"


def _replay_on_engine(trace, settings, engine: str, args, progress: bool):
    _require_torch(engine)
    from zipage.engine.replay import replay_on_engine

    if engine == "cpu":
        from zipage.engine.threads import set_cpu_threads

        set_cpu_threads(args.threads)

    return replay_on_engine(trace, settings, "cuda" if engine == "gpu" else "cpu",
                            cuda_graphs=not args.no_cuda_graphs,
                            prefill_graphs=args.prefill_graphs, progress=progress,
                            log_decisions=_log_decisions(args))


def _progress_wanted(args: argparse.Namespace) -> bool:
    """Progress bars only on a terminal: in a log file or a pipe their carriage returns and
    erasing spaces become lines of noise."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def _close_progress_bars() -> None:
    """Close any bar an error interrupted, so the error starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or []):
        bar.close()


def _log_decisions(args: argparse.Namespace) -> bool:
    return args.out is not None and args.decisions != "none"


def describe_run(summary: dict) -> str:
    """One line naming the run: trace, model, driver, device and the knobs that shape it."""
    config = summary["settings"]["config"]
    if config["compress"]:
        mode = (f"budget {config['kv_budget']}, block {config['block_size']}, "
                f"{'hybrid' if config['hybrid'] else 'constrained'} scheduling")
    else:
        mode = f"Full KV (no compression), block {config['block_size']}"
    graphs = summary.get("graphs")
    if graphs is not None and summary["driver"] == "engine-cuda":
        graphed = [steps for steps in ("decode", "prefill") if graphs[steps]]
        mode += f", {' and '.join(graphed) if graphed else 'no'} CUDA graphs"
    return (f"{summary.get('trace', 'run')} on {summary['settings']['model']} · "
            f"{summary['driver']} on {summary['device']} · {mode}")


def print_summary(summary: dict, title: str | None = None) -> None:
    """The summary's rows under `title` (default: `describe_run`, which needs the run's
    settings; a served run has none)."""
    print(title or describe_run(summary))
    width = max(len(label) for label, _, _ in SUMMARY_ROWS)
    for label, key, pattern in SUMMARY_ROWS:
        value = summary.get(key)
        text = "-" if value is None else pattern.format(value)
        print(f"  {label:<{width}}  {text}")


# ---------------------------------------------------------------- zipage calibrate

def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.from_run:
        from zipage.sim.profile_from_runs import profile_from_runs

        return _write_profile(profile_from_runs(args.from_run, gpu=args.hardware,
                                                stall_factor=args.stall_factor), args.out)
    given = "--gpu" if args.gpu else _engine_given(args)
    engine = "gpu" if args.gpu else args.engine
    _require_torch(engine, given, "use --engine cpu for the CPU path (small models)")
    from zipage.engine.calibrate import calibrate
    from zipage.engine.threads import set_cpu_threads

    if engine == "cpu":
        set_cpu_threads(args.threads)

    # The hardware table entry is only the profile's label here (None: named after the GPU);
    # the engine plans its caches from the device it runs on.
    settings = replace(settings_from_args(args), hardware=args.hardware or "a100-80gb")
    profile = calibrate(settings, "cuda" if engine == "gpu" else "cpu", hardware=args.hardware,
                        repeats=args.repeats, progress=_progress_wanted(args),
                        cuda_graphs=not args.no_cuda_graphs, prefill_graphs=args.prefill_graphs)
    return _write_profile(profile, args.out)


def _write_profile(profile: dict, path: str) -> int:
    from zipage.sim.cost_model import CalibratedCostModel

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_profile_json(profile))
    model = CalibratedCostModel.from_profile(out)
    for name, fit in (("decode", model.decode_fit), ("prefill", model.prefill_fit),
                      ("mixed", model.mixed_fit), ("compress", model.compress_fit)):
        if fit is not None:
            quality = (f"relative RMS error {fit.relative_rms_error:.1%} over {fit.num_points} "
                       "points" if fit.num_points else "no points: the larger constant assumed")
            if name == "mixed" and fit.num_points and fit.host_s and not fit.host_fitted:
                quality += "; host bound: the prefill's (the points do not determine one)"
            print(f"{name:<8} {fit.describe()} s  ({quality})")
    print(f"wrote {out}; simulate with --cost-model {out}")
    return 0


def _profile_json(profile: dict) -> str:
    """The profile with one measured point per line (diffs stay readable)."""
    lines = []
    for key, value in profile.items():
        if isinstance(value, list):
            rows = ",\n".join(f"  {json.dumps(row)}" for row in value)
            lines.append(f' {json.dumps(key)}: [\n{rows}\n ]')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


# ---------------------------------------------------------------- zipage generate

def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    try:
        from zipage.engine.llm import LLM
        from zipage.engine.sampler import SamplingParams
    except ImportError as error:
        raise ZipageError("zipage generate needs the engine: pip install 'zipage[engine]'"
                          ) from error
    config = config_from_args(args)
    llm = LLM(args.model, dtype="auto" if args.dtype is None else args.dtype,
              device=args.device, kv_memory_gb=args.kv_memory_gb,
              gpu_memory_utilization=args.gpu_memory_utilization, threads=args.threads,
              tensor_parallel=args.tensor_parallel, **config.to_dict())
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    with llm:
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            if any(isinstance(prompt, list) for prompt in prompts):
                raise ZipageError("--chat: prompts must be text, not ids:...")
            outputs = llm.chat([[*system, {"role": "user", "content": prompt}]
                                for prompt in prompts], params, progress=False)
        else:
            outputs = llm.generate(prompts, params, progress=False)
    for index, (prompt, output) in enumerate(zip(prompts, outputs), start=1):
        if len(prompts) > 1:  # label each answer with its prompt, so they cannot run together
            print(f"{'' if index == 1 else chr(10)}[{index}/{len(prompts)}] {_short(prompt)}")
        if output.error is not None:
            print(f"[failed] {output.error}")
        else:
            print(output.text if output.text is not None else " ".join(map(str, output.token_ids)))
    failed = sum(output.error is not None for output in outputs)
    return EXIT_OK if not failed else EXIT_REQUESTS_FAILED


def _read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """The positional prompts, then one per non-empty line of --file (`-`: standard input)."""
    prompts = list(args.prompts)
    if args.file is not None:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ZipageError("prompts: give at least one prompt, or --file FILE (one prompt per "
                          "line; - reads standard input)")
    return [_parse_prompt(prompt) for prompt in prompts]


def _short(prompt: str | list[int], width: int = 70) -> str:
    text = prompt if isinstance(prompt, str) else "ids:" + ",".join(map(str, prompt))
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[:width - 3] + "..."


def _parse_prompt(prompt: str) -> str | list[int]:
    """A prompt is text, or token ids written as `ids:1,2,3` (for models without a tokenizer)."""
    if prompt.startswith("ids:"):
        try:
            return [int(token) for token in prompt[4:].split(",") if token]
        except ValueError as error:
            raise ZipageError(f"prompt: {prompt!r} is not a list of token ids like ids:1,2,3"
                              ) from error
    return prompt


# ---------------------------------------------------------------- zipage trace

def cmd_trace_make(args: argparse.Namespace) -> int:
    from zipage.trace import save_trace, stamp_arrivals
    from zipage.trace_import import load_trace_file
    from zipage.workloads import WORKLOADS, make_trace

    source = Path(args.kind)
    # A workload's name makes it; an existing file is a trace to re-stamp (any layout).
    if args.kind in WORKLOADS or not source.is_file():
        trace = make_trace(args.kind, args.seed)
    else:
        trace = load_trace_file(source)
    if args.rate is not None:
        trace = stamp_arrivals(trace, args.rate, pattern=args.arrivals, seed=args.seed,
                               burst_size=args.burst_size)
    output = Path(args.output)
    if output.is_dir():
        raise ZipageError(f"-o: {output} is a directory; give the trace file to write, e.g. "
                          f"{output / 'trace.json'}")
    output.parent.mkdir(parents=True, exist_ok=True)
    save_trace(trace, output)
    print(f"wrote {args.output}: {len(trace.requests)} requests")
    return 0


def cmd_trace_import(args: argparse.Namespace) -> int:
    from zipage.trace import save_trace
    from zipage.trace_import import ImportOptions, import_trace, parse_window

    output = Path(args.output)
    if output.is_dir():
        raise ZipageError(f"-o: {output} is a directory; give the trace file to write, e.g. "
                          f"{output / 'trace.jsonl.gz'}")
    options = ImportOptions(
        window=parse_window(args.window) if args.window is not None else None,
        speedup=args.speedup, sample=args.sample, seed=args.seed,
        max_model_len=args.max_model_len, name=args.name)
    trace, report = import_trace(args.format, args.file, options)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_trace(trace, output)
    print("\n".join(report.lines(trace)))
    print(f"wrote {args.output}: {len(trace.requests):,} requests")
    return 0


# ---------------------------------------------------------------- zipage report / compare

def cmd_report_ablation(args: argparse.Namespace) -> int:
    from zipage.analysis.ablation import (
        ABLATION_VARIANTS,
        PAPER_WORKLOADS,
        check_paper_directions,
        run_ablation,
        unjudged_workloads,
        write_ablation_report,
    )
    from zipage.rundir import check_out_dir
    from zipage.sim.simulate import simulate
    from zipage.trace import load_trace

    varied = sorted({flag for overrides in ABLATION_VARIANTS.values() for flag in overrides})
    for knob in varied:
        flag = _ABLATION_FLAGS[knob]
        if not getattr(args, knob):  # a --no-... flag sets its knob to False
            raise ZipageError(f"{flag}: report ablation runs every variant itself (Zipage, "
                              "w/o async, w/o hybrid, w/o prefix cache, Full KV); drop the flag")
    base = settings_from_args(args)
    check_out_dir(args.out)

    def simulate_variant(trace_path: str, overrides: dict) -> dict:
        settings = replace(base, config=replace(base.config, **overrides))
        summary, _ = simulate(load_trace(trace_path), settings)
        return summary

    table = run_ablation(args.traces, simulate_variant, progress=_progress_wanted(args))
    write_ablation_report(table, args.out)
    print((Path(args.out) / "ablation.md").read_text())
    checks = check_paper_directions(table)
    for claim, holds, detail in checks:
        print(f"  [{'yes' if holds else 'NO '}] {claim}: {detail}")
    skipped = unjudged_workloads(table)
    if skipped:
        print(f"  not judged: {', '.join(skipped)} (the paper's claims are about "
              f"{', '.join(PAPER_WORKLOADS)}; these rows are in the table only)")
    if not checks:
        print("  no claim of the paper can be judged on these traces")
    return 0


# The ablation's own variants: their flags make no sense on `report ablation`.
_ABLATION_FLAGS = {"async_compress": "--no-async", "hybrid": "--no-hybrid",
                   "prefix_cache": "--no-prefix-cache", "compress": "--no-compress"}


def cmd_compare(args: argparse.Namespace) -> int:
    from zipage.analysis.compare import compare_runs, exceeded, format_report, parse_max_errors

    limits = parse_max_errors(args.max_error)  # a bad gate fails before the runs are read
    comparison = compare_runs(args.run_a, args.run_b)
    print(format_report(comparison))
    failed = exceeded(comparison["errors"], limits)
    for line in failed:
        print(f"zipage compare: gate failed: {line}", file=sys.stderr)
    if limits and not failed:
        print(f"all {len(limits)} gates passed: "
              + ", ".join(f"{name} <= {100 * limit:g}%" for name, limit in limits.items()))
    return EXIT_GATE if failed else EXIT_OK


# ---------------------------------------------------------------- entry point

def add_graph_flags(parser: argparse.ArgumentParser) -> None:
    """The real engine's CUDA graph flags (replay, calibrate, serve)."""
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="real engine: capture no CUDA graphs (every step eager)")
    parser.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="real engine: replay prefill and mixed steps of up to 4,096 tokens "
                             "as CUDA graphs too, padded to a token bucket (default: on where "
                             "CUDA graphs are captured; docs/engine.md, 'CUDA graphs')")


def _add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU engine: torch threads (default: $ZIPAGE_CPU_THREADS, else "
                             "$OMP_NUM_THREADS, else half the cores; see docs/engine.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zipage", description="Compressed PagedAttention inference and its simulator twin",
        epilog="examples:\n"
               "  zipage replay traces/amc23.json                 # simulate Zipage on an A100\n"
               "  zipage replay traces/amc23.json --no-compress   # the Full-KV baseline\n"
               "  zipage replay traces/tiny.json --engine cpu --model random:smollm2-135m\n"
               "  zipage generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat \"Hi!\"\n"
               "  zipage plan traces/amc23.json --hardware a100,h100 --budget 1024,2048\n"
               "\n"
               "Exit status: 0 done; 1 a `compare --max-error` gate failed; 2 a mistake in the input "
               "(one line on\nstderr); 3 the run finished but some requests failed (results "
               "written). docs/engine.md has more.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    from zipage import __version__

    parser.add_argument("--version", action="version", version=f"zipage {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser(
        "replay", help="replay a trace (simulator by default)",
        description="Replay a trace through the simulator (default) or the real engine and print "
                    "the summary; --out writes the run directory.",
        epilog="examples:\n"
               "  zipage replay traces/amc23.json --budget 1024 --hardware h100\n"
               "  zipage replay traces/mixture.json --no-hybrid --json\n"
               "  zipage replay traces/longbench.json --out runs/lb --decisions gzip\n"
               "  zipage replay traces/tiny.json --engine cpu --model random:smollm2-135m "
               "--threads 1\n"
               "\n"
               "Exit status: 0 every request completed; 2 a mistake in the input; 3 some "
               "requests failed\n(their reasons are printed and in requests.csv).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("trace", help="trace JSON (see docs/traces.md)")
    add_engine_flags(replay)
    replay.add_argument("--gpu", action="store_true",
                        help="run the real engine on the GPU (same as --engine gpu)")
    replay.add_argument("--engine", choices=["sim", "gpu", "cpu"], default="sim",
                        help="sim (default), the real engine on the GPU, or on the CPU (small "
                             "models; --kv-memory-gb defaults to 1)")
    add_graph_flags(replay)
    _add_threads_flag(replay)
    replay.add_argument("--json", action="store_true",
                        help="print exactly one JSON object (the summary) on stdout")
    replay.add_argument("--out", default=None, help="directory for summary.json, steps.csv, "
                        "requests.csv, decisions.log and timeline.png")
    replay.add_argument("--decisions", choices=["plain", "gzip", "none"], default="plain",
                        help="with --out: the per-step decision log as decisions.log (plain, "
                             "default), decisions.log.gz (gzip: a tenth of the size; 140 MB "
                             "plain for amc23.json) or not at all (none: zipage compare then "
                             "skips the decision check)")
    replay.add_argument("--step-times", default=None, metavar="RUN_DIR",
                        help="drive the simulator with an engine run's measured step times "
                             "(its --out directory): it must make the engine's decisions step "
                             "for step (docs/cost_model.md)")
    replay.add_argument("--no-progress", action="store_true")
    replay.set_defaults(handler=cmd_replay)

    calibrate = commands.add_parser(
        "calibrate", help="time the real engine's steps and write a simulator cost profile")
    add_engine_flags(calibrate)
    calibrate.set_defaults(hardware=None)
    calibrate.add_argument("--gpu", action="store_true",
                           help="measure on the GPU (same as --engine gpu)")
    calibrate.add_argument("--engine", choices=["gpu", "cpu"], default=None,
                           help="gpu (default) or cpu (small models, to try the command out; "
                                "--hardware then names the GPU entry the profile stands for)")
    add_graph_flags(calibrate)
    _add_threads_flag(calibrate)
    calibrate.add_argument("--from-run", nargs="+", default=None, metavar="RUN_DIR",
                           help="fit the profile from engine runs' steps.csv (their --out "
                                "directories) instead of measuring; --hardware labels it")
    calibrate.add_argument("--stall-factor", type=float, default=None, metavar="X",
                           help="with --from-run: leave out decode steps slower than X times "
                                "their run's median decode step (mid-run kernel compilation) "
                                "and the compressions they launched (default: keep every step)")
    calibrate.add_argument("--repeats", type=int, default=5,
                           help="timed repeats per point; the median is kept (default 5)")
    calibrate.add_argument("--out", required=True,
                           help="profile JSON to write (e.g. sim/profiles/qwen3-8b-h200.json)")
    calibrate.set_defaults(handler=cmd_calibrate)

    generate = commands.add_parser(
        "generate", help="generate text with the real engine",
        description="Generate with the real engine. Defaults differ from the Python API's "
                    "SamplingParams on purpose: greedy decoding (--temperature 0) and 128 tokens, "
                    "so the same command prints the same text (SamplingParams: 1.0 and 256).",
        epilog="examples:\n"
               "  zipage generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat "
               "\"What is the capital of France?\"\n"
               "  zipage generate --model path/to/model_dir \"The capital of France is\" "
               "\"2 + 2 =\"\n"
               "  cat prompts.txt | zipage generate --model path/to/model.gguf --file -\n"
               "  zipage generate --model random:smollm2-135m ids:1,2,3 --max-tokens 8",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    generate.add_argument("prompts", nargs="*",
                          help="prompt text, or token ids as ids:1,2,3 for random-weight models")
    generate.add_argument("--file", default=None,
                          help="read more prompts from FILE, one per line (- reads stdin)")
    generate.add_argument("--chat", action="store_true",
                          help="wrap each prompt as a user message in the model's chat template "
                               "(instruct models)")
    generate.add_argument("--system", default=None,
                          help="with --chat: a system message before each prompt")
    generate.add_argument("--model", required=True,
                          help="HF model directory, .gguf file or random:<preset>")
    generate.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    generate.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                          help="default: bfloat16 on the GPU, float32 on the CPU")
    generate.add_argument("--kv-memory-gb", type=float, default=None,
                          help="memory for KV blocks + query slots (default: 1 on the CPU; "
                               "what the GPU has left on the GPU)")
    generate.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                          help="share of GPU memory Zipage may use (default 0.9)")
    generate.add_argument("--max-tokens", type=int, default=128,
                          help="output tokens at most per prompt (default 128)")
    generate.add_argument("--temperature", type=float, default=0.0,
                          help="0 is greedy (default 0)")
    generate.add_argument("--top-k", type=int, default=0, help="0 keeps every token (default 0)")
    generate.add_argument("--top-p", type=float, default=1.0,
                          help="1.0 keeps every token (default 1.0)")
    generate.add_argument("--seed", type=int, default=None,
                          help="sampling seed (default: unseeded)")
    generate.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token")
    generate.add_argument("--tensor-parallel", type=int, default=1,
                          help="ranks (GPUs, or CPU processes) the model is sharded over "
                               "(default 1)")
    _add_threads_flag(generate)
    add_knob_flags(generate)
    generate.set_defaults(handler=cmd_generate)

    trace = commands.add_parser("trace", help="make workload traces")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    make = trace_commands.add_parser("make", help="generate a workload trace")
    from zipage.workloads import WORKLOADS

    make.add_argument("kind", help=f"{', '.join(WORKLOADS)} - or a trace .json to re-stamp "
                                   "with arrivals (docs/traces.md)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("-o", "--output", required=True)
    make.add_argument("--rate", type=float, default=None,
                      help="stamp online arrivals at this many requests per second")
    make.add_argument("--arrivals", choices=["poisson", "bursty"], default="poisson")
    make.add_argument("--burst-size", type=int, default=8)
    make.set_defaults(handler=cmd_trace_make)
    from zipage.trace_import import FORMATS

    imported = trace_commands.add_parser(
        "import", help="turn a production trace (Azure, Mooncake, BurstGPT) into a Zipage trace",
        description="Read a production trace and write a Zipage trace (docs/traces.md, "
                    "'Production traces'). A .jsonl.gz output is the compact large-trace form.")
    imported.add_argument("format", choices=FORMATS)
    imported.add_argument("file", help="the production trace (CSV or JSON Lines, optionally .gz)")
    imported.add_argument("-o", "--output", required=True,
                          help="the trace to write: .json, .jsonl or .jsonl.gz")
    imported.add_argument("--window", default=None, metavar="START:DURATION",
                          help="only requests arriving in this span from the first one, e.g. "
                               "0:3600 or 2h:30m")
    imported.add_argument("--speedup", type=float, default=1.0, metavar="X",
                          help="compress time: arrivals X times closer together (default 1)")
    imported.add_argument("--sample", type=float, default=1.0, metavar="P",
                          help="keep each request with probability P (default 1: all)")
    imported.add_argument("--seed", type=int, default=0, help="seed of --sample")
    imported.add_argument("--max-model-len", type=int, default=None, metavar="N",
                          help="drop requests whose prompt + output exceed N tokens (counted)")
    imported.add_argument("--name", default=None, help="the trace's name (default: the file's)")
    imported.set_defaults(handler=cmd_trace_import)

    report = commands.add_parser("report", help="reports over several simulated runs")
    report_commands = report.add_subparsers(dest="report_command", required=True)
    ablation = report_commands.add_parser(
        "ablation", help="Zipage vs no-async / no-hybrid / no-prefix-cache / Full KV")
    ablation.add_argument("traces", nargs="+",
                          help="trace JSON files; the paper's claims are judged on "
                               "amc23/gsm8k/mixture/longbench.json, other traces are tabulated")
    add_engine_flags(ablation)
    for action in ablation._actions:  # the variants set these themselves
        if set(action.option_strings) & set(_ABLATION_FLAGS.values()):
            action.help = argparse.SUPPRESS
    ablation.add_argument("--out", required=True)
    ablation.add_argument("--no-progress", action="store_true")
    ablation.set_defaults(handler=cmd_report_ablation)

    compare = commands.add_parser(
        "compare", help="how far two runs of one trace agree",
        description="Compare two run directories of one trace: scheduling decisions line by "
                    "line, step durations, per-request TTFT/TPOT/finish and the summaries. Errors "
                    "are of RUN_A against RUN_B: (A - B) / B.",
        epilog="example:\n"
               "  zipage replay traces/tiny.json --out runs/sim\n"
               "  zipage replay traces/tiny.json --engine cpu --model random:smollm2-135m "
               "--out runs/cpu\n"
               "  zipage compare runs/sim runs/cpu   # (the model and device differ: expect "
               "setup differences)\n"
               "  zipage compare runs/sim runs/gpu --max-error tps=3 --max-error ttft_p90=10"
               "   # a regression gate",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("run_a", metavar="RUN_A",
                         help="a run directory (zipage replay --out), typically the simulator's")
    compare.add_argument("run_b", metavar="RUN_B",
                         help="the run to compare against, typically the real engine's")
    compare.add_argument(
        "--max-error", action="append", default=[], metavar="METRIC=PCT",
        help="fail (exit 1) when |error| of METRIC exceeds PCT percent, or cannot be measured; "
             "repeat for several. METRIC: makespan, tps, ttft_p50/p90/p99, tpot_p50/p90/p99, "
             "e2e_mape (per-request end-to-end latency), decisions (share of decision lines "
             "that differ)")
    compare.set_defaults(handler=cmd_compare)

    from zipage.plan_cli import add_plan_command
    from zipage.serve.cli import add_serve_commands

    add_plan_command(commands)
    add_serve_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"zipage: error: {unknown_arguments(parser, args, unknown)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args)
    except ZipageError as error:
        _close_progress_bars()
        print(f"zipage: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("zipage: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`zipage replay ... | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as error:
        # A path the user gave cannot be read or written (missing, a file where a directory
        # belongs, no permission): theirs to fix, so one line. OSErrors without a path are bugs.
        if error.filename is None:
            raise
        _close_progress_bars()
        print(f"zipage: error: {error.filename}: {error.strerror or error}", file=sys.stderr)
        return EXIT_USAGE


def unknown_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      unknown: list[str]) -> str:
    """One line naming the first argument the subcommand does not take and, for a mistyped flag,
    the subcommand's closest flags: argparse would print the top-level usage, which names no
    flag of the subcommand at all."""
    import difflib

    command = _subcommand_parser(parser, args)
    flags = [item for item in unknown if item.startswith("-") and item != "-"]
    first = (flags or unknown)[0]
    others = len(flags) - 1
    more = f" (and {others} more)" if others > 0 else ""
    if first not in flags:
        return (f"{command.prog}: unexpected argument {first!r}{more}; "
                f"`{command.prog} --help` lists what it takes")
    flag = first.split("=", 1)[0]
    options = sorted({option for action in command._actions for option in action.option_strings
                      if action.help != argparse.SUPPRESS})
    close = difflib.get_close_matches(flag, options, n=2, cutoff=0.7)
    hint = (f"did you mean {' or '.join(close)}?" if close
            else f"`{command.prog} --help` lists its flags")
    return f"{command.prog}: unknown flag {flag}{more}; {hint}"


def _subcommand_parser(parser: argparse.ArgumentParser,
                       args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser the arguments selected: `zipage trace make`'s for
    `zipage trace make ...`."""
    while True:
        subcommands = next((action for action in parser._actions
                            if isinstance(action, argparse._SubParsersAction)), None)
        chosen = getattr(args, subcommands.dest, None) if subcommands is not None else None
        if chosen is None:
            return parser
        parser = subcommands.choices[chosen]


if __name__ == "__main__":
    sys.exit(main())
