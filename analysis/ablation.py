"""The paper's ablation: TPS of each workload with one Zipage technique switched off at a time.

`run_ablation` replays every trace under every variant of `ABLATION_VARIANTS` (overrides of
`ZipageConfig` fields) through a `simulate(trace_path, overrides) -> summary` callable that the
caller supplies, and tabulates the headline numbers with the speedup over Full KV.
`write_ablation_report` writes `ablation.csv`, `ablation.md` (the TPS table of the paper's
TPS-by-configuration figure) and `ablation.png` (grouped bars of TPS by workload and
configuration); `check_paper_directions` says which of the paper's claims these numbers reproduce.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

from zipage.errors import ZipageError

ZIPAGE = "zipage"
NO_ASYNC = "no-async"
NO_HYBRID = "no-hybrid"
NO_PREFIX_CACHE = "no-prefix-cache"
FULL_KV = "full-kv"

ABLATION_VARIANTS: dict[str, dict] = {
    ZIPAGE: {},
    NO_ASYNC: {"async_compress": False},
    NO_HYBRID: {"hybrid": False},
    NO_PREFIX_CACHE: {"prefix_cache": False},
    FULL_KV: {"compress": False},
}

VARIANT_LABELS: dict[str, str] = {
    ZIPAGE: "Zipage",
    NO_ASYNC: "w/o async compression",
    NO_HYBRID: "w/o hybrid scheduling",
    NO_PREFIX_CACHE: "w/o prefix cache",
    FULL_KV: "Full KV",
}

# Summary keys (zipage.core.metrics.summarize) copied into each row of the ablation table.
SUMMARY_METRICS = ("tps", "makespan_s", "mean_tpot_ms", "peak_running", "mean_running",
                   "preemptions", "compressions")

# The paper reports "over 2.1x" on AMC23; 1.8x leaves room for the simulator's cost model.
AMC23_MIN_SPEEDUP = 1.8
# The workloads the paper's claims are about (traces/<name>.json). Any other trace - tiny.json,
# amc23-headline.json (tuned for an H200), a user's own - is tabulated but not judged.
PAPER_WORKLOADS = ("amc23", "gsm8k", "mixture", "longbench")


def workload_name(trace_path: str | Path) -> str:
    """A trace's name in the ablation table: its file's stem ("traces/amc23.json" -> "amc23")."""
    return Path(trace_path).stem


def run_ablation(traces: list[str], simulate: Callable[[str, dict], dict],
                 progress: bool = True) -> pd.DataFrame:
    """One row per (trace, variant): the variant's summary metrics and its speedup over Full KV."""
    names = [workload_name(trace) for trace in traces]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ZipageError(f"traces: several traces are named {', '.join(duplicates)}; the "
                          f"ablation table names workloads by file stem, so rename the copies")
    rows = []
    with tqdm(total=len(traces) * len(ABLATION_VARIANTS), disable=not progress,
              desc="ablation", unit="run") as bar:
        for trace, workload in zip(traces, names):
            for variant, overrides in ABLATION_VARIANTS.items():
                bar.set_postfix_str(f"{workload} / {variant}")
                # A copy, so a simulate that edits its overrides cannot change the next run's.
                summary = simulate(trace, dict(overrides))
                rows.append({"workload": workload, "variant": variant, "trace": str(trace),
                             **{metric: summary[metric] for metric in SUMMARY_METRICS}})
                bar.update()
    return with_speedup(pd.DataFrame(rows, columns=["workload", "variant", "trace",
                                                   *SUMMARY_METRICS]))


def with_speedup(table: pd.DataFrame) -> pd.DataFrame:
    """`table` plus `speedup_vs_full_kv`: each row's TPS over its workload's Full KV TPS (NaN
    where the workload has no Full KV row or its TPS is 0)."""
    full_kv_tps = table[table["variant"] == FULL_KV].set_index("workload")["tps"]
    baseline = table["workload"].map(full_kv_tps).astype(float)
    result = table.copy()
    result["speedup_vs_full_kv"] = table["tps"].astype(float) / baseline.where(baseline > 0)
    return result


def pivot_by_variant(table: pd.DataFrame, values: str = "tps") -> pd.DataFrame:
    """One column of `table` laid out with rows = workloads (in table order) and columns =
    the variants present, in the order of ABLATION_VARIANTS."""
    pivot = table.pivot(index="workload", columns="variant", values=values)
    variants = [variant for variant in ABLATION_VARIANTS if variant in pivot.columns]
    return pivot.loc[list(dict.fromkeys(table["workload"])), variants]


def markdown_table(table: pd.DataFrame) -> str:
    """The markdown TPS table: one row per workload, one column per variant, each cell the TPS
    with its ratio to Full KV in parentheses ("-" where a run is missing)."""
    tps = pivot_by_variant(table)
    speedup = pivot_by_variant(table, "speedup_vs_full_kv")
    header = ["workload", *(VARIANT_LABELS[variant] for variant in tps.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload, row in tps.iterrows():
        cells = [str(workload)]
        for variant, value in row.items():
            ratio = speedup.at[workload, variant]
            if np.isnan(value):
                cells.append("-")
            elif np.isnan(ratio):
                cells.append(f"{value:,.1f}")
            else:
                cells.append(f"{value:,.1f} ({ratio:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_ablation(table: pd.DataFrame, path: str | Path) -> Path:
    """Grouped bars: one group per workload, one bar per variant, labelled with the ratio to
    Full KV. Returns the path written."""
    tps = pivot_by_variant(table)
    speedup = pivot_by_variant(table, "speedup_vs_full_kv")
    figure = Figure(figsize=(max(7.0, 1.6 * len(tps.index) + 2), 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    group_positions = np.arange(len(tps.index))
    bar_width = 0.8 / len(tps.columns)
    for offset, variant in enumerate(tps.columns):
        positions = group_positions + (offset - (len(tps.columns) - 1) / 2) * bar_width
        bars = axis.bar(positions, tps[variant].to_numpy(dtype=float), bar_width,
                        label=VARIANT_LABELS[variant])
        axis.bar_label(bars, labels=["" if np.isnan(ratio) else f"{ratio:.2f}x"
                                     for ratio in speedup[variant]],
                       fontsize=7, rotation=90, padding=2)
    axis.set_xticks(group_positions, [str(workload) for workload in tps.index])
    axis.set_ylabel("output tokens / s")
    axis.set_title("TPS by workload and configuration (label: ratio to Full KV)")
    axis.margins(y=0.15)
    # Below the axes, so the legend never hides a bar or its label.
    figure.legend(loc="outside lower center", ncols=min(len(tps.columns), 5), fontsize=8)
    path = Path(path)
    figure.savefig(path, dpi=110)
    return path


def write_ablation_report(df: pd.DataFrame, out_dir: str | Path) -> Path:
    """Write `ablation.csv`, `ablation.md` and `ablation.png` into `out_dir` (created if needed);
    returns `out_dir`. Each file is renamed into place under a lock on `out_dir`, so two reports
    into one directory leave one report's three files, never a mix (as `zipage plan --out`)."""
    from zipage.rundir import directory_lock, write_file_atomically

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = "# Ablation: output tokens per second (ratio to Full KV)\n\n" + markdown_table(df)
    with directory_lock(out_dir):
        write_file_atomically(out_dir / "ablation.csv", lambda path: df.to_csv(path, index=False))
        write_file_atomically(out_dir / "ablation.md", lambda path: path.write_text(text))
        write_file_atomically(out_dir / "ablation.png", lambda path: plot_ablation(df, path))
    return out_dir


def _tps_of(table: pd.DataFrame, workload: str, variant: str) -> float | None:
    rows = table[(table["workload"] == workload) & (table["variant"] == variant)]
    return float(rows["tps"].iloc[0]) if len(rows) else None


def _compare_variants(table: pd.DataFrame, claim: str, better: str, worse: str,
                      workloads: list[str], min_ratio: float | None = None
                      ) -> tuple[str, bool, str] | None:
    """Does `better` beat `worse` in TPS on every one of `workloads` (by at least `min_ratio` when
    given)? None when no workload has both rows: the claim cannot be judged on this table."""
    verdicts = []
    details = []
    for workload in workloads:
        better_tps = _tps_of(table, workload, better)
        worse_tps = _tps_of(table, workload, worse)
        if better_tps is None or worse_tps is None:
            continue
        ratio = better_tps / worse_tps if worse_tps > 0 else float("inf")
        verdicts.append(ratio >= min_ratio if min_ratio is not None else better_tps > worse_tps)
        details.append(f"{workload}: {better} {better_tps:.1f} vs {worse} {worse_tps:.1f} "
                       f"tok/s = {ratio:.2f}x")
    if not verdicts:
        return None
    wanted = f" (wanted >= {min_ratio:.1f}x)" if min_ratio is not None else ""
    return claim, all(verdicts), "; ".join(details) + wanted


def unjudged_workloads(df: pd.DataFrame) -> list[str]:
    """Workloads of the table the paper's claims say nothing about (not in PAPER_WORKLOADS)."""
    return [workload for workload in dict.fromkeys(df["workload"])
            if workload not in PAPER_WORKLOADS]


def check_paper_directions(df: pd.DataFrame) -> list[tuple[str, bool, str]]:
    """The paper's ablation claims, judged on the rows of the paper's workloads present:
    (claim, holds, detail with the numbers). A claim whose workloads or variants are all absent
    is left out; so are workloads outside PAPER_WORKLOADS (`unjudged_workloads`)."""
    workloads = [workload for workload in dict.fromkeys(df["workload"])
                 if workload in PAPER_WORKLOADS]

    def named(name: str) -> list[str]:
        return [workload for workload in workloads if workload == name]

    checks = [
        _compare_variants(df, "Zipage beats Full KV on every workload", ZIPAGE, FULL_KV,
                          workloads),
        _compare_variants(df, f"Zipage reaches >= {AMC23_MIN_SPEEDUP}x Full KV on AMC23", ZIPAGE,
                          FULL_KV, named("amc23"), min_ratio=AMC23_MIN_SPEEDUP),
        _compare_variants(df, "Disabling async compression lowers TPS on every workload", ZIPAGE,
                          NO_ASYNC, workloads),
        _compare_variants(df, "Hybrid scheduling helps the mixture workload", ZIPAGE, NO_HYBRID,
                          named("mixture")),
        _compare_variants(df, "Prefix caching helps LongBench", ZIPAGE, NO_PREFIX_CACHE,
                          named("longbench")),
    ]
    return [check for check in checks if check is not None]
