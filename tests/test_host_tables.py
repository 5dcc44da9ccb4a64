"""`HostTables` (zipage/engine/host_tables.py): the decode step's block tables, kept converted
between steps, always equal the tables the core holds, whatever the core did to them in between
(append a block, replace the list, drop the request from the batch, bring it back)."""

from __future__ import annotations

import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis_profiles import examples  # noqa: E402

from zipage.core.sequence import Sequence  # noqa: E402
from zipage.engine.host_tables import HostTables  # noqa: E402

OPS = st.lists(st.tuples(st.sampled_from(["append", "replace", "drop", "step"]),
                         st.integers(0, 19), st.integers(0, 40)), max_size=60)


def expected(sequences, rows: int, width: int):
    out = np.zeros((rows, width), dtype=np.int32)
    for index, seq in enumerate(sequences):
        out[index, :len(seq.block_table)] = seq.block_table
    return out


@given(OPS)
@settings(max_examples=examples(300))
def test_rows_equal_the_cores_tables_after_any_mutation(ops):
    # 20 requests: more than the 16 rows the store starts with, so it grows mid-run.
    sequences = [Sequence(f"s{i}", None, 16, prompt_len=1) for i in range(20)]
    for index, seq in enumerate(sequences):
        seq.block_table = [index]
    in_batch = set(range(20))
    tables = HostTables()
    counter = 1000
    for op, which, size in ops:
        seq = sequences[which]
        if op == "append":  # a new block (the list object stays the same)
            seq.block_table.append(counter)
        elif op == "replace":  # a compression, preemption or fork: a new list
            seq.block_table = list(range(counter, counter + size))
        elif op == "drop":  # out of the next decode steps, or back in
            in_batch ^= {which}
        else:
            batch = [sequences[i] for i in sorted(in_batch) if sequences[i].block_table]
            if not batch:
                continue
            width = max(len(s.block_table) for s in batch)
            rows = len(batch) + 2  # padded rows, as a graph bucket pads them
            out = np.full((rows, width), -7, dtype=np.int32)  # stale values from a wider step
            tables.fill(batch, out)
            assert (out == expected(batch, rows, width)).all()
        counter += 50


def test_an_appended_table_converts_only_its_new_entries():
    seq = Sequence("s", None, 16, prompt_len=1)
    seq.block_table = [3, 4]
    tables = HostTables()
    out = np.zeros((1, 4), dtype=np.int32)
    tables.fill([seq], out)
    writes = []
    write = tables._write
    tables._write = lambda row, start, table: (writes.append((row, start)), write(row, start, table))
    row = tables._rows["s"][2]
    seq.block_table.append(9)
    tables.fill([seq], out)
    assert writes == [(row, 2)]  # the same row, extended from its third entry
    assert out.tolist() == [[3, 4, 9, 0]]
    tables.fill([seq], out)
    assert writes == [(row, 2)]  # unchanged: nothing converted
