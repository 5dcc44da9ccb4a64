"""Where observation-window queries live (rules 5 and 7): arithmetic shared by the scheduler, the
engine's runner and the invariant checker, so it is written once.

A compression scores a request's KV with the queries of the last `w` entries of its final block
(the observation window). A request holding query slot `s` stores the query of KV entry `t` at
window index `t % b - (b - w)` of that slot, i.e. row `s * w + t % b - (b - w)` of the flattened
query cache. Only the final block of a computed range is ever read, so a driver stores queries
for `query_range(...)` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WindowLayout:
    block_size: int
    window: int

    def query_range(self, query_slot: int | None, start: int, end: int) -> tuple[int, int]:
        """KV entries in [start, end) whose queries a driver stores into the request's slot.

        The entries of the final block of the range at in-block offset >= b - w (earlier blocks'
        windows would be overwritten before any compression reads them). Empty without a slot.
        """
        if query_slot is None or end <= start:
            return (end, end)
        b = self.block_size
        last_block_start = (end - 1) // b * b
        first = max(start, last_block_start + b - self.window)
        return (min(first, end), end)

    def index(self, entry):
        """Window index of KV entry `entry` (an int or an integer tensor)."""
        return entry % self.block_size - (self.block_size - self.window)

    def row(self, query_slot: int, entry):
        """Row of the flattened [slots * w] query cache that holds the query of `entry`."""
        return query_slot * self.window + self.index(entry)

    def decode_rows(self, query_slots, entries):
        """For a decode step (each request computes the one entry `entries[i]`, numpy int arrays;
        slot -1 for a request without one): the query-cache row each request stores its query
        at, or -1 where `query_range(slot, entry, entry + 1)` is empty (its entry is not in the
        final `w` of its block)."""
        return np.where((query_slots >= 0) & (self.index(entries) >= 0),
                        self.row(query_slots, entries), -1)
