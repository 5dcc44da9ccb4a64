"""Decode steps' block tables on the host, converted once per change instead of once per step.

A decode step hands the attention kernel every request's block table. Converting the tables from
Python lists each step cost ~70-100 ns an entry: ~2 ms a step at batch 256 with 76-block tables
(Qwen2.5-7B, block 16, 1.2k-token contexts), time the GPU spent waiting on the host
(docs/BENCHMARKS.md, 'Beside published tables'). A table changes far less often than that: the
core appends a block every `block_size` tokens and replaces the whole list when it compresses,
preempts, forks or admits (it never assigns an entry of a list in place). So each request's row
is kept as an int32 array, keyed by the list object it was converted from and its length: a
longer same list converts only its new entries, another list converts whole.
"""

from __future__ import annotations

import numpy as np

from zipage.core.sequence import Sequence


class HostTables:
    """Rows of the requests of the latest decode step; the others are dropped each step (a
    request back after a prefill or a preemption converts again, once)."""

    def __init__(self) -> None:
        # seq_id -> (the block_table list it mirrors, entries converted, the row)
        self._rows: dict[str, tuple[list[int], int, np.ndarray]] = {}

    def fill(self, sequences: list[Sequence], out: np.ndarray) -> None:
        """Write each request's table into row i of `out` (int32 [>= len(sequences), width]);
        entries past a table's length are zero, as are the rows past the requests."""
        out[:] = 0
        rows = {}
        for index, seq in enumerate(sequences):
            table = seq.block_table
            kept = self._rows.get(seq.seq_id)
            if kept is not None and kept[0] is table and kept[1] <= len(table) <= len(kept[2]):
                row, done = kept[2], kept[1]
                if done < len(table):
                    row[done:len(table)] = table[done:]
            else:
                row = np.zeros(max(16, 2 * len(table)), dtype=np.int32)
                row[:len(table)] = table
            rows[seq.seq_id] = (table, len(table), row)
            out[index, :len(table)] = row[:len(table)]
        self._rows = rows
