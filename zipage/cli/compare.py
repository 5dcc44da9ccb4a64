"""`zipage compare`: how far two runs of one trace agree, with optional regression gates."""

from __future__ import annotations

import argparse
import sys

from zipage.cli.output import EXIT_GATE, EXIT_OK


def add_parser(commands) -> None:
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
               "   # a regression gate\n"
               "  zipage compare runs/sim runs/gpu --spread runs/gpu2   # beside the engine's own "
               "run-to-run spread",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("run_a", metavar="RUN_A",
                         help="a run directory (zipage replay --out), typically the simulator's")
    compare.add_argument("run_b", metavar="RUN_B",
                         help="the run to compare against, typically the real engine's")
    compare.add_argument(
        "--max-error", action="append", default=[], metavar="METRIC=PCT",
        help="fail (exit 1) when |error| of METRIC exceeds PCT percent, or cannot be measured; "
             "repeat for several. METRIC: makespan, tps, ttft_p50/p90/p99, tpot_p50/p90/p99, "
             "ks_ttft/ks_tpot (KS distance of the two distributions, in points: 10 = the CDFs "
             "never differ by more than 0.10), e2e_mape (per-request end-to-end latency), "
             "decisions (share of decision lines that differ)")
    compare.add_argument(
        "--spread", metavar="RUN_C", default=None,
        help="a second run of RUN_B's kind on the same trace (the engine again): print RUN_A's "
             "run-level errors beside RUN_C's against RUN_B, and widen each --max-error gate to "
             "RUN_C's difference where that is larger (a model cannot be nearer a run than the "
             "run is to itself)")
    compare.set_defaults(handler=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from zipage.analysis.compare import compare_runs, exceeded, format_report, format_spread, parse_max_errors, widened
    from zipage.errors import ZipageError

    limits = parse_max_errors(args.max_error)  # a bad gate fails before the runs are read
    comparison = compare_runs(args.run_a, args.run_b)
    spread = None
    if args.spread is not None:  # read before anything is printed: a bad one fails alone
        try:
            spread = compare_runs(args.spread, args.run_b)["errors"]
        except ZipageError as error:
            raise ZipageError(f"--spread {error}") from None
    print(format_report(comparison))
    if spread is not None:
        a, b = comparison["labels"].values()
        print(format_spread(comparison["errors"], spread, a, b, Path(args.spread).name))
        limits = widened(limits, spread)
    failed = exceeded(comparison["errors"], limits)
    for line in failed:
        print(f"zipage compare: gate failed: {line}", file=sys.stderr)
    if limits and not failed:
        print(f"all {len(limits)} gates passed: "
              + ", ".join(f"{name} <= {100 * limit:.4g}%" for name, limit in limits.items()))
    return EXIT_GATE if failed else EXIT_OK
