"""The calibrated prefill model of profile version 3 (sim/prefill_fit.py): host- or device-bound
with a per-sequence term, every coefficient >= 0; older profiles keep their line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from tolerance import assert_close, close

from zipage.cli.calibrate import save_profile
from zipage.errors import ConfigError
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_model import StepWork
from zipage.sim.prefill_fit import fit_prefill, nonnegative_least_squares

PER_SEQUENCE, HOST, DEVICE = 2e-4, 26e-3, (9e-3, 2.1e-5, 2.2e-9)


def truth(tokens, pairs, prompts):
    device = DEVICE[0] + DEVICE[1] * np.asarray(tokens) + DEVICE[2] * np.asarray(pairs)
    return PER_SEQUENCE * np.asarray(prompts) + np.maximum(HOST, device)


def steps(count: int, longest: int, seed: int = 0):
    """`count` prefill steps of 1-12 prompts of up to `longest` tokens: tokens, pairs, prompts."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 13, count)
    each = np.exp(rng.uniform(np.log(16), np.log(longest), count)).astype(int)
    cached = rng.integers(0, 2048, count)
    tokens = prompts * each
    pairs = prompts * (each * (each + 1) // 2 + each * cached)
    return tokens, pairs, prompts


def profile(points, version: int = 3) -> dict:
    decode = [{"batch": b, "context_tokens": b * c, "time_s": 6e-3 + 2e-5 * b + 6e-8 * b * c}
              for b in (1, 16, 64) for c in (256, 2048)]
    return {"version": version, "model": "qwen3-8b", "gpu": "h200", "decode": decode,
            "prefill": points}


def points_of(tokens, pairs, prompts, times) -> list[dict]:
    return [{"new_tokens": int(t) / int(r), "requests": int(r), "attention_pairs": int(a),
             "time_s": float(s)} for t, a, r, s in zip(tokens, pairs, prompts, times)]


def test_nonnegative_least_squares_meets_its_optimality_conditions():
    rng = np.random.default_rng(3)
    for _ in range(50):
        matrix, target = rng.standard_normal((30, 5)), rng.standard_normal(30)
        solution = nonnegative_least_squares(matrix, target)
        gradient = matrix.T @ (matrix @ solution - target)
        assert (solution >= 0).all()
        # Karush-Kuhn-Tucker: no descent along a free coefficient, none into a bound one.
        assert np.allclose(gradient[solution > 0], 0, atol=1e-9)
        assert (gradient[solution == 0] >= -1e-9).all()
    matrix = rng.random((20, 3))
    exact = np.array([1.0, 2.0, 0.5])
    assert nonnegative_least_squares(matrix, matrix @ exact) == pytest.approx(exact)


def test_fit_recovers_a_known_prefill_model():
    tokens, pairs, prompts = steps(80, 8192)
    exact = fit_prefill(tokens, pairs, prompts, truth(tokens, pairs, prompts))
    assert exact.per_sequence_s == pytest.approx(PER_SEQUENCE, rel=1e-6)
    assert exact.host_s == pytest.approx(HOST, rel=1e-6)
    assert exact.device_coefficients == pytest.approx(DEVICE, rel=1e-6)
    noisy = truth(tokens, pairs, prompts) * (1 + 0.03 * np.random.default_rng(1).standard_normal(80))
    fit = fit_prefill(tokens, pairs, prompts, noisy)
    assert fit.host_s == pytest.approx(HOST, rel=0.05)
    assert fit.device_coefficients[1] == pytest.approx(DEVICE[1], rel=0.1)
    assert fit.relative_rms_error < 0.04
    assert min(fit.device_coefficients + (fit.host_s, fit.per_sequence_s)) >= 0


def test_long_prompts_are_extrapolated_from_short_ones():
    """The headline case: a profile of mostly short prompts (host-bound) and a few long ones.
    One line through them (version 2) bends to the short ones and predicts a long prompt more
    than 10 % short; the version-3 model stays within 2 %."""
    tokens, pairs, prompts = steps(60, 600)
    long_tokens, long_pairs, long_prompts = steps(4, 6000, seed=2)
    points = points_of(np.r_[tokens, long_tokens], np.r_[pairs, long_pairs],
                       np.r_[prompts, long_prompts],
                       truth(np.r_[tokens, long_tokens], np.r_[pairs, long_pairs],
                             np.r_[prompts, long_prompts]))
    step = [(12_000, 0), (4_000, 0)]  # (new, cached) of two prompts in one step
    expected = float(truth(16_000, 12_000 * 12_001 // 2 + 4_000 * 4_001 // 2, 2))
    line = CalibratedCostModel.from_profile(profile(points, version=2))
    assert line.prefill_time_for(step) < 0.9 * expected
    fitted = CalibratedCostModel.from_profile(profile(points))
    assert fitted.prefill_time_for(step) == pytest.approx(expected, rel=0.02)


def test_old_profiles_keep_their_line_even_a_negative_one():
    """A profile written before version 3 predicts what it always did, negative terms
    included; the same points as version 3 get a non-negative fit."""
    tokens, pairs, prompts = steps(40, 600)
    points = points_of(tokens, pairs, prompts, truth(tokens, pairs, prompts))
    old = CalibratedCostModel.from_profile(profile(points, version=2)).prefill_fit
    assert old.host_s == close(0.0) and old.per_sequence_s == close(0.0)
    assert min(old.device_coefficients) < 0  # short prompts only: the line tilts
    new = CalibratedCostModel.from_profile(profile(points)).prefill_fit
    assert min(new.device_coefficients + (new.host_s, new.per_sequence_s)) >= 0


def test_one_prompt_per_step_fits_no_per_sequence_term():
    tokens, pairs, _ = steps(30, 8192)
    prompts = np.ones(30, dtype=int)
    fit = fit_prefill(tokens, pairs, prompts, truth(tokens, pairs, prompts))
    assert fit.per_sequence_s == close(0.0)
    assert fit.host_s == pytest.approx(HOST + PER_SEQUENCE, rel=1e-6)


def test_two_prompt_counts_fit_no_per_sequence_term():
    """Steps of one and two prompts cannot pin a per-prompt cost down for steps of a hundred
    (MIN_PROMPT_COUNTS); three counts can."""
    tokens, pairs, _ = steps(30, 8192)
    two = np.where(np.arange(30) % 6 == 0, 2, 1)
    assert fit_prefill(tokens, pairs, two, truth(tokens, pairs, two)).per_sequence_s == close(0.0)
    three = np.where(np.arange(30) % 6 == 0, 2, np.where(np.arange(30) % 6 == 1, 4, 1))
    fit = fit_prefill(tokens, pairs, three, truth(tokens, pairs, three))
    assert fit.per_sequence_s == pytest.approx(PER_SEQUENCE, rel=1e-6)


def test_too_few_prefill_points_are_refused():
    tokens, pairs, prompts = steps(5, 8192)
    points = points_of(tokens, pairs, prompts, truth(tokens, pairs, prompts))
    with pytest.raises(ConfigError, match="prefill: 5 point"):
        CalibratedCostModel.from_profile(profile(points))


def test_mixed_steps_pay_the_host_bound_and_the_per_chunk_cost():
    tokens, pairs, prompts = steps(40, 8192)
    model = CalibratedCostModel.from_profile(
        profile(points_of(tokens, pairs, prompts, truth(tokens, pairs, prompts))))
    # One decode and a 16-token chunk: device work far below the host-bound time.
    small = model.forward_time_for(StepWork.from_counts(1, 100, [(16, 0)]))
    assert small >= HOST + PER_SEQUENCE - 1e-12
    large = StepWork.from_counts(8, 8000, [(4000, 0), (4000, 0)])
    device = model.mixed_fit.predict(8, 8000, 8000, large.attention_pairs)
    assert model.forward_time_for(large) == pytest.approx(device + 2 * PER_SEQUENCE, rel=1e-9)


def test_a_gzipped_profile_loads(tmp_path):
    tokens, pairs, prompts = steps(40, 8192)
    data = profile(points_of(tokens, pairs, prompts, truth(tokens, pairs, prompts)))
    path = tmp_path / "profile.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    assert CalibratedCostModel.from_profile(path).prefill_fit.host_s == pytest.approx(HOST)
    (tmp_path / "broken.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ConfigError, match="not a readable JSON file"):
        CalibratedCostModel.from_profile(tmp_path / "broken.json.gz")


def test_calibrate_prints_the_prefill_model(tmp_path, capsys):
    tokens, pairs, prompts = steps(40, 8192)
    data = profile(points_of(tokens, pairs, prompts, truth(tokens, pairs, prompts)))
    assert save_profile(data, str(tmp_path / "p.json")) == 0  # what `zipage calibrate` runs
    printed = capsys.readouterr().out
    assert "prefill  0.0002 * requests + max(0.026, 0.009 + 2.1e-05 * new_tokens" in printed


def test_a_device_bound_profile_is_one_line():
    """Without host-bound steps (synthesize_profile's analytic costs, say) the fit is the line
    with its per-sequence term, and the host bound never binds."""
    tokens, pairs, prompts = steps(30, 8192)
    line = DEVICE[0] + DEVICE[1] * tokens + DEVICE[2] * pairs + PER_SEQUENCE * prompts
    fit = fit_prefill(tokens, pairs, prompts, line)
    assert fit.device_coefficients == pytest.approx(DEVICE, rel=1e-6)
    assert fit.per_sequence_s == pytest.approx(PER_SEQUENCE, rel=1e-6)
    # No point is host-bound, so the host time is only known not to bind anywhere.
    assert fit.host_s <= min(fit.device_time(t, a) for t, a in zip(tokens, pairs)) * (1 + 1e-9)
    assert fit.relative_rms_error < 1e-9


EAGER_PROFILE = (Path(__file__).parent
                 / "golden/profiles/eager-prefill/qwen3-0.6b-h200-b64-k512-zipage.json")


@pytest.mark.parametrize("ulps", [-3, -1, 1, 2, 5])
def test_a_tie_between_supports_does_not_follow_the_last_bit(ulps, monkeypatch):
    """Three device-bound points of that profile share one prompt length, so the constant and
    the per-token cost fit them equally well, and two supports of the non-negative least squares
    tie to the last bit. lstsq rounds differently on another CPU (its BLAS kernel); a last-bit
    change must not pick the other support, whose model predicts steps up to 4 % apart."""
    model = CalibratedCostModel.from_profile(EAGER_PROFILE)
    steps_ = [[(512, 0)], [(2048, 0)], [(128, 3000)], [(64, 0)] * 8, [(4000, 0), (300, 100)]]
    expected = [model.prefill_time_for(step) for step in steps_]
    lstsq = np.linalg.lstsq

    def shifted(*args, **kwargs):
        solution, *rest = lstsq(*args, **kwargs)
        return (solution * (1.0 + ulps * 2.0**-52), *rest)

    monkeypatch.setattr(np.linalg, "lstsq", shifted)
    shifted_model = CalibratedCostModel.from_profile(EAGER_PROFILE)
    assert_close([shifted_model.prefill_time_for(step) for step in steps_], expected)
