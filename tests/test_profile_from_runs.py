"""`zipage calibrate --from-run`: a cost profile fitted from run directories' steps."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from zipage.core.config import ZipageConfig
from zipage.core.metrics import STEP_COLUMN_DEFAULTS, STEP_COLUMNS
from zipage.deployment import ReplaySettings
from zipage.errors import ConfigError
from zipage.sim.cost_model import CalibratedCostModel
from zipage.sim.profile_from_runs import profile_from_runs

DECODE = (2e-3, 1e-5, 2e-8)  # seconds: constant, per request, per context token
PREFILL = (5e-3, 2e-6, 1e-10)  # constant, per new token, per attention pair
MIXED = (6e-3,) + DECODE[1:] + PREFILL[1:]  # its own constant, the parts' per-unit costs
COMPRESS = (1e-3, 4e-5)  # constant, per source block


def step_kind(step_id: int) -> str:
    return {0: "prefill", 3: "mixed", 7: "mixed"}.get(step_id % 10, "decode")


def compresses(step_id: int) -> bool:
    """A decode step in ten and a mixed step in twenty compress."""
    return step_id % 10 == 5 or step_id % 20 == 7


def synthetic_run(directory, asynchronous: bool, seed: int = 0):
    """A run directory whose step times follow known linear costs exactly."""
    rng = np.random.default_rng(seed)
    rows, t = [], 0.0
    for step_id in range(300):
        kind = step_kind(step_id)
        batch, context = int(rng.integers(1, 64)), int(rng.integers(100, 100_000))
        new, pairs = int(rng.integers(16, 4096)), int(rng.integers(1_000, 10_000_000))
        blocks = int(rng.integers(9, 200)) if compresses(step_id) else 0
        if blocks:  # inside the clean steps' range: a fit never extrapolates below its fastest
            context += 100_000  # point (the floor), which would blur the subtraction
        decodes, prefills = kind != "prefill", kind != "decode"
        if kind == "prefill":
            duration = PREFILL[0] + PREFILL[1] * new + PREFILL[2] * pairs
        elif kind == "decode":
            duration = DECODE[0] + DECODE[1] * batch + DECODE[2] * context
        else:
            duration = (MIXED[0] + MIXED[1] * batch + MIXED[2] * context + MIXED[3] * new
                        + MIXED[4] * pairs)
        if compresses(step_id) and not asynchronous:
            duration += COMPRESS[0] + COMPRESS[1] * blocks
        rows.append(dict(STEP_COLUMN_DEFAULTS, step_id=step_id, t_start=t, t_end=t + duration,
                         kind=kind,
                         n_prefill=int(prefills), n_decode=batch if decodes else 0,
                         n_compress=int(compresses(step_id)), n_running=batch, n_waiting=0,
                         blocks_used=0, blocks_total=1000, slots_used=0, preempted=0,
                         prefill_tokens=new if prefills else 0,
                         decode_context_tokens=context if decodes else 0,
                         batches_done=int(compresses(step_id) and asynchronous),
                         attention_pairs=pairs if prefills else 0,
                         compress_blocks=blocks))
        t += duration
    directory.mkdir()
    pd.DataFrame(rows)[STEP_COLUMNS].to_csv(directory / "steps.csv", index=False)
    settings = ReplaySettings(model="qwen3-8b", hardware="h200",
                              config=ZipageConfig(async_compress=asynchronous))
    (directory / "summary.json").write_text(json.dumps({"driver": "engine-cuda",
                                                        "settings": settings.to_dict()}))
    return directory


def test_fit_recovers_the_costs_of_sync_runs(tmp_path):
    profile = profile_from_runs([synthetic_run(tmp_path / "a", False),
                                 synthetic_run(tmp_path / "b", False, seed=1)])
    model = CalibratedCostModel.from_profile(profile)
    assert model.decode_fit.coefficients == pytest.approx(DECODE, rel=1e-6)
    assert model.prefill_fit.device_coefficients == pytest.approx(PREFILL, rel=1e-6)
    assert model.mixed_fit.coefficients == pytest.approx(MIXED, rel=1e-6)
    assert model.compress_fit.coefficients == pytest.approx(COMPRESS, rel=1e-6)
    assert profile["gpu"] == "h200" and profile["block_size"] == 256
    clean = [step_kind(i) for i in range(300) if not compresses(i)]
    for kind in ("decode", "prefill", "mixed"):
        assert len(profile[kind]) == 2 * clean.count(kind)
    assert len(profile["compress"]) == 2 * sum(map(compresses, range(300)))


def test_runs_without_mixed_steps_give_a_profile_without_mixed_points(tmp_path):
    run = synthetic_run(tmp_path / "a", False)
    steps = pd.read_csv(run / "steps.csv")
    steps[steps["kind"] != "mixed"].to_csv(run / "steps.csv", index=False)
    profile = profile_from_runs([run])
    assert "mixed" not in profile
    # The one-forward assumption then times a mixed step (docs/cost_model.md).
    assert CalibratedCostModel.from_profile(profile).mixed_fit.num_points == 0


def test_async_batches_and_contention(tmp_path):
    profile = profile_from_runs([synthetic_run(tmp_path / "a", True)], gpu="h200-141gb")
    # The launching step overlaps its own batch; it completes within it here: no contention.
    assert profile["contention_factor"] == pytest.approx(1.0)
    assert all(row["time_s"] > 0 for row in profile["compress"])
    assert profile["gpu"] == "h200-141gb"


def test_steps_that_overlap_a_batch_measure_contention_whatever_their_kind(tmp_path):
    run = synthetic_run(tmp_path / "a", True)
    steps = pd.read_csv(run / "steps.csv")
    # Each batch now completes one step after its launch, and both steps run 1.5 times slower.
    launches = steps.index[steps["n_compress"] > 0]
    overlapped = launches.union(launches + 1)
    steps["batches_done"] = 0
    steps.loc[launches + 1, "batches_done"] = 1
    duration = (steps["t_end"] - steps["t_start"]).where(~steps.index.isin(overlapped),
                                                        1.5 * (steps["t_end"] - steps["t_start"]))
    steps["t_end"] = duration.cumsum()
    steps["t_start"] = steps["t_end"] - duration
    steps.to_csv(run / "steps.csv", index=False)
    assert set(steps.loc[overlapped, "kind"]) == {"decode", "mixed"}
    profile = profile_from_runs([run])
    assert profile["contention_factor"] == pytest.approx(1.5)
    clean = steps.drop(index=overlapped)
    for kind in ("decode", "prefill", "mixed"):
        assert len(profile[kind]) == (clean["kind"] == kind).sum()
    assert CalibratedCostModel.from_profile(profile).mixed_fit.coefficients == pytest.approx(
        MIXED, rel=1e-6)


def test_runs_of_different_setups_are_refused(tmp_path):
    sync, other = synthetic_run(tmp_path / "a", False), synthetic_run(tmp_path / "b", False)
    summary = json.loads((other / "summary.json").read_text())
    summary["settings"]["config"]["block_size"] = 128
    summary["settings"]["config"]["kv_budget"] = 2048
    (other / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="block_size"):
        profile_from_runs([sync, other])
    with pytest.raises(ConfigError, match="--from-run"):
        profile_from_runs([tmp_path / "missing"])
