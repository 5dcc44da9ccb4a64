"""`zipage calibrate --from-run`: a cost profile fitted from run directories' steps."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from zipage.core.config import ZipageConfig
from zipage.core.metrics import STEP_COLUMNS
from zipage.deployment import ReplaySettings
from zipage.errors import ConfigError
from zipage.sim.cost_model import CalibratedCostModel
from zipage.sim.profile_from_runs import profile_from_runs

DECODE = (2e-3, 1e-5, 2e-8)  # seconds: constant, per request, per context token
PREFILL = (5e-3, 2e-6, 1e-10)  # constant, per new token, per attention pair
COMPRESS = (1e-3, 4e-5)  # constant, per source block


def synthetic_run(directory, asynchronous: bool, seed: int = 0):
    """A run directory whose step times follow known linear costs exactly."""
    rng = np.random.default_rng(seed)
    rows, t = [], 0.0
    for step_id in range(300):
        kind = "prefill" if step_id % 10 == 0 else "decode"
        batch, context = int(rng.integers(1, 64)), int(rng.integers(100, 100_000))
        new, pairs = int(rng.integers(16, 4096)), int(rng.integers(1_000, 10_000_000))
        compresses = kind == "decode" and step_id % 10 == 5
        blocks = int(rng.integers(9, 200)) if compresses else 0
        if kind == "prefill":
            duration = PREFILL[0] + PREFILL[1] * new + PREFILL[2] * pairs
        else:
            duration = DECODE[0] + DECODE[1] * batch + DECODE[2] * context
            if compresses and not asynchronous:
                duration += COMPRESS[0] + COMPRESS[1] * blocks
        rows.append(dict(step_id=step_id, t_start=t, t_end=t + duration, kind=kind,
                         n_prefill=int(kind == "prefill"), n_decode=batch if kind == "decode" else 0,
                         n_compress=int(compresses), n_running=batch, n_waiting=0, blocks_used=0,
                         blocks_total=1000, slots_used=0, preempted=0,
                         prefill_tokens=new if kind == "prefill" else 0,
                         decode_context_tokens=context if kind == "decode" else 0,
                         batches_done=int(compresses and asynchronous),
                         attention_pairs=pairs if kind == "prefill" else 0,
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
    assert model.prefill_fit.coefficients == pytest.approx(PREFILL, rel=1e-6)
    assert model.compress_fit.coefficients == pytest.approx(COMPRESS, rel=1e-6)
    assert profile["gpu"] == "h200" and profile["block_size"] == 256
    assert len(profile["decode"]) == 2 * 240 and len(profile["compress"]) == 2 * 30


def test_async_batches_and_contention(tmp_path):
    profile = profile_from_runs([synthetic_run(tmp_path / "a", True)], gpu="h200-141gb")
    # The launching step overlaps its own batch; it completes within it here: no contention.
    assert profile["contention_factor"] == pytest.approx(1.0)
    assert all(row["time_s"] > 0 for row in profile["compress"])
    assert profile["gpu"] == "h200-141gb"


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
