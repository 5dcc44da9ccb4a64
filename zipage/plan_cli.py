"""`zipage plan`: the command line of capacity planning (`zipage.sim.planning`).

`add_plan_command(subparsers)` registers the subcommand. It takes every engine flag of
`zipage replay` for the knobs that stay fixed; the searched axes take comma lists (`--hardware
h100,h200`, `--budget 1024,2048`, `--budget-policy fixed,elastic`, `--hybrid on,off`, `--replicas
1..4`, `--rate offline,5,10`).
The handler prints the ranked table, the infeasible points with their reasons and the Pareto
front of the objective against the budget per GPU (with `--no-compress`, Full KV, which has no
budget: the best point per GPU); `--out DIR` writes results.csv, results.parquet (when pandas
has a Parquet engine) and pareto.png.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from zipage.errors import ConfigError
from zipage.sim.planning import (
    CACHE_SUBDIR,
    LOCAL,
    MAX_RATE,
    OBJECTIVES,
    OK,
    RAY,
    RESULT_COLUMNS,
    SERIAL,
    SLO,
    TPS,
    TPS_PER_DOLLAR,
    PlanResult,
    PlanSpec,
    RateSearch,
    run_plan,
)

OFFLINE = "offline"
# Deployment fields and knobs that are grid axes of the search (each flag takes a comma list).
PLAN_AXES = frozenset({"hardware", "kv_memory_gb", "gpu_memory_utilization", "kv_budget",
                       "budget_policy", "block_size", "hybrid"})
OBJECTIVE_LABELS = {TPS: "throughput (tok/s)", TPS_PER_DOLLAR: "tok/s per $/h",
                    MAX_RATE: "max rate meeting the SLOs (req/s)"}


def add_plan_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `zipage plan` on the `zipage` command's subparsers."""
    from zipage.core.routing import LEAST_LOADED, ROUTING_POLICIES
    from zipage.flags import add_engine_flags
    from zipage.trace import ARRIVAL_PATTERNS

    plan = subparsers.add_parser(
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
    grid.add_argument("--arrivals", choices=ARRIVAL_PATTERNS, default="poisson")
    grid.add_argument("--burst-size", type=int, default=8,
                      help="requests per burst with --arrivals bursty (default 8)")
    grid.add_argument("--arrival-seed", type=int, default=0)
    grid.add_argument("--routing", choices=ROUTING_POLICIES, default=LEAST_LOADED,
                      help="how requests are spread over replicas (default least-loaded)")

    goal = plan.add_argument_group("objective and SLOs")
    goal.add_argument("--objective", choices=OBJECTIVES, default=TPS,
                      help="tps: output tokens/s; tps-per-dollar: tokens/s per dollar-per-hour of "
                           "the GPUs; max-rate: the highest Poisson rate meeting the SLOs, found "
                           "by bisection (default tps)")
    goal.add_argument("--slo-ttft-p90", type=float, default=None, metavar="SECONDS",
                      help="90th-percentile time to first token must not exceed this")
    goal.add_argument("--slo-ttft-p99", type=float, default=None, metavar="SECONDS",
                      help="99th-percentile time to first token must not exceed this")
    goal.add_argument("--slo-tpot-p99", type=float, default=None, metavar="MS",
                      help="99th-percentile time per output token must not exceed this")
    goal.add_argument("--rate-tolerance", type=float, default=0.05,
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
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    from zipage.trace_import import load_trace_file

    trace = load_trace_file(args.trace)
    spec = spec_from_args(args)
    cache_dir = None if args.no_cache else Path(
        args.cache_dir or Path(args.out or ".") / CACHE_SUBDIR)
    executor = RAY if args.ray is not None else (SERIAL if args.workers == 1 else LOCAL)
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers: got {args.workers}, expected an integer >= 1")
    spec.validate()
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
    from zipage.flags import axis_values, settings_from_args
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
    rates = parse_rates(args.rate) if args.rate is not None else [None]
    slo = SLO(args.slo_ttft_p90, args.slo_tpot_p99, args.slo_ttft_p99)
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
        arrivals=args.arrivals, arrival_seed=args.arrival_seed, burst_size=args.burst_size,
        objective=args.objective, slo=slo,
        search=replace(RateSearch(), start_qps=start, tolerance=args.rate_tolerance))


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
            (1 if spec.objective == MAX_RATE else len(spec.rates), "rates"),
            (len(spec.speedups), "speed-ups")]
    varying = [f"{count} {name}" for count, name in axes if count > 1]
    return " x ".join(varying) or "one point"


# ---------------------------------------------------------------- the printed report

def format_report(result: PlanResult, spec: PlanSpec, top: int = 20) -> str:
    rows = result.rows
    full_kv = not spec.base.config.compress
    ranked = [row for row in rows if row["status"] != "infeasible"]
    infeasible = [row for row in rows if row["status"] == "infeasible"]
    columns = _table_columns(spec)
    lines = [f"ranked by {OBJECTIVE_LABELS[spec.objective]}"
             + (f", SLOs: {_describe_slo(spec.slo)}" if spec.slo.active else "")
             + (f" (top {top} of {len(ranked)})" if len(ranked) > top else "")]
    lines += format_table([header for header, _ in columns],
                          [[cell(row) for _, cell in columns] for row in ranked[:top]])
    missed = [row for row in ranked[:top] if row["status"] != OK]
    for row in missed:
        lines.append(f"  #{row['rank']} misses the SLOs: {row['reason']}")
    lines.append("")
    lines.append(f"infeasible points: {len(infeasible)}")
    for row in infeasible:
        lines.append(f"  {_describe_point(row, full_kv)}: {row['reason']}")
    lines.append("")
    front = result.pareto
    lines.append(f"best per GPU, {OBJECTIVE_LABELS[spec.objective]} (Full KV: no budget to "
                 "trade against accuracy):" if full_kv else
                 f"Pareto front, {OBJECTIVE_LABELS[spec.objective]} vs KV budget "
                 f"(higher budget = more accurate), per GPU:")
    if not front:
        lines.append("  (empty: no point meets the SLOs)" if spec.slo.active else
                     "  (empty: no feasible point)")
    pareto_columns = [("gpu", lambda row: row["hardware"]),
                      ("budget", lambda row: _budget(row, full_kv)),
                      (_objective_header(spec), lambda row: _number(row["objective_value"])),
                      ("rank", lambda row: row["rank"]),
                      ("deployment", lambda row: _describe_deployment(row, full_kv))]
    lines += format_table([header for header, _ in pareto_columns],
                          [[cell(row) for _, cell in pareto_columns] for row in front])
    # With max-rate every point meets the SLOs at the rate it found: there is no count to name.
    if spec.slo.active and len(spec.replicas) > 1 and spec.objective != MAX_RATE:
        lines += ["", *format_fewest_replicas(rows, spec)]
    return "\n".join(lines)


def format_fewest_replicas(rows: list[dict], spec: PlanSpec) -> list[str]:
    """Per GPU and load, the fewest replicas of any point that meets the SLOs (the best of those
    by the objective): how many GPUs this traffic needs."""
    if spec.speedups != [None]:
        load = ("speedup", "speedup", spec.speedups, lambda value: f"{value:g}x")
    elif spec.rates != [None]:
        load = ("rate req/s", "rate_qps", spec.rates, _rate)
    else:
        load = None
    best: dict[tuple, dict] = {}
    for row in rows:  # ranked: the first of a replica count is the best by the objective
        group = (row["hardware"], *((row[load[1]],) if load else ()))
        if row["status"] == OK and (group not in best or row["replicas"] < best[group]["replicas"]):
            best[group] = row
    full_kv = not spec.base.config.compress
    table = []
    for group in itertools.product(spec.hardware, *((load[2],) if load else ())):
        row = best.get(group)
        cells = [group[0], *((load[3](group[1]),) if load else ())]
        if row is None:
            table.append([*cells, f"> {max(spec.replicas)}", "-",
                          "no replica count searched meets them"])
        else:
            table.append([*cells, row["replicas"], _budget(row, full_kv),
                          _describe_deployment(row, full_kv)])
    headers = ["gpu", *((load[0],) if load else ()), "replicas", "budget", "deployment"]
    return [f"fewest replicas meeting the SLOs ({_describe_slo(spec.slo)}), per GPU"
            + (" and load" if load else "") + ":", *format_table(headers, table)]


def format_table(headers: list[str], rows: list[list]) -> list[str]:
    """Left-aligned text columns, right-aligned numbers, two spaces apart."""
    cells = [[str(value) for value in row] for row in rows]
    widths = [max([len(header), *(len(row[index]) for row in cells)])
              for index, header in enumerate(headers)]
    numeric = [all(_is_numeric(row[index]) for row in cells) and cells
               for index in range(len(headers))]

    def line(values: list[str]) -> str:
        return "  " + "  ".join(
            value.rjust(width) if is_number else value.ljust(width)
            for value, width, is_number in zip(values, widths, numeric)).rstrip()

    return [line(headers), *(line(row) for row in cells)]


def _table_columns(spec: PlanSpec) -> list[tuple[str, object]]:
    full_kv = not spec.base.config.compress
    columns = [("#", lambda row: row["rank"]), ("gpu", lambda row: row["hardware"]),
               ("budget", lambda row: _budget(row, full_kv))]
    if len(spec.budget_policies) > 1:
        columns.append(("policy", lambda row: row["budget_policy"]))
    columns += [("block", lambda row: row["block_size"]),
               ("hybrid", lambda row: "-" if full_kv else "on" if row["hybrid"] else "off"),
               ("replicas", lambda row: row["replicas"])]
    if spec.kv_memory_gb is not None:
        columns.append(("kv GiB", lambda row: f"{row['kv_memory_gb']:g}"))
    elif len(spec.gpu_memory_utilization) > 1:
        columns.append(("util", lambda row: f"{row['gpu_memory_utilization']:g}"))
    if spec.objective == MAX_RATE:
        # The metrics of a max-rate row are measured at the rate found.
        columns.append(("max req/s", lambda row: _rate(row["max_rate_qps"])))
    elif spec.rates != [None]:
        columns.append(("rate req/s", lambda row: _rate(row["rate_qps"])))
    if spec.speedups != [None]:
        columns.append(("speedup", lambda row: f"{row['speedup']:g}x"))
    columns += [("tok/s", lambda row: _number(row["tps"])),
                ("tok/s per $/h", lambda row: _number(row["tps_per_dollar"])),
                ("TTFT p90 s", lambda row: f"{row['ttft_p90_s']:.2f}"),
                *([("TTFT p99 s", lambda row: f"{row['ttft_p99_s']:.2f}")]
                  if spec.slo.ttft_p99_s is not None else []),
                ("TPOT p99 ms", lambda row: f"{row['tpot_p99_ms']:.1f}")]
    if len(spec.budget_policies) > 1:
        # What the requests kept on average: the budget under "fixed", more under "elastic".
        columns.append(("kept", lambda row: _number(row["mean_kept_budget"])))
    columns += [
                ("M", lambda row: row["max_concurrency"] if row["max_concurrency"] is not None
                 else "-"),
                ("status", lambda row: row["status"] + (" *" if row["pareto"] else ""))]
    return columns


def _objective_header(spec: PlanSpec) -> str:
    return {TPS: "tok/s", TPS_PER_DOLLAR: "tok/s per $/h", MAX_RATE: "max req/s"}[spec.objective]


def _describe_slo(slo: SLO) -> str:
    parts = []
    if slo.ttft_p90_s is not None:
        parts.append(f"TTFT p90 <= {slo.ttft_p90_s:g} s")
    if slo.ttft_p99_s is not None:
        parts.append(f"TTFT p99 <= {slo.ttft_p99_s:g} s")
    if slo.tpot_p99_ms is not None:
        parts.append(f"TPOT p99 <= {slo.tpot_p99_ms:g} ms")
    return ", ".join(parts)


def _budget(row: dict, full_kv: bool) -> str | int:
    return "Full KV" if full_kv else row["budget"]


def _describe_deployment(row: dict, full_kv: bool = False) -> str:
    """The point's settings besides the GPU and budget; Full KV has no hybrid mode (no query
    slots) and no budget policy."""
    policy = ["elastic budget"] if row.get("budget_policy") == "elastic" and not full_kv else []
    mode = [] if full_kv else [f"hybrid {'on' if row['hybrid'] else 'off'}"]
    parts = [*policy, f"block {row['block_size']}", *mode,
             f"{row['replicas']} replica{'s' if row['replicas'] > 1 else ''}"]
    if row["kv_memory_gb"] is not None:
        parts.append(f"{row['kv_memory_gb']:g} GiB kv")
    if row["rate_qps"] is not None:
        parts.append(f"{_rate(row['rate_qps'])} req/s")
    if row.get("speedup") is not None:
        parts.append(f"{row['speedup']:g}x speed-up")
    return ", ".join(parts)


def _describe_point(row: dict, full_kv: bool = False) -> str:
    budget = "Full KV" if full_kv else f"budget {row['budget']}"
    return f"{row['hardware']} {budget}, {_describe_deployment(row, full_kv)}"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:,.1f}" if abs(value) < 100 else f"{value:,.0f}"


def _rate(value: float | None) -> str:
    if value is None:
        return "offline"
    return "inf" if math.isinf(value) else f"{value:.3g}"


def _is_numeric(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return text in ("-", "inf")
    return True


# ---------------------------------------------------------------- files under --out

def write_outputs(result: PlanResult, spec: PlanSpec, out: Path) -> list[str]:
    """results.csv, results.parquet (if pandas can write Parquet) and pareto.png; returns what
    was written, one line each. Each file replaces its predecessor by rename, under a lock on
    `out`: grids planned into one directory at once leave the three files of one grid, whole
    (the last to finish), never rows of both."""
    from zipage.rundir import directory_lock, write_file_atomically

    out.mkdir(parents=True, exist_ok=True)
    with directory_lock(out):
        write_file_atomically(out / "results.csv", lambda path: _write_csv(result, path))
        written = [f"wrote {out / 'results.csv'} ({len(result.rows)} rows)",
                   _write_parquet(result, out / "results.parquet")]
        write_file_atomically(out / "pareto.png", lambda path: plot_pareto(result, spec, path))
    written.append(f"wrote {out / 'pareto.png'}")
    return written


def _write_csv(result: PlanResult, path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(RESULT_COLUMNS)
        for row in result.rows:
            writer.writerow(["" if row[column] is None else row[column]
                             for column in RESULT_COLUMNS])


def _write_parquet(result: PlanResult, path: Path) -> str:
    import pandas

    from zipage.rundir import write_file_atomically

    frame = pandas.DataFrame(result.rows, columns=RESULT_COLUMNS)
    try:
        write_file_atomically(path, lambda temporary: frame.to_parquet(temporary, index=False))
    except ImportError:
        path.unlink(missing_ok=True)  # an earlier grid's rows would contradict results.csv
        return (f"skipped {path}: pandas has no Parquet engine here (pip install pyarrow); "
                "results.csv holds the same rows")
    return f"wrote {path}"


def plot_pareto(result: PlanResult, spec: PlanSpec, path: Path) -> None:
    """Every point meeting the SLOs as a dot, each GPU's Pareto front as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    ok_rows = [row for row in result.rows if row["status"] == OK]
    if not spec.base.config.compress:
        _plot_per_gpu(axes, ok_rows, spec)
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        return
    budgets = sorted({row["budget"] for row in result.rows})
    for index, hardware in enumerate(spec.hardware):
        color = f"C{index}"
        points = [row for row in ok_rows if row["hardware"] == hardware]
        front = sorted((row for row in points if row["pareto"]), key=lambda row: row["budget"])
        finite = [row for row in points if math.isfinite(row["objective_value"])]
        axes.scatter([row["budget"] for row in finite],
                     [row["objective_value"] for row in finite], color=color, alpha=0.35, s=18)
        front = [row for row in front if math.isfinite(row["objective_value"])]
        axes.plot([row["budget"] for row in front], [row["objective_value"] for row in front],
                  color=color, marker="o", label=f"{hardware} (front)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(budgets, [str(budget) for budget in budgets])
    axes.minorticks_off()
    axes.set_xlabel("KV budget k (tokens kept per request; higher = more accurate)")
    axes.set_ylabel(OBJECTIVE_LABELS[spec.objective])
    _finish_axes(axes, "Pareto front: " + OBJECTIVE_LABELS[spec.objective] + " vs budget", spec,
                 ok_rows)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _plot_per_gpu(axes, ok_rows: list[dict], spec: PlanSpec) -> None:
    """Full KV has no budget axis: every point meeting the SLOs over its GPU, the best one of
    each GPU marked."""
    for index, hardware in enumerate(spec.hardware):
        values = [row["objective_value"] for row in ok_rows
                  if row["hardware"] == hardware and math.isfinite(row["objective_value"])]
        axes.scatter([index] * len(values), values, color=f"C{index}", alpha=0.35, s=18)
        if values:
            axes.scatter([index], [max(values)], color=f"C{index}", marker="o", s=40,
                         label=f"{hardware} (best)")
    axes.set_xticks(range(len(spec.hardware)), spec.hardware)
    axes.set_xlim(-0.5, len(spec.hardware) - 0.5)
    axes.set_xlabel("GPU")
    axes.set_ylabel(OBJECTIVE_LABELS[spec.objective])
    _finish_axes(axes, "Full KV (no compression): " + OBJECTIVE_LABELS[spec.objective]
                 + " per GPU", spec, ok_rows)


def _finish_axes(axes, title: str, spec: PlanSpec, ok_rows: list[dict]) -> None:
    if spec.slo.active:
        title += f"\nSLOs: {_describe_slo(spec.slo)}"
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    if ok_rows:
        axes.legend(fontsize=8)
