"""`zipage replay`: a trace through the simulator (default) or the real engine, its summary and run directory."""

from __future__ import annotations

import argparse
import json
import sys

from zipage.cli.flags import add_engine_flags, add_graph_flags, add_threads_flag, require_torch, settings_from_args
from zipage.cli.output import print_summary, progress_wanted, run_status
from zipage.rundir import DECISION_FORMATS, DEFAULT_DECISIONS


def add_parser(commands) -> None:
    replay = commands.add_parser(
        "replay", help="replay a trace (simulator by default)",
        description="Replay a trace through the simulator (default) or the real engine and print "
                    "the summary; --out writes the run directory.",
        epilog="examples:\n"
               "  zipage replay traces/amc23.json --budget 1024 --hardware h100\n"
               "  zipage replay traces/mixture.json --no-hybrid --json\n"
               "  zipage replay traces/longbench.json --out runs/lb --decisions plain\n"
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
    add_threads_flag(replay)
    replay.add_argument("--json", action="store_true",
                        help="print exactly one JSON object (the summary) on stdout")
    replay.add_argument("--out", default=None, help="directory for summary.json, steps.csv, "
                        "requests.csv, decisions.log.gz and timeline.png")
    replay.add_argument("--decisions", choices=list(DECISION_FORMATS), default=DEFAULT_DECISIONS,
                        help="with --out: the per-step decision log as decisions.log.gz (gzip, "
                             "default: 2.7 MB for amc23.json), decisions.log (plain: 140 MB "
                             "there; zipage compare reads either) or not at all (none: zipage "
                             "compare then skips the decision check)")
    replay.add_argument("--step-times", default=None, metavar="RUN_DIR",
                        help="drive the simulator with an engine run's measured step times "
                             "(its --out directory): it must make the engine's decisions step "
                             "for step (docs/cost_model.md)")
    replay.add_argument("--no-progress", action="store_true")
    replay.set_defaults(handler=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from zipage.trace_import import load_trace_file, stream_trace_file

    engine = "gpu" if args.gpu else args.engine
    # Both twins stream their run into --out as it is made (`_run_streamed`); the simulator also
    # reads a JSON Lines or production trace as its clock reaches the requests (docs/traces.md,
    # 'Streamed traces'). Step-time replay compares its whole decision log with the engine's, so
    # it keeps its run and writes it at the end.
    streamed = args.step_times is None
    trace = (stream_trace_file(args.trace) if streamed and engine == "sim"
             else load_trace_file(args.trace))
    settings = settings_from_args(args)
    if args.out is not None:
        from zipage.rundir import check_run_out_dir

        check_run_out_dir(args.out)
    # On stderr, only at a terminal: never mixed into --json's stdout.
    show_progress = progress_wanted(args)
    if args.step_times is not None:
        from zipage.sim.step_replay import replay_step_times

        summary, run = replay_step_times(trace, args.step_times, progress=show_progress)
    else:
        summary, run = _run_streamed(trace, settings, engine, args, show_progress)
    summary = {"trace": trace.name, **summary}
    if args.out is not None and not streamed:
        from zipage.analysis.timeline import plot_run
        from zipage.rundir import write_run

        write_run(args.out, summary, run.steps, run.requests, run.decision_log,
                  decisions=args.decisions, finish=plot_run)
    if run.late_turns:
        print(f"warning: {run.late_turns} session turns were read after they came due and sent "
              "late: write each session's turns before the sessions that start after it "
              "(docs/traces.md, 'Sessions')", file=sys.stderr)
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
            log = DECISION_FORMATS[args.decisions]
            print(f"wrote {args.out}/summary.json, steps.csv, requests.csv, "
                  + (f"{log}, " if log else "") + "timeline.png")
    return run_status(summary)


def _run_streamed(trace, settings, engine: str, args: argparse.Namespace, progress: bool):
    """Either twin's run, streamed the same way: with --out its records are written to the run
    directory as they are made (summary.json and the timeline at the end); without it the
    simulator gathers only the summary, so memory follows the requests in flight, not the
    trace's length (the engine keeps its requests' tokens anyway)."""
    from zipage.core.recorder import RecordSink

    if args.out is None:
        sink = RecordSink() if engine == "sim" else None
        return _run(trace, settings, engine, args, progress, sink)
    from zipage.analysis.timeline import plot_run
    from zipage.rundir import ENGINE, SIMULATED, RunWriter

    writer = RunWriter(args.out, args.decisions, kind=SIMULATED if engine == "sim" else ENGINE)
    try:
        summary, run = _run(trace, settings, engine, args, progress, writer)
    except BaseException:
        writer.discard()
        raise
    writer.close({"trace": trace.name, **summary}, finish=plot_run)
    return summary, run


def _run(trace, settings, engine: str, args: argparse.Namespace, progress: bool, sink):
    if engine == "sim":
        from zipage.sim.simulate import simulate

        return simulate(trace, settings, progress=progress, log_decisions=_log_decisions(args),
                        sink=sink)
    require_torch(engine)
    from zipage.engine.replay import replay_on_engine

    if engine == "cpu":
        from zipage.engine.threads import set_cpu_threads

        set_cpu_threads(args.threads)
    return replay_on_engine(trace, settings, "cuda" if engine == "gpu" else "cpu",
                            cuda_graphs=not args.no_cuda_graphs,
                            prefill_graphs=args.prefill_graphs, progress=progress,
                            log_decisions=_log_decisions(args), sink=sink)


def _log_decisions(args: argparse.Namespace) -> bool:
    return args.out is not None and args.decisions != "none"
