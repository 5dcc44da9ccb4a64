"""A prefill or mixed step's host inputs (`ModelRunner.step_inputs`), built a column at a time with
array arithmetic, equal to the straightforward construction, a few torch ops a chunk, that it
replaced (`reference_step_inputs` below: the engine's before, kept as the oracle), for random
chunks (cached starts, partial chunks, query slots whose window falls in the chunk or not, prompt
log-probabilities) beside random decode rows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from zipage.core.sequence import Sequence  # noqa: E402
from zipage.core.step import MIXED, PREFILL, PrefillItem, StepPlan  # noqa: E402
from zipage.core.window import WindowLayout  # noqa: E402
from zipage.engine.host_tables import HostTables  # noqa: E402
from zipage.engine.runner import ModelRunner  # noqa: E402


def reference_step_inputs(runner: ModelRunner, plan: StepPlan, tokens: dict[str, list[int]]) -> dict:
    """The engine's construction before it was vectorized (2026-11-30), field by field."""
    b = runner.block_size
    input_ids, positions, slots, query_slots = [], [], [], []
    cu_seqlens, context_lens, tables, logits_rows = [0], [], [], []
    for item in plan.prefill:
        seq, start, end = item.seq, item.num_cached_tokens, item.num_tokens
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        entries = torch.arange(start, end, dtype=torch.int64)
        input_ids.append(torch.tensor(tokens[seq.seq_id][start:end], dtype=torch.int64))
        positions.append(entries)
        slots.append(table[entries // b] * b + entries % b)
        query = torch.full((end - start,), -1, dtype=torch.int64)
        first, last = runner.windows.query_range(seq.query_slot, start, end)
        if last > first:
            query[first - start:] = runner.windows.row(seq.query_slot, torch.arange(first, last))
        query_slots.append(query)
        cu_seqlens.append(cu_seqlens[-1] + end - start)
        context_lens.append(end)
        tables.append(seq.block_table)
        if item.samples:
            logits_rows.append(cu_seqlens[-1] - 1)
    decode = None
    if plan.decode:
        width = max(len(seq.block_table) for seq in plan.decode)
        columns, decode_tables = runner._decode_inputs(plan.decode, tokens, len(plan.decode), width)
        for rows, column in zip((input_ids, positions, slots, query_slots), columns[[0, 1, 2, 4]]):
            rows.append(column)
        logits_rows.extend(range(cu_seqlens[-1], cu_seqlens[-1] + len(plan.decode)))
        decode = (columns[3].int(), decode_tables)
    prompt_rows = []
    for index, item in enumerate(plan.prefill):
        if item.prompt_logits:
            rows = item.num_new_tokens - (1 if item.samples else 0)
            if rows > 0:
                logits_rows.extend(range(cu_seqlens[index], cu_seqlens[index] + rows))
                prompt_rows.append((item.seq.seq_id, item.num_cached_tokens, rows))
    width = max(len(table) for table in tables)
    return dict(
        input_ids=torch.cat(input_ids), positions=torch.cat(positions), slot_mapping=torch.cat(slots),
        query_slot_mapping=torch.cat(query_slots), cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([table + [0] * (width - len(table)) for table in tables],
                                  dtype=torch.int32).reshape(len(tables), width),
        decode_context_lens=None if decode is None else decode[0],
        decode_block_tables=None if decode is None else decode[1],
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        max_q_len=max(item.num_new_tokens for item in plan.prefill), prompt_rows=prompt_rows)


def bare_runner(block_size: int, window: int) -> ModelRunner:
    """The parts of a runner its input construction reads."""
    runner = object.__new__(ModelRunner)
    runner.block_size = block_size
    runner.windows = WindowLayout(block_size, window)
    runner.host_tables = HostTables()
    runner._prompt_rows = []
    return runner


@st.composite
def steps(draw):
    block_size = draw(st.sampled_from([1, 4, 16, 64]))
    window = draw(st.integers(1, block_size))
    blocks = iter(draw(st.permutations(range(200))))
    tokens, items, decodes = {}, [], []
    for index in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 4 * block_size + 3))
        seq = Sequence(f"p{index}", None, 8, prompt_len=length)
        seq.block_table = [next(blocks) for _ in range(-(-length // block_size))]
        seq.query_slot = draw(st.one_of(st.none(), st.integers(0, 30)))
        tokens[seq.seq_id] = draw(st.lists(st.integers(0, 50_000), min_size=length, max_size=length))
        start = draw(st.integers(0, length - 1))
        end = draw(st.integers(start + 1, length))
        items.append(PrefillItem(seq, start, end, samples=end == length and draw(st.booleans()),
                                 prompt_logits=draw(st.booleans())))
    for index in range(draw(st.integers(0, 4))):
        context = draw(st.integers(1, 3 * block_size))
        seq = Sequence(f"d{index}", None, 8, prompt_len=context - 1)
        seq.block_table = [next(blocks) for _ in range(-(-(context + 1) // block_size))]
        seq.set_counters(context - 1, 1)
        seq.query_slot = draw(st.one_of(st.none(), st.integers(0, 30)))
        tokens[seq.seq_id] = draw(st.lists(st.integers(0, 50_000), min_size=context, max_size=context))
        decodes.append(seq)
    plan = StepPlan(step_id=0, kind=MIXED if decodes else PREFILL, prefill=items, decode=decodes)
    return bare_runner(block_size, window), plan, tokens


@given(step=steps())
def test_step_inputs_match_the_per_chunk_construction(step):
    runner, plan, tokens = step
    want = reference_step_inputs(runner, plan, tokens)
    got = runner.step_inputs(plan, tokens)
    for name, expected in want.items():
        value = getattr(got, name)
        if isinstance(expected, torch.Tensor):
            assert value.dtype == expected.dtype, name
            assert torch.equal(value, expected), name
        else:
            assert value == expected, name
    assert runner._prompt_rows == want["prompt_rows"]


def test_a_chunk_past_its_block_table_is_an_error_not_block_zero():
    """The padded table would give such a row block 0 (another request's KV); the per-chunk
    construction raised there, and so does this one."""
    runner = bare_runner(4, 2)
    short, long = Sequence("short", None, 8, prompt_len=9), Sequence("long", None, 8, prompt_len=12)
    short.block_table, long.block_table = [5, 6], [7, 8, 9]  # short needs 3 blocks for 9 tokens
    tokens = {"short": list(range(9)), "long": list(range(12))}
    plan = StepPlan(step_id=0, kind=PREFILL, prefill=[PrefillItem(short, 0, 9), PrefillItem(long, 0, 12)])
    with pytest.raises(RuntimeError, match="past its request's block table"):
        runner.step_inputs(plan, tokens)
