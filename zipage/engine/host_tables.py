"""Decode steps' block tables on the host, converted once per change instead of once per step.

A decode step hands the attention kernel every request's block table. Converting the tables from
Python lists each step cost ~70-100 ns an entry: ~2 ms a step at batch 256 with 76-block tables
(Qwen2.5-7B, block 16, 1.2k-token contexts), time the GPU spent waiting on the host
(docs/BENCHMARKS.md, 'Beside published tables'). A table changes far less often than that: the
core appends a block every `block_size` tokens and replaces the whole list when it compresses,
preempts, forks or admits (it never assigns an entry of a list in place). So each request's table
is kept as a row of one int32 array, keyed by the list object it was converted from and its
length: a longer same list converts only its new entries, another list converts whole. A step's
tables are then one gather from that array, not a copy a request.
"""

from __future__ import annotations

import numpy as np

from zipage.core.sequence import Sequence


class HostTables:
    """Rows of the requests of the latest decode step; a request missing from a step gives its
    row back (back after a prefill or a preemption, it converts again, once)."""

    def __init__(self) -> None:
        self._store = np.zeros((0, 16), dtype=np.int32)
        # Per store row: the entries that may be non-zero (all past them are zero).
        self._used: list[int] = []
        self._free: list[int] = []
        # seq_id -> (the block_table list it mirrors, entries converted, its store row)
        self._rows: dict[str, tuple[list[int], int, int]] = {}

    def fill(self, sequences: list[Sequence], out: np.ndarray) -> None:
        """Write each request's table into row i of `out` (int32 [>= len(sequences), width]);
        entries past a table's length are zero, as are the rows past the requests."""
        previous, rows, index = self._rows, {}, []
        for seq in sequences:
            table = seq.block_table
            kept = previous.pop(seq.seq_id, None)
            if kept is not None and kept[0] is table and kept[1] <= len(table):
                row = kept[2]
                if kept[1] < len(table):
                    self._write(row, kept[1], table)
            else:
                row = kept[2] if kept is not None else self._take()
                self._write(row, 0, table)
            rows[seq.seq_id] = (table, len(table), row)
            index.append(row)
        self._free.extend(row for _, _, row in previous.values())
        self._rows = rows
        width = min(out.shape[1], self._store.shape[1])
        out[:len(index), :width] = self._store[index, :width]
        out[:len(index), width:] = 0
        out[len(index):] = 0

    def _take(self) -> int:
        if not self._free:
            grown = max(16, 2 * len(self._store))
            self._store = np.concatenate(
                [self._store, np.zeros((grown - len(self._store), self._store.shape[1]), np.int32)])
            self._free = list(range(grown - 1, len(self._used) - 1, -1))
            self._used += [0] * (grown - len(self._used))
        return self._free.pop()

    def _write(self, row: int, start: int, table: list[int]) -> None:
        """Entries [start, len(table)) of row `row` from `table`, and zeros past it."""
        end = len(table)
        if end > self._store.shape[1]:
            wider = np.zeros((len(self._store), max(end, 2 * self._store.shape[1])), np.int32)
            wider[:, :self._store.shape[1]] = self._store
            self._store = wider
        self._store[row, start:end] = table[start:]
        if self._used[row] > end:
            self._store[row, end:self._used[row]] = 0
        self._used[row] = end
