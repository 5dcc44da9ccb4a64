"""The paper's ablation: Zipage against itself without async compression, without hybrid
scheduling, without prefix caching, and against Full KV, on several workloads.

`run_ablation` replays every (trace, variant) through a `simulate(trace_path, overrides)` callable
(the CLI passes the simulator), `write_ablation_report` writes the table, a markdown version and
the grouped bar chart of the paper's TPS-by-configuration figure, and `check_paper_directions`
says which of the paper's claims the numbers reproduce.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd

ABLATION_VARIANTS: dict[str, dict] = {
    "zipage": {},
    "no-async": {"async_compress": False},
    "no-hybrid": {"hybrid": False},
    "no-prefix-cache": {"prefix_cache": False},
    "full-kv": {"compress": False},
}
COLUMNS = ["tps", "makespan_s", "mean_tpot_ms", "peak_running", "mean_running", "preemptions",
           "compressions"]


def workload_name(trace_path: str) -> str:
    return Path(trace_path).stem


def run_ablation(traces: list[str], simulate: Callable[[str, dict], dict],
                 progress: bool = True) -> pd.DataFrame:
    points = [(trace, variant) for trace in traces for variant in ABLATION_VARIANTS]
    if progress:
        from tqdm import tqdm

        points = tqdm(points, desc="ablation", unit="run")
    rows = []
    for trace, variant in points:
        summary = simulate(trace, ABLATION_VARIANTS[variant])
        rows.append({"workload": workload_name(trace), "variant": variant,
                     **{column: summary[column] for column in COLUMNS}})
    table = pd.DataFrame(rows)
    full_kv = table[table.variant == "full-kv"].set_index("workload")["tps"]
    table["speedup_vs_full_kv"] = table.tps / table.workload.map(full_kv)
    return table


def markdown_table(table: pd.DataFrame) -> str:
    """Rows = workloads, columns = variants: TPS with its ratio to Full KV."""
    variants = [v for v in ABLATION_VARIANTS if v in set(table.variant)]
    lines = ["| workload | " + " | ".join(variants) + " |",
             "|---|" + "---|" * len(variants)]
    for workload, rows in table.groupby("workload", sort=False):
        by_variant = rows.set_index("variant")
        cells = [f"{by_variant.tps[v]:,.0f} ({by_variant.speedup_vs_full_kv[v]:.2f}x)"
                 for v in variants]
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_ablation_report(table: pd.DataFrame, out_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "ablation.csv", index=False)
    (out / "ablation.md").write_text(
        "Output tokens/s by workload and configuration (ratio to Full KV)\n\n"
        + markdown_table(table))
    pivot = table.pivot(index="workload", columns="variant", values="tps")
    pivot = pivot[[v for v in ABLATION_VARIANTS if v in pivot.columns]]
    axis = pivot.plot.bar(figsize=(9, 4.5), rot=0, width=0.8)
    axis.set_ylabel("output tokens / s")
    axis.set_title("TPS by workload and configuration (simulated)")
    axis.legend(ncols=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    axis.figure.tight_layout()
    axis.figure.savefig(out / "ablation.png", dpi=120)
    plt.close(axis.figure)
    return out


def check_paper_directions(table: pd.DataFrame) -> list[tuple[str, bool, str]]:
    """The paper's ablation claims, evaluated on the workloads present."""
    tps = table.pivot(index="workload", columns="variant", values="tps")
    checks = []

    def claim(text: str, holds: bool, detail: str) -> None:
        checks.append((text, bool(holds), detail))

    if {"zipage", "full-kv"} <= set(tps.columns):
        ratios = tps.zipage / tps["full-kv"]
        claim("Zipage beats Full KV on every workload", (ratios > 1).all(),
              ", ".join(f"{w} {r:.2f}x" for w, r in ratios.items()))
        for workload, ratio in ratios.items():
            if "amc23" in workload:
                claim("Zipage >= 1.8x Full KV on AMC23", ratio >= 1.8, f"{ratio:.2f}x")
    if {"zipage", "no-async"} <= set(tps.columns):
        change = tps["no-async"] / tps.zipage - 1
        claim("disabling async compression lowers TPS everywhere", (change < 0).all(),
              ", ".join(f"{w} {100 * c:+.1f}%" for w, c in change.items()))
    for workload in tps.index:
        if "mixture" in workload and {"zipage", "no-hybrid"} <= set(tps.columns):
            gain = tps.zipage[workload] / tps["no-hybrid"][workload] - 1
            claim("hybrid scheduling helps the mixture", gain > 0, f"{100 * gain:+.1f}%")
        if "longbench" in workload and {"zipage", "no-prefix-cache"} <= set(tps.columns):
            gain = tps.zipage[workload] / tps["no-prefix-cache"][workload] - 1
            claim("prefix caching helps LongBench", gain > 0, f"{100 * gain:+.1f}%")
    return checks
