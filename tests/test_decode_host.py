"""The calibrated decode fit's host floor (sim/decode_host.py): max(h, device line) where the
points determine it, the line as before where they do not."""

from __future__ import annotations

import numpy as np
import pytest
from tolerance import close

from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_model import StepWork
from zipage.sim.decode_host import MIN_REGIME_POINTS, DecodeFit
from zipage.sim.linear_fit import LinearFit

HOST = 2.7e-3  # the host's time of a step (a small model on an H200, through the engine loop)
DEVICE = (1.6e-3, 3.4e-5, 2.6e-8)  # constant, per request, per KV entry
EXCESS = 5.5e-7  # per entry the longest request holds beyond the mean
SHARED = -1.0e-8  # a shared entry's saving (cheaper than an unshared one, not free)


def device_time(batch: int, context: int, longest: int, shared: int = 0) -> float:
    constant, per_request, per_entry = DEVICE
    excess = max(0.0, longest - context / batch)
    return constant + per_request * batch + per_entry * context + EXCESS * excess \
        + SHARED * shared


def profile(points: list[dict]) -> dict:
    prefill = [{"new_tokens": new, "time_s": 3e-3 + 2e-6 * new}
               for new in (64, 256, 512, 2048, 8192)]
    prefill += [{"new_tokens": 128, "requests": 4, "time_s": 4e-3}]
    return {"version": 3, "model": "qwen3-0.6b", "gpu": "h200-141gb", "dtype": "bfloat16",
            "block_size": 64, "decode": points, "prefill": prefill}


def loop_points(truth, shared: bool = False) -> list[dict]:
    """Decode steps as the engine loop sees them: batches 1 to 96, balanced and not, some
    sharing prefix blocks; `truth` prices each."""
    points = []
    for batch in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96):
        for mean in (300, 550, 900):
            for extra in (0, 1500, 4000):
                context = batch * mean
                longest = mean + extra if batch > 1 else mean
                share = context // 3 if shared and batch > 1 and extra == 1500 else 0
                point = {"batch": batch, "context_tokens": context, "max_context": longest,
                         "time_s": truth(batch, context, longest, share)}
                if share:
                    point["shared_tokens"] = share
                points.append(point)
    return points


def host_bound(batch, context, longest, shared=0) -> float:
    return max(HOST, device_time(batch, context, longest, shared))


def test_a_host_bound_decode_truth_is_recovered_exactly():
    points = loop_points(host_bound)
    host = sum(1 for point in points if point["time_s"] == HOST)  # deliberately exact: max
    assert min(host, len(points) - host) >= MIN_REGIME_POINTS  # both regimes determined
    model = CalibratedCostModel.from_profile(profile(points))
    fit = model.decode_fit
    assert isinstance(fit, DecodeFit)
    assert fit.feature_names == ("constant", "batch", "context_tokens", "longest_excess")
    assert fit.host_s == close(HOST)
    assert fit.coefficients == pytest.approx(DEVICE + (EXCESS,), rel=1e-6)
    assert fit.relative_rms_error < 1e-9
    # A small balanced step costs the host's time, a large one its device line.
    assert model.decode_time_for(4, 4 * 500, max_context=500) == close(HOST)
    assert model.decode_time_for(80, 80 * 700, max_context=4700) == pytest.approx(
        device_time(80, 80 * 700, 4700), rel=1e-6)
    assert "max(0.0027, " in fit.describe()


def test_a_shared_saving_is_recovered_under_the_host_floor():
    model = CalibratedCostModel.from_profile(profile(loop_points(host_bound, shared=True)))
    fit = model.decode_fit
    assert fit.feature_names[-1] == "shared_tokens"
    assert fit.host_s == close(HOST)
    assert fit.coefficients == pytest.approx(DEVICE + (EXCESS, SHARED), rel=1e-6)
    work = StepWork(64, 64 * 900, decode_max_context=900, shared_kv_tokens=64 * 300)
    assert model.forward_time_for(work) == pytest.approx(
        device_time(64, 64 * 900, 900, 64 * 300), rel=1e-6)


def test_a_profile_that_is_never_host_bound_keeps_its_line():
    # Device-bound everywhere: the line is the truth, and its fit is what it always was.
    points = loop_points(lambda *step: device_time(*step) + 1e-3)
    fit = CalibratedCostModel.from_profile(profile(points)).decode_fit
    assert type(fit) is LinearFit
    assert fit.coefficients == pytest.approx((DEVICE[0] + 1e-3,) + DEVICE[1:] + (EXCESS,),
                                             rel=1e-6)
    # Noisy device-bound points: a host bound would fit a few of the fastest to their noise.
    rng = np.random.default_rng(3)
    for point in points:
        point["time_s"] *= 1 + 0.02 * rng.standard_normal()
    assert type(CalibratedCostModel.from_profile(profile(points)).decode_fit) is LinearFit


def test_too_few_points_on_either_side_keep_the_line():
    # A grid profile's few dozen points, host-bound or not, cannot determine the bound.
    grid = [point for point in loop_points(host_bound)
            if point["max_context"] == point["context_tokens"] // point["batch"]]
    assert len(grid) < 2 * MIN_REGIME_POINTS
    assert type(CalibratedCostModel.from_profile(profile(grid)).decode_fit) is LinearFit
    # Many points, nearly all host-bound: the device line is not determined.
    flat = [dict(point, time_s=HOST) for point in loop_points(host_bound)]
    for point in flat[:MIN_REGIME_POINTS - 1]:
        point["time_s"] = 2 * HOST
    assert type(CalibratedCostModel.from_profile(profile(flat)).decode_fit) is LinearFit
