"""The decode fit's longest request priced over its decode partitions (a profile's
`decode_excess: "per_partition"`, docs/cost_model.md 'Decode: the longest request'): the split-K
kernel cuts each sequence into `decode_num_partitions(batch)` partitions, so a long request
beside few short ones costs its excess over the mean divided by those partitions, not per entry.
Profiles without the field price and fit as before."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_profile_from_runs import DECODE, synthetic_steps, write_run
from tolerance import close

from zipage.decode_grid import decode_num_partitions, programs_per_sm
from zipage.errors import ConfigError
from zipage.profile import DECODE_PROGRAMS_PER_SM
from zipage.sim.calibrated import (
    LONGEST_EXCESS,
    PARTITION_EXCESS,
    CalibratedCostModel,
    DecodePartitions,
    decode_partitions,
    partition_geometry_known,
)
from zipage.sim.profile_from_runs import profile_from_runs

DEVICE = (5.5e-3, 2e-5, 3.5e-8)  # constant, per request, per KV entry (an 8B on an H200)
EXCESS = 1.0e-6  # per entry of the longest request's partition beyond the mean
KV_HEADS, SMS = 8, 132  # Qwen3-8B's KV heads, the H200's streaming multiprocessors


def partitions(batch: int) -> int:
    return decode_num_partitions(batch, KV_HEADS, SMS)


def per_partition(batch: int, context: int, longest: int) -> float:
    constant, per_request, per_entry = DEVICE
    excess = max(0.0, longest - context / batch)
    return constant + per_request * batch + per_entry * context + EXCESS * excess / partitions(batch)


def decode_points(law) -> list[dict]:
    """Decode steps from batch 1 to 128, balanced and with one request 2k-16k entries beyond
    the mean, timed by `law`."""
    points = []
    for batch in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
        for mean in (300, 600, 1200):
            for extra in (0, 2000, 6000, 16000):
                longest = mean + extra if batch > 1 else mean
                context = batch * mean + (longest - mean)
                points.append({"batch": batch, "context_tokens": context, "max_context": longest,
                               "time_s": law(batch, context, longest)})
    return points


def profile(points: list[dict], **header) -> dict:
    prefill = [{"new_tokens": new, "time_s": 10e-3 + 2e-5 * new}
               for new in (64, 256, 512, 2048, 8192)]
    prefill += [{"new_tokens": 128, "requests": 4, "time_s": 12e-3}]
    return {"version": 3, "model": "qwen3-8b", "gpu": "h200-141gb", "dtype": "bfloat16",
            "block_size": 64, **header, "decode": points, "prefill": prefill}


def test_the_partitions_follow_the_kernels_grid():
    counts = DecodePartitions(KV_HEADS, SMS)
    assert [counts(batch) for batch in (1, 2, 4, 16, 33, 34, 256)] == [66, 33, 16, 4, 2, 1, 1]


def test_a_profile_counts_the_partitions_of_the_grid_it_was_measured_on():
    # A profile records the programs an SM its engine's grid aimed for (decode_programs_per_sm: 5 with the fp8
    # launch, 660 on 132 SMs; 4 with bfloat16's, 528), and one written before the field ran the grid of 4 whatever
    # its dtype.
    fp8 = DecodePartitions(KV_HEADS, SMS, 5)
    assert [fp8(batch) for batch in (1, 2, 4, 16, 40, 82, 83)] == [82, 41, 20, 5, 2, 1, 1]
    header = {"model": "qwen3-8b", "gpu": "h200-141gb", "kv_cache_dtype": "fp8"}
    assert decode_partitions("profile", header)(40) == 1
    assert decode_partitions("profile", header | {DECODE_PROGRAMS_PER_SM: programs_per_sm("fp8")})(40) == 2


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "3"])
def test_a_profile_grid_must_be_a_positive_integer(value):
    data = profile(decode_points(per_partition), decode_excess="per_partition")
    data[DECODE_PROGRAMS_PER_SM] = value
    with pytest.raises(ConfigError, match=f"{DECODE_PROGRAMS_PER_SM}: got"):
        CalibratedCostModel.from_profile(data)


def test_a_per_partition_law_is_recovered_and_priced_below_per_entry_at_small_batches():
    model = CalibratedCostModel.from_profile(
        profile(decode_points(per_partition), decode_excess="per_partition"))
    fit = model.decode_fit
    assert fit.feature_names == ("constant", "batch", "context_tokens", PARTITION_EXCESS)
    assert fit.coefficients == pytest.approx(DEVICE + (EXCESS,), rel=1e-6)
    assert fit.relative_rms_error < 1e-9
    assert "partition_excess" in fit.describe()
    # A 16k-entry request beside a short one at batch 2: 33 partitions share its excess.
    line = DEVICE[0] + DEVICE[1] * 2 + DEVICE[2] * 16_500
    excess = 16_000 - 16_500 / 2
    priced = model.decode_time_for(2, 16_500, max_context=16_000)
    assert priced == pytest.approx(line + EXCESS * excess / 33, rel=1e-6)
    assert priced < line + EXCESS * excess  # what one cost per entry would charge
    # From batch 34 on a sequence has one partition: the two forms agree.
    assert model.decode_time_for(64, 64 * 500 + 8000, max_context=8500) == pytest.approx(
        DEVICE[0] + DEVICE[1] * 64 + DEVICE[2] * (64 * 500 + 8000)
        + EXCESS * (8500 - (64 * 500 + 8000) / 64), rel=1e-6)
    # The same points fitted per entry cannot follow the law.
    entry = CalibratedCostModel.from_profile(profile(decode_points(per_partition))).decode_fit
    assert entry.feature_names[-1] == LONGEST_EXCESS
    assert entry.relative_rms_error > 0.01


def test_without_the_field_a_profile_fits_and_prices_per_entry_as_before():
    def per_entry(batch: int, context: int, longest: int) -> float:
        return (DEVICE[0] + DEVICE[1] * batch + DEVICE[2] * context
                + EXCESS * max(0.0, longest - context / batch))

    points = decode_points(per_entry)
    plain = CalibratedCostModel.from_profile(profile(points))
    named = CalibratedCostModel.from_profile(profile(copy.deepcopy(points),
                                                     decode_excess="per_entry"))
    assert plain.decode_partitions is None and named.decode_partitions is None
    for model in (plain, named):
        assert model.decode_fit.feature_names[-1] == LONGEST_EXCESS
        assert model.decode_fit.coefficients == pytest.approx(DEVICE + (EXCESS,), rel=1e-6)
    for batch, context, longest in ((1, 9000, 9000), (2, 16_500, 16_000), (64, 40_000, 8500)):
        assert named.decode_time_for(batch, context, max_context=longest) == close(
            plain.decode_time_for(batch, context, max_context=longest))


def test_a_bad_field_or_unknown_partitions_are_refused():
    points = decode_points(per_partition)
    with pytest.raises(ConfigError, match="decode_excess: got 'per_block'"):
        CalibratedCostModel.from_profile(profile(points, decode_excess="per_block"))
    unknown = dict(profile(points, decode_excess="per_partition"), model="my-own-model")
    with pytest.raises(ConfigError, match="decode_excess.*partitions"):
        CalibratedCostModel.from_profile(unknown)
    # So a writer sets the field only where the header names known partitions.
    assert not partition_geometry_known(unknown)
    assert partition_geometry_known(profile(points))


def partition_run(directory, seed: int = 0):
    """A sync run (test_profile_from_runs' synthetic steps) whose decode steps hold one request
    0-16k entries beyond their mean, priced per partition on top of their forward."""
    steps = synthetic_steps(seed)
    rng = np.random.default_rng(seed + 100)
    for step in steps:
        if step["kind"] != "decode":
            continue
        batch, context = step["n_decode"], step["decode_context_tokens"]
        mean = context // batch
        longest = mean + int(rng.choice((0, 2000, 6000, 16000))) if batch > 1 else context
        step["decode_max_context"] = longest
        step["forward"] += EXCESS * max(0.0, longest - context / batch) / partitions(batch)
    durations = [step["forward"] + (1e-3 + 4e-5 * step["compress_blocks"]
                                    if step["compress_blocks"] else 0.0) for step in steps]
    return write_run(directory, steps, durations, asynchronous=False)


def test_a_fit_from_runs_writes_the_field_and_recovers_a_per_partition_law(tmp_path):
    fitted = profile_from_runs([partition_run(tmp_path / "a"), partition_run(tmp_path / "b", 1)])
    assert fitted["decode_excess"] == "per_partition"  # qwen3-8b on the h200: known partitions
    model = CalibratedCostModel.from_profile(fitted)
    assert model.decode_fit.feature_names[-1] == PARTITION_EXCESS
    assert model.decode_fit.coefficients == pytest.approx(DECODE + (EXCESS,), rel=1e-6)
    # The compressions are residuals over that decode model: their costs come back too.
    assert model.compress_fit.coefficients == pytest.approx((1e-3, 4e-5), rel=1e-6)
