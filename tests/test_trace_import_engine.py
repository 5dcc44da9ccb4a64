"""Production traces through both twins: an Azure excerpt and block-hashed (Mooncake-shaped)
sharing on the CPU engine, the simulator making the engine's decisions under step-time replay,
and the block hashes showing as the same prefix-cache hits in both."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_step_replay import engine_run, tiny_model  # noqa: E402,F401  (the fixture)

from zipage.sim.step_replay import replay_step_times  # noqa: E402
from zipage.trace import parse_trace  # noqa: E402
from zipage.trace_import import ImportOptions, import_trace  # noqa: E402

AZURE_2023 = Path(__file__).parent / "fixtures" / "traces" / "azure_conv_2023_excerpt.csv"


def hashed_trace():
    """Mooncake's sharing as a tree, at a tiny model's scale: 32-token hashed blocks over 16-token
    engine blocks; a shared root, two branches, a request that repeats a block after another
    root (no hit: the cache keys a block with its prefix). Arrivals are a quarter second apart,
    far longer than a tiny prompt's prefill, so each request's shared blocks are cached before
    the next arrives on any machine (4 ms apart, a fast machine admitted several in one step and
    the hits counted depended on its speed)."""
    chains = [[0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [5, 1], [0, 6], [0, 1, 3, 7]]
    return parse_trace({"version": 1, "name": "hashed", "hash_block_size": 32, "requests": [
        {"id": f"m{i}", "arrival_s": 0.25 * i, "prompt_len": 32 * len(chain) - 5,
         "block_hashes": chain, "output_len": 40 + 7 * i}
        for i, chain in enumerate(chains)]})


@pytest.mark.parametrize("asynchronous", [False, True])
def test_block_hashes_hit_alike_in_both_twins(tiny_model, tmp_path, asynchronous):  # noqa: F811
    trace = hashed_trace()
    out, summary, run = engine_run(tiny_model, tmp_path / "engine", trace, asynchronous,
                                   kv_memory_gb=0.0002)
    assert summary["completed"] == len(trace.requests)
    assert summary["prefix_hit_tokens"] >= 3 * 32  # m1, m2 and m5 reuse two hashed blocks
    replayed, replay_run = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
    assert replay_run.decision_log == run.decision_log
    assert replayed["prefix_hit_tokens"] == summary["prefix_hit_tokens"]


def test_an_azure_excerpt_runs_on_the_engine_as_simulated(tiny_model, tmp_path):  # noqa: F811
    trace, _ = import_trace("azure", AZURE_2023,
                            ImportOptions(window=(0.0, 12.0), speedup=400.0, max_model_len=512))
    assert len(trace.requests) >= 8
    out, summary, run = engine_run(tiny_model, tmp_path / "engine", trace, asynchronous=True,
                                   kv_memory_gb=0.002)
    assert summary["completed"] == len(trace.requests)
    replayed, replay_run = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]


# The longest requests of each fixture are left out (--max-model-len): a CPU step of 4k tokens or
# a thousand decode steps would dominate the suite's time without testing more.
@pytest.mark.parametrize("fmt, name, max_model_len", [("azure", "azure_code_2024.csv", 2100),
                                                      ("burstgpt", "burstgpt.csv", 1000),
                                                      ("mooncake", "mooncake.jsonl", None)])
def test_every_format_runs_on_the_cpu_engine_as_simulated(tmp_path, fmt, name, max_model_len):
    """Each production format's fixture through the CPU engine (random SmolLM2 weights, its
    8k context) and the simulator on the engine's clock: the same decisions; Mooncake's hashed
    blocks are prefix-cache hits in both."""
    import torch

    from zipage.config import ZipageConfig
    from zipage.core.deployment import ReplaySettings
    from zipage.engine.replay import replay_on_engine
    from zipage.rundir import write_run

    torch.set_num_threads(1)
    trace, _ = import_trace(fmt, AZURE_2023.parent / name,
                            ImportOptions(speedup=50.0, max_model_len=max_model_len))
    settings = ReplaySettings(model="random:smollm2-135m", dtype="float32", kv_memory_gb=0.5,
                              config=ZipageConfig(block_size=64, window=8, kv_budget=256))
    summary, run = replay_on_engine(trace, settings, "cpu", log_decisions=True)
    assert summary["completed"] == len(trace.requests)
    out = write_run(tmp_path / "engine", summary, run.steps, run.requests, run.decision_log)
    replayed, _ = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
    assert replayed["prefix_hit_tokens"] == summary["prefix_hit_tokens"]
    if fmt == "mooncake":  # requests 1 and 3 reuse request 0's two leading hashed blocks
        assert summary["prefix_hit_tokens"] >= 2 * 1024 - 64
