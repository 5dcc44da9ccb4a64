"""The eviction scoring policies (`--scoring`, kernels/scoring, zipage/scoring.py): each reference
on small tensors, the fast paths through the Triton interpreter against the references, the knob's
checks, the cost terms, and every policy through the CPU engine with the simulator making the
engine's decisions under step-time replay."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import TRITON_INSTALLED, UNDER_INTERPRETER, run_test_file_under_interpreter, under_interpreter  # noqa: E402

from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.memory import block_bytes  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402
from zipage.hardware import get_hardware  # noqa: E402
from zipage.kernels.compress import CompressionInputs, compress  # noqa: E402
from zipage.kernels.compress_ref import (  # noqa: E402
    CompressionParams,
    ScoreInputs,
    attention_scores,
    compress_ref,
    final_scores,
    pool_scores,
    redundancy_scores,
)
from zipage.kernels.scoring import SCORERS, scoring_policy  # noqa: E402
from zipage.presets import get_preset  # noqa: E402
from zipage.scoring import SCORING_POLICIES  # noqa: E402
from zipage.sim.analytic import AnalyticCostModel  # noqa: E402

torch.set_num_threads(1)
# The reference tests run in the parent only; the interpreter's child runs the fast paths alone.
in_parent = pytest.mark.skipif(UNDER_INTERPRETER, reason="a reference test: in the parent process")
BLOCK, WINDOW, HEADS, KV_HEADS, DIM = 16, 4, 4, 2, 8
# Scores are float32 sums of a few dozen terms: two computations of one formula differ by
# rounding only, far below this.
ATOL = 1e-6


def score_inputs(length: int = 3 * BLOCK, seed: int = 0, compressed: bool = False) -> ScoreInputs:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, KV_HEADS, DIM, generator=generator)
    values = torch.randn(length, KV_HEADS, DIM, generator=generator)
    queries = torch.randn(WINDOW, HEADS, DIM, generator=generator)
    previous = 0.03 * torch.rand(KV_HEADS, length, generator=generator)
    return ScoreInputs(keys, queries, previous, compressed, DIM**-0.5, seed, None, lambda: values)


def params(scoring: str = "zipage", **knobs) -> CompressionParams:
    return scoring_policy(scoring).fixed(
        CompressionParams(block_size=BLOCK, window=WINDOW, scoring=scoring, **knobs))


@in_parent
def test_both_registries_name_the_same_policies():
    assert list(SCORERS) == list(SCORING_POLICIES)
    assert all(policy.name == name for name, policy in SCORERS.items())
    # Only the default keeps global scores; every policy that reads no queries says so.
    assert [name for name, spec in SCORING_POLICIES.items() if spec.global_scores] == ["zipage"]
    assert {name for name, spec in SCORING_POLICIES.items() if spec.needs_queries} == {
        "zipage", "snapkv", "rkv"}


@in_parent
@pytest.mark.parametrize("name", list(SCORERS))
def test_every_reference_scores_each_entry_keeps_the_window_and_repeats(name):
    inputs = score_inputs()
    final, stored = SCORERS[name].reference(inputs, params(name))
    assert final.shape == (KV_HEADS, 3 * BLOCK) and final.dtype == torch.float32
    assert torch.isposinf(final[:, -WINDOW:]).all()
    older = final[:, 4:-WINDOW]  # past streaming's sinks, which score +inf too
    assert torch.isfinite(older).all()
    assert (stored is not None) == (name == "zipage")
    again, _ = SCORERS[name].reference(inputs, params(name))
    assert torch.equal(final, again)


@in_parent
def test_the_zipage_policy_is_the_pipelines_final_score():
    for compressed in (False, True):
        inputs = score_inputs(compressed=compressed)
        for knobs in ({}, dict(redundancy="flash", pooling="always"), dict(global_score=False)):
            own = params(**knobs)
            final, stored = SCORERS["zipage"].reference(inputs, own)
            expected, expected_stored = final_scores(inputs.keys, inputs.queries, inputs.previous,
                                                     compressed, own, inputs.scale)
            torch.testing.assert_close(final, expected, rtol=0, atol=ATOL)
            if expected_stored is None:
                assert stored is None
            else:
                torch.testing.assert_close(stored, expected_stored, rtol=0, atol=ATOL)


@in_parent
def test_snapkv_average_pools_the_window_attention():
    inputs = score_inputs()
    final, _ = SCORERS["snapkv"].reference(inputs, params("snapkv"))
    attention = attention_scores(inputs.queries, inputs.keys, 3 * BLOCK, BLOCK, inputs.scale)
    # By hand: entry 10 averages entries 8..12; entry 0 averages 0..2 and two zeros.
    torch.testing.assert_close(final[:, 10], attention[:, 8:13].mean(dim=1), rtol=0, atol=ATOL)
    torch.testing.assert_close(final[:, 0], attention[:, :3].sum(dim=1) / 5, rtol=0, atol=ATOL)


@in_parent
def test_rkv_is_a_tenth_pooled_attention_less_nine_tenths_all_pairs_redundancy():
    inputs = score_inputs()
    final, stored = SCORERS["rkv"].reference(inputs, params("rkv"))
    attention = attention_scores(inputs.queries, inputs.keys, 3 * BLOCK, BLOCK, inputs.scale)
    # R-KV's redundancy: the mean similarity of each key (tau 1 over the whole sequence).
    redundancy = redundancy_scores(inputs.keys, "flash", BLOCK, 0.5, 1.0)
    expected = 0.1 * pool_scores(attention, 7) - 0.9 * redundancy
    torch.testing.assert_close(final[:, :-WINDOW], expected[:, :-WINDOW], rtol=0, atol=ATOL)
    assert stored is None


@in_parent
def test_keydiff_prefers_the_outlier_key():
    inputs = score_inputs()
    keys = torch.ones(3 * BLOCK, KV_HEADS, DIM) + 0.01 * inputs.keys
    keys[7, 0] = -keys[7, 0]  # opposite to every other key of head 0
    keys[20, 1, :DIM // 2] = 0  # half-way off the others in head 1
    final, _ = SCORERS["keydiff"].reference(dataclasses.replace(inputs, keys=keys),
                                            params("keydiff"))
    assert int(final[0, :-WINDOW].argmax()) == 7 and int(final[1, :-WINDOW].argmax()) == 20


@in_parent
def test_vnorm_orders_by_the_values_norm():
    inputs = score_inputs()
    final, _ = SCORERS["vnorm"].reference(inputs, params("vnorm"))
    norms = inputs.values.norm(dim=-1).transpose(0, 1)
    for head in range(KV_HEADS):
        order = final[head, :-WINDOW].argsort(descending=True)
        assert torch.equal(order, norms[head, :-WINDOW].argsort(descending=True))


@in_parent
def test_random_differs_by_seed_and_head_and_spreads_over_zero_to_one():
    first, _ = SCORERS["random"].reference(score_inputs(seed=1), params("random"))
    other, _ = SCORERS["random"].reference(score_inputs(seed=2), params("random"))
    assert not torch.equal(first, other) and not torch.equal(first[0], first[1])
    older = first[:, :-WINDOW]
    assert 0.0 <= float(older.min()) and float(older.max()) < 1.0
    assert abs(float(older.mean()) - 0.5) < 0.15  # 88 draws of a uniform: sd 0.03


# ------------------------------------------------------------------ whole compressions, reference


def numbered_batch(layers: int = 2, seed: int = 0) -> CompressionInputs:
    """Two requests (3 and 4 source blocks, 2 and 3 targets, the first in place) over a cache
    whose entry e of block b holds b * BLOCK + e in K's last element (the kept set can be read
    back), random elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    shape = (layers, 12, BLOCK, KV_HEADS, DIM)
    keys = torch.randn(shape, generator=generator)
    keys[..., -1] = torch.arange(12 * BLOCK, dtype=torch.float32).view(1, 12, BLOCK, 1)
    return CompressionInputs(
        k_cache=keys, v_cache=torch.randn(shape, generator=generator),
        score_cache=0.03 * torch.rand(shape[:4], generator=generator),
        query_cache=torch.randn(layers, 3, WINDOW, HEADS, DIM, generator=generator),
        source_tables=torch.tensor([[3, 5, 1, -1], [0, 2, 4, 6]], dtype=torch.int32),
        num_source_blocks=torch.tensor([3, 4], dtype=torch.int32),
        target_tables=torch.tensor([[3, 5, -1], [7, 8, 9]], dtype=torch.int32),
        query_slots=torch.tensor([1, 2]), is_compressed=torch.tensor([False, True]),
        num_target_blocks=torch.tensor([2, 3], dtype=torch.int32),
        seeds=torch.tensor([11, 12]))


def kept_positions(batch: CompressionInputs, request: int, layer: int, head: int) -> list[int]:
    """The source positions of the entries request `request` kept (read back from K)."""
    targets = batch.target_tables[request, :int(batch.num_target_blocks[request])].long()
    numbers = batch.k_cache[layer, targets, :, head, -1].flatten().long().tolist()
    table = batch.source_tables[request].tolist()
    return [table.index(number // BLOCK) * BLOCK + number % BLOCK for number in numbers]


def run(batch: CompressionInputs, scoring: str, **knobs) -> CompressionInputs:
    batch = batch.clone()
    compress(*batch.arguments(CompressionParams(block_size=BLOCK, window=WINDOW,
                                                scoring=scoring, **knobs), DIM**-0.5),
             **batch.keywords())
    return batch


@in_parent
def test_zipage_through_the_registry_equals_the_reference_pipeline():
    batch = numbered_batch()
    through = run(batch, "zipage")
    direct = batch.clone()
    compress_ref(*direct.arguments(CompressionParams(block_size=BLOCK, window=WINDOW), DIM**-0.5),
                 num_target_blocks=direct.num_target_blocks)
    for name in ("k_cache", "v_cache", "score_cache"):
        assert torch.equal(getattr(through, name), getattr(direct, name))


@in_parent
def test_streaming_keeps_exactly_the_sinks_and_the_most_recent():
    batch = run(numbered_batch(), "streaming")
    for request, (length, keep) in enumerate([(3 * BLOCK, 2 * BLOCK), (4 * BLOCK, 3 * BLOCK)]):
        expected = list(range(4)) + list(range(length - (keep - 4), length))
        for layer in range(2):
            for head in range(KV_HEADS):
                assert kept_positions(batch, request, layer, head) == expected


@in_parent
def test_random_repeats_per_compression_and_draws_apart_per_request_seed_and_layer():
    batch = numbered_batch()
    first, again = run(batch, "random"), run(batch, "random")
    assert torch.equal(first.k_cache, again.k_cache)
    reseeded = dataclasses.replace(batch, seeds=torch.tensor([11, 13]))
    other = run(reseeded, "random")
    assert kept_positions(other, 0, 0, 0) == kept_positions(first, 0, 0, 0)  # its seed unchanged
    assert kept_positions(other, 1, 0, 0) != kept_positions(first, 1, 0, 0)
    assert kept_positions(first, 0, 0, 0) != kept_positions(first, 0, 1, 0)
    for request, length in ((0, 3 * BLOCK), (1, 4 * BLOCK)):
        kept = kept_positions(first, request, 1, 1)
        assert kept == sorted(kept) and kept[-WINDOW:] == list(range(length - WINDOW, length))


@in_parent
@pytest.mark.parametrize("name", [name for name in SCORERS if name != "zipage"])
def test_other_policies_leave_the_score_cache_alone(name):
    batch = numbered_batch()
    assert torch.equal(run(batch, name).score_cache, batch.score_cache)


# ------------------------------------------------------------------ fast paths, under the interpreter


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="this is the child process already")
def test_fast_paths_under_the_interpreter():
    run_test_file_under_interpreter(__file__)


def ragged_batch(layers: int = 2, seed: int = 3) -> CompressionInputs:
    """Three requests of 2, 4 and 3 source blocks (2 and 3 kept in place, 1 to 3 targets) over a
    random cache whose block 0, which no request owns but every padded table entry (-1) would
    read, holds NaN: a fast path that let padding into a score, a mean or a norm would differ."""
    generator = torch.Generator().manual_seed(seed)
    shape = (layers, 12, BLOCK, KV_HEADS, DIM)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    keys[:, 0], values[:, 0] = float("nan"), float("nan")
    return CompressionInputs(
        k_cache=keys, v_cache=values, score_cache=None,
        query_cache=torch.randn(layers, 3, WINDOW, HEADS, DIM, generator=generator),
        source_tables=torch.tensor([[2, 3, -1, -1], [4, 5, 6, 7], [8, 9, 10, -1]],
                                   dtype=torch.int32),
        num_source_blocks=torch.tensor([2, 4, 3], dtype=torch.int32),
        target_tables=torch.tensor([[11, -1, -1], [4, 5, 6], [1, 8, -1]], dtype=torch.int32),
        query_slots=torch.tensor([0, 1, 2]), is_compressed=torch.tensor([False, True, False]),
        num_target_blocks=torch.tensor([1, 3, 2], dtype=torch.int32),
        seeds=torch.tensor([5, 6, 7]))


FAST_PATHS = [name for name, policy in SCORERS.items()
              if policy.triton is not None and name != "zipage"]


@in_parent
def test_every_policy_has_a_fast_path():
    assert all(policy.triton is not None for policy in SCORERS.values())


@in_parent
def test_keydiff_batched_anchor_leaves_out_each_requests_padding():
    """`keydiff.batch_scores` on a padded batch equals the reference on each request's own keys,
    whatever the padding holds (here keys far larger than the real ones, all one way)."""
    from zipage.kernels.scoring import keydiff

    generator = torch.Generator().manual_seed(4)
    lengths = (2 * BLOCK, 4 * BLOCK, 3 * BLOCK)
    keys = 1e3 * torch.ones(len(lengths), 4 * BLOCK, KV_HEADS, DIM)
    own = [torch.randn(length, KV_HEADS, DIM, generator=generator) for length in lengths]
    for request, request_keys in enumerate(own):
        keys[request, :len(request_keys)] = request_keys
    valid = torch.arange(4 * BLOCK)[None, :] < torch.tensor(lengths)[:, None]
    batched = keydiff.batch_scores(keys, valid)
    for request, request_keys in enumerate(own):
        inputs = dataclasses.replace(score_inputs(), keys=request_keys)
        expected, _ = keydiff.reference(inputs, params("keydiff"))
        length = len(request_keys)
        torch.testing.assert_close(batched[request, :, :length - WINDOW],
                                   expected[:, :-WINDOW], rtol=0, atol=ATOL)


def compressed_both_ways(batch: CompressionInputs, name: str
                         ) -> tuple[CompressionInputs, CompressionInputs]:
    fast = run(batch, name)  # TRITON_INTERPRET=1: the policy's fast path
    reference = batch.clone()
    compress_ref(*reference.arguments(params(name), DIM**-0.5),
                 num_target_blocks=reference.num_target_blocks, seeds=reference.seeds,
                 k_scale=reference.k_scale, v_scale=reference.v_scale,
                 scorer=SCORERS[name].reference)
    return fast, reference


def assert_same_caches(fast: CompressionInputs, reference: CompressionInputs) -> None:
    """The compaction moves entries without arithmetic, so the same kept sets give the same
    bytes: the caches are compared exactly (tolerance 0; NaN, in blocks no request owns, equals
    NaN)."""
    for name in ("k_cache", "v_cache", "score_cache", "k_scale", "v_scale"):
        if getattr(reference, name) is None:
            continue
        torch.testing.assert_close(getattr(fast, name).float(), getattr(reference, name).float(),
                                   rtol=0, atol=0, equal_nan=True)


@under_interpreter
@pytest.mark.parametrize("name", FAST_PATHS)
def test_fast_path_matches_the_reference(name):
    # The scores differ by float32 rounding at most (ATOL), far from any tie at the cut on these
    # keys, so the kept sets and the moved entries are the same.
    assert_same_caches(*compressed_both_ways(numbered_batch(), name))


@under_interpreter
@pytest.mark.parametrize("name", FAST_PATHS)
def test_fast_path_matches_the_reference_on_ragged_requests(name):
    batch = ragged_batch()
    fast, reference = compressed_both_ways(batch, name)
    assert_same_caches(fast, reference)
    # The compression did move entries (the comparison is not of two untouched caches).
    assert not torch.equal(fast.k_cache[:, 11], batch.k_cache[:, 11])


@under_interpreter
@pytest.mark.parametrize("name", ["streaming", "random", "keydiff", "vnorm"])
def test_fast_path_matches_the_reference_on_an_fp8_cache(name):
    from zipage.kernels.kv_quant_ref import quantize_kv

    batch = ragged_batch()
    batch.k_cache[:, 0], batch.v_cache[:, 0] = 0.0, 0.0  # e4m3fn has no NaN to spare
    (k_cache, k_scale), (v_cache, v_scale) = quantize_kv(batch.k_cache), quantize_kv(batch.v_cache)
    fp8 = dataclasses.replace(batch, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale,
                              v_scale=v_scale)
    assert_same_caches(*compressed_both_ways(fp8, name))


@under_interpreter
def test_random_fast_path_seeds_each_request_and_layer():
    batch = numbered_batch()
    first = run(batch, "random")
    other = run(dataclasses.replace(batch, seeds=torch.tensor([11, 13])), "random")
    assert kept_positions(other, 0, 0, 0) == kept_positions(first, 0, 0, 0)
    assert kept_positions(other, 1, 0, 0) != kept_positions(first, 1, 0, 0)
    assert kept_positions(first, 0, 0, 0) != kept_positions(first, 0, 1, 0)


# ------------------------------------------------------------------ the knob, memory, cost


@in_parent
def test_the_knob_lists_the_policies_and_refuses_pipeline_knobs_beside_another():
    with pytest.raises(ConfigError, match="scoring: got 'h2o', expected one of zipage, snapkv"):
        ZipageConfig(scoring="h2o")
    with pytest.raises(ConfigError, match="^lambda_weight: shapes the zipage scoring policy only"):
        ZipageConfig(scoring="snapkv", lambda_weight=0.5)
    assert ZipageConfig().keeps_global_scores and not ZipageConfig(scoring="rkv").keeps_global_scores
    shape = get_preset("qwen3-8b")
    # A policy without global scores leaves their per-entry bytes to KV: 1 / (2d) of a block.
    with_scores = block_bytes(shape, ZipageConfig(), 2)
    without = block_bytes(shape, ZipageConfig(scoring="keydiff"), 2)
    assert with_scores - without == shape.num_layers * shape.num_kv_heads * 2 * 256


@in_parent
def test_the_analytic_model_prices_each_policy_by_its_cost_terms():
    shape, gpu = get_preset("qwen3-8b"), get_hardware("h200")
    blocks = [9] * 8
    cost = {name: AnalyticCostModel(shape, gpu, scoring=name).compress_time_for(blocks)
            for name in SCORERS}
    default = AnalyticCostModel(shape, gpu).compress_time_for(blocks)
    assert abs(cost["zipage"] - default) <= 1e-12 * default
    # No attention and no redundancy: cheaper than anything that reads the window queries.
    for cheap in ("streaming", "random", "keydiff", "vnorm"):
        assert cost[cheap] < cost["snapkv"] < cost["zipage"] < cost["rkv"]
    assert cost["streaming"] < cost["keydiff"]  # keydiff reads every key twice
    assert AnalyticCostModel(shape, gpu, scoring="rkv").contention_factor > \
        AnalyticCostModel(shape, gpu).contention_factor  # flash redundancy


@in_parent
def test_a_profile_measured_before_the_knob_prices_only_the_default():
    from zipage.sim.cost_loader import load_cost_model

    shape, gpu = get_preset("qwen3-8b"), get_hardware("h200")
    knobs = dict(block_size=64, kv_budget=512)
    load_cost_model("qwen3-8b-h200-b64-k512-zipage", shape, gpu, **knobs)
    with pytest.raises(ConfigError, match="scoring: measured with 'zipage', but this run uses "
                                          "'streaming'"):
        load_cost_model("qwen3-8b-h200-b64-k512-zipage", shape, gpu, scoring="streaming", **knobs)


# ------------------------------------------------------------------ the engine and the simulator


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_models import save_tiny_qwen3

    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_qwen3(directory)
    return directory


@in_parent
@pytest.mark.parametrize("name", list(SCORERS))
def test_engine_and_step_replay_make_the_same_decisions_per_policy(tiny_model, tmp_path, name):
    from zipage.core.deployment import ReplaySettings
    from zipage.engine.replay import replay_on_engine
    from zipage.rundir import write_run
    from zipage.sim.step_replay import replay_step_times
    from zipage.trace import Trace, TraceRequest

    torch.set_num_threads(1)
    trace = Trace("scoring", [
        TraceRequest(id=f"r{i}", arrival_s=0.0, prompt_len=prompt, output_len=output)
        for i, (prompt, output) in enumerate([(20, 60), (33, 40), (5, 70)])])
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=False,
                          scoring=name)
    settings = ReplaySettings(model=str(tiny_model), dtype="float32", kv_memory_gb=0.0001,
                              config=config)
    summary, run_ = replay_on_engine(trace, settings, "cpu", log_decisions=True)
    assert summary["compressions"] > 0 and summary["completed"] == len(trace.requests)
    out = write_run(tmp_path / "engine", summary, run_.steps, run_.requests, run_.decision_log)
    replayed, replay_run = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
    assert replay_run.decision_log == run_.decision_log
