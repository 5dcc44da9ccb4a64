"""The padded layout of prefill graphs (`ModelRunner.padded_layout`), over random steps.

Whatever a step holds (chunks of any length over any cached context, no decode row or a few or
more than the decode section has slots, short or long contexts), its layout must give every chunk
tile and every folded decode row exactly one work item, give the section's rows none, fill the
section's slots with the decode rows in order and leave the others empty (row 0, no entries), and
take the section exactly when `takes_decode_section` says so. Checked without a model: the layout
reads only the runner's bucket sizes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis_profiles import examples  # noqa: E402

from zipage.engine.runner import ModelRunner, StepInputs  # noqa: E402
from zipage.kernels.attention import prefill_tile_tokens, prefill_work_capacity  # noqa: E402
from zipage.prefill_buckets import (  # noqa: E402
    DECODE_SECTION_MIN_CONTEXT,
    DECODE_SECTION_ROWS,
    PREFILL_GRAPH_TOKENS,
    bucket_of,
    decode_section_rows,
    takes_decode_section,
)

MAX_NUM_SEQS = 64


def runner_stub(num_heads: int, num_kv_heads: int) -> SimpleNamespace:
    """What `padded_layout` reads of a runner: its bucket sizes and work-list capacity."""
    tile = prefill_tile_tokens(num_heads, num_kv_heads)

    def sequences(bucket: int) -> int:
        return min(bucket, MAX_NUM_SEQS)

    return SimpleNamespace(bucket_sequences=sequences, tile_tokens=tile,
                           bucket_work_items=lambda bucket: prefill_work_capacity(bucket, sequences(bucket), tile))


@st.composite
def steps(draw):
    chunks = draw(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 9000)), min_size=1, max_size=4))
    contexts = st.one_of(st.integers(1, DECODE_SECTION_MIN_CONTEXT - 1),
                         st.integers(DECODE_SECTION_MIN_CONTEXT - 1, 40000))
    count = draw(st.integers(0, min(MAX_NUM_SEQS - len(chunks), DECODE_SECTION_ROWS + 8)))
    decodes = draw(st.lists(contexts, min_size=count, max_size=count))
    width = draw(st.integers(1, 12))
    return chunks, decodes, width


def step_inputs(chunks, decodes, width) -> StepInputs:
    query_lens = [length for length, _ in chunks]
    rows = sum(query_lens) + len(decodes)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows_of = torch.arange(rows, dtype=torch.int64)
    tables = torch.arange(len(chunks) * width, dtype=torch.int32).view(len(chunks), width)
    decode_tables = 1000 + torch.arange(len(decodes) * width, dtype=torch.int32).view(len(decodes), width)
    return StepInputs(
        input_ids=rows_of, positions=rows_of, slot_mapping=rows_of,
        query_slot_mapping=-torch.ones(rows, dtype=torch.int64),
        cu_seqlens_q=cu, context_lens=torch.tensor([length + cached for length, cached in chunks], dtype=torch.int32),
        block_tables=tables,
        decode_context_lens=torch.tensor(decodes, dtype=torch.int32) if decodes else None,
        decode_block_tables=decode_tables if decodes else None,
        logits_indices=torch.zeros(0, dtype=torch.int64), max_q_len=max(query_lens))


@pytest.mark.parametrize("heads", [(32, 8), (16, 8), (9, 3)], ids=["group-4", "group-2", "group-3"])
def test_a_padded_layout_covers_every_row_once(heads) -> None:
    runner = runner_stub(*heads)

    @hypothesis_settings(max_examples=examples(100))
    @given(step=steps())
    def check(step) -> None:
        chunks, decodes, width = step
        inputs = step_inputs(chunks, decodes, width)
        num_rows = len(inputs.input_ids)
        bucket = bucket_of(num_rows, PREFILL_GRAPH_TOKENS)
        layout, sectioned = ModelRunner.padded_layout(runner, inputs, bucket)
        assert sectioned == (bool(decodes) and takes_decode_section(bucket, len(decodes), max(decodes)))
        # Work: each chunk's tiles once, in order; each folded decode row once; nothing else.
        items = layout["work_items"][(layout["work_items"][:, 0] >= 0)].tolist()
        tile = runner.tile_tokens
        expected = [(seq, index) for seq, (length, _) in enumerate(chunks) for index in range(-(-length // tile))]
        if decodes and not sectioned:
            expected += [(len(chunks) + row, 0) for row in range(len(decodes))]
        assert [tuple(item) for item in items] == expected
        assert (layout["work_items"][len(items):] == -1).all()
        # Rows: the step's own, then padding rows that store nothing.
        assert layout["rows"].shape == (4, bucket)
        assert (layout["rows"][2:, num_rows:] == -1).all()
        # Sequences: the chunks, one per decode row, then empty padding.
        assert int(layout["cu_seqlens_q"][-1]) == num_rows
        assert len(layout["context_lens"]) == runner.bucket_sequences(bucket)
        if not sectioned:
            assert "section_rows" not in layout
            return
        slots, first = decode_section_rows(bucket), int(inputs.cu_seqlens_q[-1])
        filled = layout["section_filled"].flatten().tolist()
        assert filled == [True] * len(decodes) + [False] * (slots - len(decodes))
        assert layout["section_rows"].tolist() == [first + row for row in range(len(decodes))] + [0] * (
            slots - len(decodes))
        assert layout["section_context_lens"].tolist() == decodes + [0] * (slots - len(decodes))
        assert torch.equal(layout["section_block_tables"], inputs.decode_block_tables)

    check()
