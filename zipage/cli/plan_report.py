"""`zipage plan`'s output: the ranked table, the fewest replicas meeting the SLOs, the Pareto
front, and the files --out writes (results.csv, results.parquet, pareto.png). Where a validated
profile priced the points, each figure's column names its error band and a verdict within the
band is uncertain (sim/slo.py); otherwise one line says the figures have no band."""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path

from zipage.cli.bands import no_band_line, validated_lines
from zipage.sim.planning import (
    ARRIVAL_CAP_SHARE,
    MAX_RATE,
    MAX_USERS,
    OK,
    RESULT_COLUMNS,
    SEARCHED,
    SLO_UNCERTAIN,
    TPS,
    TPS_PER_DOLLAR,
    PlanResult,
    PlanSpec,
)
from zipage.sim.slo import format_band

OBJECTIVE_LABELS = {TPS: "throughput (tok/s)", TPS_PER_DOLLAR: "tok/s per $/h",
                    MAX_RATE: "max rate meeting the SLOs (req/s)",
                    MAX_USERS: "max concurrent users meeting the SLOs"}


def format_report(result: PlanResult, spec: PlanSpec, top: int = 20) -> str:
    rows = result.rows
    full_kv = not spec.base.config.compress
    ranked = [row for row in rows if row["status"] != "infeasible"]
    infeasible = [row for row in rows if row["status"] == "infeasible"]
    columns = _table_columns(spec, ranked)
    lines = [f"ranked by {OBJECTIVE_LABELS[spec.objective]}"
             + (f", SLOs: {spec.slo.describe()}" if spec.slo.active else "")
             + _describe_sessions(rows, spec)
             + (f" (top {top} of {len(ranked)})" if len(ranked) > top else "")]
    lines += format_table([header for header, _ in columns],
                          [[cell(row) for _, cell in columns] for row in ranked[:top]])
    lines += _arrival_cap_lines(ranked, spec)
    missed = [row for row in ranked[:top] if row["status"] != OK]
    for row in missed:
        verb = "may miss" if row["status"] == SLO_UNCERTAIN else "misses"
        lines.append(f"  #{row['rank']} {verb} the SLOs: {row['reason']}")
    if ranked:
        lines += _trust_lines(result, spec)
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
    uncertain = sum(row["status"] == SLO_UNCERTAIN for row in ranked)
    if not front:
        lines.append(f"  (empty: no point surely meets the SLOs; {uncertain} uncertain)"
                     if uncertain else "  (empty: no point meets the SLOs)" if spec.slo.active
                     else "  (empty: no feasible point)")
    objective_key = None if spec.objective in SEARCHED else "tps"  # per dollar: tps's band
    pareto_columns = [("gpu", lambda row: row["hardware"]),
                      ("budget", lambda row: _budget(row, full_kv)),
                      (_banded(_objective_header(spec), ranked, objective_key),
                       lambda row: _number(row["objective_value"])),
                      ("rank", lambda row: row["rank"]),
                      ("deployment", lambda row: _describe_deployment(row, full_kv))]
    lines += format_table([header for header, _ in pareto_columns],
                          [[cell(row) for _, cell in pareto_columns] for row in front])
    # With max-rate (max-users) every point meets the SLOs at the rate (users) it found: there
    # is no count to name.
    if spec.slo.active and len(spec.replicas) > 1 and spec.objective not in SEARCHED:
        lines += ["", *format_fewest_replicas(rows, spec)]
    return "\n".join(lines)


def format_fewest_replicas(rows: list[dict], spec: PlanSpec) -> list[str]:
    """Per GPU and load, the fewest replicas of any point that meets the SLOs (the best of those
    by the objective): how many GPUs this traffic needs. Smaller counts whose verdict is
    uncertain (within the validated band) are named beside it: they may do."""
    if spec.speedups != [None]:
        load = ("speedup", "speedup", spec.speedups, lambda value: f"{value:g}x")
    elif spec.rates != [None]:
        load = ("rate req/s", "rate_qps", spec.rates, _rate)
    else:
        load = None
    best: dict[tuple, dict] = {}
    uncertain: dict[tuple, dict[int, dict]] = {}
    for row in rows:  # ranked: the first of a replica count is the best by the objective
        group = (row["hardware"], *((row[load[1]],) if load else ()))
        if row["status"] == OK and (group not in best or row["replicas"] < best[group]["replicas"]):
            best[group] = row
        elif row["status"] == SLO_UNCERTAIN:
            uncertain.setdefault(group, {}).setdefault(row["replicas"], row)
    full_kv = not spec.base.config.compress
    table = []
    for group in itertools.product(spec.hardware, *((load[2],) if load else ())):
        row = best.get(group)
        cells = [group[0], *((load[3](group[1]),) if load else ())]
        maybe = _uncertain_counts(uncertain.get(group, {}), row)
        if row is None:
            table.append([*cells, f"> {max(spec.replicas)}", "-",
                          ("no replica count searched surely meets them " + maybe) if maybe
                          else "no replica count searched meets them"])
        else:
            table.append([*cells, row["replicas"], _budget(row, full_kv),
                          _describe_deployment(row, full_kv) + (f" {maybe}" if maybe else "")])
    headers = ["gpu", *((load[0],) if load else ()), "replicas", "budget", "deployment"]
    return [f"fewest replicas meeting the SLOs ({spec.slo.describe()}), per GPU"
            + (" and load" if load else "") + ":", *format_table(headers, table)]


def _uncertain_counts(by_count: dict[int, dict], answer: dict | None) -> str:
    """'(2 is uncertain: TTFT p99 0.98 s within the ±11.0 % band of 1 s)': the replica counts
    below the answer (any, when there is none) whose verdict is uncertain, with the reason of
    the largest, the nearest to the answer; '' when there are none."""
    counts = sorted(count for count in by_count
                    if answer is None or count < answer["replicas"])
    if not counts:
        return ""
    named = (str(counts[0]) if len(counts) == 1
             else ", ".join(map(str, counts[:-1])) + f" and {counts[-1]}")
    reason = by_count[counts[-1]]["reason"]
    if len(counts) == 1:
        return f"({named} is uncertain: {reason})"
    return f"({named} are uncertain; {counts[-1]}: {reason})"


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


def _table_columns(spec: PlanSpec, ranked: list[dict]) -> list[tuple[str, object]]:
    """The ranked table's columns; a figure's header names its validated band where every row
    shares one (`ranked`: the rows shown)."""
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
    elif spec.objective == MAX_USERS:
        # ... and those of a max-users row with the users found (with 1 when none meets them).
        columns.append(("max users", lambda row: row["max_users"]))
    elif spec.rates != [None]:
        columns.append(("rate req/s", lambda row: _rate(row["rate_qps"])))
    if spec.speedups != [None]:
        columns.append(("speedup", lambda row: f"{row['speedup']:g}x"))
    columns += [(_banded("tok/s", ranked, "tps"), lambda row: _number(row["tps"])),
                (_banded("tok/s per $/h", ranked, "tps"),
                 lambda row: _number(row["tps_per_dollar"])),
                (_banded("TTFT p90 s", ranked, "ttft_p90_s"),
                 lambda row: f"{row['ttft_p90_s']:.2f}"),
                *([(_banded("TTFT p99 s", ranked, "ttft_p99_s"),
                    lambda row: f"{row['ttft_p99_s']:.2f}")]
                  if spec.slo.ttft_p99_s is not None else []),
                # A trace of sessions: what the users waited for an answer after the first.
                *([(_banded("follow-up TTFT p90 s", ranked, "followup_ttft_p90_s"),
                    lambda row: _seconds(row["followup_ttft_p90_s"]))]
                  if any(row["followup_ttft_p90_s"] is not None for row in ranked) else []),
                (_banded("TPOT p99 ms", ranked, "tpot_p99_ms"),
                 lambda row: f"{row['tpot_p99_ms']:.1f}")]
    if len(spec.budget_policies) > 1:
        # What the requests kept on average: the budget under "fixed", more under "elastic".
        columns.append(("kept", lambda row: _number(row["mean_kept_budget"])))
    if _capped(ranked, spec):
        columns.append(("capped", lambda row: "yes" if row["arrival_capped"] else "-"))
    columns += [
                ("M", lambda row: row["max_concurrency"] if row["max_concurrency"] is not None
                 else "-"),
                ("status", lambda row: row["status"] + (" *" if row["pareto"] else ""))]
    return columns


def _capped(ranked: list[dict], spec: PlanSpec) -> list[dict]:
    """The rows whose throughput the trace's arrivals capped (sim/planning.py's rule); none under
    max-rate and max-users, which choose the load themselves."""
    if spec.objective in SEARCHED:
        return []
    return [row for row in ranked if row.get("arrival_capped")]


def _arrival_cap_lines(ranked: list[dict], spec: PlanSpec) -> list[str]:
    """One note, when some point served the trace as fast as it arrived: its tok/s is the
    trace's arrival rate, the same for any deployment fast enough, so ranking by it compares
    nothing."""
    capped = len(_capped(ranked, spec))
    if not capped:
        return []
    who = ("every point" if capped == len(ranked) else
           f"{capped} point{'s' if capped > 1 else ''} (capped: yes)")
    return [f"  note: {who} served the trace as fast as it arrived ({capped}/{len(ranked)} "
            f"points arrival-capped: tok/s within {1 - ARRIVAL_CAP_SHARE:.0%} of the trace's "
            "output tokens / arrival span):",
            "  throughput there measures the trace, not the deployment; to compare deployments "
            "use --objective max-rate, --speedup to play the trace faster, or an all-at-once "
            "trace"]


def _banded(header: str, rows: list[dict], key: str | None) -> str:
    """`header` with the validated band of the figure `key` ("tok/s ±2.2 %") when the rows
    share one; the bare header when they have none (or, which one --cost-model rules out,
    differ: results.csv has each row's)."""
    bands = {row.get(f"{key}_band") for row in rows} if key is not None else {None}
    return header if len(bands) != 1 or None in bands else f"{header} {format_band(bands.pop())}"


def _trust_lines(result: PlanResult, spec: PlanSpec) -> list[str]:
    """Where the bands in the headers come from and what they do to the verdicts, or one line
    that there are none."""
    if result.validation is None:
        return ["  " + no_band_line(spec.base.cost_model)]
    lines = validated_lines(result.validation)
    if spec.objective == MAX_RATE:
        lines.append("max req/s: the highest rate whose figures meet the SLOs even off by their "
                     "band (docs/planning.md)")
    elif spec.objective == MAX_USERS:
        lines.append("max users: the most users whose figures meet the SLOs even off by their "
                     "band (docs/planning.md)")
    elif spec.slo.active:
        lines.append("SLO verdicts: uncertain where the target lies within the figure's band "
                     "(docs/planning.md)")
    return ["  " + line for line in lines]


def _objective_header(spec: PlanSpec) -> str:
    return {TPS: "tok/s", TPS_PER_DOLLAR: "tok/s per $/h", MAX_RATE: "max req/s",
            MAX_USERS: "max users"}[spec.objective]


def _describe_sessions(rows: list[dict], spec: PlanSpec) -> str:
    """With max-users, how many sessions the users work through (every row has the trace's)."""
    if spec.objective != MAX_USERS:
        return ""
    sessions = next((row["sessions"] for row in rows if row["sessions"] is not None), None)
    if sessions is None:  # (every point infeasible before a simulation)
        return ""
    return f" ({sessions:,} session{'s' if sessions != 1 else ''}, all starting at 0)"


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
    if row.get("users") is not None:
        parts.append(f"{row['users']} user{'s' if row['users'] > 1 else ''}")
    return ", ".join(parts)


def _describe_point(row: dict, full_kv: bool = False) -> str:
    budget = "Full KV" if full_kv else f"budget {row['budget']}"
    return f"{row['hardware']} {budget}, {_describe_deployment(row, full_kv)}"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):  # (a count: max users)
        return f"{value:,}"
    if math.isinf(value):
        return "inf"
    return f"{value:,.1f}" if abs(value) < 100 else f"{value:,.0f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


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
        title += f"\nSLOs: {spec.slo.describe()}"
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    if ok_rows:
        axes.legend(fontsize=8)
