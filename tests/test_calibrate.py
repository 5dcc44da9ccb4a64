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

from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.deployment import ReplaySettings  # noqa: E402
from zipage.engine.calibrate import calibrate  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402
from zipage.hardware import get_hardware  # noqa: E402
from zipage.model_spec import resolve_shape  # noqa: E402
from zipage.sim.calibrated import CalibratedCostModel  # noqa: E402

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
        (1, False), (1, True), (4, False), (16, False)}
    n_max = KNOBS["kv_budget"] // KNOBS["block_size"] + 1
    assert {row["blocks"] // row["requests"] for row in profile["compress"]} == {n_max, 2 * n_max}
    rows = decode + profile["prefill"] + profile["compress"]
    assert all(row["time_s"] > 0 for row in rows)
    # Measured, not defaulted; its value means nothing on the CPU, where an async batch runs
    # inside the step that launches it.
    assert "contention_factor" in profile and 1.0 <= profile["contention_factor"] < float("inf")


def test_profile_measures_mixed_steps(profile):
    assert "mixed" in profile, profile["note"]  # the engine executes mixed steps
    mixed = profile["mixed"]
    # Decode batches at two contexts, each with the first and the last chunk of a prompt.
    assert len({row["batch"] for row in mixed}) >= 2
    assert len({row["context_tokens"] // row["batch"] for row in mixed}) == 2
    assert len({row["new_tokens"] for row in mixed}) >= 2
    assert {row["cached_tokens"] > 0 for row in mixed} == {False, True}
    assert all(row["time_s"] > 0 for row in mixed)
    # The mixed fit uses every point. (Its constant's sign is not asserted: one repeat of a
    # CPU step on a busy 2-core machine is too noisy for that.)
    fit = CalibratedCostModel.from_profile(profile).mixed_fit
    assert fit.num_points == len(mixed)


class MixedStepRunner:
    """Stands in for a runner that executes mixed plans (until the engine's is merged): checks
    what a real one would need of each plan and answers the tokens a real one samples."""

    device = torch.device("cpu")

    def __init__(self, config: ZipageConfig) -> None:
        self.config, self.plans = config, []

    def execute(self, plan, tokens):
        block_size = self.config.block_size
        sequences = [item.seq for item in plan.prefill] + plan.decode
        for item in plan.prefill:
            assert len(item.seq.block_table) * block_size > item.num_tokens
            assert len(tokens[item.seq.seq_id]) >= item.seq.prompt_len >= item.num_tokens
        for seq in plan.decode:
            assert len(seq.block_table) * block_size > seq.kv_len
        slots = [seq.query_slot for seq in sequences]
        assert len(set(slots)) == len(slots)  # no query slot shared in a step
        blocks = [block for seq in sequences for block in seq.block_table]
        assert len(set(blocks)) == len(blocks)
        self.plans.append(plan)
        return [(seq, 0) for seq in plan.sampled]


def _mixed_step_bench():
    """A `Bench` on a `MixedStepRunner` (2,000 blocks, 80 query slots), and the runner."""
    from types import SimpleNamespace

    from zipage.core.scheduler import Scheduler
    from zipage.engine.calibrate import Bench

    config = ZipageConfig(**KNOBS, max_model_len=512)
    capacity = SimpleNamespace(num_blocks=2000, num_query_slots=80)
    runner = MixedStepRunner(config)
    engine = SimpleNamespace(config=config, capacity=capacity, runner=runner,
                             new_scheduler=lambda: Scheduler(config, 2000, 80))
    return Bench(engine, repeats=1), runner


def test_mixed_grid_on_an_engine_that_runs_mixed_steps():
    from zipage.core.step import MIXED
    from zipage.engine.calibrate import mixed_points, runs_mixed_steps

    bench, runner = _mixed_step_bench()
    assert runs_mixed_steps(bench) is None
    points = mixed_points(bench)
    assert bench.blocks.num_free_blocks == 2000  # every point frees what it took
    # 3 batches x 2 contexts x 2 chunk sizes (128, and 255: half the longest prompt) x 2 chunks.
    assert len(points) == 24 and all(plan.kind == MIXED for plan in runner.plans[1:])
    profile = {"version": 2, "model": "tiny", "gpu": "h200", "mixed": points,
               "decode": [{"batch": b, "context_tokens": b * c, "time_s": 1e-3 + 1e-6 * b * c}
                          for b in (1, 4, 16) for c in (8, 72)],
               "prefill": [{"new_tokens": n, "time_s": 2e-3 + 1e-6 * n * n} for n in (16, 64,
                                                                                       255)] * 2}
    assert CalibratedCostModel.from_profile(profile).mixed_fit.num_points == 24


def test_chunk_grid_times_many_prompts_in_one_step_beyond_what_the_runs_held():
    """`chunk_points`: prefill steps of 8-64 whole prompts sharing 512 or 2,048 tokens, and mixed
    steps of as many beside 16 decodes, only above the chunk counts the runs reached (what
    `zipage calibrate` adds to a profile fitted through the loop, so the per-chunk term is
    measured where a burst of short prompts lands); none where the engine runs no mixed steps."""
    from zipage.core.step import MIXED, PREFILL
    from zipage.engine.calibrate import chunk_points

    bench, runner = _mixed_step_bench()
    prefill, mixed = chunk_points(bench, above_prefill=8, above_mixed=4)
    assert bench.blocks.num_free_blocks == 2000  # every point frees what it took
    # 16, 32 and 64 prompts of 512 / count and 2,048 / count tokens (at least 16 each).
    assert [(p["requests"], p["new_tokens"]) for p in prefill] == [
        (16, 32), (16, 128), (32, 16), (32, 64), (64, 32)]
    # Beside 16 decodes the full step leaves 2,032 tokens; 64 + 16 requests fill the 80 slots.
    assert [(p["requests"], p["new_tokens"], p["batch"]) for p in mixed] == [
        (8, 64, 16), (8, 254, 16), (16, 32, 16), (16, 127, 16), (32, 16, 16), (32, 63, 16),
        (64, 31, 16)]
    steps = runner.plans
    assert {len(plan.prefill) for plan in steps if plan.kind == PREFILL} == {16, 32, 64}
    assert all(len(plan.decode) == 16 for plan in steps if plan.kind == MIXED)
    assert all(point["time_s"] > 0 for point in prefill + mixed)
    runner.plans.clear()
    assert chunk_points(bench, above_prefill=64, above_mixed=None) == ([], [])
    assert not runner.plans
    # The profile takes them: the prefill fit sees chunk counts 16-64 beside the runs' one.
    rows = [{"new_tokens": n, "requests": 1, "time_s": 2e-3 + 1e-6 * n * n} for n in (16, 64, 255)]
    profile = {"version": 3, "model": "tiny", "gpu": "h200", "prefill": rows * 2 + prefill,
               "decode": [{"batch": b, "context_tokens": b * c, "time_s": 1e-3 + 1e-6 * b * c}
                          for b in (1, 4, 16) for c in (8, 72)]}
    assert CalibratedCostModel.from_profile(profile).prefill_fit.num_points == 6 + len(prefill)


def test_short_prompts_alone_below_what_the_runs_held_alone():
    """`short_prompt_points`: one whole prompt of 16, 64 or 128 tokens alone in a prefill step,
    only under the shortest whole prompt a run's step held alone (`_whole_alone`: a prompt after
    a cached prefix is not one), so the prefill fit does not price a lone short prompt at its
    floor."""
    from zipage.analysis.calibration import _whole_alone
    from zipage.core.step import PREFILL
    from zipage.engine.calibrate import short_prompt_points

    bench, runner = _mixed_step_bench()
    points = short_prompt_points(bench, below_tokens=100)
    assert [(p["requests"], p["new_tokens"]) for p in points] == [(1, 16), (1, 64)]
    assert bench.blocks.num_free_blocks == 2000 and all(p["time_s"] > 0 for p in points)
    steps = [plan for plan in runner.plans if plan.kind == PREFILL]  # warm-up and timed ones
    assert {(len(plan.prefill), plan.prefill[0].num_tokens) for plan in steps} == {(1, 16), (1, 64)}
    assert len(short_prompt_points(bench)) == 3 and short_prompt_points(bench, 16) == []
    assert _whole_alone({"new_tokens": 177, "requests": 1, "attention_pairs": 177 * 178 // 2})
    assert not _whole_alone({"new_tokens": 49, "requests": 1, "attention_pairs": 151753})
    assert not _whole_alone({"new_tokens": 64, "requests": 8, "cached_tokens": 0})
    assert _whole_alone({"new_tokens": 64, "requests": 1, "cached_tokens": 0})


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
    # Nothing is graphed on the CPU; the simulation says what its profile timed.
    assert profile["graphs"] == {"decode": False, "prefill": False}
    assert summary["graphs"] == profile["graphs"]
    assert "prefill_buckets" not in profile  # unpadded steps: the CPU's default


def test_prefill_graphs_calibrate_the_padded_path(tiny_model, monkeypatch):  # noqa: F811
    """With prefill graphs on, the prefill and mixed points are timed through the padded
    layout a graph replays (on the CPU it runs eagerly: the same forward)."""
    from zipage.engine.runner import ModelRunner

    padded = []
    forward = ModelRunner.padded_forward
    monkeypatch.setattr(ModelRunner, "padded_forward",
                        lambda runner, bucket, sectioned: padded.append(bucket) or forward(runner, bucket, sectioned))
    directory, _ = tiny_model
    settings = ReplaySettings(model=str(directory), kv_memory_gb=0.01,
                              config=ZipageConfig(**KNOBS))
    profile = calibrate(settings, "cpu", hardware="h200", repeats=1, prefill_graphs=True)
    points = len(profile["prefill"]) + len(profile["mixed"])
    assert len(padded) >= 2 * points  # a warm-up and a timed run per point
    # The profile names the buckets its steps were padded to; its fits read the padded rows.
    from zipage.prefill_buckets import buckets_up_to

    buckets = buckets_up_to(ZipageConfig(**KNOBS).step_tokens)
    assert set(padded) <= set(buckets)
    assert profile["prefill_buckets"] == list(buckets)
    model = CalibratedCostModel.from_profile(profile)
    assert model.prefill_buckets == buckets
    assert model.mixed_fit.num_points == 24


def test_cli_writes_a_profile_and_refuses_what_it_cannot_do(tiny_model, tmp_path):  # noqa: F811
    directory, _ = tiny_model
    out = tmp_path / "profile.json"
    base = [sys.executable, "-m", "zipage.cli", "calibrate", "--model", str(directory),
            "--block-size", "16", "--window", "4", "--budget", "64", "--kv-memory-gb", "0.01",
            "--repeats", "1", "--out", str(out)]
    # The whole path (fit through the engine loop, held-out validation, prefill graphs) on 25 s
    # of traffic, not the default 150: the wiring is what this test checks; the fit's quality is
    # tests/test_calibrate_loop.py's.
    done = subprocess.run(base + ["--engine", "cpu", "--hardware", "h100", "--prefill-graphs",
                                  "--fit-seconds", "20", "--validation-seconds", "5"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["gpu"] == "h100-80gb"
    assert "relative RMS error" in done.stdout
    no_label = subprocess.run(base + ["--engine", "cpu"], capture_output=True, text=True)
    assert no_label.returncode == 2 and "--hardware" in no_label.stderr
    if not torch.cuda.is_available():
        no_gpu = subprocess.run(base + ["--gpu"], capture_output=True, text=True)
        assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr


def test_tensor_parallel_profile(tiny_model):  # noqa: F811
    """TP=2 on the CPU (gloo): every timed step runs on both ranks, the profile says TP=2, the
    simulator accepts it for TP=2 only, and the ranks are gone afterwards."""
    import torch.distributed as dist

    directory, _ = tiny_model
    shape = resolve_shape(str(directory))
    settings = ReplaySettings(model=str(directory), kv_memory_gb=0.01, tensor_parallel=2,
                              config=ZipageConfig(**KNOBS))
    profile = calibrate(settings, "cpu", hardware="h200", repeats=1)
    assert not dist.is_initialized()
    assert profile["tensor_parallel"] == 2
    assert {"decode", "prefill", "compress"} <= set(profile)
    h200 = get_hardware("h200")
    CalibratedCostModel.from_profile(profile, shape=shape, gpu=h200, tensor_parallel=2, **KNOBS)
    with pytest.raises(ConfigError, match="tensor_parallel"):
        CalibratedCostModel.from_profile(profile, shape=shape, gpu=h200, tensor_parallel=1,
                                         **KNOBS)
