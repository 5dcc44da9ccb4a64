"""Query slots: the M places where requests write the window queries a compression reads.

KV entry t "needs a slot" when it lies in the window of a block that may trigger a compression
(docs/architecture.md, 'Scheduling', 'Query-slot need'; 'Rules', rule 7). `QuerySlots` answers
that question, keeps which slots are free, the blocks their holders reserve, the running requests
that hold none (hybrid scheduling) and those of them waiting for one; the scheduler decides who
takes a slot when, and gives it back when a request leaves `running`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from zipage.config import ZipageConfig
from zipage.core.sequence import Sequence
from zipage.core.window import WindowLayout


class QuerySlots:
    def __init__(self, config: ZipageConfig, num_blocks: int, num_query_slots: int) -> None:
        self.block_size = config.block_size
        self.window = config.window
        self.windows = WindowLayout(config.block_size, config.window)
        self.n_max = config.n_max  # of the default budget; a request's own is `seq.n_max`
        self.compress = config.compress
        self.num_blocks = num_blocks
        self.num_query_slots = num_query_slots if config.compress else 0
        self.free = list(range(self.num_query_slots))  # a min-heap: lowest slot first
        # Blocks reserved for the slot holders: the sum of their `slot_blocks`, never above
        # num_blocks (with one budget, the planner's N_total >= M N_max makes this automatic).
        self.reserved = 0
        self.num_slotless = 0  # running requests without a slot (compression on)
        # Requests waiting for a query slot (hybrid): only a slot hand-out can release them, so
        # they are not rescanned each step.
        self.waiters: set[Sequence] = set()

    def needs_slot(self, token_index: int, n_max: int | None = None) -> bool:
        """Computing KV entry `token_index` writes a window query a compression will read.

        True for the last w in-block offsets of every block from index N_max - 1 on (the
        request's N_max; the default's when not given): those blocks are the final block when a
        compression triggers (docs/architecture.md, 'Rules', rule 7), at N_max blocks or, for an
        elastic request, at any number above.
        """
        b = self.block_size
        n_max = self.n_max if n_max is None else n_max
        return (self.compress and token_index // b >= n_max - 1
                and token_index % b >= b - self.window)

    def first_slot_token(self, kv_len: int, n_max: int) -> int:
        """The first KV entry from `kv_len` on that needs a slot."""
        b = self.block_size
        block = max(kv_len // b, n_max - 1)
        return max(kv_len, block * b + b - self.window)

    def needs_slot_to_start(self, seq: Sequence, num_tokens: int) -> bool:
        """Prefill of num_tokens, or the first decode after it, writes window queries."""
        return (self.needs_slot(num_tokens - 1, seq.n_max)
                or self.needs_slot(num_tokens, seq.n_max))

    def window_query_range(self, seq: Sequence, start: int, end: int) -> tuple[int, int]:
        """KV entries in [start, end) whose queries a driver stores (`WindowLayout.query_range`)."""
        return self.windows.query_range(seq.query_slot, start, end)

    def can_take(self, seq: Sequence) -> bool:
        """A slot is free, no running request waits for one before `seq`, and the pool can back
        `seq`'s reservation too."""
        return (bool(self.free) and not self.num_slotless
                and self.reserved + seq.slot_blocks <= self.num_blocks)

    def take(self, seq: Sequence) -> int:
        self.reserved += seq.slot_blocks
        return heapq.heappop(self.free)

    def seat(self, seq: Sequence, takes_slot: bool) -> None:
        """`seq` enters `running`, with a slot or (compression on) counted among those without."""
        seq.query_slot = self.take(seq) if takes_slot else None
        if self.compress and not takes_slot:
            self.num_slotless += 1

    def hand_out(self, running: Iterable[Sequence]) -> list[Sequence]:
        """Freed slots go to the foremost running requests that lack one (hybrid); those that
        got one."""
        given: list[Sequence] = []
        if not (self.free and self.num_slotless):
            return given
        for seq in running:
            if seq.query_slot is None:
                if self.reserved + seq.slot_blocks > self.num_blocks:
                    break  # the foremost waits until enough holders finish; nobody overtakes
                seq.query_slot = self.take(seq)
                self.num_slotless -= 1
                given.append(seq)
                if not (self.free and self.num_slotless):
                    break
        return given

    def release(self, seq: Sequence) -> None:
        """`seq` leaves `running`: its slot, if it holds one, is free again."""
        if seq.query_slot is not None:
            heapq.heappush(self.free, seq.query_slot)
            self.reserved -= seq.slot_blocks
            seq.query_slot = None
        elif self.compress:
            self.num_slotless -= 1
