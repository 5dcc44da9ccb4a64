"""Analysis on synthetic run directories: the timeline plot (tiny, empty and 50k-step runs, exact
binning), the ablation table, report and paper-direction checks on hand-made summaries, and the
sim-versus-real comparison on identical and perturbed runs against hand-computed errors; plus one
end-to-end check on a run directory written by `zipage replay`."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from tolerance import assert_close, close

from zipage.analysis.ablation import (
    ABLATION_VARIANTS,
    check_paper_directions,
    markdown_table,
    run_ablation,
    unjudged_workloads,
    with_speedup,
    write_ablation_report,
)
from zipage.analysis.compare import DIFFERENCE_CONTEXT, UNSYNCED, compare_runs, excerpt, format_report
from zipage.analysis.timeline import (
    _bin_step_chunks,
    _bin_steps,
    load_run,
    plot_run,
    plot_timeline,
    run_figure,
    run_title,
    timeline_figure,
)
from zipage.errors import ZipageError
from zipage.records import REQUEST_COLUMN_DEFAULTS, REQUEST_COLUMNS, STEP_COLUMN_DEFAULTS, STEP_COLUMNS
from zipage.rundir import ENGINE

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- synthetic run directories

def make_steps(kinds: list[str], durations: list[float], **columns: list) -> pd.DataFrame:
    """Back-to-back steps of the given kinds and durations; other columns default to small
    plausible values unless given."""
    count = len(kinds)
    end = np.cumsum(durations)
    steps = pd.DataFrame({
        "step_id": range(count), "t_start": end - np.asarray(durations), "t_end": end,
        "kind": kinds, "n_prefill": [2 if kind == "prefill" else 0 for kind in kinds],
        "n_decode": [4 if kind == "decode" else 0 for kind in kinds], "n_compress": 0,
        "n_running": 4, "n_waiting": 1, "blocks_used": 50, "blocks_total": 100,
        "slots_used": 3, "preempted": 0, "prefill_tokens": 0, "decode_context_tokens": 0,
        **STEP_COLUMN_DEFAULTS,
    })
    for name, values in columns.items():
        steps[name] = values
    return steps[STEP_COLUMNS]


def make_requests(arrival: list[float], first_token: list[float], finish: list[float],
                  output_len: list[int]) -> pd.DataFrame:
    count = len(arrival)
    return pd.DataFrame({
        "id": [f"r{index}" for index in range(count)], "arrival": arrival,
        "first_token": first_token, "finish": finish, "prompt_len": 10, "output_len": output_len,
        "n_preempted": 0, "n_compressions": 0, "max_blocks_held_after_first_compression": 0,
        "status": "finished", "error": None, **REQUEST_COLUMN_DEFAULTS,
    })[REQUEST_COLUMNS]


def write_run_dir(directory: Path, steps: pd.DataFrame, requests: pd.DataFrame,
                  summary: dict, decisions: list[str]) -> Path:
    directory.mkdir(parents=True)
    (directory / "summary.json").write_text(json.dumps(summary))
    steps.to_csv(directory / "steps.csv", index=False)
    requests.to_csv(directory / "requests.csv", index=False)
    (directory / "decisions.log").write_text("\n".join(decisions) + "\n")
    return directory


REAL_KINDS = ["prefill", "decode", "decode", "decode", "prefill", "decode"]
REAL_DURATIONS = [2.0, 1.0, 1.0, 2.0, 4.0, 1.0]
REAL_DECISIONS = [f"step {index} {kind} run=4 wait=1 blocks=50 slots=3"
                  for index, kind in enumerate(REAL_KINDS)]
REAL_SUMMARY = {"tps": 100.0, "makespan_s": 11.0, "mean_tpot_ms": 2000.0, "steps": 6,
                "preemptions": 0, "compressions": 2, "n_max": 9, "max_concurrency": 4,
                "num_blocks": 100, "settings": {"model": "qwen3-8b",
                                                "config": {"async_compress": False}}}


def real_requests() -> pd.DataFrame:
    # TTFT 2, 1, 4; TPOT 2, 2, undefined (one token); finish from arrival 8, 11, 4.
    return make_requests(arrival=[0.0, 1.0, 0.0], first_token=[2.0, 2.0, 4.0],
                         finish=[8.0, 12.0, 4.0], output_len=[4, 6, 1])


@pytest.fixture
def real_dir(tmp_path: Path) -> Path:
    return write_run_dir(tmp_path / "real", make_steps(REAL_KINDS, REAL_DURATIONS),
                         real_requests(), REAL_SUMMARY, REAL_DECISIONS)


# ---------------------------------------------------------------- timeline

def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert path.stat().st_size > 5_000


def test_timeline_of_a_tiny_run(tmp_path):
    steps = make_steps(["prefill", "decode", "decode"], [0.03, 0.01, 0.012])
    assert plot_timeline(steps, tmp_path / "tiny.png", title="tiny") == tmp_path / "tiny.png"
    assert_png(tmp_path / "tiny.png")


def test_timeline_of_a_50k_step_run_is_fast(tmp_path):
    count = 50_000
    random = np.random.default_rng(0)
    kinds = np.where(np.arange(count) % 50 == 0, "prefill", "decode").tolist()
    steps = make_steps(kinds, random.uniform(0.01, 0.03, count).tolist(),
                       n_running=random.integers(1, 200, count),
                       blocks_used=random.integers(0, 100, count))
    started = time.perf_counter()
    plot_timeline(steps, tmp_path / "long.png", max_concurrency=128)
    assert time.perf_counter() - started < 10.0
    assert_png(tmp_path / "long.png")


def test_timeline_of_empty_and_zero_duration_runs(tmp_path):
    plot_timeline(make_steps([], []), tmp_path / "empty.png")
    assert_png(tmp_path / "empty.png")
    plot_timeline(make_steps(["decode", "decode"], [0.0, 0.0]), tmp_path / "instant.png")
    assert_png(tmp_path / "instant.png")


def test_timeline_bins_are_exact_time_weighted_aggregates():
    # A 1 s step with 2 running and a 3 s step with 6 running, in 2 bins of 2 s each: the first
    # bin holds all of step 0 and a third of step 1, the second bin the rest of step 1.
    steps = make_steps(["decode", "decode"], [1.0, 3.0], n_decode=[10, 30], n_running=[2, 6])
    binned = _bin_steps(steps, bins=2)
    assert binned.decode_tokens == pytest.approx([10 + 10, 20])
    assert binned.decode_seconds == pytest.approx([2.0, 2.0])
    assert binned.running == pytest.approx([(2 * 1 + 6 * 1) / 2, 6.0])
    assert binned.block_occupancy_percent == pytest.approx([50.0, 50.0])


def test_timeline_leaves_gaps_between_steps_empty():
    steps = make_steps(["decode", "decode"], [1.0, 1.0])
    steps.loc[1, ["t_start", "t_end"]] = [3.0, 4.0]  # idle from 1 s to 3 s: no step recorded
    binned = _bin_steps(steps, bins=4)
    assert np.isnan(binned.running[1]) and np.isnan(binned.running[2])
    assert binned.running[[0, 3]] == pytest.approx([4.0, 4.0])
    assert binned.decode_tokens.sum() == pytest.approx(8.0)


def test_timeline_counts_the_decodes_of_mixed_steps(tmp_path):
    # Chunked prefill: a mixed step decodes 4 requests beside a prompt chunk; a prefill step
    # decodes nobody.
    steps = make_steps(["prefill", "mixed", "decode", "mixed"], [1.0, 1.0, 1.0, 1.0],
                       n_decode=[0, 4, 4, 6], n_prefill=[1, 1, 0, 2])
    binned = _bin_steps(steps, bins=2)
    assert binned.decode_tokens == pytest.approx([4, 10])
    assert binned.decode_seconds == pytest.approx([1.0, 2.0])
    assert binned.prefill_share == pytest.approx([0.5, 0.0])
    assert binned.mixed_share == pytest.approx([0.5, 0.5])
    assert_png(plot_timeline(steps, tmp_path / "mixed.png"))


def labelled(figure, prefix: str):
    """The one artist of `figure` whose legend label starts with `prefix`."""
    found = [artist for axis in figure.axes for artist in [*axis.collections, *axis.lines]
             if artist.get_label().startswith(prefix)]
    assert len(found) == 1, [artist.get_label() for artist in found]
    return found[0]


def dots(figure, prefix: str) -> np.ndarray:
    """The (x, y) of the scatter labelled `prefix`, as a plain array."""
    return np.asarray(labelled(figure, prefix).get_offsets())


def test_timeline_marks_preemptions_and_draws_request_latencies(tmp_path):
    """A replay whose small KV memory preempts: panel (b) counts the preemptions per bin (the
    stems add up to the run's total), panel (d) has a dot per request's TTFT at its arrival and
    per multi-token request's TPOT at its finish."""
    from zipage.cli.parser import main

    run = tmp_path / "tiny"
    assert main(["replay", str(ROOT / "traces" / "tiny.json"), "--out", str(run),
                 "--no-progress", "--no-async", "--decisions", "none", "--block-size", "16",
                 "--window", "4", "--budget", "64", "--kv-memory-gb", "0.05"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preemptions"] > 0
    figure = run_figure(run, bins=50)
    titles = [axis.get_title(loc="left") for axis in figure.axes]
    assert titles.count("(d) request latency: TTFT at arrival, TPOT at finish") == 1
    stems = labelled(figure, "preemptions per bin")
    assert stems.get_label().endswith(f"({summary['preemptions']:,} in all)")
    # Each stem runs from 0 to its bin's count: the counts are whole numbers, summed exactly.
    assert sum(segment[1][1] for segment in stems.get_segments()) == summary["preemptions"]

    requests = pd.read_csv(run / "requests.csv")
    origin = pd.read_csv(run / "steps.csv")["t_start"].min()
    ttft = dots(figure, "TTFT, at arrival")
    np.testing.assert_allclose(ttft[:, 0], requests["arrival"] - origin, atol=1e-9)
    np.testing.assert_allclose(ttft[:, 1], requests["first_token"] - requests["arrival"],
                               atol=1e-9)
    several = requests[requests["output_len"] > 1]
    tpot = dots(figure, "TPOT, at finish")
    np.testing.assert_allclose(tpot[:, 1], (several["finish"] - several["first_token"])
                               / (several["output_len"] - 1), rtol=1e-9)
    latency_axis = figure.axes[titles.index("(d) request latency: TTFT at arrival, "
                                            "TPOT at finish")]
    assert latency_axis.get_ylabel().startswith("latency (s")


def test_timeline_latencies_skip_undefined_tpot_and_sample_long_runs(monkeypatch):
    # TTFT 2, 1, 4; TPOT 2, 2 and none for the one-token request.
    figure = timeline_figure(make_steps(REAL_KINDS, REAL_DURATIONS), requests=real_requests())
    assert dots(figure, "TTFT, at arrival")[:, 1].tolist() == pytest.approx([2, 1, 4])
    assert dots(figure, "TPOT, at finish")[:, 1].tolist() == pytest.approx([2, 2])
    assert labelled(figure, "preemptions per bin").get_label().endswith("(0 in all)")
    # Past MAX_LATENCY_POINTS requests, an even sample is drawn and the title says so.
    monkeypatch.setattr("zipage.analysis.timeline.MAX_LATENCY_POINTS", 2)
    figure = timeline_figure(make_steps(REAL_KINDS, REAL_DURATIONS), requests=real_requests())
    assert dots(figure, "TTFT, at arrival")[:, 1].tolist() == pytest.approx([2, 4])
    assert any("an even sample of 2 of 3 requests" in axis.get_title(loc="left")
               for axis in figure.axes)


def test_timeline_bins_chunk_by_chunk_as_whole():
    # plot_run reads steps.csv in chunks: the sums over chunks are the whole run's, with steps
    # longer than a bin and chunks ending inside a bin.
    count = 301
    random = np.random.default_rng(1)
    kinds = random.choice(["prefill", "decode", "mixed", "idle"], count).tolist()
    steps = make_steps(kinds, random.uniform(0.0, 0.5, count).tolist(),
                       n_decode=random.integers(0, 9, count), n_running=random.integers(1, 20, count),
                       slots_used=random.integers(0, 4, count))
    whole = _bin_steps(steps, bins=37)
    # Each bin's integral is a difference of running sums, the whole run's or a chunk's: they
    # round differently by a few ulps of the run's total, hence the small absolute slack.
    for size in (1, 10, 64):
        chunked = _bin_step_chunks(
            lambda: [steps.iloc[i:i + size] for i in range(0, count, size)], bins=37)
        for name in ("edges", "decode_tokens", "decode_seconds", "prefill_share", "mixed_share",
                     "running", "waiting", "block_occupancy_percent", "slots_used", "preemptions"):
            np.testing.assert_allclose(getattr(chunked, name), getattr(whole, name), rtol=1e-9,
                                       atol=1e-9, equal_nan=True, err_msg=name)


def test_plot_run_reads_steps_in_chunks(tmp_path, monkeypatch):
    import zipage.rundir as rundir

    steps = make_steps(REAL_KINDS * 20, REAL_DURATIONS * 20)
    directory = write_run_dir(tmp_path / "run", steps.drop(columns=["shared_kv_tokens"]),
                              real_requests(), {**REAL_SUMMARY, "rows": {"steps.csv": 120}},
                              REAL_DECISIONS)
    # A run written before a column: its chunks have it, at its default.
    first = next(rundir.iter_step_chunks(directory, REAL_SUMMARY))
    assert len(first) == 120 and first["shared_kv_tokens"].eq(0).all()
    read: list[int] = []
    chunks = rundir.iter_step_chunks

    def counting(*args, **kwargs):
        for chunk in chunks(*args, **kwargs):
            read.append(len(chunk))
            yield chunk

    monkeypatch.setattr(rundir, "STEP_CHUNK_ROWS", 25)
    monkeypatch.setattr("zipage.analysis.timeline.iter_step_chunks", counting)
    assert_png(plot_run(directory))
    assert read == [25, 25, 25, 25, 20] * 2  # the time span, then the sums
    (directory / "summary.json").write_text(json.dumps({**REAL_SUMMARY,
                                                        "rows": {"steps.csv": 121}}))
    with pytest.raises(ZipageError, match="120 rows, but summary.json says the run wrote 121"):
        plot_run(directory)


@pytest.mark.parametrize("missing", ["summary.json", "steps.csv", "requests.csv"])
def test_load_run_names_the_missing_file(real_dir, missing):
    (real_dir / missing).unlink()
    with pytest.raises(ZipageError, match=missing):
        load_run(real_dir)


def test_load_run_keeps_request_ids_as_strings(tmp_path):
    requests = real_requests()
    requests["id"] = ["7", "007", "x"]
    directory = write_run_dir(tmp_path / "run", make_steps(["decode"], [1.0]), requests,
                              REAL_SUMMARY, ["step 0 decode"])
    assert load_run(directory).requests["id"].tolist() == ["7", "007", "x"]


# ---------------------------------------------------------------- ablation

# TPS per workload in ABLATION_VARIANTS order: zipage, no-async, no-hybrid, no-prefix-cache,
# full-kv. Chosen so every one of the paper's directions holds.
PAPER_LIKE_TPS = {
    "amc23": [100.0, 90.0, 95.0, 99.0, 40.0],
    "mixture": [100.0, 95.0, 80.0, 100.0, 60.0],
    "longbench": [50.0, 49.0, 52.0, 30.0, 45.0],
}


def fake_simulate(tps_by_workload: dict[str, list[float]], calls: list | None = None):
    variant_of = {json.dumps(overrides, sort_keys=True): variant
                  for variant, overrides in ABLATION_VARIANTS.items()}

    def simulate(trace_path: str, overrides: dict) -> dict:
        if calls is not None:
            calls.append((trace_path, overrides))
        variant = variant_of[json.dumps(overrides, sort_keys=True)]
        tps = tps_by_workload[Path(trace_path).stem][list(ABLATION_VARIANTS).index(variant)]
        return {"tps": tps, "makespan_s": 1000.0 / tps, "mean_tpot_ms": 20.0,
                "peak_running": 8, "mean_running": 5.5, "preemptions": 1, "compressions": 3,
                "requests": 10}
    return simulate


def paper_like_table(tps_by_workload: dict[str, list[float]] = PAPER_LIKE_TPS) -> pd.DataFrame:
    return run_ablation([f"traces/{name}.json" for name in tps_by_workload],
                        fake_simulate(tps_by_workload), progress=False)


def test_run_ablation_runs_every_trace_under_every_variant():
    calls: list = []
    table = run_ablation(["traces/amc23.json", "traces/mixture.json"],
                         fake_simulate(PAPER_LIKE_TPS, calls), progress=False)
    assert len(table) == len(calls) == 2 * len(ABLATION_VARIANTS)
    assert calls[1] == ("traces/amc23.json", {"async_compress": False})
    assert calls[4] == ("traces/amc23.json", {"compress": False})
    assert list(table.columns) == [
        "workload", "variant", "trace", "tps", "makespan_s", "mean_tpot_ms", "peak_running",
        "mean_running", "preemptions", "compressions", "speedup_vs_full_kv"]
    amc23 = table[table["workload"] == "amc23"].set_index("variant")
    assert amc23.loc["zipage", "speedup_vs_full_kv"] == pytest.approx(2.5)
    assert amc23.loc["no-async", "speedup_vs_full_kv"] == pytest.approx(2.25)
    assert amc23.loc["full-kv", "speedup_vs_full_kv"] == pytest.approx(1.0)
    assert amc23.loc["zipage", "makespan_s"] == pytest.approx(10.0)


def test_run_ablation_refuses_two_traces_with_one_name():
    with pytest.raises(ZipageError, match="amc23"):
        run_ablation(["a/amc23.json", "b/amc23.json"], fake_simulate(PAPER_LIKE_TPS),
                     progress=False)


def test_speedup_is_missing_without_a_full_kv_run():
    table = with_speedup(pd.DataFrame({"workload": ["gsm8k"], "variant": ["zipage"],
                                       "tps": [10.0]}))
    assert np.isnan(table["speedup_vs_full_kv"].iloc[0])
    assert "| gsm8k | 10.0 |" in markdown_table(table)


def test_ablation_markdown_table():
    lines = markdown_table(paper_like_table()).splitlines()
    assert lines[0] == ("| workload | Zipage | w/o async compression | w/o hybrid scheduling "
                        "| w/o prefix cache | Full KV |")
    assert lines[2] == ("| amc23 | 100.0 (2.50x) | 90.0 (2.25x) | 95.0 (2.38x) | 99.0 (2.48x) "
                        "| 40.0 (1.00x) |")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| amc23", "| mixture",
                                                           "| longbench"]


def test_write_ablation_report(tmp_path):
    table = paper_like_table()
    out = write_ablation_report(table, tmp_path / "report")
    assert_close(pd.read_csv(out / "ablation.csv")["tps"].tolist(), table["tps"].tolist())
    assert markdown_table(table) in (out / "ablation.md").read_text()
    assert_png(out / "ablation.png")


def test_paper_directions_all_hold_on_paper_like_numbers():
    checks = check_paper_directions(paper_like_table())
    assert [(claim, holds) for claim, holds, _ in checks] == [
        ("Zipage beats Full KV on every workload", True),
        ("Zipage reaches >= 1.8x Full KV on AMC23", True),
        ("Disabling async compression lowers TPS on every workload", True),
        ("Hybrid scheduling helps the mixture workload", True),
        ("Prefix caching helps LongBench", True),
    ]
    details = {claim: detail for claim, _, detail in checks}
    assert details["Zipage reaches >= 1.8x Full KV on AMC23"] == (
        "amc23: zipage 100.0 vs full-kv 40.0 tok/s = 2.50x (wanted >= 1.8x)")


@pytest.mark.parametrize("workload, variant, tps, broken_claim", [
    ("longbench", "full-kv", 55.0, "Zipage beats Full KV on every workload"),
    ("amc23", "full-kv", 60.0, "Zipage reaches >= 1.8x Full KV on AMC23"),
    ("mixture", "no-async", 100.0, "Disabling async compression lowers TPS on every workload"),
    ("mixture", "no-hybrid", 120.0, "Hybrid scheduling helps the mixture workload"),
    ("longbench", "no-prefix-cache", 51.0, "Prefix caching helps LongBench"),
])
def test_each_paper_direction_can_fail(workload, variant, tps, broken_claim):
    numbers = {name: list(values) for name, values in PAPER_LIKE_TPS.items()}
    numbers[workload][list(ABLATION_VARIANTS).index(variant)] = tps
    verdicts = {claim: holds for claim, holds, _ in check_paper_directions(
        paper_like_table(numbers))}
    assert verdicts.pop(broken_claim) is False
    assert all(verdicts.values())


def test_paper_directions_only_judge_the_rows_present():
    table = paper_like_table({"gsm8k": [30.0, 29.0, 31.0, 30.0, 25.0]})
    assert [claim for claim, _, _ in check_paper_directions(table)] == [
        "Zipage beats Full KV on every workload",
        "Disabling async compression lowers TPS on every workload",
    ]
    assert check_paper_directions(table[table["variant"] == "zipage"]) == []


def test_other_traces_are_tabulated_but_not_judged():
    numbers = {**PAPER_LIKE_TPS, "tiny": [10.0] * 5, "amc23-headline": [40.0, 39.0, 40.0, 40.0,
                                                                         32.0]}
    table = paper_like_table(numbers)
    assert unjudged_workloads(table) == ["tiny", "amc23-headline"]
    # tiny's equal TPS and amc23-headline's 1.25x would fail claims; they are not judged.
    assert all(holds for _, holds, _ in check_paper_directions(table))
    details = " ".join(detail for _, _, detail in check_paper_directions(table))
    assert "tiny" not in details and "headline" not in details
    only_others = table[table["workload"].isin(["tiny", "amc23-headline"])]
    assert check_paper_directions(only_others) == []


# ---------------------------------------------------------------- compare

def test_identical_runs_compare_with_zero_error(real_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(real_dir, copy)
    comparison = compare_runs(copy, real_dir)
    decisions = comparison["decisions"]
    assert decisions["identical"] and decisions["first_difference"] is None
    assert decisions["identical_fraction"] == close(1.0)
    assert comparison["setup_differences"] == {}
    for stats in [*comparison["step_time"]["duration"].values(),
                  *(comparison["request_time"][metric] for metric in ("ttft", "tpot", "finish"))]:
        assert stats["count"] > 0
        assert_close([stats[key] for key in ("median", "p90", "mape", "bias")], [0.0] * 4)
    assert comparison["step_time"]["total_time"]["relative_error"] == close(0.0)
    ratios = {key: values["ratio"] for key, values in comparison["summary"].items()}
    # No ratio for 0 preemptions against 0: undefined, not 1.
    assert_close(ratios, {"tps": 1.0, "makespan_s": 1.0, "mean_tpot_ms": 1.0, "steps": 1.0,
                          "preemptions": None, "compressions": 1.0, "prefix_hit_tokens": None,
                          "first_hit_tokens": None})
    assert "(a) scheduling decisions: identical" in format_report(comparison)


def test_perturbed_run_against_hand_computed_errors(real_dir, tmp_path):
    decisions = list(REAL_DECISIONS)
    decisions[3] = "step 3 decode preempt=r1 run=3 wait=2 blocks=50 slots=3"
    sim_durations = [3.0, 1.1, 1.0, 2.2, 4.0, 0.9]
    sim_requests = make_requests(arrival=[0.0, 1.0, 0.0], first_token=[3.0, 2.0, 4.0],
                                 finish=[9.0, 17.0, 4.0], output_len=[4, 6, 1])
    sim_summary = {**REAL_SUMMARY, "tps": 120.0, "mean_tpot_ms": None,
                   "settings": {"model": "qwen3-8b", "config": {"async_compress": True}}}
    sim_dir = write_run_dir(tmp_path / "sim", make_steps(REAL_KINDS, sim_durations),
                            sim_requests, sim_summary, decisions)
    comparison = compare_runs(sim_dir, real_dir)

    decision_report = comparison["decisions"]
    assert not decision_report["identical"]
    assert decision_report["identical_fraction"] == pytest.approx(5 / 6)
    assert decision_report["first_difference"] == {
        "line": 4, "step": 3, "sim": decisions[3], "real": REAL_DECISIONS[3]}

    duration = comparison["step_time"]["duration"]
    # prefill: (3 - 2) / 2 = +0.5 and 0; decode: +0.1, 0, +0.1, -0.1.
    assert duration["prefill"]["median"] == pytest.approx(0.25)
    assert duration["prefill"]["p90"] == pytest.approx(0.45)
    assert duration["decode"]["median"] == pytest.approx(0.1)
    assert duration["decode"]["mape"] == pytest.approx(0.075)
    assert duration["decode"]["bias"] == pytest.approx(0.05)
    assert duration["all"]["mape"] == pytest.approx((0.5 + 0.1 + 0.1 + 0.1) / 6)
    assert comparison["step_time"]["total_time"]["relative_error"] == pytest.approx(1.2 / 11)

    requests = comparison["request_time"]
    # TTFT 3 vs 2, 1 vs 1, 4 vs 4; TPOT 2 vs 2, 3 vs 2; finish 9 vs 8, 16 vs 11, 4 vs 4.
    assert requests["ttft"]["median"] == close(0.0)
    assert requests["ttft"]["mape"] == pytest.approx(0.5 / 3)
    assert requests["ttft"]["p90"] == pytest.approx(0.4)
    assert requests["tpot"]["count"] == 2 and requests["tpot"]["excluded"] == 1
    assert requests["tpot"]["median"] == pytest.approx(0.25)
    assert requests["tpot"]["median_abs"] == pytest.approx(0.5)
    assert requests["finish"]["median"] == pytest.approx(0.125)
    assert requests["finish"]["mape"] == pytest.approx((0.125 + 5 / 11) / 3)

    summary = comparison["summary"]
    assert_close(summary["tps"], {"sim": 120.0, "real": 100.0, "ratio": 1.2})
    assert summary["mean_tpot_ms"]["ratio"] is None
    assert comparison["setup_differences"] == {
        "config.async_compress": {"sim": True, "real": False}}
    # Graphed steps: compared only where both runs say (an analytic simulation does not).
    real_summary = json.loads((real_dir / "summary.json").read_text())
    (real_dir / "summary.json").write_text(json.dumps(
        {**real_summary, "graphs": {"decode": True, "prefill": True}}))
    assert "graphs.prefill" not in compare_runs(sim_dir, real_dir)["setup_differences"]
    (sim_dir / "summary.json").write_text(json.dumps(
        {**sim_summary, "graphs": {"decode": True, "prefill": False}}))
    differences = compare_runs(sim_dir, real_dir)["setup_differences"]
    assert differences["graphs.prefill"] == {"sim": False, "real": True}
    assert "graphs.decode" not in differences

    report = format_report(comparison)
    assert "DIFFERENT" in report
    # Neither summary names its driver: the runs are A and B.
    assert f"    A: {decisions[3]}" in report and f"    B: {REAL_DECISIONS[3]}" in report


def test_an_engine_runs_silent_chunks_are_compared_with_the_step_that_waits_for_them(tmp_path):
    """An engine run: three prompt chunks that sample nothing return at their launch (10 ms),
    the fourth chunk's step waits for all four forwards (4 s). Step for step that is a -99 % /
    +300 % pair of errors; the stretch as one unit is what the simulation priced (4 x 1 s)."""
    kinds = ["prefill"] * 4 + ["mixed", "decode"]
    sampled = [0, 0, 0, 1, 2, 2]
    engine_summary = {**REAL_SUMMARY, "kind": ENGINE, "driver": "engine-cuda"}
    real_dir = write_run_dir(tmp_path / "real", make_steps(kinds, [0.01, 0.01, 0.01, 4.0, 1.0, 0.5],
                                                           n_sampled=sampled),
                             real_requests(), engine_summary, REAL_DECISIONS)
    sim_dir = write_run_dir(tmp_path / "sim", make_steps(kinds, [1.0, 1.0, 1.0, 1.0, 1.1, 0.5],
                                                         n_sampled=sampled),
                            real_requests(), REAL_SUMMARY, REAL_DECISIONS)
    duration = compare_runs(sim_dir, real_dir)["step_time"]["duration"]
    assert duration[UNSYNCED]["count"] == 1 and "prefill" not in duration
    assert duration[UNSYNCED]["bias"] == pytest.approx((4.0 - 4.03) / 4.03)
    assert duration["mixed"]["bias"] == pytest.approx(0.1) and duration["decode"]["bias"] == close(0.0)
    assert duration["all"]["count"] == 3  # the stretch, the mixed step, the decode step
    assert UNSYNCED in format_report(compare_runs(sim_dir, real_dir))
    # Without the record (a run written before it), a prefill step shorter than the median
    # decode step stands for a silent one.
    old = make_steps(kinds, [0.01, 0.01, 0.01, 4.0, 1.0, 0.5])
    old[STEP_COLUMNS].drop(columns="n_sampled").to_csv(real_dir / "steps.csv", index=False)
    assert compare_runs(sim_dir, real_dir)["step_time"]["duration"][UNSYNCED]["count"] == 1
    # A run that did not chunk its prompts: every step its own.
    unchunked = {**engine_summary, "settings": {"model": "qwen3-8b", "config": {"chunked_prefill": False}}}
    (real_dir / "summary.json").write_text(json.dumps(unchunked))
    duration = compare_runs(sim_dir, real_dir)["step_time"]["duration"]
    assert UNSYNCED not in duration and duration["prefill"]["count"] == 4


def test_time_by_kind_splits_the_total_time_error(real_dir, tmp_path):
    """Where each run's time went, per step kind (compressing steps apart) and host gaps: the
    parts of a makespan error, whether or not the runs' steps match one for one."""
    steps = make_steps(REAL_KINDS, [3.0, 1.1, 1.0, 2.2, 4.0, 0.9],
                       n_compress=[0, 0, 0, 1, 0, 0])
    steps.loc[1:, ["t_start", "t_end"]] += 0.1  # 0.1 s of host time after the first step
    sim_dir = write_run_dir(tmp_path / "sim", steps, real_requests(), REAL_SUMMARY,
                            REAL_DECISIONS)
    comparison = compare_runs(sim_dir, real_dir)
    by_kind = comparison["time_by_kind"]
    assert by_kind["sim"]["decode+compress"] == {"steps": 1, "seconds": pytest.approx(2.2),
                                                 "mean_ms": pytest.approx(2200.0)}
    assert_close(by_kind["real"]["decode"], {"steps": 4, "seconds": 5.0, "mean_ms": 1250.0})
    assert by_kind["sim"]["host gaps"]["seconds"] == pytest.approx(0.1)
    # Of the engine's 11 s: prefill 7 vs 6 s, decode 3 vs 5, compressing decode 2.2 vs 0.
    assert by_kind["share_of_real_time"] == pytest.approx({
        "prefill": 1 / 11, "decode": -2 / 11, "decode+compress": 2.2 / 11,
        "host gaps": 0.1 / 11})
    report = format_report(comparison)
    assert "(f) time by step kind" in report and "+20.00%" in report


def test_a_log_that_stops_early_differs_at_its_end(real_dir, tmp_path):
    sim_dir = tmp_path / "sim"
    shutil.copytree(real_dir, sim_dir)
    (sim_dir / "decisions.log").write_text("\n".join(REAL_DECISIONS[:4]) + "\n")
    decisions = compare_runs(sim_dir, real_dir)["decisions"]
    assert decisions["first_difference"] == {"line": 5, "step": 4, "sim": None,
                                             "real": REAL_DECISIONS[4]}
    assert decisions["identical_fraction"] == pytest.approx(4 / 6)


@pytest.mark.parametrize("missing", ["summary.json", "steps.csv", "requests.csv"])
def test_compare_names_the_missing_file(real_dir, tmp_path, missing):
    sim_dir = tmp_path / "sim"
    shutil.copytree(real_dir, sim_dir)
    (sim_dir / missing).unlink()
    with pytest.raises(ZipageError, match=f"sim/{missing}"):
        compare_runs(sim_dir, real_dir)


def test_compare_without_a_decision_log_skips_that_check(real_dir, tmp_path):
    sim_dir = tmp_path / "sim"
    shutil.copytree(real_dir, sim_dir)
    (sim_dir / "decisions.log").unlink()
    comparison = compare_runs(sim_dir, real_dir)
    assert comparison["decisions"] is None
    assert "scheduling decisions: not compared" in format_report(comparison)
    assert comparison["step_time"]["matched_steps"] == len(REAL_KINDS)


def test_compare_reads_a_gzipped_decision_log(real_dir, tmp_path):
    sim_dir = tmp_path / "sim"
    shutil.copytree(real_dir, sim_dir)
    (sim_dir / "decisions.log").unlink()
    with gzip.open(sim_dir / "decisions.log.gz", "wt") as handle:
        handle.write("\n".join(REAL_DECISIONS) + "\n")
    assert compare_runs(sim_dir, real_dir)["decisions"]["identical"]


def test_compare_names_runs_by_driver_and_cuts_long_lines(real_dir, tmp_path):
    requests = " ".join(f"r{index}" for index in range(2000))  # a big step: ~10 KB a line
    sim_decisions = [*REAL_DECISIONS[:2], f"step 2 decode run={requests} x"]
    real_decisions = [*REAL_DECISIONS[:2], f"step 2 decode run={requests} y"]
    sim_dir = write_run_dir(tmp_path / "sim", make_steps(REAL_KINDS, REAL_DURATIONS),
                            real_requests(), {**REAL_SUMMARY, "driver": "simulator"},
                            sim_decisions)
    other = write_run_dir(tmp_path / "gpu", make_steps(REAL_KINDS, REAL_DURATIONS),
                          real_requests(), {**REAL_SUMMARY, "driver": "engine-cuda"},
                          real_decisions)
    report = format_report(compare_runs(sim_dir, other))
    assert report.startswith("simulator:   ") and "\nengine-cuda: " in report
    assert "(b) step duration error, simulator against engine-cuda" in report
    difference_lines = [line for line in report.splitlines() if line.startswith("    simulator:")
                        or line.startswith("    engine-cuda:")]
    assert len(difference_lines) == 2
    assert all(len(line) < 2 * DIFFERENCE_CONTEXT + 40 for line in difference_lines)
    assert difference_lines[0].endswith("r1999 x") and difference_lines[1].endswith("r1999 y")
    assert "sim" not in format_report(compare_runs(other, other)).splitlines()[0]


def test_excerpt_centres_on_the_first_difference():
    assert excerpt("abc", "abd") == "abc"
    assert excerpt(None, "x") == "<end of log>"
    line = "x" * 500 + "A" + "y" * 500
    cut = excerpt(line, "x" * 500 + "B" + "y" * 500, context=10)
    assert cut == "..." + "x" * 10 + "A" + "y" * 9 + "..."


def test_run_title_names_trace_device_and_knobs():
    summary = {"trace": "amc23", "driver": "simulator", "device": "h100-80gb",
               "settings": {"model": "qwen3-8b", "hardware": "h100",
                            "config": {"compress": True, "kv_budget": 2048, "block_size": 256,
                                       "hybrid": False}}}
    assert run_title(summary) == ("amc23 · qwen3-8b · simulator · h100-80gb\n"
                                  "KV budget 2048, block 256, constrained scheduling")
    full_kv = {**summary, "settings": {**summary["settings"], "config": {"compress": False,
                                                                         "block_size": 16}}}
    assert run_title(full_kv).endswith("Full KV (no compression), block 16")
    assert run_title({"settings": {"model": "m"}, "driver": "engine-cpu"}) == "m · engine-cpu"


def test_compare_on_a_replayed_run_directory(tmp_path):
    from zipage.cli.parser import main

    run = tmp_path / "tiny"
    assert main(["replay", str(ROOT / "traces" / "tiny.json"), "--out", str(run),
                 "--no-progress", "--no-async", "--block-size", "16", "--window", "4",
                 "--budget", "64", "--kv-memory-gb", "0.05"]) == 0
    assert_png(run / "timeline.png")
    comparison = compare_runs(run, run)
    assert comparison["decisions"]["identical"]
    assert comparison["request_time"]["finished_in_both"] == 18
    assert comparison["step_time"]["duration"]["all"]["mape"] == close(0.0)


def test_a_bin_no_step_covers_has_no_share(tmp_path):
    """The Azure excerpt's replay leaves a bin that no step covers with a prefill integral of a
    few ulps (the running sums' rounding): its share was 3.5e-18 / 0 = inf, and the plot's
    100 * share overflowed. A share is 0 there, and never outside [0, 1]."""
    import warnings

    from zipage.cli.parser import main

    trace = ROOT / "tests" / "fixtures" / "traces" / "azure_conv_2023_excerpt.csv"
    assert main(["replay", str(trace), "--no-progress", "--decisions", "none",
                 "--out", str(tmp_path / "run")]) == 0
    steps = pd.read_csv(tmp_path / "run" / "steps.csv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        binned = _bin_steps(steps, 400)
    for share in (binned.prefill_share, binned.mixed_share):
        assert np.isfinite(share).all() and (share >= 0).all() and (share <= 1).all()
