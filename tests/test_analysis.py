"""Analysis: timeline plots, the ablation report and its paper-direction checks, and the
comparison of two run directories."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from zipage.analysis.ablation import check_paper_directions, markdown_table, write_ablation_report
from zipage.analysis.compare import compare_runs, format_report
from zipage.cli import main
from zipage.errors import ZipageError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    assert main(["replay", str(ROOT / "traces" / "tiny.json"), "--out", str(out),
                 "--no-progress", "--no-async", "--block-size", "16", "--window", "4",
                 "--budget", "64", "--kv-memory-gb", "0.05"]) == 0
    return out


def test_identical_runs_compare_as_identical(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    comparison = compare_runs(run_dir, copy)
    assert comparison["decisions"]["identical"]
    assert comparison["step_time_error"]["all"]["mape"] == 0.0
    assert comparison["request_error"]["ttft"]["median"] == 0.0
    assert "identical" in format_report(comparison)


def test_perturbed_run_reports_first_difference_and_errors(run_dir, tmp_path):
    copy = tmp_path / "perturbed"
    shutil.copytree(run_dir, copy)
    log = (copy / "decisions.log").read_text().splitlines()
    log[5] = log[5] + " changed"
    (copy / "decisions.log").write_text("\n".join(log) + "\n")
    steps = pd.read_csv(copy / "steps.csv")
    steps["t_end"] = steps.t_start + (steps.t_end - steps.t_start) * 1.1  # every step 10% longer
    steps.to_csv(copy / "steps.csv", index=False)
    comparison = compare_runs(run_dir, copy)
    assert not comparison["decisions"]["identical"]
    assert comparison["decisions"]["first_difference"]["step"] == 5
    assert comparison["step_time_error"]["all"]["median"] == pytest.approx(0.1, rel=1e-6)


def test_missing_run_file_is_a_clear_error(tmp_path):
    with pytest.raises(ZipageError, match="summary.json"):
        compare_runs(tmp_path, tmp_path)


def test_ablation_report_and_directions(tmp_path):
    rows = []
    for workload, tps in {"amc23": [100, 90, 95, 99, 40], "mixture": [100, 95, 80, 100, 60],
                          "longbench": [50, 49, 52, 30, 45]}.items():
        for variant, value in zip(["zipage", "no-async", "no-hybrid", "no-prefix-cache",
                                   "full-kv"], tps):
            rows.append({"workload": workload, "variant": variant, "tps": float(value)})
    table = pd.DataFrame(rows)
    full = table[table.variant == "full-kv"].set_index("workload").tps
    table["speedup_vs_full_kv"] = table.tps / table.workload.map(full)
    assert "| amc23 | 100 (2.50x) | 90 (2.25x)" in markdown_table(table)
    checks = {claim: holds for claim, holds, _ in check_paper_directions(table)}
    assert checks == {
        "Zipage beats Full KV on every workload": True,
        "Zipage >= 1.8x Full KV on AMC23": True,
        "disabling async compression lowers TPS everywhere": True,
        "hybrid scheduling helps the mixture": True,
        "prefix caching helps LongBench": True,
    }
    table.loc[(table.workload == "amc23") & (table.variant == "full-kv"), "tps"] = 80.0
    checks = {claim: holds for claim, holds, _ in check_paper_directions(table)}
    assert checks["Zipage >= 1.8x Full KV on AMC23"] is False
    out = write_ablation_report(table, tmp_path / "report")
    for name in ("ablation.csv", "ablation.md", "ablation.png"):
        assert (out / name).stat().st_size > 0


def test_timeline_handles_long_runs(tmp_path):
    import numpy as np

    from zipage.analysis.timeline import plot_timeline
    from zipage.core.metrics import STEP_COLUMNS

    count = 50_000
    start = np.cumsum(np.full(count, 0.02))
    steps = pd.DataFrame({column: 0 for column in STEP_COLUMNS}, index=range(count))
    steps["step_id"] = range(count)
    steps["t_start"], steps["t_end"] = start, start + 0.02
    steps["kind"] = np.where(np.arange(count) % 50 == 0, "prefill", "decode")
    steps["n_decode"] = 100
    steps["n_running"], steps["blocks_used"], steps["blocks_total"] = 100, 500, 1000
    plot_timeline(steps, tmp_path / "timeline.png", title="synthetic")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
