"""Compression keeps the prefix cache while memory is to spare: a request that alone holds a
document's computed prompt blocks compresses into fresh blocks and releases the document with its
hash, so the next request with that document hits it (issue: RAG-like traffic lost its cache)."""

from __future__ import annotations

from zipage.config import ZipageConfig
from zipage.core.block_manager import BlockManager, prompt_block_hashes
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.sim.instant import InstantDriver


def _indexed_request(manager: BlockManager, tokens: int) -> Sequence:
    seq = Sequence("a", list(range(tokens)), 4)
    seq.prompt_block_hashes = prompt_block_hashes(seq.prompt_token_ids, manager.block_size)
    seq.block_table = manager.allocate_prefill([], tokens)
    manager.register_prompt_blocks(seq, 0, tokens // manager.block_size)
    return seq


def test_indexed_blocks_survive_compression_when_memory_is_spare():
    manager = BlockManager(num_blocks=32, block_size=16, prefix_cache=True)
    seq = _indexed_request(manager, 64)  # 4 indexed prompt blocks
    targets = manager.plan_compression(seq.block_table, 3, reserve=2)
    new_table = targets.target_blocks + [targets.new_block]
    assert not set(new_table) & set(seq.block_table)  # all fresh
    assert sorted(targets.released) == sorted(seq.block_table)
    manager.release_all(targets.released)
    # Every prompt block is still findable by its hash.
    assert sorted(manager.hash_to_block.values()) == sorted(seq.block_table)


def test_indexed_blocks_are_overwritten_when_memory_binds():
    manager = BlockManager(num_blocks=6, block_size=16, prefix_cache=True)
    seq = _indexed_request(manager, 64)  # 4 of 6 blocks used, 2 free
    targets = manager.plan_compression(seq.block_table, 3, reserve=1)
    assert targets.target_blocks == seq.block_table[:2]  # in place, as without the reserve
    assert list(manager.hash_to_block.values()) == [seq.block_table[3]]


def test_document_is_hit_after_its_only_holder_compressed():
    # A 64-token document (4 blocks of 16) plus a question; the second request arrives after the
    # first compressed (N_max = 3 blocks) and must find the whole document cached.
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=False)
    scheduler = Scheduler(config, num_blocks=64, num_query_slots=4)
    document = list(range(1000, 1064))
    first = Sequence("first", document + [1, 2, 3], 40, arrival_s=0.0)
    second = Sequence("second", document + [7, 8], 5, arrival_s=30.0)
    run = InstantDriver(scheduler, check=True, log_decisions=True).run([first, second])
    admitted = next(line for line in run.decision_log if "prefill=second" in line)
    assert "second[64:66]" in admitted  # the 4 document blocks came from the cache
    assert first.num_compressions > 0
