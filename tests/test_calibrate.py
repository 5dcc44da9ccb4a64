"""`zipage calibrate`: the engine's measured step times become a profile the simulator accepts.

Run on the CPU with the tiny model (the GPU run is the same code on CUDA tensors): every section is
measured at the points it names, the profile passes the calibrated cost model's checks for the
same knobs (and is refused for others), a simulation with it completes, and the command line
fails clearly where it cannot work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_engine import tiny_model  # noqa: E402,F401
from zipage.core.config import ZipageConfig  # noqa: E402
from zipage.engine.calibrate import calibrate  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402
from zipage.presets import resolve_shape  # noqa: E402
from zipage.deployment import ReplaySettings  # noqa: E402
from zipage.sim.cost_model import CalibratedCostModel  # noqa: E402
from zipage.sim.hardware import get_hardware  # noqa: E402

KNOBS = dict(block_size=16, window=4, kv_budget=64)


@pytest.fixture(scope="module")
def profile(tiny_model):  # noqa: F811
    directory, _ = tiny_model
    settings = ReplaySettings(model=str(directory), kv_memory_gb=0.01,
                              config=ZipageConfig(**KNOBS))
    return calibrate(settings, "cpu", hardware="h200", repeats=1)


def test_profile_has_every_section_measured(profile):
    assert profile["source"] == "measured" and profile["gpu"] == "h200-141gb"
    assert {key: profile[key] for key in KNOBS} == KNOBS
    decode = profile["decode"]
    # Three contexts (one block, half the budget, just under N_max blocks) x several batches.
    assert len({row["context_tokens"] // row["batch"] for row in decode}) == 3
    assert len({row["batch"] for row in decode}) >= 4
    assert {(row["requests"], row["cached_tokens"] > 0) for row in profile["prefill"]} >= {
        (1, False), (1, True), (4, False)}
    n_max = KNOBS["kv_budget"] // KNOBS["block_size"] + 1
    assert {row["blocks"] // row["requests"] for row in profile["compress"]} == {n_max, 2 * n_max}
    rows = decode + profile["prefill"] + profile["compress"]
    assert all(row["time_s"] > 0 for row in rows)
    # Measured, not defaulted; its value means nothing on the CPU, where an async batch runs
    # inside the step that launches it.
    assert "contention_factor" in profile and 1.0 <= profile["contention_factor"] < float("inf")


def test_simulator_accepts_the_profile_for_the_same_setup_only(profile, tiny_model, tmp_path):  # noqa: F811
    directory, _ = tiny_model
    path = tmp_path / "tiny-h200.json"
    path.write_text(json.dumps(profile))
    shape = resolve_shape(str(directory))
    model = CalibratedCostModel.from_profile(path, shape=shape, gpu=get_hardware("h200"), **KNOBS)
    assert model.compress_time_for([5, 5]) > 0
    with pytest.raises(ConfigError, match="block_size"):
        CalibratedCostModel.from_profile(path, shape=shape, gpu=get_hardware("h200"),
                                         **dict(KNOBS, block_size=32))
    from zipage.sim.simulate import simulate
    from zipage.workloads import make_trace

    trace = make_trace("amc23", 0, num_questions=2, samples_per_question=2, max_output_len=100)
    settings = ReplaySettings(model=str(directory), hardware="h200", kv_memory_gb=0.01,
                              cost_model=str(path), config=ZipageConfig(**KNOBS))
    summary, _ = simulate(trace, settings)
    assert summary["completed"] == 4 and summary["makespan_s"] > 0


def test_cli_writes_a_profile_and_refuses_what_it_cannot_do(tiny_model, tmp_path):  # noqa: F811
    directory, _ = tiny_model
    out = tmp_path / "profile.json"
    base = [sys.executable, "-m", "zipage.cli", "calibrate", "--model", str(directory),
            "--block-size", "16", "--window", "4", "--budget", "64", "--kv-memory-gb", "0.01",
            "--repeats", "1", "--out", str(out)]
    done = subprocess.run(base + ["--engine", "cpu", "--hardware", "h100"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["gpu"] == "h100-80gb"
    assert "relative RMS error" in done.stdout
    no_label = subprocess.run(base + ["--engine", "cpu"], capture_output=True, text=True)
    assert no_label.returncode == 2 and "--hardware" in no_label.stderr
    if not torch.cuda.is_available():
        no_gpu = subprocess.run(base + ["--gpu"], capture_output=True, text=True)
        assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr
