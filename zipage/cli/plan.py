"""`zipage plan`: the command line of capacity planning (`zipage.sim.planning`).

It takes every engine flag of
`zipage replay` for the knobs that stay fixed; the searched axes take comma lists (`--hardware
h100,h200`, `--budget 1024,2048`, `--budget-policy fixed,elastic`, `--hybrid on,off`, `--replicas
1..4`, `--rate offline,5,10`); `--objective max-users` searches the number of concurrent users of a
trace of sessions instead of a rate.
The handler prints the ranked table, the infeasible points with their reasons and the Pareto
front of the objective against the budget per GPU (with `--no-compress`, Full KV, which has no
budget: the best point per GPU); `--out DIR` writes results.csv, results.parquet (when pandas
has a Parquet engine) and pareto.png.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from zipage.cli.plan_report import format_report, write_outputs
from zipage.errors import ConfigError
from zipage.sim.planning import (
    CACHE_SUBDIR,
    LOCAL,
    MAX_RATE,
    MAX_USERS,
    OBJECTIVES,
    RAY,
    SEARCHED,
    SERIAL,
    SLO,
    TPS,
    PlanSpec,
    RateSearch,
    run_plan,
)
from zipage.sim.slo import TARGETS

OFFLINE = "offline"
# Deployment fields and knobs that are grid axes of the search (each flag takes a comma list).
PLAN_AXES = frozenset({"hardware", "kv_memory_gb", "gpu_memory_utilization", "kv_budget",
                       "budget_policy", "block_size", "hybrid"})


def add_parser(commands) -> None:
    from zipage.cli.flags import add_engine_flags
    from zipage.core.routing import LEAST_LOADED, ROUTING_POLICIES
    from zipage.trace import ARRIVAL_PATTERNS

    plan = commands.add_parser(
        "plan",
        help="search deployments of a trace with the simulator (GPU, budget, hybrid, replicas...)",
        description="Simulate every combination of the comma-separated axes, rank them by the "
                    "objective and print the Pareto front of the objective against the KV "
                    "budget per GPU. See docs/planning.md.")
    plan.add_argument("trace", help="trace JSON (see docs/traces.md)")
    # The searched knobs and deployment fields take comma lists (flags derived from their
    # declarations); --hardware defaults to every GPU of the table, --kv-memory-gb replaces the
    # utilisation axis.
    add_engine_flags(plan, axes=PLAN_AXES)

    grid = plan.add_argument_group("search axes (comma lists)")
    grid.add_argument("--replicas", default="1",
                      help="engines behind the router: a list and/or ranges, e.g. 1..4 or 1,2,4 "
                           "(default 1)")
    grid.add_argument("--rate", default=None,
                      help="Poisson (or --arrivals bursty) request rates in req/s stamped on the "
                           "trace, e.g. offline,5,10; 'offline' keeps the trace's own arrival "
                           "times (the default). With --objective max-rate: the starting guess")
    grid.add_argument("--speedup", default=None, metavar="X[,X...]",
                      help="play the trace's own arrival times X times faster, e.g. 1,2,4: a "
                           "production trace's load axis, its burstiness kept (not with --rate)")
    # (None: not given, so --objective max-users can refuse what it has no use for.)
    grid.add_argument("--arrivals", choices=ARRIVAL_PATTERNS, default=None,
                      help="how --rate stamps arrivals (default poisson)")
    grid.add_argument("--burst-size", type=int, default=None,
                      help="requests per burst with --arrivals bursty (default 8)")
    grid.add_argument("--arrival-seed", type=int, default=None,
                      help="seed of the stamped arrivals (default 0)")
    grid.add_argument("--routing", choices=ROUTING_POLICIES, default=LEAST_LOADED,
                      help="how requests are spread over replicas (default least-loaded)")

    goal = plan.add_argument_group("objective and SLOs")
    goal.add_argument("--objective", choices=OBJECTIVES, default=TPS,
                      help="tps: output tokens/s; tps-per-dollar: tokens/s per dollar-per-hour of "
                           "the GPUs; max-rate: the highest Poisson rate meeting the SLOs, found "
                           "by bisection; max-users: the most concurrent users meeting the SLOs, "
                           "every session starting at 0 and each user working through the "
                           "sessions back to back (default tps)")
    # (Strings, read by `slo_from_args`: a value that is no number is one line naming its flag.)
    goal.add_argument("--slo-ttft-p90", default=None, metavar="SECONDS",
                      help="90th-percentile time to first token must not exceed this")
    goal.add_argument("--slo-followup-ttft-p90", default=None, metavar="SECONDS",
                      help="90th-percentile time to first token of sessions' follow-up turns "
                           "alone, timed from when each came due, must not exceed this (a "
                           "trace of sessions)")
    goal.add_argument("--slo-ttft-p99", default=None, metavar="SECONDS",
                      help="99th-percentile time to first token must not exceed this")
    goal.add_argument("--slo-tpot-p99", default=None, metavar="MS",
                      help="99th-percentile time per output token must not exceed this")
    goal.add_argument("--rate-tolerance", type=float, default=None,
                      help="max-rate: stop bisecting when the bracket is narrower than this "
                           "share of its upper end (default 0.05)")

    execution = plan.add_argument_group("execution and output")
    execution.add_argument("--workers", type=int, default=None,
                           help="local worker processes (default: one per core; 1 runs serially "
                                "in this process)")
    execution.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                           help="run the points as Ray tasks: on the cluster at ADDRESS (e.g. "
                                "auto, ray://head:10001), else on RAY_ADDRESS's or a new local "
                                "instance (a bare --ray goes after the trace argument)")
    execution.add_argument("--out", default=None,
                           help="directory for results.csv, results.parquet and pareto.png")
    execution.add_argument("--cache-dir", default=None,
                           help=f"finished points, so a rerun resumes (default: "
                                f"{CACHE_SUBDIR} under --out, else under the current directory)")
    execution.add_argument("--no-cache", action="store_true", help="simulate every point")
    execution.add_argument("--top", type=int, default=20,
                           help="rows of the ranked table to print (default 20; all in --out)")
    execution.add_argument("--no-progress", action="store_true")
    plan.set_defaults(handler=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from zipage.trace_import import load_trace_file

    trace = load_trace_file(args.trace)
    spec = spec_from_args(args)
    cache_dir = None if args.no_cache else Path(
        args.cache_dir or Path(args.out or ".") / CACHE_SUBDIR)
    executor = RAY if args.ray is not None else (SERIAL if args.workers == 1 else LOCAL)
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers: got {args.workers}, expected an integer >= 1")
    spec.validate(trace)
    points = len(spec.points())
    workers = "Ray tasks" if executor == RAY else (
        f"{min(args.workers or os.cpu_count() or 1, points)} worker process(es)")
    print(f"{trace.name} ({len(trace.requests):,} requests) on {spec.base.model}: {points} points "
          f"({describe_grid(spec)}), objective {spec.objective}, {workers}")
    result = run_plan(trace, spec, executor=executor, workers=args.workers,
                      ray_address=args.ray or None, cache_dir=cache_dir,
                      progress=not args.no_progress and sys.stderr.isatty())
    print(f"{result.evaluated} simulated, {result.cached} from the cache"
          f"{f' ({cache_dir})' if cache_dir is not None else ''}, {result.wall_s:.1f} s")
    print()
    print(format_report(result, spec, top=args.top))
    if args.out is not None:
        for line in write_outputs(result, spec, Path(args.out)):
            print(line)
    return 0


def spec_from_args(args: argparse.Namespace) -> PlanSpec:
    from zipage.cli.flags import axis_values, settings_from_args
    from zipage.hardware import HARDWARE

    budgets = axis_values(args, "kv_budget")
    block_sizes = axis_values(args, "block_size")
    hybrid = axis_values(args, "hybrid")
    policies = axis_values(args, "budget_policy")
    kv_memory = axis_values(args, "kv_memory_gb")
    utilizations = axis_values(args, "gpu_memory_utilization")
    if kv_memory is not None and utilizations is not None:
        raise ConfigError("--kv-memory-gb and --gpu-memory-utilization: give one (exact cache "
                          "memory replaces the utilisation axis)")
    # The base settings hold every knob that is not searched; axis values replace theirs per point.
    base = settings_from_args(args, axes=PLAN_AXES)
    if not base.config.compress:
        given = [flag for flag, values in (("--budget", budgets), ("--hybrid", hybrid),
                                           ("--budget-policy", policies)) if values is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: --no-compress plans Full KV, which keeps "
                              "every token (no budget, no query slots to schedule around); drop "
                              f"{' and '.join(given)}, or drop --no-compress to search them")
    utilizations = utilizations or [base.gpu_memory_utilization]
    base = replace(base, gpu_memory_utilization=utilizations[0], config=_base_config(
        base.config, budgets or [base.config.kv_budget], block_sizes or [base.config.block_size]))
    if args.objective == MAX_USERS:
        refuse_load_flags(args)
    rates = parse_rates(args.rate) if args.rate is not None else [None]
    slo = slo_from_args(args)
    speedups = parse_speedups(args.speedup) if args.speedup is not None else [None]
    start = rates[0] if args.objective == MAX_RATE and len(rates) == 1 else None
    return PlanSpec(
        base=base, hardware=axis_values(args, "hardware") or list(HARDWARE),
        budgets=budgets or [base.config.kv_budget],
        budget_policies=policies or [base.config.budget_policy],
        block_sizes=block_sizes or [base.config.block_size], hybrid=hybrid or [True],
        kv_memory_gb=kv_memory, gpu_memory_utilization=utilizations,
        replicas=parse_replicas(args.replicas), rates=rates, speedups=speedups,
        routing=args.routing,
        arrivals=args.arrivals or "poisson",
        arrival_seed=0 if args.arrival_seed is None else args.arrival_seed,
        burst_size=8 if args.burst_size is None else args.burst_size,
        objective=args.objective, slo=slo,
        search=replace(RateSearch(), start_qps=start, **(
            {} if args.rate_tolerance is None else {"tolerance": args.rate_tolerance})))


def slo_from_args(args: argparse.Namespace) -> SLO:
    """The targets of the --slo-* flags. A value that is not a number is refused here, one
    that is not > 0 by `PlanSpec.validate`, each in one line naming its flag."""
    targets = {}
    for target in TARGETS:
        text = getattr(args, target.flag.removeprefix("--").replace("-", "_"))
        if text is not None:
            try:
                targets[target.key] = float(text)
            except ValueError:
                raise ConfigError(target.bad_value(text)) from None
    return SLO(**targets)


# Flags of an arrival rate or a fixed population, which --objective max-users has no use for.
LOAD_FLAGS = (("rate", "--rate"), ("speedup", "--speedup"), ("arrivals", "--arrivals"),
              ("burst_size", "--burst-size"), ("arrival_seed", "--arrival-seed"),
              ("rate_tolerance", "--rate-tolerance"), ("users", "--users"))


def refuse_load_flags(args: argparse.Namespace) -> None:
    """--objective max-users starts every session at 0 and searches the number of users: a flag
    that stamps or scales arrivals, or fixes the users, is a mistake, named in one line."""
    for name, flag in LOAD_FLAGS:
        if getattr(args, name, None) is not None:
            what = ("fixes the number of users" if name == "users"
                    else "tunes the max-rate search" if name == "rate_tolerance"
                    else "sets arrival times")
            hint = "" if name == "users" else ", or use --objective max-rate to search a rate"
            raise ConfigError(f"{flag}: --objective max-users starts every session at 0 and "
                              f"searches the number of concurrent users, and {flag} {what}; "
                              f"drop {flag}{hint}")


def _base_config(config, budgets: list[int], block_sizes: list[int]):
    """The fixed knobs with the first budget and block size they accept together: the other
    knobs are checked against a real point (a --window needs its block size), while a
    combination the config refuses (a budget off the block size's multiples) stays one
    infeasible row of the search rather than aborting it. When none is accepted, the first
    one's error says why."""
    from zipage.errors import ZipageError

    first_error = None
    for budget in budgets:
        for block_size in block_sizes:
            try:
                return replace(config, kv_budget=budget, block_size=block_size)
            except ZipageError as error:
                first_error = first_error or error
    raise first_error


# ---------------------------------------------------------------- parsing comma lists

def parse_speedups(text: str) -> list[float]:
    """'1,2,4' -> 1.0, 2.0, 4.0."""
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--speedup: got {item.strip()!r} in {text!r}, expected numbers > 0 "
                              "like 1,2,4")
        values.append(value)
    return list(dict.fromkeys(values))


def parse_replicas(text: str) -> list[int]:
    """'1..4' -> 1, 2, 3, 4; '1,2,8' and mixes like '1..3,8' work too."""
    values: list[int] = []
    for item in text.split(","):
        low, separator, high = item.strip().partition("..")
        try:
            first = int(low)
            last = int(high) if separator else first
        except ValueError:
            raise ConfigError(f"--replicas: {item!r} is neither an integer nor a range like "
                              "1..4") from None
        if first < 1 or last < first:
            raise ConfigError(f"--replicas: {item!r}; replicas are integers >= 1 and a range "
                              "goes up, e.g. 1..4")
        values.extend(range(first, last + 1))
    return list(dict.fromkeys(values))


def parse_rates(text: str) -> list[float | None]:
    rates: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item == OFFLINE:
            rates.append(None)
            continue
        try:
            rate = float(item)
        except ValueError:
            raise ConfigError(f"--rate: {item!r} is neither a number of requests per second nor "
                              f"'{OFFLINE}', e.g. --rate offline,5,10") from None
        if not (rate > 0 and math.isfinite(rate)):
            raise ConfigError(f"--rate: got {item}, expected a rate > 0 in requests per second")
        rates.append(rate)
    return list(dict.fromkeys(rates))


def describe_grid(spec: PlanSpec) -> str:
    axes = [(len(spec.hardware), "GPUs"), (len(spec.budgets), "budgets"),
            (len(spec.budget_policies), "budget policies"),
            (len(spec.block_sizes), "block sizes"), (len(spec.hybrid), "hybrid modes"),
            (len(spec.kv_memory_gb or spec.gpu_memory_utilization), "memory sizes"),
            (len(spec.replicas), "replica counts"),
            (1 if spec.objective in SEARCHED else len(spec.rates), "rates"),
            (len(spec.speedups), "speed-ups")]
    varying = [f"{count} {name}" for count, name in axes if count > 1]
    return " x ".join(varying) or "one point"
