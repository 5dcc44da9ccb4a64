"""`zipage calibrate`: time the real engine's steps (or fit engine runs) into a simulator cost profile."""

from __future__ import annotations

import argparse
from dataclasses import replace

from zipage.cli.flags import (
    add_engine_flags,
    add_graph_flags,
    add_threads_flag,
    engine_given,
    require_torch,
    settings_from_args,
)
from zipage.cli.output import progress_wanted


def add_parser(commands) -> None:
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
    add_threads_flag(calibrate)
    calibrate.add_argument("--from-run", nargs="+", default=None, metavar="RUN_DIR",
                           help="fit the profile from engine runs' steps.csv (their --out "
                                "directories) instead of measuring; --hardware labels it")
    calibrate.add_argument("--stall-factor", type=float, default=None, metavar="X",
                           help="with --from-run: leave out decode steps slower than X times "
                                "their run's median decode step (mid-run kernel compilation) "
                                "and the compressions they launched (default: keep every step)")
    calibrate.add_argument("--grid", action="store_true",
                           help="time isolated steps on a grid only, no runs through the engine "
                                "loop and no validation (faster, and less faithful: "
                                "docs/cost_model.md)")
    add_loop_flags(calibrate)
    add_quick_flags(calibrate)
    calibrate.add_argument("--repeats", type=int, default=5,
                           help="with --grid: timed repeats per point; the median is kept "
                                "(default 5)")
    calibrate.add_argument("--out", required=True,
                           help="profile JSON to write (e.g. sim/profiles/qwen3-8b-h200.json)")
    calibrate.set_defaults(handler=cmd_calibrate)


def add_quick_flags(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="re-scale --profile (measured on another machine of this kind) "
                             "from a few anchor steps run here, in about a minute, instead of "
                             "measuring a profile (docs/cost_model.md, 'Quick correction')")
    parser.add_argument("--profile", default=None, metavar="PROFILE",
                        help="with --quick: the profile to re-scale (a file, or the name of one "
                             "in sim/profiles/); the engine flags must be the ones it was "
                             "measured with")
    add_quick_limits(parser)


def add_quick_limits(parser) -> None:
    """When a quick correction is refused (`zipage calibrate --quick`, `zipage fidelity
    --quick-correct`)."""
    from zipage.sim.quick_correction import MAX_RESIDUAL, MAX_SCALE

    parser.add_argument("--max-residual", type=float, default=MAX_RESIDUAL, metavar="X",
                        help="refuse a quick correction whose re-scaled profile still misses an "
                             f"anchor by more than this fraction (default {MAX_RESIDUAL:g})")
    parser.add_argument("--max-scale", type=float, default=MAX_SCALE, metavar="X",
                        help="refuse a quick correction's scale beyond X (or below 1/X): a machine "
                             "that much faster or slower is not of the profile's kind (default "
                             f"{MAX_SCALE:g})")


def check_quick_flags(args: argparse.Namespace) -> None:
    """One line naming the flag for a --quick invocation that cannot work."""
    from zipage.errors import ConfigError

    if not args.quick:
        if args.profile is not None:
            raise ConfigError("--profile: only read with --quick (re-scale that profile); add "
                              "--quick, or drop --profile to measure a new one")
        return
    if args.profile is None:
        raise ConfigError("--quick: name the profile to re-scale with --profile PROFILE (e.g. "
                          "--profile qwen3-8b-h200-b64-k512-zipage)")
    for flag, given in (("--from-run", args.from_run), ("--grid", args.grid)):
        if given:
            raise ConfigError(f"{flag}: not with --quick (a quick correction measures its own "
                              f"anchors); drop {flag} or --quick")
    check_quick_limits(args)


def check_quick_limits(args: argparse.Namespace) -> None:
    from zipage.errors import ConfigError

    if not 0.0 < args.max_residual < float("inf"):
        raise ConfigError(f"--max-residual: got {args.max_residual:g}, expected a fraction "
                          "above 0 (e.g. 0.15)")
    if not 1.0 < args.max_scale < float("inf"):
        raise ConfigError(f"--max-scale: got {args.max_scale:g}, expected a factor above 1 "
                          "(e.g. 2)")


def shipped_path(spec: str) -> str:
    """A profile file, or the name of one shipped in sim/profiles/ (as --cost-model takes it)."""
    from pathlib import Path

    from zipage.sim.cost_model import PROFILES_DIR

    if not Path(spec).exists() and (PROFILES_DIR / f"{spec}.json").exists():
        return str(PROFILES_DIR / f"{spec}.json")
    return spec


def engine_settings(args: argparse.Namespace):
    """The device the flags ask for ("cuda" or "cpu", torch checked, the CPU's threads set) and
    the deployment. The hardware table entry is only the profile's label here (None: named after
    the GPU); the engine plans its caches from the device it runs on."""
    given = "--gpu" if args.gpu else engine_given(args)
    engine = "gpu" if args.gpu else args.engine
    require_torch(engine, given, "use --engine cpu for the CPU path (small models)")
    from zipage.engine.threads import set_cpu_threads

    if engine == "cpu":
        set_cpu_threads(args.threads)
    return ("cuda" if engine == "gpu" else "cpu",
            replace(settings_from_args(args), hardware=args.hardware or "a100-80gb"))


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_quick_flags(args)
    if args.quick:
        return cmd_quick(args)
    if args.from_run:
        from zipage.sim.profile_from_runs import profile_from_runs

        return save_profile(profile_from_runs(args.from_run, gpu=args.hardware,
                                                stall_factor=args.stall_factor), args.out)
    device, settings = engine_settings(args)
    from zipage.engine.calibrate import calibrate

    if args.grid:
        profile = calibrate(settings, device, hardware=args.hardware, repeats=args.repeats,
                            progress=progress_wanted(args), cuda_graphs=not args.no_cuda_graphs,
                            prefill_graphs=args.prefill_graphs)
        return save_profile(profile, args.out)
    from zipage.analysis.calibration import calibrate_in_loop, open_twin

    twin = open_twin(settings, device, hardware=args.hardware,
                     cuda_graphs=not args.no_cuda_graphs, prefill_graphs=args.prefill_graphs)
    try:
        profile = calibrate_in_loop(twin, fit_seconds=args.fit_seconds,
                                    validation_seconds=args.validation_seconds,
                                    seed=args.trace_seed, runs_dir=args.runs_dir,
                                    progress=progress_wanted(args), report=_say)
    finally:
        twin.close()
    status = save_profile(profile, args.out)
    print_validation(profile["validation"])
    return status


def cmd_quick(args: argparse.Namespace) -> int:
    """`zipage calibrate --quick`: build the engine, run the anchors, write the re-scaled
    profile, or refuse (exit 2) in one line when no re-scaling explains the anchors."""
    import time

    from zipage.errors import ConfigError
    from zipage.profile import read_profile

    started = time.perf_counter()
    args.profile = shipped_path(args.profile)
    read_profile(args.profile)  # a missing or unreadable file is refused before the slow build
    device, settings = engine_settings(args)
    from zipage.analysis.calibration import open_twin
    from zipage.analysis.quick_calibration import anchor_table, quick_correct

    twin = open_twin(settings, device, hardware=args.hardware,
                     cuda_graphs=not args.no_cuda_graphs, prefill_graphs=args.prefill_graphs)
    built = time.perf_counter() - started
    _say(f"engine built in {built:.1f} s")
    try:
        result = quick_correct(twin, args.profile, max_residual=args.max_residual,
                               max_scale=args.max_scale, runs_dir=args.runs_dir, report=_say)
    finally:
        twin.close()
    print(anchor_table(result.correction))
    elapsed = time.perf_counter() - started
    timing = f"{elapsed:.1f} s in all (engine build {built:.1f} s, anchors {result.elapsed_s:.1f} s)"
    if result.correction.refusal is not None:
        _say(timing)
        raise ConfigError(f"calibrate --quick: refused for {args.profile}: "
                          f"{result.correction.refusal}; measure this machine with a full "
                          "`zipage calibrate` instead")
    result.profile["correction"]["elapsed_s"] = round(elapsed, 1)
    save_profile(result.profile, args.out)
    _say(timing)
    return 0


def add_loop_flags(parser) -> None:
    """How long `zipage calibrate` (and `zipage fidelity`) run their built-in traces."""
    from zipage.calibration_traces import DEFAULT_FIT_SECONDS, DEFAULT_VALIDATION_SECONDS

    parser.add_argument("--fit-seconds", type=float, default=DEFAULT_FIT_SECONDS,
                        help="seconds of traffic the fitting traces run in all, sized to this "
                             f"engine by a probe (default {DEFAULT_FIT_SECONDS:g})")
    parser.add_argument("--validation-seconds", type=float, default=DEFAULT_VALIDATION_SECONDS,
                        help="seconds of the held-out validation trace (default "
                             f"{DEFAULT_VALIDATION_SECONDS:g})")
    parser.add_argument("--trace-seed", type=int, default=0,
                        help="seed of the built-in fitting and validation traces (default 0)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars for the engine runs")
    parser.add_argument("--runs-dir", default=None, metavar="DIR",
                        help="keep the engine's and the simulator's run directories here "
                             "(default: a temporary directory, removed)")


def _say(line: str) -> None:
    print(f"calibrate: {line}", flush=True)


def print_validation(validation: dict) -> None:
    """The held-out trace's errors, both models side by side, and what to use."""
    errors = validation["errors"]
    print(f"validation on {validation['workload']} ({validation['requests']} requests, fitted "
          "on nothing): (simulated - engine) / engine")
    print(f"  {'metric':<10} {'profile':>9} {'analytic':>9}")
    for metric in errors["profile"]:
        cells = [errors[name].get(metric) for name in ("profile", "analytic")]
        text = ["-" if value is None else f"{100 * value:.1f}%" if metric == "e2e_mape"
                else f"{100 * value:+.1f}%" for value in cells]
        print(f"  {metric:<10} {text[0]:>9} {text[1]:>9}")
    for warning in validation["warnings"]:
        print(f"warning: {warning}")
    recommended = validation["recommended"]
    print("recommended: " + ("this profile (--cost-model PROFILE)" if recommended == "profile"
                             else "the analytic model (--cost-model analytic): on this trace it "
                                  "predicted the engine better than the profile"))


def save_profile(profile: dict, path: str) -> int:
    """Write the profile (through its format's owner) and print how well each section fits."""
    from zipage.profile import write_profile
    from zipage.sim.calibrated import CalibratedCostModel

    out = write_profile(profile, path)
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
