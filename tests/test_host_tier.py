"""The host tier (docs/architecture.md, 'Host tier'): prompt blocks the GPU's prefix cache drops
are saved to host slots and loaded back as prefix hits. Its bookkeeping, the block manager's
saves and loads, the engine's copies (the same tokens as GPU prefix hits, on SmolLM2), the
engine and the simulator making the same decisions, and what the tier gives back on the agent
sessions. The invariants of every step are the property tests' (tests/test_core_properties.py,
the host modes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from smollm2 import GGUF, SKIP_REASON
from test_engine import (
    read_decisions,
    replay_sim_and_cpu,
    tiny_model,  # noqa: F401  (a fixture the tests below take)
)

from zipage.config import ZipageConfig
from zipage.core.block_manager import BlockManager, prompt_block_hashes
from zipage.core.deployment import ReplaySettings
from zipage.core.host_tier import HostTier
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.errors import ConfigError
from zipage.session_workloads import agent_sessions
from zipage.sim.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent


def test_the_least_recently_used_unpinned_slot_is_reused():
    host = HostTier(2)
    assert host.save(11) == 0 and host.save(22) == 1
    assert host.save(11) is None  # already here: only used again
    assert host.save(33) == 1  # 22 was the least recently used
    assert host.lookup(22) is None and host.lookup(33) == 1
    assert host.use(11) == 0 and host.use(33) == 1  # both pinned by this step's loads
    assert host.save(44) is None  # nothing to evict: the save is skipped
    host.end_step()
    assert host.save(44) == 0  # 11 is the least recently used again


def _sequence(seq_id: str, tokens: list[int], block_size: int) -> Sequence:
    seq = Sequence(seq_id, tokens, 4)
    seq.prompt_block_hashes = prompt_block_hashes(tokens, block_size)
    return seq


def _computed(manager: BlockManager, tokens: list[int]) -> Sequence:
    """A prompt prefilled: its full blocks allocated and indexed."""
    seq = _sequence("done", tokens, manager.block_size)
    seq.block_table = manager.allocate_prefill([], len(tokens))
    manager.register_prompt_blocks(seq, 0, len(tokens) // manager.block_size)
    return seq


def _computed_then_freed(manager: BlockManager, tokens: list[int]) -> Sequence:
    """A prompt prefilled and finished: its blocks free, their hashes kept."""
    seq = _computed(manager, tokens)
    manager.release_table(seq.block_table)
    return seq


def test_a_reused_block_is_saved_and_its_prefix_comes_back_from_the_host():
    manager = BlockManager(num_blocks=5, block_size=16, prefix_cache=True, num_host_blocks=8)
    first = _computed_then_freed(manager, list(range(64)))
    assert manager.take_copies() == ([], [])
    # Another prompt takes every block: the four indexed ones go to host slots.
    other = _sequence("b", list(range(100, 180)), 16)
    other.block_table = manager.allocate_prefill([], 80)
    saves, loads = manager.take_copies()
    assert sorted(block for block, _ in saves) == sorted(first.block_table) and not loads
    manager.release_table(other.block_table)
    # The first prompt again, one token more: no GPU hit (its blocks hold the other prompt),
    # its four full blocks, all before the last token, from the host.
    again = _sequence("c", list(range(65)), 16)
    assert manager.cached_prefix_blocks(again, 65) == []
    slots = manager.host_prefix_slots(again, 65, 0)
    assert len(slots) == 4 and manager.host_prefix_slots(again, 64, 0) == slots[:3]
    slots = manager.reserve_host_prefix(again, 0, 4)
    again.block_table = manager.allocate_prefill([], 65)
    manager.load_prefix(again, 0, slots)
    saves, loads = manager.take_copies()
    saved_slot = {block: slot for block, slot in saves}
    assert loads == list(zip(slots, again.block_table[:4]))
    assert all(manager.hash_to_block[h] == b
               for h, b in zip(again.prompt_block_hashes, again.block_table[:4]))
    assert len(saved_slot) == len(saves)  # one save a slot


def test_prompt_blocks_a_compression_rewrites_are_saved_first():
    """Memory binds (no reserve): a compression overwrites the request's own indexed prompt
    blocks in place (rule 5); each goes to the host tier before it leaves the index."""
    manager = BlockManager(num_blocks=8, block_size=16, prefix_cache=True, num_host_blocks=8)
    seq = _computed(manager, list(range(64)))
    assert manager.take_copies() == ([], [])
    targets = manager.plan_compression(seq.block_table, n_max=3)
    rewritten = targets.target_blocks + [targets.new_block]
    saves, loads = manager.take_copies()
    assert sorted(block for block, _ in saves) == sorted(rewritten) and not loads
    assert {seq.prompt_block_hashes[seq.block_table.index(block)] for block in rewritten} \
        == set(manager.host.slot_of)


def test_two_saves_into_one_slot_keep_the_later():
    manager = BlockManager(num_blocks=2, block_size=16, prefix_cache=True, num_host_blocks=1)
    seq = _computed_then_freed(manager, list(range(32)))
    manager.allocate_many(2)  # both indexed blocks go: the second save reuses the one slot
    saves, _ = manager.take_copies()
    assert len(saves) == 1
    kept = seq.prompt_block_hashes[seq.block_table.index(saves[0][0])]
    assert manager.host.slot_of == {kept: 0}


@pytest.mark.parametrize("flags, expected", [
    (["--host-kv-gb", "-1"], "host_kv_gb: got -1.0, expected a number of GiB >= 0"),
    (["--host-kv-gb", "8", "--no-prefix-cache"], "host_kv_gb: the host tier keeps the prefix cache"),
    (["--host-kv-gb", "0.0001"], "host_kv_gb: 0.0001 GiB cannot hold one KV block"),
])
def test_bad_host_tier_settings_are_one_line(flags, expected, tmp_path):
    result = subprocess.run([sys.executable, "-m", "zipage.cli", "replay", "traces/tiny.json",
                             "--model", "qwen3-0.6b", *flags, "--no-progress"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_settings_refuse_a_host_tier_without_a_number():
    with pytest.raises(ConfigError, match="host_kv_gb"):
        ReplaySettings(host_kv_gb="8")


# ---------------------------------------------------------------- the engine's copies

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.skipif(GGUF is None, reason=SKIP_REASON)
@pytest.mark.parametrize("knobs, small_gb", [(dict(compress=False), 0.0056),
                                             (dict(kv_budget=32, window=4), 0.0045)],
                         ids=["full-kv", "compress-all"])
def test_host_hits_give_the_tokens_of_gpu_hits_on_smollm2(knobs, small_gb):
    """One request at a time: a prompt, another that takes its blocks (Full KV: the free list
    reuses them; compression: its own compressions overwrite its prompt), then the first prompt
    again with a new tail. On a cache large enough its prefix is a GPU hit; on a small one with
    a host tier it is loaded back from host memory. Greedy tokens are equal, token for token."""
    from zipage import LLM

    generator = torch.Generator().manual_seed(5)
    base, filler, tail = (torch.randint(100, 40000, (n,), generator=generator).tolist()
                          for n in (70, 90, 10))
    prompts = [base, filler, base + tail]
    common = dict(block_size=16, max_num_seqs=1, **knobs)
    large = LLM(str(GGUF), kv_memory_gb=0.05, **common)
    expected = large.generate(prompts, GREEDY, progress=False)
    assert large.last_run.summary["host_hit_tokens"] == 0
    small = LLM(str(GGUF), kv_memory_gb=small_gb, host_kv_gb=0.01, **common)
    outputs = small.generate(prompts, GREEDY, progress=False)
    summary = small.last_run.summary
    assert summary["host_hit_tokens"] >= 48  # three of the prompt's four full blocks at least
    assert summary["prefix_hit_tokens"] == large.last_run.summary["prefix_hit_tokens"]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_engine_and_simulator_make_the_same_decisions_with_a_host_tier(tiny_model, tmp_path):  # noqa: F811
    directory, _ = tiny_model
    runs = replay_sim_and_cpu(directory, tmp_path, "host-tier",
                              [(40, 30), (33, 12), (45, 50), (40, 8), (47, 25), (64, 3), (41, 9)],
                              "--host-kv-gb", "0.001")
    assert runs["cpu"]["host_hit_tokens"] > 0 and runs["cpu"]["host_copy_blocks"] > 0
    assert runs["sim"]["num_host_blocks"] == runs["cpu"]["num_host_blocks"] > 0
    sim_log = read_decisions(tmp_path / "sim")
    assert sim_log and sim_log == read_decisions(tmp_path / "cpu")


# ---------------------------------------------------------------- what it gives back (simulator)

def _agent_run(compress: bool = True, host_kv_gb: float = 0.0) -> dict:
    """Twelve coding-agent sessions at a tenth of the published size (329 calls, prompts of
    ~5.6k tokens), Qwen3-8B on an H200 with 3 GB of KV: memory binds."""
    trace = agent_sessions(0, sessions=12, scale=0.1, tool_time=0.1, think_time=0.5,
                           session_rate=4)
    config = ZipageConfig(block_size=64, kv_budget=512, compress=compress)
    settings = ReplaySettings(model="qwen3-8b", hardware="h200", kv_memory_gb=3.0,
                              host_kv_gb=host_kv_gb, config=config)
    summary, _ = simulate(trace, settings)
    assert summary["completed"] == len(trace.requests)
    return summary


@pytest.mark.parametrize("compress", [True, False], ids=["compress-all", "full-kv"])
def test_the_tier_gives_back_the_prefix_hits_memory_took(compress):
    """Where 3 GB of KV cannot keep the sessions' contexts, a 4 GB host tier serves most of
    the next calls' prompts from host memory: far more prefix hits, far fewer prompt tokens
    computed, a shorter run (its copies priced at the H200's host link)."""
    alone = _agent_run(compress)
    tiered = _agent_run(compress, host_kv_gb=4.0)
    assert alone["host_hit_tokens"] == alone["host_copy_blocks"] == 0
    assert tiered["host_hit_tokens"] > 0 and tiered["host_copy_blocks"] > 0
    assert tiered["prefix_hit_tokens"] > 1.5 * alone["prefix_hit_tokens"]
    assert tiered["prefill_tokens"] < 0.5 * alone["prefill_tokens"]
    assert tiered["makespan_s"] < alone["makespan_s"]


# ---------------------------------------------------------------- served

def test_a_served_repeat_finds_its_prefix_in_host_memory(tmp_path):
    """`zipage serve --host-kv-gb` (CPU engine, random SmolLM2, Full KV on 8 blocks): a prompt,
    another that takes the first one's blocks, then the first again. The repeat's usage counts
    its cached prompt tokens, and /metrics' `host_cache_hits` the ones copied back from host."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from test_serve_metrics import _complete, _idle, _value
    from test_serve_process import _server

    generator = torch.Generator().manual_seed(3)
    first, other = (torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (70, 100))
    with _server(tmp_path, "--no-compress", "--kv-memory-gb", "0.0055", "--host-kv-gb", "0.01",
                 "--max-num-seqs", "1") as (_, url, _, _):
        before = _idle(url)
        _complete(url, first, 4)
        _complete(url, other, 4)
        repeat = _complete(url, first + [7, 8, 9], 4)
        after = _idle(url)
    host_hits = (_value(after, "zipage:host_cache_hits_total")
                 - _value(before, "zipage:host_cache_hits_total"))
    assert host_hits >= 48  # three of its four full blocks at least: the fourth may stay on the GPU
    assert repeat["prompt_tokens_details"]["cached_tokens"] == 64
