"""`WindowLayout.decode_rows` (zipage/core/window.py), the decode step's query rows for a whole
batch at once, is `query_range` + `row` asked one request at a time."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zipage.core.window import WindowLayout

BLOCKS = st.sampled_from([4, 8, 16, 64, 128])


@given(BLOCKS, st.data())
@settings(max_examples=examples(300))
def test_decode_rows_are_query_range_and_row_per_request(block_size, data):
    window = data.draw(st.integers(1, block_size))
    layout = WindowLayout(block_size, window)
    requests = data.draw(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 50)),
                                            st.integers(0, 5000)), min_size=1, max_size=40))
    expected = []
    for slot, entry in requests:
        first, last = layout.query_range(slot, entry, entry + 1)
        expected.append(layout.row(slot, entry) if last > first else -1)
    slots = np.array([-1 if slot is None else slot for slot, _ in requests], dtype=np.int64)
    entries = np.array([entry for _, entry in requests], dtype=np.int64)
    assert layout.decode_rows(slots, entries).tolist() == expected
