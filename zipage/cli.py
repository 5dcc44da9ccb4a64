"""The `zipage` command line: replay, calibrate, generate, trace, report, compare, plan.

Every subcommand maps flags onto the same objects the Python API uses (`ZipageConfig`,
`ReplaySettings`). A `ZipageError` — anything a user can cause — prints one line and exits 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
import sys
from pathlib import Path

from zipage.errors import ZipageError
from zipage.flags import add_engine_flags, add_knob_flags, config_from_args, settings_from_args

SUMMARY_ROWS = [
    ("requests", "requests", "{}"), ("completed", "completed", "{}"), ("failed", "failed", "{}"),
    ("output tokens", "output_tokens", "{:,}"), ("makespan (s)", "makespan_s", "{:,.1f}"),
    ("throughput (tok/s)", "tps", "{:,.1f}"), ("mean TPOT (ms)", "mean_tpot_ms", "{:.2f}"),
    ("peak running", "peak_running", "{}"), ("mean running", "mean_running", "{:.1f}"),
    ("preemptions", "preemptions", "{:,}"), ("compressions", "compressions", "{:,}"),
    ("max blocks after compression", "max_blocks_after_compress", "{}"),
    ("N_max", "n_max", "{}"), ("max concurrency M", "max_concurrency", "{}"),
    ("KV blocks", "num_blocks", "{:,}"), ("steps", "steps", "{:,}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
]


# ---------------------------------------------------------------- zipage replay

def cmd_replay(args: argparse.Namespace) -> int:
    from zipage.trace import load_trace

    trace = load_trace(args.trace)
    settings = settings_from_args(args)
    show_progress = not args.no_progress and not args.json
    engine = "gpu" if args.gpu else args.engine
    if engine == "sim":
        from zipage.sim.simulate import simulate

        summary, run = simulate(trace, settings, progress=show_progress,
                                log_decisions=args.out is not None)
    else:
        summary, run = _replay_on_engine(trace, settings, engine, args, show_progress)
    if args.out is not None:
        from zipage.analysis.timeline import plot_run
        from zipage.rundir import write_run

        plot_run(write_run(args.out, summary, run.steps, run.requests, run.decision_log))
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary, title=f"{trace.name} on {settings.model} "
                                     f"({summary['driver']}, {settings.hardware})")
        failed = [request for request in run.requests if request.error]
        for request in failed[:5]:
            print(f"  failed: {request.error}")
        if args.out is not None:
            print(f"wrote {args.out}/summary.json, steps.csv, requests.csv, decisions.log, "
                  "timeline.png")
    return 0


def _require_torch(engine: str) -> None:
    try:
        import torch
    except ImportError as error:
        raise ZipageError("the real engine needs torch: pip install 'zipage[engine]' (on a "
                          "machine without a GPU: pip install torch==2.13.0 first)") from error
    if engine == "gpu" and not torch.cuda.is_available():
        raise ZipageError("--gpu: no CUDA device is visible; use --engine cpu for the CPU path "
                          "(small models) or run the simulator (no flag)")


def _replay_on_engine(trace, settings, engine: str, args, progress: bool):
    _require_torch(engine)
    from zipage.engine.replay import replay_on_engine

    return replay_on_engine(trace, settings, "cuda" if engine == "gpu" else "cpu",
                            cuda_graphs=not args.no_cuda_graphs, progress=progress,
                            log_decisions=args.out is not None)


def print_summary(summary: dict, title: str) -> None:
    print(title)
    width = max(len(label) for label, _, _ in SUMMARY_ROWS)
    for label, key, pattern in SUMMARY_ROWS:
        value = summary.get(key)
        text = "-" if value is None else pattern.format(value)
        print(f"  {label:<{width}}  {text}")


# ---------------------------------------------------------------- zipage calibrate

def cmd_calibrate(args: argparse.Namespace) -> int:
    engine = "gpu" if args.gpu else args.engine
    _require_torch(engine)
    from zipage.engine.calibrate import calibrate
    from zipage.sim.cost_model import CalibratedCostModel

    # The hardware table entry is only the profile's label here (None: named after the GPU);
    # the engine plans its caches from the device it runs on.
    settings = replace(settings_from_args(args), hardware=args.hardware or "a100-80gb")
    profile = calibrate(settings, "cuda" if engine == "gpu" else "cpu", hardware=args.hardware,
                        repeats=args.repeats, progress=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_profile_json(profile))
    model = CalibratedCostModel.from_profile(out)
    for name, fit in (("decode", model.decode_fit), ("prefill", model.prefill_fit),
                      ("compress", model.compress_fit)):
        if fit is not None:
            terms = " + ".join(f"{c:.3g} * {f}" for c, f in
                               zip(fit.coefficients[1:], fit.feature_names[1:]))
            print(f"{name:<8} {fit.coefficients[0]:.3g} + {terms} s  (relative RMS error "
                  f"{fit.relative_rms_error:.1%} over {fit.num_points} points)")
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
    try:
        from zipage.engine.llm import LLM
        from zipage.engine.sampler import SamplingParams
    except ImportError as error:
        raise ZipageError("zipage generate needs the engine: pip install 'zipage[engine]'"
                          ) from error
    config = config_from_args(args)
    llm = LLM(args.model, dtype="auto" if args.dtype is None else args.dtype,
              device=args.device, kv_memory_gb=args.kv_memory_gb,
              gpu_memory_utilization=args.gpu_memory_utilization,
              tensor_parallel=args.tensor_parallel, **config.to_dict())
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    prompts = [_parse_prompt(prompt) for prompt in args.prompts]
    for output in llm.generate(prompts, params, progress=False):
        if output.error is not None:
            print(f"[failed] {output.error}")
        else:
            print(output.text if output.text is not None else " ".join(map(str, output.token_ids)))
    return 0


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
    from zipage.trace import load_trace, save_trace, stamp_arrivals
    from zipage.workloads import make_trace

    source = Path(args.kind)
    trace = load_trace(source) if source.suffix == ".json" else make_trace(args.kind, args.seed)
    if args.rate is not None:
        trace = stamp_arrivals(trace, args.rate, pattern=args.arrivals, seed=args.seed,
                               burst_size=args.burst_size)
    save_trace(trace, args.output)
    print(f"wrote {args.output}: {len(trace.requests)} requests")
    return 0


# ---------------------------------------------------------------- zipage report / compare

def cmd_report_ablation(args: argparse.Namespace) -> int:
    from zipage.analysis.ablation import check_paper_directions, run_ablation, write_ablation_report
    from zipage.sim.simulate import simulate
    from zipage.trace import load_trace

    base = settings_from_args(args)

    def simulate_variant(trace_path: str, overrides: dict) -> dict:
        settings = replace(base, config=replace(base.config, **overrides))
        summary, _ = simulate(load_trace(trace_path), settings)
        return summary

    table = run_ablation(args.traces, simulate_variant, progress=not args.no_progress)
    write_ablation_report(table, args.out)
    print((Path(args.out) / "ablation.md").read_text())
    for claim, holds, detail in check_paper_directions(table):
        print(f"  [{'yes' if holds else 'NO '}] {claim}: {detail}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from zipage.analysis.compare import compare_runs, format_report

    print(format_report(compare_runs(args.sim_dir, args.real_dir)))
    return 0


# ---------------------------------------------------------------- entry point

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zipage", description="Compressed PagedAttention inference and its simulator twin")
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser("replay", help="replay a trace (simulator by default)")
    replay.add_argument("trace", help="trace JSON (see docs/traces.md)")
    add_engine_flags(replay)
    replay.add_argument("--gpu", action="store_true",
                        help="run the real engine on the GPU (same as --engine gpu)")
    replay.add_argument("--engine", choices=["sim", "gpu", "cpu"], default="sim",
                        help="sim (default), the real engine on the GPU, or on the CPU (small "
                             "models; --kv-memory-gb defaults to 1)")
    replay.add_argument("--no-cuda-graphs", action="store_true",
                        help="real engine: run decode eagerly")
    replay.add_argument("--json", action="store_true",
                        help="print exactly one JSON object (the summary) on stdout")
    replay.add_argument("--out", default=None, help="directory for summary.json, steps.csv, "
                        "requests.csv, decisions.log and timeline.png")
    replay.add_argument("--no-progress", action="store_true")
    replay.set_defaults(handler=cmd_replay)

    calibrate = commands.add_parser(
        "calibrate", help="time the real engine's steps and write a simulator cost profile")
    add_engine_flags(calibrate)
    calibrate.set_defaults(hardware=None)
    calibrate.add_argument("--gpu", action="store_true",
                           help="measure on the GPU (same as --engine gpu)")
    calibrate.add_argument("--engine", choices=["gpu", "cpu"], default="gpu",
                           help="gpu (default) or cpu (small models, to try the command out; "
                                "--hardware then names the GPU entry the profile stands for)")
    calibrate.add_argument("--repeats", type=int, default=5,
                           help="timed repeats per point; the median is kept (default 5)")
    calibrate.add_argument("--out", required=True,
                           help="profile JSON to write (e.g. sim/profiles/qwen3-8b-h200.json)")
    calibrate.set_defaults(handler=cmd_calibrate)

    generate = commands.add_parser("generate", help="generate text with the real engine")
    generate.add_argument("prompts", nargs="+",
                          help="prompt text, or token ids as ids:1,2,3 for random-weight models")
    generate.add_argument("--model", required=True,
                          help="HF model directory, .gguf file or random:<preset>")
    generate.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    generate.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                          help="default: bfloat16 on the GPU, float32 on the CPU")
    generate.add_argument("--kv-memory-gb", type=float, default=None)
    generate.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    generate.add_argument("--tensor-parallel", type=int, default=1,
                          help="ranks (GPUs, or CPU processes) the model is sharded over")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--ignore-eos", action="store_true")
    add_knob_flags(generate)
    generate.set_defaults(handler=cmd_generate)

    trace = commands.add_parser("trace", help="make workload traces")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    make = trace_commands.add_parser("make", help="generate a workload trace")
    make.add_argument("kind", help="amc23, gsm8k, mixture, longbench, tiny - or a trace .json to "
                                   "re-stamp with arrivals")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("-o", "--output", required=True)
    make.add_argument("--rate", type=float, default=None,
                      help="stamp online arrivals at this many requests per second")
    make.add_argument("--arrivals", choices=["poisson", "bursty"], default="poisson")
    make.add_argument("--burst-size", type=int, default=8)
    make.set_defaults(handler=cmd_trace_make)

    report = commands.add_parser("report", help="reports over several simulated runs")
    report_commands = report.add_subparsers(dest="report_command", required=True)
    ablation = report_commands.add_parser(
        "ablation", help="Zipage vs no-async / no-hybrid / no-prefix-cache / Full KV")
    ablation.add_argument("traces", nargs="+")
    add_engine_flags(ablation)
    ablation.add_argument("--out", required=True)
    ablation.add_argument("--no-progress", action="store_true")
    ablation.set_defaults(handler=cmd_report_ablation)

    compare = commands.add_parser("compare", help="how far two runs of one trace agree")
    compare.add_argument("sim_dir")
    compare.add_argument("real_dir")
    compare.set_defaults(handler=cmd_compare)

    from zipage.plan_cli import add_plan_command

    add_plan_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ZipageError as error:
        print(f"zipage: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zipage: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`zipage replay ... | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
