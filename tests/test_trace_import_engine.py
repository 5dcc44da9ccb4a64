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
    root (no hit: the cache keys a block with its prefix), arrivals while others run."""
    chains = [[0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [5, 1], [0, 6], [0, 1, 3, 7]]
    return parse_trace({"version": 1, "name": "hashed", "hash_block_size": 32, "requests": [
        {"id": f"m{i}", "arrival_s": 0.004 * i, "prompt_len": 32 * len(chain) - 5,
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
