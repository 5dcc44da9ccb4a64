"""The calibrated mixed step's own host bound (profile version 3, sim/mixed_fit.py).

A mixed step (decodes and prompt chunks in one eager forward) costs
s * chunks + max(h_m, m + the decode fit's and the prefill fit's slopes): h_m and m are fitted
to the profile's mixed points, s is the prefill's. When the points cannot determine h_m (all
device-bound, or fewer than three) it falls back to the prefill's host bound h, m fitted as one
constant through every point, as before; profiles before version 3 keep that fit exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tolerance import close

from zipage.cli.calibrate import save_profile
from zipage.core.step import causal_pairs
from zipage.errors import ConfigError
from zipage.hardware import get_hardware
from zipage.prefill_buckets import PREFILL_GRAPH_TOKENS, padded_rows
from zipage.presets import get_preset
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_loader import load_cost_model
from zipage.sim.cost_model import StepWork

ROOT = Path(__file__).resolve().parent.parent
DECODE = (5e-3, 5e-6, 3.5e-8)  # constant, per request, per context token
# Prefill: per prompt, host-bound time, device line (constant, per new token, per pair).
PER_SEQUENCE, HOST, DEVICE = 2e-4, 15e-3, (1e-3, 2e-5, 2e-9)
# The mixed step's own host bound, above the prefill's as measured on the H200 (19-20 ms
# against 15.4 ms for Qwen3-8B: the decode rows add launches), and its own constant.
MIXED_HOST, MIXED_CONSTANT = 20e-3, 3e-3


def prefill_truth(tokens: float, pairs: float, prompts: int) -> float:
    return PER_SEQUENCE * prompts + max(HOST, DEVICE[0] + DEVICE[1] * tokens + DEVICE[2] * pairs)


def mixed_device(batch: int, context: int, tokens: float, pairs: float) -> float:
    return (MIXED_CONSTANT + DECODE[1] * batch + DECODE[2] * context + DEVICE[1] * tokens
            + DEVICE[2] * pairs)


def mixed_truth(batch: int, context: int, tokens: float, pairs: float, chunks: int) -> float:
    return PER_SEQUENCE * chunks + max(MIXED_HOST, mixed_device(batch, context, tokens, pairs))


def mixed_point(batch: int, per_request: int, new: int, cached: int, chunks: int = 1) -> dict:
    pairs = chunks * causal_pairs(new, cached)
    return {"batch": batch, "context_tokens": batch * per_request, "new_tokens": new,
            "cached_tokens": cached, "requests": chunks,
            "time_s": mixed_truth(batch, batch * per_request, chunks * new, pairs, chunks)}


def is_host_bound(point: dict) -> bool:
    return mixed_device(point["batch"], point["context_tokens"], point["new_tokens"],
                        causal_pairs(point["new_tokens"], point["cached_tokens"])) < MIXED_HOST


# calibrate --gpu's grid: decode batches x two contexts x chunks of 128 / 512 / 2048 tokens,
# first and last chunk of a prompt: 20 of its 36 points are host-bound.
GRID = [mixed_point(batch, context, new, cached)
        for batch in (1, 16, 64) for context in (512, 8192)
        for new in (128, 512, 2048) for cached in (0, new)]


def profile(mixed: list[dict], version: int = 3, noise: float = 0.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def measured(time: float) -> float:
        return time * (1 + noise * rng.standard_normal())

    decode = [{"batch": b, "context_tokens": b * c,
               "time_s": measured(DECODE[0] + DECODE[1] * b + DECODE[2] * b * c)}
              for b in (1, 4, 16, 64) for c in (512, 2048, 8192)]
    prefill = []
    for new, prompts in ((128, 1), (512, 1), (2048, 1), (8192, 1), (128, 4), (2048, 4),
                         (128, 16)):
        for cached in (0, new):
            pairs = prompts * causal_pairs(new, cached)
            prefill.append({"new_tokens": new, "cached_tokens": cached, "requests": prompts,
                            "time_s": measured(prefill_truth(prompts * new, pairs, prompts))})
    mixed = [dict(point, time_s=measured(point["time_s"])) for point in mixed]
    return {"version": version, "model": "qwen3-8b", "gpu": "h200", "decode": decode,
            "prefill": prefill, "mixed": mixed}


def mixed_work(batch: int, per_request: int, *chunks: tuple[int, int]) -> StepWork:
    """`chunks`: (new, cached) tokens of each prompt chunk."""
    return StepWork.from_counts(batch, batch * per_request, list(chunks))


def test_the_fit_recovers_a_known_mixed_host_bound_and_constant():
    assert sum(map(is_host_bound, GRID)) == 20
    exact = CalibratedCostModel.from_profile(profile(GRID))
    fit = exact.mixed_fit
    assert fit.host_fitted
    assert fit.host_s == pytest.approx(MIXED_HOST, rel=1e-6)
    assert fit.coefficients[0] == pytest.approx(MIXED_CONSTANT, rel=1e-6)
    assert fit.per_sequence_s == pytest.approx(PER_SEQUENCE, rel=1e-6)
    assert fit.relative_rms_error < 1e-6
    # 1 % noise on every point of every section.
    noisy = CalibratedCostModel.from_profile(profile(GRID, noise=0.01, seed=1)).mixed_fit
    assert noisy.host_fitted
    assert noisy.host_s == pytest.approx(MIXED_HOST, rel=0.01)
    assert noisy.coefficients[0] == pytest.approx(MIXED_CONSTANT, abs=1.5e-3)
    assert noisy.relative_rms_error < 0.02
    assert min(noisy.host_s, noisy.coefficients[0]) >= 0


def test_small_mixed_steps_are_priced_at_the_mixed_host_bound():
    model = CalibratedCostModel.from_profile(profile(GRID))
    assert model.prefill_fit.host_s == pytest.approx(HOST, rel=1e-6)
    # One decode and a 16-token chunk: host-bound at h_m, not at the prefill's h.
    small = model.forward_time_for(mixed_work(1, 100, (16, 0)))
    assert small == pytest.approx(PER_SEQUENCE + MIXED_HOST, rel=1e-6)
    assert small > model.forward_time_for(mixed_work(0, 0, (16, 0))) + 4e-3
    # 32 decodes and two 256-token chunks: still host-bound; each chunk pays its cost.
    work = mixed_work(32, 1024, (256, 0), (256, 0))
    assert mixed_device(32, 32 * 1024, 512, work.attention_pairs) < MIXED_HOST - 5e-3
    two = model.forward_time_for(work)
    assert two == pytest.approx(2 * PER_SEQUENCE + MIXED_HOST, rel=1e-6)
    # A 4096-token chunk beside 64 decodes is device-bound: m plus the pure fits' slopes.
    work = mixed_work(64, 1024, (4096, 0))
    expected = mixed_truth(64, 64 * 1024, 4096, work.attention_pairs, 1)
    assert expected > PER_SEQUENCE + MIXED_HOST + 0.05
    assert model.forward_time_for(work) == pytest.approx(expected, rel=1e-6)


def test_device_bound_points_fall_back_to_the_prefill_host_bound():
    """Mixed points that are all device-bound say nothing about h_m: the prefill's h is taken,
    and m is the one constant through every point, as before h_m existed."""
    device_bound = [point for point in GRID if not is_host_bound(point)]
    model = CalibratedCostModel.from_profile(profile(device_bound))
    fit = model.mixed_fit
    assert not fit.host_fitted
    assert fit.host_s == close(model.prefill_fit.host_s)
    assert fit.per_sequence_s == close(model.prefill_fit.per_sequence_s)
    assert fit.coefficients[0] == pytest.approx(MIXED_CONSTANT, rel=1e-6)
    assert fit.relative_rms_error < 1e-6
    small = model.forward_time_for(mixed_work(1, 100, (16, 0)))
    assert small == pytest.approx(PER_SEQUENCE + HOST, rel=1e-6)


def test_too_few_points_fall_back_to_the_prefill_host_bound():
    # Two points (one host-bound, one device-bound) cannot fit h_m and m with a point to spare.
    two = [GRID[0], GRID[4]]
    assert is_host_bound(two[0]) and not is_host_bound(two[1])
    model = CalibratedCostModel.from_profile(profile(two))
    assert not model.mixed_fit.host_fitted
    assert model.mixed_fit.host_s == close(model.prefill_fit.host_s)
    assert model.mixed_fit.num_points == 2


def test_host_bound_points_fit_h_m_and_take_the_one_forward_constant():
    """Points that are all host-bound give h_m but only an upper bound on m: m is then the
    one-forward assumption of a profile without mixed points, the larger pure constant."""
    host_bound = list(filter(is_host_bound, GRID))
    model = CalibratedCostModel.from_profile(profile(host_bound))
    fit = model.mixed_fit
    assert fit.host_fitted
    assert fit.host_s == pytest.approx(MIXED_HOST, rel=1e-6)
    one_forward = max(model.decode_fit.coefficients[0], model.prefill_fit.device_coefficients[0])
    assert fit.coefficients[0] == close(one_forward)
    assert one_forward == pytest.approx(DECODE[0], rel=1e-6)


def test_profiles_before_version_3_keep_the_one_constant_fit():
    """A version-2 profile with the same points: no host bound of its own (nor the prefill's,
    a line there), m the relative-error mean of what the slopes leave, as it always was."""
    model = CalibratedCostModel.from_profile(profile(GRID, version=2))
    fit = model.mixed_fit
    assert not fit.host_fitted
    assert fit.host_s == close(0.0) and fit.per_sequence_s == close(0.0)
    features = np.array([[point["batch"], point["context_tokens"], point["new_tokens"],
                          causal_pairs(point["new_tokens"], point["cached_tokens"])]
                         for point in GRID], dtype=float)
    time = np.array([point["time_s"] for point in GRID])
    left = time - features @ np.array(fit.coefficients[1:])
    assert fit.coefficients[0] == pytest.approx(np.sum(left / time**2) / np.sum(1 / time**2),
                                                rel=1e-9)
    # Version 3 fits the same points with their host bound, far closer.
    assert CalibratedCostModel.from_profile(profile(GRID)).mixed_fit.relative_rms_error \
        < fit.relative_rms_error / 100


def test_calibrate_prints_the_mixed_host_bound(tmp_path, capsys):
    assert save_profile(profile(GRID), str(tmp_path / "p.json")) == 0
    printed = capsys.readouterr().out
    assert "mixed    0.0002 * requests + max(0.02, 0.003 + 5e-06 * batch" in printed
    assert "host bound: the prefill's" not in printed
    device_bound = [point for point in GRID if not is_host_bound(point)]
    assert save_profile(profile(device_bound), str(tmp_path / "q.json")) == 0
    printed = capsys.readouterr().out
    assert "mixed    0.0002 * requests + max(0.015, 0.003 + 5e-06 * batch" in printed
    assert "host bound: the prefill's (the points do not determine one)" in printed


def test_an_eager_8b_full_kv_profile_prices_small_mixed_steps_at_their_host_bound():
    """Measured by `zipage calibrate --gpu` on an H200 with eager prefill steps (the profiles kept
    for `--no-prefill-graphs` runs, docs/cost_model.md): small mixed steps of Qwen3-8B
    are host-bound at 19-20 ms, above the prefill's 15.4 ms. One fitted constant under the
    prefill's host bound left a relative RMS error of 22.5 % and priced 32 decodes beside a
    512-token chunk at 23.7 ms, above a decode step and a prefill step apart (6.5 + 15.4 ms)."""
    cost = load_cost_model(str(ROOT / "tests/golden/profiles/eager-prefill/qwen3-8b-h200-b64-k512-fullkv.json"),
                           get_preset("qwen3-8b"), get_hardware("h200"))
    fit = cost.mixed_fit
    assert fit.host_fitted and fit.num_points == 24
    assert 19e-3 < fit.host_s < 21e-3
    assert cost.prefill_fit.host_s < 16e-3
    assert fit.relative_rms_error < 0.08
    mixed = cost.forward_time_for(mixed_work(32, 1024, (512, 0)))
    assert mixed == pytest.approx(fit.host_s + fit.per_sequence_s, rel=1e-12)
    decode = cost.forward_time_for(mixed_work(32, 1024))
    prefill = cost.forward_time_for(mixed_work(0, 0, (512, 0)))
    assert max(decode, prefill) < mixed < decode + prefill


# An engine with prefill graphs pads a step of up to 4,096 rows to its token bucket, and a padded
# step's decode rows are one-token sequences of the prefill launch: the longest one's context is
# walked by one program (no split-K), a cost of its own (per KV entry).
BUCKETS = list(PREFILL_GRAPH_TOKENS)
LONGEST = 5e-7


def padded_profile() -> dict:
    """`profile(GRID)` as an engine with prefill graphs measures it: every prefill and mixed time
    from the truth above at the padded rows, mixed steps with the longest decode's walk."""
    data = profile(GRID)
    for point in data["prefill"]:
        tokens = point["requests"] * point["new_tokens"]
        pairs = point["requests"] * causal_pairs(point["new_tokens"], point["cached_tokens"])
        point["time_s"] = prefill_truth(padded_rows(tokens, BUCKETS), pairs, point["requests"])
    for point in data["mixed"]:
        batch, tokens = point["batch"], point["requests"] * point["new_tokens"]
        pairs = point["requests"] * causal_pairs(point["new_tokens"], point["cached_tokens"])
        device = (mixed_device(batch, point["context_tokens"],
                               padded_rows(batch + tokens, BUCKETS) - batch, pairs)
                  + LONGEST * point["context_tokens"] / batch)
        point["time_s"] = PER_SEQUENCE * point["requests"] + max(MIXED_HOST, device)
    return data | {"prefill_buckets": BUCKETS}


def test_a_padded_profile_is_fitted_and_priced_at_the_padded_rows():
    """With `prefill_buckets` the fits read each point's tokens as its bucket's rows less its
    decode rows and fit the longest decode's walk: the truth comes back exactly; read unpadded,
    the same points leave a large error (the shipped H200 profiles: 26-31 %, docs/cost_model.md)."""
    data = padded_profile()
    model = CalibratedCostModel.from_profile(data)
    fit = model.mixed_fit
    assert fit.feature_names[-1] == "longest_decode"
    assert fit.coefficients[-1] == pytest.approx(LONGEST, rel=1e-6)
    assert fit.host_s == pytest.approx(MIXED_HOST, rel=1e-6)
    assert fit.coefficients[0] == pytest.approx(MIXED_CONSTANT, rel=1e-6)
    assert fit.relative_rms_error < 1e-6
    assert model.prefill_fit.relative_rms_error < 1e-6
    unpadded = CalibratedCostModel.from_profile({k: v for k, v in data.items()
                                                 if k != "prefill_buckets"})
    assert unpadded.mixed_fit.feature_names[-1] != "longest_decode"
    assert unpadded.mixed_fit.relative_rms_error > 0.05
    # A 513-token prompt computes 768 rows (its pairs are its own); 8,192 tokens run unpadded.
    work = mixed_work(0, 0, (513, 0))
    assert model.forward_time_for(work) == pytest.approx(
        prefill_truth(768, work.attention_pairs, 1), rel=1e-9)
    work = mixed_work(0, 0, (8192, 0))
    assert model.forward_time_for(work) == pytest.approx(
        prefill_truth(8192, work.attention_pairs, 1), rel=1e-9)
    # Two decodes at 4,000 and 100 entries beside a 700-token chunk: 702 rows run as 768, and
    # the longer decode's walk is priced by its own length, not the mean.
    work = mixed_work(2, 0, (700, 0))
    work.decode_context_tokens, work.decode_max_context = 4100, 4000
    device = (mixed_device(2, 4100, 766, work.attention_pairs) + LONGEST * 4000)
    assert model.forward_time_for(work) == pytest.approx(
        PER_SEQUENCE + max(MIXED_HOST, device), rel=1e-9)


def test_mixed_points_are_fitted_at_their_longest_decode():
    """Points that say their longest decode row (`max_context`, as runs through the engine loop
    record it) are fitted at it, the length the simulator prices a step with: fitted at the mean
    context instead, the walk's slope came out wrong and priced the 0.6B Zipage H200 run's mixed
    steps 16 % high (docs/cost_model.md)."""
    data = padded_profile()
    for index, point in enumerate(data["mixed"]):
        batch, tokens = point["batch"], point["requests"] * point["new_tokens"]
        pairs = point["requests"] * causal_pairs(point["new_tokens"], point["cached_tokens"])
        # The longest row is 1x to 4x the mean (one row alone is the mean).
        longest = point["context_tokens"] / batch * (1 + (index % 4) * (batch > 1))
        point["max_context"] = longest
        device = (mixed_device(batch, point["context_tokens"],
                               padded_rows(batch + tokens, BUCKETS) - batch, pairs)
                  + LONGEST * longest)
        point["time_s"] = PER_SEQUENCE * point["requests"] + max(MIXED_HOST, device)
    model = CalibratedCostModel.from_profile(data)
    assert model.mixed_fit.coefficients[-1] == pytest.approx(LONGEST, rel=1e-6)
    assert model.mixed_fit.relative_rms_error < 1e-6


def test_prefill_buckets_are_checked():
    data = profile(GRID)
    for bad in ([], [512, 256], [16, "32"], [0, 16], {"16": 1}, [True]):
        with pytest.raises(ConfigError, match="prefill_buckets"):
            CalibratedCostModel.from_profile(data | {"prefill_buckets": bad})


def test_the_shipped_profiles_measured_padded_steps_and_fit_them():
    """The four shipped H200 profiles (`zipage calibrate --gpu` through the engine loop, prefill
    graphs on): each names the buckets its runs padded to (the step token budget's, 2,048 tokens,
    and below), and its mixed and prefill fits stay within 10 and 20 % (the 0.6B's prefill 35 %).
    A running engine's steps scatter more than an isolated grid's (the grid profiles kept 6 %),
    and the 0.6B's prefill-only steps are host-bound: its eager ones above the largest graph
    bucket take 22-48 ms whatever their length (docs/cost_model.md)."""
    for stem in ("qwen3-0.6b-h200-b64-k512-fullkv", "qwen3-0.6b-h200-b64-k512-zipage",
                 "qwen3-8b-h200-b64-k512-fullkv", "qwen3-8b-h200-b64-k512-zipage"):
        model = load_cost_model(stem, get_preset(stem.split("-h200")[0]), get_hardware("h200"))
        assert model.measured_graphs == {"decode": True, "prefill": True}, stem
        assert model.prefill_buckets == tuple(t for t in PREFILL_GRAPH_TOKENS if t <= 2048), stem
        assert model.mixed_fit.feature_names[-1] == "longest_decode", stem
        assert model.mixed_fit.relative_rms_error < 0.10, stem
        assert model.prefill_fit.relative_rms_error < (0.35 if "0.6b" in stem else 0.20), stem


def test_many_varied_mixed_points_fit_their_own_slopes():
    # A profile fitted from runs through the engine loop holds hundreds of mixed steps; their
    # slopes are their own, not the pure fits' (a running engine's mixed steps cost what its
    # whole-prompt prefill steps cannot tell). Here every slope differs from the pure fits'.
    own = (4e-3, 9e-6, 5e-8, 3e-5, 3e-9)  # constant, per request, context, token, pair
    chunk_cost = 6e-4
    rng = np.random.default_rng(0)
    points = []
    for _ in range(120):
        batch, per_request = int(rng.integers(1, 64)), int(rng.integers(100, 4000))
        chunks = int(rng.integers(1, 4))
        new, cached = int(rng.integers(16, 600)), int(rng.integers(0, 2000))
        pairs = chunks * causal_pairs(new, cached)
        device = own[0] + own[1] * batch + own[2] * batch * per_request + own[3] * chunks * new \
            + own[4] * pairs
        points.append({"batch": batch, "context_tokens": batch * per_request, "new_tokens": new,
                       "cached_tokens": cached, "requests": chunks,
                       "time_s": chunk_cost * chunks + max(MIXED_HOST, device)})
    fit = CalibratedCostModel.from_profile(profile(points)).mixed_fit
    assert fit.coefficients == pytest.approx(own, rel=1e-6)
    assert fit.per_sequence_s == pytest.approx(chunk_cost, rel=1e-6)
    assert fit.host_fitted and fit.host_s == pytest.approx(MIXED_HOST, rel=1e-6)
    # Fewer points keep the shared-slope fit (the shipped grid profiles' 18-36).
    few = CalibratedCostModel.from_profile(profile(points[:40])).mixed_fit
    assert few.coefficients[1:] == pytest.approx(DECODE[1:] + DEVICE[1:], rel=1e-9)
