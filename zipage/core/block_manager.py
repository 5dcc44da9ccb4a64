"""KV blocks: allocation, reference counts, the prefix index and compression targets.

A block's reference count is the number of holders: block tables, plus compression jobs that
hold blocks outside any table while they run. Free blocks sit in an LRU order and keep their
content and hash until they are handed out again, so a later request with the same prompt prefix
can take a free block back from the prefix index (as vLLM does).

Prefix index: the full blocks of a prompt are keyed by a chained content hash (the hash of a
block covers every token before it too), so equal hashes mean equal prefixes. Only prompt blocks
of uncompressed requests enter the index (docs/architecture.md, 'Rules', rule 7); a block whose content a compression
overwrites leaves it at once.

Host tier (`num_host_blocks` > 0, zipage/core/host_tier.py): a block that leaves the index because
its content is about to go (handed out again, or a compression target) is first saved to a host
slot, and a prefix lookup continues through the host's hashes where the GPU's stop. The copies of
a step gather here (`kv_saves`, `kv_loads`) until the scheduler moves them into its plan.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from zipage.core.host_tier import HostTier
from zipage.core.sequence import Sequence


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of a prompt."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    hashes = []
    previous = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hasher = xxhash.xxh64(seed=0)
        hasher.update(previous.to_bytes(8, "little"))
        hasher.update(tokens[start:start + block_size].tobytes())
        previous = hasher.intdigest()
        hashes.append(previous)
    return hashes


@dataclass
class CompressionTargets:
    """Where a compression writes: see docs/architecture.md, 'Rules', rule 5."""

    target_blocks: list[int]
    new_block: int
    fresh_blocks: list[int]  # newly allocated (a subset of target_blocks + [new_block])
    released: list[int]  # blocks of the old table that are not in the new one


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool,
                 num_host_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.refcount = [0] * num_blocks
        # Holders beyond the first, summed over blocks: each is a second read of a block's KV in
        # a step (a cost feature, `StepPlan.shared_kv_tokens`), kept as refcounts change.
        self.extra_holders = 0
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # The free blocks, least recently freed first: a queue of blocks as they were freed, in
        # which an entry is live only while its block is free and it is the block's latest entry
        # (a free block the prefix cache takes back stays queued, dead, until it reaches the
        # front). `_queued[block]`: the block's entries in the queue. A deque hands a block out
        # and takes it back several times faster than an ordered dict.
        self._free_queue: deque[int] = deque(range(num_blocks))
        self._queued = [1] * num_blocks
        self.num_free_blocks = num_blocks
        self.host = HostTier(num_host_blocks) if prefix_cache and num_host_blocks > 0 else None
        # This step's copies so far: (GPU block, host slot) saves, (host slot, GPU block) loads.
        self.kv_saves: list[tuple[int, int]] = []
        self.kv_loads: list[tuple[int, int]] = []

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def free_blocks(self) -> list[int]:
        """The free blocks in the order they are handed out (for the invariant checker)."""
        queued = list(self._queued)
        live = []
        for block in self._free_queue:
            queued[block] -= 1
            if queued[block] == 0 and self.refcount[block] == 0:
                live.append(block)
        return live

    # ---- allocation ----

    def allocate(self) -> int:
        """Hand out a fresh block (its old content, and so its hash, is gone)."""
        return self.allocate_many(1)[0]

    def allocate_many(self, count: int) -> list[int]:
        """Hand out `count` fresh blocks, least recently freed first (a prompt's blocks come in
        one call: the simulator allocates millions)."""
        queue, queued, refcount = self._free_queue, self._queued, self.refcount
        block_hash, hash_to_block = self.block_hash, self.hash_to_block
        blocks = []
        for _ in range(count):
            while True:
                block = queue.popleft()
                entries = queued[block] - 1
                queued[block] = entries
                if not entries and not refcount[block]:
                    break
            old_hash = block_hash[block]
            if old_hash is not None:  # its old content, and so its hash, is gone
                # (`_forget_hash`, inline: most blocks handed out held a prompt block; a block
                # with a hash is the one the index maps it to)
                if self.host is not None:
                    self._save(block, old_hash)
                del hash_to_block[old_hash]
                block_hash[block] = None
            refcount[block] = 1
            blocks.append(block)
        self.num_free_blocks -= count
        return blocks

    def release(self, block: int) -> None:
        self.release_all((block,))

    def release_table(self, table: list[int]) -> None:
        """Release a request's whole block table, last block first: the free list hands out
        least recently freed blocks first, so a prompt's leading blocks - the ones another
        request with the same prefix can map - are the last of them to lose their content."""
        self.release_all(reversed(table))

    def release_all(self, blocks: Iterable[int]) -> None:
        refcount, queued, free = self.refcount, self._queued, self._free_queue.append
        freed = 0
        for block in blocks:
            count = refcount[block] - 1
            assert count >= 0, f"block {block} released more often than held"
            refcount[block] = count
            if count == 0:
                free(block)
                queued[block] += 1
                freed += 1
            else:
                self.extra_holders -= 1
        self.num_free_blocks += freed

    # ---- prefix cache ----

    def cached_prefix_blocks(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Leading blocks of `seq` already in the prefix index, for a prefill of num_tokens.

        The block holding the last token is always computed (its logits, and its window queries
        for rule 7), so only blocks entirely before the last token are looked up. A request that
        needs the logits of every prompt position (`Sequence.prompt_logits`) maps none.
        """
        if not self.prefix_cache or seq.prompt_logits:
            return []
        hits = []
        for block_hash in seq.prompt_block_hashes[:(num_tokens - 1) // self.block_size]:
            block = self.hash_to_block.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def host_prefix_slots(self, seq: Sequence, num_tokens: int, gpu_hits: int) -> list[int]:
        """Host slots holding the prompt blocks of `seq` that follow its `gpu_hits` blocks from
        the GPU's index, as far as the host has them (looked at only: `reserve_host_prefix`
        takes them). The same blocks as `cached_prefix_blocks` may map: never the last token's."""
        if self.host is None or seq.prompt_logits:
            return []
        slots, lookup = [], self.host.slot_of.get
        for block_hash in seq.prompt_block_hashes[gpu_hits:(num_tokens - 1) // self.block_size]:
            slot = lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def reserve_host_prefix(self, seq: Sequence, first: int, count: int) -> list[int]:
        """Take the host slots of prompt blocks [first, first + count) of `seq` for this step's
        loads, before its blocks are allocated: an allocation saves the blocks it reuses, and
        a save must not evict a slot this step reads."""
        use = self.host.use
        return [use(block_hash) for block_hash in seq.prompt_block_hashes[first:first + count]]

    def load_prefix(self, seq: Sequence, first: int, slots: list[int]) -> None:
        """Blocks [first, first + len(slots)) of `seq`'s fresh table come from the host tier:
        each is loaded from its slot (copied before the step's forward) and indexed now, as a
        computed prompt block."""
        hash_to_block, hash_of = self.hash_to_block, self.block_hash
        end = first + len(slots)
        for slot, block_hash, block in zip(slots, seq.prompt_block_hashes[first:end],
                                           seq.block_table[first:end]):
            self.kv_loads.append((slot, block))
            if block_hash not in hash_to_block:  # (an equal block indexed since: keep it)
                hash_of[block] = block_hash
                hash_to_block[block_hash] = block

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's saves and loads, for its plan; the next step starts with none. Of two
        saves into one slot (a small tier reused it within the step) only the later is kept."""
        saves, loads = self.kv_saves, self.kv_loads
        self.kv_saves, self.kv_loads = [], []
        self.host.end_step()
        if len(saves) > 1 and len({slot for _, slot in saves}) < len(saves):
            last = {slot: index for index, (_, slot) in enumerate(saves)}
            saves = [save for index, save in enumerate(saves) if last[save[1]] == index]
        return saves, loads

    def _save(self, block: int, block_hash: int) -> None:
        slot = self.host.save(block_hash)
        if slot is not None:
            self.kv_saves.append((block, slot))

    def can_allocate_prefill(self, cached: list[int], num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(cached)
        cached_but_free = sum(1 for block in cached if self.refcount[block] == 0) if cached else 0
        return self.num_free_blocks >= needed + cached_but_free

    def allocate_prefill(self, cached: list[int], num_tokens: int) -> list[int]:
        """Block table for a prefill: the cached prefix blocks, then fresh ones."""
        table = []
        for block in cached:
            if self.refcount[block] == 0:
                self.num_free_blocks -= 1  # its queue entry dies as its refcount rises
            else:
                self.extra_holders += 1
            self.refcount[block] += 1
            table.append(block)
        needed = -(-num_tokens // self.block_size) - len(cached)
        table.extend(self.allocate_many(needed))
        return table

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (held already: a fork maps its leader's)."""
        for block in blocks:
            assert self.refcount[block] > 0, f"block {block} shared while free"
            self.refcount[block] += 1
        self.extra_holders += len(blocks)

    def register_prompt_blocks(self, seq: Sequence, first: int, end: int) -> None:
        """Index the full prompt blocks [first, end) of `seq` that a prefill just computed."""
        if not self.prefix_cache:
            return
        hash_to_block, hash_of = self.hash_to_block, self.block_hash  # (a few blocks a request)
        for block_hash, block in zip(seq.prompt_block_hashes[first:end],
                                     seq.block_table[first:end]):
            if block_hash in hash_to_block:
                continue  # an equal block is already indexed; keep the first
            if hash_of[block] is not None:  # (a fresh block's is gone already)
                self._forget_hash(block)
            hash_of[block] = block_hash
            hash_to_block[block_hash] = block

    def _forget_hash(self, block: int) -> None:
        # `block_hash` and the index change together: a block has a hash exactly while the index
        # maps that hash to it (the invariant checker's `_check_prefix_index`).
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.hash_to_block[block_hash]
            self.block_hash[block] = None

    # ---- compression ----

    def is_shared(self, block: int) -> bool:
        return self.refcount[block] > 1

    def fresh_blocks_for_compression(self, table: list[int], n_max: int) -> int:
        """How many free blocks compressing a request with this table needs (rule 5)."""
        prefix_targets, own = self._split_for_compression(table, n_max)
        return prefix_targets + max(0, n_max - prefix_targets - len(own))

    def plan_compression(self, table: list[int], n_max: int,
                         reserve: int | None = None) -> CompressionTargets | None:
        """Choose target blocks for compressing `table`; None if the free blocks don't suffice.

        Shared leading blocks are never overwritten: as many fresh blocks as there are shared
        leading ones (up to n_max - 1) take their place; the request's own unshared blocks, in
        order, take the remaining target places and the new-token place; fresh blocks fill any
        shortfall. Blocks that will be overwritten leave the prefix index right away, so no other
        request can pick them up while the compression runs.

        Keeping the prefix cache: with `reserve` given, the request's own blocks that are in the
        prefix index (computed prompt blocks, e.g. a shared document nobody else holds right now)
        are not overwritten while more than `reserve` free blocks remain besides the fresh targets
        taking their place: they are released with their hash, so a later request with the same
        prefix still finds them, and LRU reuse of the free list evicts them only when memory is
        needed. Otherwise (memory binds) they are overwritten as any own block.
        """
        prefix_targets, own = self._split_for_compression(table, n_max)
        own_used = own[: n_max - prefix_targets]
        shortfall = n_max - prefix_targets - len(own_used)
        if reserve is not None and self.prefix_cache:
            uncached = [block for block in own if self.block_hash[block] is None]
            kept_uncached = uncached[: n_max - prefix_targets]
            extra = len(own_used) - len(kept_uncached)
            if extra and self.num_free_blocks - (prefix_targets + shortfall + extra) > reserve:
                own_used = kept_uncached
                shortfall += extra
        if self.num_free_blocks < prefix_targets + shortfall:
            return None
        prefix_fresh = [self.allocate() for _ in range(prefix_targets)]
        extra_fresh = [self.allocate() for _ in range(shortfall)]
        for block in own_used:
            if self.host is not None and self.block_hash[block] is not None:
                self._save(block, self.block_hash[block])
            self._forget_hash(block)
        new_table = prefix_fresh + own_used + extra_fresh
        kept = set(new_table)
        return CompressionTargets(
            target_blocks=new_table[: n_max - 1],
            new_block=new_table[n_max - 1],
            fresh_blocks=prefix_fresh + extra_fresh,
            released=[block for block in table if block not in kept],
        )

    def _split_for_compression(self, table: list[int], n_max: int) -> tuple[int, list[int]]:
        refcount = self.refcount
        shared_prefix = 0
        while shared_prefix < len(table) and refcount[table[shared_prefix]] > 1:
            shared_prefix += 1
        own = [block for block in table if refcount[block] == 1]
        return min(shared_prefix, n_max - 1), own
