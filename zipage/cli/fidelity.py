"""`zipage fidelity`: check the twin on this machine: calibrate (or take a profile), run fresh
traces through the engine, simulate each with the profile and with the analytic model, print the
errors."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path

from zipage.cli.calibrate import (
    add_loop_flags,
    add_quick_limits,
    check_quick_limits,
    print_validation,
    save_profile,
    shipped_path,
)
from zipage.cli.flags import (
    add_engine_flags,
    add_graph_flags,
    add_threads_flag,
    engine_given,
    require_torch,
    settings_from_args,
)
from zipage.cli.output import progress_wanted

DEFAULT_TRACES = 4
DEFAULT_TRACE_SECONDS = 30.0


def add_parser(commands) -> None:
    fidelity = commands.add_parser(
        "fidelity", help="check the simulator against the engine on fresh traces",
        description="Calibrate a profile through the engine loop (or take --cost-model), run "
                    "fresh traces the calibration never saw through the engine, simulate each "
                    "with the profile and with the analytic model, and print their errors.",
        epilog="example:\n"
               "  zipage fidelity --gpu --model random:qwen3-8b --kv-memory-gb 6 --block-size 64 "
               "--budget 512 --out runs/fidelity\n"
               "  zipage fidelity --gpu ... --trace azure-window.jsonl   # your traffic too\n"
               "  zipage fidelity --gpu ... --cost-model qwen3-8b-h200-b64-k512-zipage "
               "--quick-correct --traces 0 --trace traces/amc23-headline.json\n"
               "\nExit status: 0 done (whatever the errors); 2 a mistake in the input.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(fidelity)
    fidelity.set_defaults(hardware=None, cost_model=None)
    fidelity.add_argument("--gpu", action="store_true", help="the engine on the GPU")
    fidelity.add_argument("--engine", choices=["gpu", "cpu"], default=None,
                          help="gpu (default) or cpu (small models; --hardware then names the "
                               "GPU entry the profile stands for)")
    add_graph_flags(fidelity)
    add_threads_flag(fidelity)
    add_loop_flags(fidelity)
    fidelity.add_argument("--traces", type=int, default=DEFAULT_TRACES,
                          help=f"fresh built-in traces to check on (default {DEFAULT_TRACES}: "
                               "Azure conversation and code shapes, Mooncake-shaped overload, "
                               "bursts)")
    fidelity.add_argument("--trace", action="append", default=[], metavar="FILE",
                          help="also check on this trace (any format `zipage replay` reads); "
                               "repeatable")
    fidelity.add_argument("--trace-seconds", type=float, default=DEFAULT_TRACE_SECONDS,
                          help="seconds each built-in trace runs for (default "
                               f"{DEFAULT_TRACE_SECONDS:g})")
    fidelity.add_argument("--check-seed", type=int, default=None,
                          help="seed of the fresh traces (default: a new one each time, printed)")
    fidelity.add_argument("--quick-correct", action="store_true",
                          help="with --cost-model PROFILE (measured on another machine of this "
                               "kind): also re-scale it to this machine (`zipage calibrate "
                               "--quick`) and simulate every trace with both, side by side")
    add_quick_limits(fidelity)
    fidelity.add_argument("--out", required=True,
                          help="directory for profile.json, fidelity.json and every run")
    fidelity.set_defaults(handler=cmd_fidelity)


def cmd_fidelity(args: argparse.Namespace) -> int:
    from zipage.errors import ConfigError
    from zipage.trace_import import load_trace_file

    if args.traces < 0 or (args.traces == 0 and not args.trace):
        raise ConfigError("--traces: expected a count >= 1 (or 0 with --trace FILE)")
    if not args.trace_seconds > 0:
        raise ConfigError("--trace-seconds: expected seconds > 0")
    if args.quick_correct and args.cost_model in (None, "analytic"):
        raise ConfigError("--quick-correct: give --cost-model PROFILE, the profile measured on "
                          "another machine to re-scale to this one")
    check_quick_limits(args)
    given = "--gpu" if args.gpu else engine_given(args)
    engine = "gpu" if args.gpu else args.engine
    require_torch(engine, given, "use --engine cpu for the CPU path (small models)")
    files = [load_trace_file(path) for path in args.trace]  # refuse a bad file before the GPU
    from zipage.analysis.calibration import calibrate_in_loop, check_twin, format_table, fresh_traces, open_twin

    if engine == "cpu":
        from zipage.engine.threads import set_cpu_threads

        set_cpu_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = replace(settings_from_args(args, cost_model="analytic"),
                       hardware=args.hardware or "a100-80gb")
    seed = args.check_seed if args.check_seed is not None else random.randrange(1, 1 << 30)
    twin = open_twin(settings, "cuda" if engine == "gpu" else "cpu", hardware=args.hardware,
                     cuda_graphs=not args.no_cuda_graphs, prefill_graphs=args.prefill_graphs)
    try:
        if args.cost_model is None:
            profile = calibrate_in_loop(twin, fit_seconds=args.fit_seconds,
                                        validation_seconds=args.validation_seconds,
                                        seed=args.trace_seed, runs_dir=out / "calibration",
                                        progress=progress_wanted(args), report=_say)
            profile_path = out / "profile.json"
            save_profile(profile, profile_path)
            print_validation(profile["validation"])
        else:
            profile_path = Path(shipped_path(args.cost_model))
        others, correction = {}, None
        if args.quick_correct:
            others, correction = _quick_correct(twin, profile_path, out, args)
        traces = fresh_traces(twin, args.trace_seconds, seed, args.traces, _say) + files
        _say(f"checking on {len(traces)} trace(s), seed {seed}")

        def write(rows: list[dict], complete: bool) -> None:
            (out / "fidelity.json").write_text(json.dumps(
                {"profile": str(profile_path), "check_seed": seed, "complete": complete,
                 "rows": rows, **({"correction": correction} if args.quick_correct else {})},
                indent=1) + "\n")

        def checked(rows: list[dict], added: list[dict]) -> None:
            # Each trace's errors as soon as it is simulated, and the file so far: a check that
            # is stopped (a call's time limit) keeps the traces it finished.
            write(rows, complete=False)
            print(format_table(added), flush=True)

        rows = check_twin(twin, profile_path, traces, out / "runs",
                          progress=progress_wanted(args), report=_say, others=others,
                          on_trace=checked)
    finally:
        twin.close()
    write(rows, complete=True)
    print(format_table(rows))
    print(f"wrote {out}/fidelity.json (every run under {out}/runs)")
    return 0


def _quick_correct(twin, profile_path: Path, out: Path,
                   args: argparse.Namespace) -> tuple[dict[str, Path], dict]:
    """The profile re-scaled to this machine on the twin's engine (`zipage calibrate --quick`),
    as the extra model "corrected" of the table, and the correction's summary; no extra model
    where the correction is refused (the summary says why)."""
    from zipage.analysis.quick_calibration import anchor_table, describe, quick_correct

    result = quick_correct(twin, profile_path, max_residual=args.max_residual,
                           max_scale=args.max_scale, runs_dir=out / "quick", report=_say)
    print(anchor_table(result.correction))
    summary = describe(result)
    if result.correction.refusal is not None:
        _say(f"quick correction refused: {result.correction.refusal}; the table has the "
             "profile as it is")
        return {}, summary
    path = out / "profile-corrected.json"
    save_profile(result.profile, path)
    summary["profile"] = str(path)
    return {"corrected": path}, summary


def _say(line: str) -> None:
    print(f"fidelity: {line}", flush=True)
