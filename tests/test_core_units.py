"""Unit tests of the core pieces: config validation, the memory planner against hand-computed
numbers, block-manager rules (prefix index, compression targets) and the scheduler's slot rules."""

from __future__ import annotations

import pytest

from zipage.config import ZipageConfig
from zipage.core.block_manager import BlockManager, prompt_block_hashes
from zipage.core.memory import plan_memory
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.errors import ConfigError, MemoryPlanError
from zipage.presets import get_preset

GIB = 1024**3


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("field,value,fragment", [
    ("block_size", 48, "power of two"),
    ("block_size", 8, "between 16 and 1024"),
    ("window", 0, "1 <= window"),
    ("window", 200, "block_size/2"),
    ("kv_budget", 1000, "multiple of block_size"),
    ("pooling", "sometimes", "first, always, off"),
    ("redundancy", "fast", "lightning, flash, off"),
    ("alpha", 1.5, "between 0 and 1"),
    ("max_num_seqs", 0, "positive integer"),
])
def test_config_errors_name_the_field(field, value, fragment):
    with pytest.raises(ConfigError) as error:
        ZipageConfig(**{field: value})
    assert str(error.value).startswith(field) and fragment in str(error.value)


def test_defaults_are_the_papers():
    config = ZipageConfig()
    assert (config.block_size, config.window, config.kv_budget, config.n_max) == (256, 16, 2048, 9)
    assert (config.alpha, config.lambda_weight, config.tau, config.similarity_threshold) == (
        0.8, 0.2, 0.4, 0.5)


# ---------------------------------------------------------------- memory planner

def test_memory_plan_qwen3_8b_hand_computed():
    # Qwen3-8B: 36 layers, 8 KV heads, 32 query heads, head_dim 128, bf16.
    # m_kv per token: K+V 2*36*8*128*2 = 147456 bytes + global scores 36*8*2 = 576 bytes.
    m_kv = (147456 + 576) * 256  # = 37,896,192 bytes per block of 256 tokens
    m_q = 36 * 16 * 32 * 128 * 2  # = 4,718,592 bytes per query slot (w = 16)
    available = 60 * GIB  # 64,424,509,440 bytes
    # M = floor(64424509440 / (9 * 37896192 + 4718592)) = floor(186.31...) = 186
    # N = floor((64424509440 - 186 * 4718592) / 37896192) = floor(1676.86...) = 1676
    plan = plan_memory(get_preset("qwen3-8b"), ZipageConfig(), available)
    assert (plan.block_bytes, plan.query_slot_bytes) == (m_kv, m_q)
    assert (plan.num_query_slots, plan.num_blocks) == (186, 1676)
    assert plan.num_blocks >= plan.num_query_slots * 9


def test_memory_plan_query_slots_caps_the_slots_and_gives_their_memory_to_blocks():
    m_kv, m_q = (147456 + 576) * 256, 36 * 16 * 32 * 128 * 2  # as hand-computed above
    plan = plan_memory(get_preset("qwen3-8b"), ZipageConfig(query_slots=8), 60 * GIB)
    assert plan.num_query_slots == 8
    assert plan.num_blocks == (60 * GIB - 8 * m_q) // m_kv  # = 1699 (186 slots: 1676)
    # A cap above what the memory backs changes nothing.
    assert plan_memory(get_preset("qwen3-8b"), ZipageConfig(query_slots=1000), 60 * GIB).num_query_slots == 186


@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_query_slots_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match="query_slots"):
        ZipageConfig(query_slots=value)


def test_memory_plan_full_kv_uses_everything_for_blocks():
    plan = plan_memory(get_preset("qwen3-8b"), ZipageConfig(compress=False), 60 * GIB)
    assert plan.num_query_slots == 0
    assert plan.block_bytes == 147456 * 256  # no global scores without compression
    assert plan.num_blocks == 60 * GIB // (147456 * 256)  # = 1706


def test_memory_plan_infeasible_is_a_clear_error():
    with pytest.raises(MemoryPlanError, match="smaller --budget"):
        plan_memory(get_preset("qwen3-8b"), ZipageConfig(), 100 * 1024**2)


# ---------------------------------------------------------------- block manager

def test_prefix_hash_is_chained():
    a = prompt_block_hashes(list(range(64)), 16)
    b = prompt_block_hashes([999] + list(range(1, 64)), 16)
    assert len(a) == 4 and all(x != y for x, y in zip(a, b))  # a change poisons later blocks
    assert prompt_block_hashes(list(range(40)), 16) == a[:2]


def test_freed_blocks_stay_in_prefix_index_until_reused():
    manager = BlockManager(num_blocks=4, block_size=16, prefix_cache=True)
    seq = Sequence("a", list(range(40)), 4)
    seq.prompt_block_hashes = prompt_block_hashes(seq.prompt_token_ids, 16)
    seq.block_table = manager.allocate_prefill([], 40)
    manager.register_prompt_blocks(seq, 0, 2)
    manager.release_all(seq.block_table)
    again = Sequence("b", list(range(40)), 4)
    again.prompt_block_hashes = seq.prompt_block_hashes
    assert manager.cached_prefix_blocks(again, 40) == seq.block_table[:2]
    # The last token's block is never taken from the cache (its logits must be computed).
    assert manager.cached_prefix_blocks(again, 32) == seq.block_table[:1]


def _manager_with_table(table_len: int, shared_prefix: int):
    manager = BlockManager(num_blocks=32, block_size=16, prefix_cache=True)
    table = [manager.allocate() for _ in range(table_len)]
    for block in table[:shared_prefix]:
        manager.refcount[block] += 1  # another request holds the prefix too
    return manager, table


@pytest.mark.parametrize("table_len,shared,n_max,fresh", [
    (5, 0, 3, 0),  # nothing shared: compress in place into own blocks
    (5, 1, 3, 1),  # one shared block: one fresh target replaces it
    (5, 4, 3, 2),  # N_prefix >= N_max - 1: all N_max - 1 targets are fresh
    (3, 3, 3, 3),  # everything shared: even the new-token block is fresh
])
def test_compression_targets_never_shared(table_len, shared, n_max, fresh):
    manager, table = _manager_with_table(table_len, shared)
    free_before = manager.num_free_blocks
    assert manager.fresh_blocks_for_compression(table, n_max) == fresh
    targets = manager.plan_compression(table, n_max)
    assert manager.num_free_blocks == free_before - fresh
    new_table = targets.target_blocks + [targets.new_block]
    assert len(targets.target_blocks) == n_max - 1
    assert not any(block in table[:shared] for block in new_table)
    assert len(set(new_table)) == n_max
    own = [block for block in table[shared:]]
    reused = [block for block in new_table if block in table]
    assert reused == own[:len(reused)]  # own blocks are reused in order
    assert sorted(targets.released) == sorted(set(table) - set(new_table))


def test_compression_without_free_blocks_is_refused():
    manager = BlockManager(num_blocks=3, block_size=16, prefix_cache=True)
    table = [manager.allocate() for _ in range(3)]
    manager.refcount[table[0]] += 1
    assert manager.plan_compression(table, 3) is None
    assert manager.num_free_blocks == 0


def test_overwritten_blocks_leave_the_prefix_index():
    manager = BlockManager(num_blocks=8, block_size=16, prefix_cache=True)
    seq = Sequence("a", list(range(64)), 4)
    seq.prompt_block_hashes = prompt_block_hashes(seq.prompt_token_ids, 16)
    seq.block_table = manager.allocate_prefill([], 64)
    manager.register_prompt_blocks(seq, 0, 4)
    targets = manager.plan_compression(seq.block_table, 3)
    assert targets.target_blocks == seq.block_table[:2]
    assert targets.new_block == seq.block_table[2]
    # The released fourth block keeps its content, so it stays findable; the others are gone.
    assert list(manager.hash_to_block.values()) == [seq.block_table[3]]


# ---------------------------------------------------------------- scheduler rules

def _scheduler(**knobs):
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, **knobs)
    return Scheduler(config, num_blocks=knobs.pop("num_blocks", 6), num_query_slots=2)


def test_needs_slot_only_in_windows_of_blocks_that_may_compress():
    scheduler = _scheduler()
    # N_max = 3: blocks 2, 3, ... may trigger compression; the window is offsets 12..15.
    assert [t for t in range(64) if scheduler.slots.needs_slot(t)] == [
        44, 45, 46, 47, 60, 61, 62, 63]


def test_window_queries_only_for_the_final_block():
    scheduler = _scheduler()
    seq = Sequence("a", list(range(40)), 4)
    seq.query_slot = 0
    slots = scheduler.slots
    assert slots.window_query_range(seq, 0, 40) == (40, 40)  # final block ends at offset 7
    assert slots.window_query_range(seq, 0, 48) == (44, 48)
    assert slots.window_query_range(seq, 46, 47) == (46, 47)
    seq.query_slot = None
    assert slots.window_query_range(seq, 0, 48) == (48, 48)


def test_capacity_must_back_every_slot():
    with pytest.raises(ConfigError, match="cannot back"):
        Scheduler(ZipageConfig(block_size=16, window=4, kv_budget=32), num_blocks=5,
                  num_query_slots=2)


def test_impossible_request_fails_alone():
    from zipage.sim.instant import InstantDriver

    scheduler = Scheduler(ZipageConfig(block_size=16, window=4, kv_budget=32, compress=False),
                          num_blocks=4, num_query_slots=0)
    ok = Sequence("ok", list(range(10)), 20)
    huge = Sequence("huge", list(range(10)), 200)  # needs 14 blocks, only 4 exist
    run = InstantDriver(scheduler, check=True).run([huge, ok])
    assert run.summary["completed"] == 1 and run.summary["failed"] == 1
    assert "needs 14 KV blocks" in huge.error and "enable compression" in huge.error
    assert ok.num_output_tokens == 20
