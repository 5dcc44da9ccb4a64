"""A decode step priced at the rows its CUDA graph computes (a profile's `decode_graph_sizes`,
docs/cost_model.md 'Decode: the graph's padded batch'): the engine replays the smallest captured
graph that holds the batch, so a batch of 97 runs 128 rows and its split-K kernel cuts each
sequence as a batch of 128 would. The fit and the predictions read the padded size; a profile
without the field (every one written before it, an eager engine) prices the live batch as
before; runs record their graphs' sizes and a fit from them carries them."""

from __future__ import annotations

import json

import pytest
from test_decode_partitions import partitions, profile
from test_profile_from_runs import synthetic_run

from zipage.decode_grid import GRAPH_BATCH_SIZES, graph_batch
from zipage.errors import ConfigError
from zipage.sim.calibrated import PARTITION_EXCESS, CalibratedCostModel, DecodeRows
from zipage.sim.profile_from_runs import profile_from_runs

DEVICE = (5.5e-3, 4e-5, 3.5e-8)  # constant, per row, per KV entry (an 8B on an H200)
EXCESS = 1.0e-6  # per entry of the longest request's partition beyond the mean
SIZES = list(GRAPH_BATCH_SIZES)


def padded_law(batch: int, context: int, longest: int) -> float:
    """A graphed decode step: its rows and its partitions are the padded batch's; the longest
    request's excess is over the live requests' mean."""
    rows = graph_batch(batch, SIZES)
    excess = max(0.0, longest - context / batch)
    return DEVICE[0] + DEVICE[1] * rows + DEVICE[2] * context + EXCESS * excess / partitions(rows)


def decode_points() -> list[dict]:
    points = []
    for batch in (1, 2, 3, 5, 7, 9, 13, 17, 20, 25, 33, 40, 49, 57, 65, 80, 97, 113, 129):
        for mean in (300, 1200):
            for extra in (0, 6000):
                longest = mean + extra if batch > 1 else mean
                context = batch * mean + (longest - mean)
                points.append({"batch": batch, "context_tokens": context, "max_context": longest,
                               "time_s": padded_law(batch, context, longest)})
    return points


def graphed(**header) -> dict:
    return profile(decode_points(), decode_excess="per_partition",
                   graphs={"decode": True, "prefill": False}, **header)


def test_a_batch_replays_the_smallest_graph_that_holds_it():
    assert [graph_batch(batch, SIZES) for batch in (1, 3, 9, 33, 97, 129, 512, 513)] == [
        1, 4, 16, 48, 128, 160, 512, 513]  # above the largest: eager, its own size
    assert graph_batch(300, [1, 2, 4, 256]) == 300
    rows = DecodeRows(tuple(SIZES))
    assert [rows(batch) for batch in (5, 5, 65)] == [8, 8, 96]
    assert DecodeRows(())(65) == 65  # no sizes: the live batch


def test_the_padded_law_is_recovered_and_a_batch_is_priced_at_its_graphs_rows():
    model = CalibratedCostModel.from_profile(graphed(decode_graph_sizes=SIZES))
    fit = model.decode_fit
    assert fit.feature_names == ("constant", "batch", "context_tokens", PARTITION_EXCESS)
    assert fit.coefficients == pytest.approx(DEVICE + (EXCESS,), rel=1e-6)
    assert fit.relative_rms_error < 1e-9
    # 97 requests cost what 128 rows cost; 128 requests the same rows, and more context.
    assert model.decode_time_for(97, 97 * 500) == pytest.approx(padded_law(97, 97 * 500, 500))
    assert model.decode_time_for(97, 97 * 500) > model.decode_time_for(96, 97 * 500)
    assert model.decode_time_for(128, 97 * 500) == pytest.approx(
        model.decode_time_for(97, 97 * 500))


def test_without_the_field_the_same_points_fit_the_live_batch_worse():
    """The form the field adds is what these points need: the live batch leaves the padding in
    the residuals (the shipped H200 profiles showed the same, `bench/graph_batch_fits.py`)."""
    live = CalibratedCostModel.from_profile(graphed()).decode_fit
    assert live.relative_rms_error > 0.02


def test_the_field_is_checked():
    for sizes in ([], [4, 2], [0, 8], [1, 2.5], "1,2"):
        with pytest.raises(ConfigError, match="decode_graph_sizes: got .* increasing positive"):
            CalibratedCostModel.from_profile(graphed(decode_graph_sizes=sizes))
    eager = profile(decode_points(), graphs={"decode": False, "prefill": False},
                    decode_graph_sizes=SIZES)
    with pytest.raises(ConfigError, match="with graphs.decode true"):
        CalibratedCostModel.from_profile(eager)


def test_runs_record_their_graphs_sizes_and_the_fit_carries_them(tmp_path):
    first, second = synthetic_run(tmp_path / "a", False), synthetic_run(tmp_path / "b", False)
    for run in (first, second):
        summary = json.loads((run / "summary.json").read_text())
        summary.update(graphs={"decode": True, "prefill": True}, decode_graph_sizes=SIZES[:9])
        (run / "summary.json").write_text(json.dumps(summary))
    assert profile_from_runs([first, second])["decode_graph_sizes"] == SIZES[:9]
    summary = json.loads((second / "summary.json").read_text())
    (second / "summary.json").write_text(json.dumps({**summary, "decode_graph_sizes": SIZES}))
    with pytest.raises(ConfigError, match="differ in decode_graph_sizes"):
        profile_from_runs([first, second])
    # An eager engine's runs record no sizes (an empty list): the fit prices the live batch.
    for run in (first, second):
        summary = json.loads((run / "summary.json").read_text())
        summary.update(graphs={"decode": False, "prefill": False}, decode_graph_sizes=[])
        (run / "summary.json").write_text(json.dumps(summary))
    assert "decode_graph_sizes" not in profile_from_runs([first, second])


def test_the_partition_count_is_the_kernels_at_the_padded_rows():
    """What a graph captured at 48 rows launches (8 KV heads, 132 SMs): 48 rows' partitions,
    not the 33 live requests'."""
    assert partitions(graph_batch(33, SIZES)) == partitions(48) != partitions(33)


def test_a_simulation_priced_with_the_profile_reports_its_graphs_sizes(tmp_path):
    """As `graphs` and `prefill_buckets`: a simulated run's summary has the keys an engine run's
    has, the sizes its profile measured (none for the analytic model)."""
    from zipage.config import ZipageConfig
    from zipage.core.deployment import ReplaySettings
    from zipage.sim.simulate import simulate
    from zipage.trace import Trace, TraceRequest

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(graphed(decode_graph_sizes=SIZES)))
    trace = Trace("t", [TraceRequest(f"r{i}", 0.0, 100, 20) for i in range(4)])
    config = ZipageConfig(block_size=64, kv_budget=512, compress=False)
    summaries = {}
    for name, cost_model in (("profile", str(path)), ("analytic", "analytic")):
        settings = ReplaySettings(model="qwen3-8b", hardware="h200", kv_memory_gb=2.0,
                                  cost_model=cost_model, config=config)
        summaries[name], _ = simulate(trace, settings)
    assert summaries["profile"]["decode_graph_sizes"] == SIZES
    assert summaries["analytic"]["decode_graph_sizes"] == []
