"""Paged attention kernels: the torch reference against dense causal attention, and the Triton kernels against the
reference through the Triton interpreter (CPU, float32 and float16; the interpreter mis-computes bfloat16 dots).

Triton decides whether it interprets when it is first imported, so the Triton tests run in a child pytest process
started with ``TRITON_INTERPRET=1`` (``test_triton_kernels_under_the_interpreter``); in the parent they are skipped
and the parent never imports Triton, which keeps the rest of the session unaffected. To run them directly:
``TRITON_INTERPRET=1 pytest tests/test_kernels_attention.py``.

Shapes are tiny because the interpreter runs every program in Python. Caches are filled with random values
everywhere, so a kernel that reads a block it does not own, or a padding entry of a block table, gets a wrong
answer instead of a lucky zero.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

torch = pytest.importorskip("torch")

from triton_interpreter import (  # noqa: E402
    HOPPER_COMMAND,
    TRITON_INSTALLED,
    UNDER_INTERPRETER,
    compile_for_hopper,
    run_hopper_compilation,
    run_test_file_under_interpreter,
    under_interpreter,
)

from zipage import decode_grid  # noqa: E402
from zipage.kernels import attention  # noqa: E402
from zipage.kernels.attention_ref import (  # noqa: E402
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    prefill_tile_tokens,
    prefill_work,
    prefill_work_capacity,
    store_kv_ref,
    store_queries_ref,
)
from zipage.kernels.kv_quant_ref import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    SCALE_SEARCH_SIZE,
    SCALE_SEARCH_STEP,
    SEARCH_FIXED_POINT,
    dequantize_kv,
    kv_scales,
    quantize_kv,
)
from zipage.presets import PRESETS  # noqa: E402

HEAD_DIM = 64
NUM_KV_HEADS = 2
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def triton_kernels():
    from zipage.kernels import attention_triton

    return attention_triton


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="this is the child process already")
def test_triton_kernels_under_the_interpreter():
    run_test_file_under_interpreter(__file__)


def hopper_launches() -> list:
    """Every kernel with the constexpr values of one bfloat16 launch (Qwen3-8B-like head shapes)."""
    from zipage.kernels import attention_triton as kernels

    shape = dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PADDED=128)
    attention_shape = shape | dict(GROUP=8, KV_TILE=64, DOT_PRECISION="tf32")
    prefill = attention_shape | dict(GROUP_PADDED=8, QUERY_TOKENS=8, k_desc=None, v_desc=None, KV_LOAD="gather",
                                     SPLIT_CAUSAL=False, FOLD_SCALE=False, FP8_KEYS="queries", FP8_VALUES="weights")
    # The load variants of _PREFILL_KV_LOAD need a block of 64 (one KV tile) or a multiple; "descriptor" takes
    # TMA descriptors (typed in argument_type) instead of None.
    variants = [
        prefill | dict(BLOCK_SIZE=64, KV_LOAD=kv_load, SPLIT_CAUSAL=split, FOLD_SCALE=split, USE_WORK_ITEMS=items)
        for kv_load, split, items in (("gather", True, False), ("block", False, False), ("block", True, True))
    ]
    descriptor = dict(attention_shape, GROUP_PADDED=8, QUERY_TOKENS=8, BLOCK_SIZE=64, KV_LOAD="descriptor",
                      FP8_KEYS="queries", FP8_VALUES="weights")
    variants += [descriptor | dict(SPLIT_CAUSAL=split, FOLD_SCALE=split, USE_WORK_ITEMS=items)
                 for split, items in ((False, False), (True, True))]
    # The FP8 widening modes of _PREFILL_FP8_KEYS / _PREFILL_FP8_VALUES (they matter with FP8 on).
    variants += [descriptor | dict(SPLIT_CAUSAL=True, FOLD_SCALE=True, USE_WORK_ITEMS=False, FP8_KEYS="f16",
                                   FP8_VALUES="f16-asm"),
                 prefill | dict(BLOCK_SIZE=64, KV_LOAD="block", SPLIT_CAUSAL=True, FOLD_SCALE=True,
                                USE_WORK_ITEMS=True, FP8_KEYS="f16-asm", FP8_VALUES="f16")]
    decode = attention_shape | dict(NUM_HEADS=16, SINGLE_PARTITION=False, GROUP_PADDED=16, MIN_TILES=2,
                                    KV_LOAD="gather", FP8_VALUES="weights", FP8_KEYS="queries", BALANCED=False,
                                    SUM_TILE=256)
    # The decode variants of _DECODE_KV_LOAD / _DECODE_FP8_KV_TILE / _DECODE_FP8_VALUES / _DECODE_FP8_KEYS (the
    # FP8 ones matter with FP8 on, in hopper_fp8_launches).
    decode_variants = [decode | dict(BLOCK_SIZE=128, KV_LOAD=load, KV_TILE=tile, FP8_VALUES=values, FP8_KEYS=keys)
                       for load, tile, values, keys in (
                           ("block", 64, "f16-asm", "queries"), ("block", 128, "f16", "f16"),
                           ("block", 128, "weights", "queries"), ("block", 128, "f16-asm", "f16-asm"),
                           ("gather", 128, "weights", "f16"))]
    return [
        (kernels._store_queries_kernel, dict(NUM_HEADS=32, HEAD_DIM=128, HEADS_PADDED=32, HEAD_DIM_PADDED=128)),
        (kernels._store_kv_kernel, shape | dict(NUM_KV_HEADS=2, HEAD_GROUP=2, FP8=False, FP8_MAX=FP8_MAX,
                                               SEARCH_STEP=SCALE_SEARCH_STEP, SEARCH_SIZE=SCALE_SEARCH_SIZE,
                                               SEARCH_FIXED_POINT=SEARCH_FIXED_POINT, SEARCH_PARALLEL=False)),
        (kernels._prefill_kernel, prefill | dict(USE_WORK_ITEMS=False, FP8=False)),
        (kernels._prefill_kernel, prefill | dict(USE_WORK_ITEMS=True, FP8=False)),
        *[(kernels._prefill_kernel, constants | dict(FP8=False)) for constants in variants],
        (kernels._decode_partition_kernel, decode | dict(FP8=False)),
        *[(kernels._decode_partition_kernel, constants | dict(FP8=False)) for constants in decode_variants],
        (kernels._decode_partition_kernel, decode | dict(FP8=False, BALANCED=True)),
        *[(
            kernels._decode_merge_kernel,
            dict(NUM_HEADS=16, HEAD_DIM=128, HEAD_DIM_PADDED=128, KV_TILE=64, MIN_TILES=2, MERGE_TILE=16,
                 BALANCED=balanced, SUM_TILE=256),
        ) for balanced in (False, True)],
    ]


def hopper_fp8_launches() -> list:
    """The kernels that read or write an FP8 KV cache, with FP8 on: the store (its caches as bytes), prefill by
    the gather, block and descriptor loads, decode."""
    from zipage.kernels import attention_triton as kernels

    launches = hopper_launches()
    store = [(kernel, constants | dict(FP8=True, HEAD_GROUP=heads, SEARCH_PARALLEL=parallel))
             for kernel, constants in launches if kernel is kernels._store_kv_kernel
             for _, search, heads, _ in kernels._STORE_FP8_LAUNCHES for parallel in [search == "parallel"]]
    attention = [(kernel, constants | dict(FP8=True)) for kernel, constants in launches
                 if kernel in (kernels._prefill_kernel, kernels._decode_partition_kernel)]
    # The prefill's FP8 tile (_PREFILL_FP8_KV_TILE), gathered from blocks of 64 or read a block at a time, on
    # the first prefill launch (no work items).
    prefill = next(constants for kernel, constants in launches if kernel is kernels._prefill_kernel)
    attention += [(kernels._prefill_kernel,
                   prefill | dict(FP8=True, KV_TILE=kernels._PREFILL_FP8_KV_TILE, BLOCK_SIZE=block, KV_LOAD=load,
                                  FP8_KEYS="f16", FP8_VALUES="f16-asm"))
                  for block, load in ((64, "gather"), (2 * kernels._PREFILL_FP8_KV_TILE, "block"))]
    return store, attention


POINTER_TYPES = {name: "*bf16" for name in ("key_ptr", "value_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr",
                                            "query_ptr", "query_cache_ptr")}
POINTER_TYPES |= {name: "*fp32" for name in ("partial_out_ptr", "partial_log_sum_ptr")}
POINTER_TYPES |= {
    name: "*i32" for name in ("cu_seqlens_q_ptr", "context_lens_ptr", "block_tables_ptr", "work_items_ptr")
}
POINTER_TYPES |= {"slot_mapping_ptr": "*i64", "query_slot_mapping_ptr": "*i64", "qk_scale": "fp32"}
POINTER_TYPES |= {name: "*fp32" for name in ("k_scale_ptr", "v_scale_ptr")}


def fp8_argument_type(cache_type: str):
    """Argument types of an FP8 launch: the caches as `cache_type` (bytes for the store, fp8e4nv to read)."""
    types = POINTER_TYPES | {"k_cache_ptr": cache_type, "v_cache_ptr": cache_type}
    types |= {name: "tensordesc<fp8e4nv[64, 128]>" for name in ("k_desc", "v_desc")}
    return lambda name: types.get(name, "i32")
POINTER_TYPES |= {name: "tensordesc<bf16[64, 128]>" for name in ("k_desc", "v_desc")}


def argument_type(name: str) -> str:
    return POINTER_TYPES.get(name, "i32")


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="the compiler needs Triton imported without the interpreter")
def test_kernels_compile_for_hopper():
    run_hopper_compilation(__file__)


@dataclass
class PagedBatch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    dense_keys: list[torch.Tensor]
    dense_values: list[torch.Tensor]


def make_paged_batch(
    context_lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    padding: int = -1,
    head_dim: int = HEAD_DIM,
) -> PagedBatch:
    """Random dense K/V per sequence, stored with the reference into randomly chosen blocks of a random cache;
    block tables are ragged and padded with ``padding``, and a few spare blocks stay unowned."""
    blocks_per_sequence = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_per_sequence) + 3
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    block_order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.full((len(context_lens), max(blocks_per_sequence) + 1), padding, dtype=torch.int32)
    dense_keys, dense_values = [], []
    next_block = 0
    for seq, (length, num_seq_blocks) in enumerate(zip(context_lens, blocks_per_sequence)):
        owned = block_order[next_block : next_block + num_seq_blocks]
        next_block += num_seq_blocks
        block_tables[seq, :num_seq_blocks] = owned.to(torch.int32)
        positions = torch.arange(length)
        slot_mapping = owned[positions // block_size] * block_size + positions % block_size
        keys = torch.randn((length, NUM_KV_HEADS, head_dim), generator=generator).to(dtype)
        values = torch.randn((length, NUM_KV_HEADS, head_dim), generator=generator).to(dtype)
        store_kv_ref(keys, values, k_cache, v_cache, slot_mapping)
        dense_keys.append(keys)
        dense_values.append(values)
    return PagedBatch(
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(context_lens, dtype=torch.int32),
        dense_keys,
        dense_values,
    )


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)


def dense_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain float64 attention of the last ``len(q)`` positions of a dense sequence, KV heads repeated per group."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    q_len, context_len = q.shape[0], keys.shape[0]
    logits = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    future = torch.arange(context_len)[None, :] > torch.arange(context_len - q_len, context_len)[:, None]
    weights = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_reference_matches_dense_causal_attention(group):
    generator = torch.Generator().manual_seed(group)
    block_size, scale = 16, HEAD_DIM**-0.5
    context_lens = [37, 16, 5]
    q_lens = [9, 16, 1]  # cached prefix of 28, no prefix, prefix of 4
    batch = make_paged_batch(context_lens, block_size, torch.float32, generator)
    num_heads = NUM_KV_HEADS * group
    q = torch.randn((sum(q_lens), num_heads, HEAD_DIM), generator=generator)
    out = paged_prefill_attention_ref(
        q, batch.k_cache, batch.v_cache, cumulative(q_lens), batch.context_lens, batch.block_tables, scale
    )
    starts = cumulative(q_lens).tolist()
    for seq in range(len(context_lens)):
        rows = slice(starts[seq], starts[seq + 1])
        expected = dense_causal_attention(q[rows], batch.dense_keys[seq], batch.dense_values[seq], scale)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)

    decode_q = torch.randn((len(context_lens), num_heads, HEAD_DIM), generator=generator)
    decode_out = paged_decode_attention_ref(
        decode_q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, scale
    )
    for seq in range(len(context_lens)):
        expected = dense_causal_attention(
            decode_q[seq : seq + 1], batch.dense_keys[seq], batch.dense_values[seq], scale
        )
        torch.testing.assert_close(decode_out[seq : seq + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_decode_of_an_empty_sequence_is_zero():
    generator = torch.Generator().manual_seed(0)
    batch = make_paged_batch([3, 1], 16, torch.float32, generator)
    q = torch.randn((2, NUM_KV_HEADS, HEAD_DIM), generator=generator)
    out = paged_decode_attention_ref(
        q, batch.k_cache, batch.v_cache, torch.tensor([3, 0], dtype=torch.int32), batch.block_tables, 0.1
    )
    assert torch.count_nonzero(out[1]) == 0


@under_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_reference(triton_kernels, dtype):
    generator = torch.Generator().manual_seed(1)
    num_blocks, block_size = 4, 16
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    # Keys as a model produces them: a slice of a fused projection, so the token stride is not heads x dim.
    fused = torch.randn((6, 3, NUM_KV_HEADS, HEAD_DIM), generator=generator).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slot_mapping = torch.tensor([5, -1, 63, 16, -1, 40], dtype=torch.int64)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, expected_k, expected_v, slot_mapping)
    triton_kernels.store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize(
    "mapping",
    [[-1, 0, -1, 5], [3, -1, -1, -1], [-1, -1, -1, -1], [0, 1, 2, 3]],
    ids=["index-0-kept-among-dropped", "first-kept", "none-kept", "all-kept"],
)
def test_store_queries_reference_writes_only_kept_rows(mapping: list[int]) -> None:
    generator = torch.Generator().manual_seed(2)
    query = torch.randn((4, 2, 8), generator=generator)
    cache = torch.randn((3, 2, 2, 8), generator=generator)  # 3 slots x window 2: flat rows 0-5
    expected = cache.clone()
    for row, index in enumerate(mapping):
        if index >= 0:
            expected.view(-1, 2, 8)[index] = query[row]
    store_queries_ref(query, cache, torch.tensor(mapping))
    assert torch.equal(cache, expected)


@under_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_queries_matches_reference(triton_kernels, dtype):
    generator = torch.Generator().manual_seed(3)
    num_heads, head_dim = 6, 40  # neither a power of two: the padded lanes must store nothing
    cache = torch.randn((3, 4, num_heads, head_dim), generator=generator).to(dtype)
    # Queries as a model produces them: a slice of the fused QKV projection, so the token stride is not heads x dim.
    fused = torch.randn((5, 2 * num_heads, head_dim), generator=generator).to(dtype)
    query = fused[:, :num_heads]
    mapping = torch.tensor([7, -1, 0, 11, -1], dtype=torch.int64)
    expected = cache.clone()
    store_queries_ref(query, expected, mapping)
    triton_kernels.store_queries_triton(query, cache, mapping)
    assert torch.equal(cache, expected)


PREFILL_CASES = [
    # (dtype, group, block_size, padding of the block tables)
    (torch.float32, 1, 16, -1),
    (torch.float32, 3, 32, 0),
    (torch.float32, 8, 16, -1),
    (torch.float16, 1, 32, -1),
    (torch.float16, 3, 16, 0),
    (torch.float16, 8, 32, -1),
]


@under_interpreter
@pytest.mark.parametrize("dtype,group,block_size,padding", PREFILL_CASES)
def test_prefill_matches_reference(triton_kernels, dtype, group, block_size, padding):
    generator = torch.Generator().manual_seed(group * block_size)
    # A prefix-cached prompt (two full cached blocks plus new tokens that straddle a block end), a prompt with
    # nothing cached and more tokens than one query tile, a single new token, and an empty chunk.
    context_lens = [2 * block_size + 23, 70, block_size + 1, 4]
    q_lens = [23, 70, 1, 0]
    batch = make_paged_batch(context_lens, block_size, dtype, generator, padding)
    q = torch.randn((sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, cumulative(q_lens), batch.context_lens, batch.block_tables, 0.125)
    out = triton_kernels.paged_prefill_attention_triton(*arguments)
    assert out.dtype == dtype
    torch.testing.assert_close(out, paged_prefill_attention_ref(*arguments), **TOLERANCES[dtype])
    # The engine passes the longest query length instead of letting the wrapper read it back.
    assert torch.equal(triton_kernels.paged_prefill_attention_triton(*arguments, max(q_lens)), out)


def test_prefill_work_lists_every_tile_once_and_pads():
    work = prefill_work(torch.tensor([5, 0, 16, 17, 1]), tile_tokens=8, capacity=12)
    assert work.items.tolist() == [[0, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2], [4, 0]] + [[-1, -1]] * 5
    assert prefill_tile_tokens(32, 8) == 16 and prefill_tile_tokens(12, 4) == 16 and prefill_tile_tokens(4, 4) == 64
    # The capacity bound holds for the worst split of a bucket: every sequence one token past full tiles.
    assert len(prefill_work(torch.tensor([9] * 7), 8).items) <= prefill_work_capacity(64, 7, 8)
    with pytest.raises(ValueError, match="do not fit"):
        prefill_work(torch.tensor([17]), tile_tokens=8, capacity=2)
    assert prefill_work(torch.tensor([], dtype=torch.int64), 8, capacity=2).items.tolist() == [[-1, -1]] * 2
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):  # against the obvious loop
        lens = torch.randint(0, 200, (int(torch.randint(1, 30, (1,), generator=generator)),),
                             generator=generator)
        tile = [1, 8, 16, 64][int(torch.randint(0, 4, (1,), generator=generator))]
        expected = [[seq, index] for seq, n in enumerate(lens.tolist()) for index in range(-(-n // tile))]
        work = prefill_work(lens, tile, capacity=len(expected) + 3)
        assert work.items.dtype == torch.int32 and work.items.tolist() == expected + [[-1, -1]] * 3


def test_reference_leaves_padding_rows_zero():
    """A padded step: rows past cu_seqlens_q[-1] and zero-length padding sequences compute nothing."""
    generator = torch.Generator().manual_seed(4)
    batch = make_paged_batch([9, 3], 16, torch.float32, generator)
    q = torch.randn((16, NUM_KV_HEADS, HEAD_DIM), generator=generator)
    cu = torch.tensor([0, 5, 8, 8, 8], dtype=torch.int32)
    lens = torch.tensor([9, 3, 0, 0], dtype=torch.int32)
    tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables)])
    padded = paged_prefill_attention_ref(q, batch.k_cache, batch.v_cache, cu, lens, tables, 0.125)
    tight = paged_prefill_attention_ref(q[:8], batch.k_cache, batch.v_cache, cu[:3], lens[:2], tables[:2], 0.125)
    assert torch.equal(padded[:8], tight) and torch.count_nonzero(padded[8:]) == 0


@under_interpreter
@pytest.mark.parametrize("dtype,group", [(torch.float32, 1), (torch.float32, 3), (torch.float16, 8)])
def test_prefill_work_items_match_the_grid(triton_kernels, dtype, group):
    """The work-list launch (tight, and padded as a CUDA graph's: padding items, zero-length padding sequences,
    rows past the last sequence, decode rows as 1-token sequences) computes exactly what the grid does."""
    generator = torch.Generator().manual_seed(group + 40)
    block_size = 16
    context_lens = [2 * block_size + 23, 70, 40, 17, 1]
    q_lens = [23, 70, 1, 1, 1]  # a cached-prefix chunk, a whole prompt, three decode rows
    batch = make_paged_batch(context_lens, block_size, dtype, generator)
    total = sum(q_lens)
    q = torch.randn((total, NUM_KV_HEADS * group, HEAD_DIM), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, cumulative(q_lens), batch.context_lens, batch.block_tables, 0.125)
    grid_out = triton_kernels.paged_prefill_attention_triton(*arguments, max(q_lens))
    tile = prefill_tile_tokens(NUM_KV_HEADS * group, NUM_KV_HEADS)
    tight = prefill_work(torch.tensor(q_lens), tile)
    assert torch.equal(triton_kernels.paged_prefill_attention_triton(*arguments, None, tight), grid_out)
    # Padded: 128 rows, 8 sequences (3 of them empty), the work list sized for the bucket.
    rows, seqs = 128, 8
    padded_q = torch.cat([q, torch.randn((rows - total, *q.shape[1:]), generator=generator).to(dtype)])
    cu = torch.cat([cumulative(q_lens), torch.full((seqs - len(q_lens),), total, dtype=torch.int32)])
    lens = torch.cat([batch.context_lens, torch.zeros(seqs - len(q_lens), dtype=torch.int32)])
    tables = torch.cat([batch.block_tables, torch.zeros((seqs - len(q_lens), batch.block_tables.shape[1]),
                                                        dtype=torch.int32)])
    padded = prefill_work(torch.tensor(q_lens + [0] * (seqs - len(q_lens))), tile,
                          capacity=prefill_work_capacity(rows, seqs, tile))
    padded_arguments = (padded_q, batch.k_cache, batch.v_cache, cu, lens, tables, 0.125)
    out = triton_kernels.paged_prefill_attention_triton(*padded_arguments, None, padded)
    assert torch.equal(out[:total], grid_out)
    torch.testing.assert_close(out[:total], paged_prefill_attention_ref(*padded_arguments)[:total],
                               **TOLERANCES[dtype])
    decode = paged_decode_attention_ref(q[93:], batch.k_cache, batch.v_cache, batch.context_lens[2:],
                                        batch.block_tables[2:], 0.125)
    torch.testing.assert_close(out[93:total], decode, **TOLERANCES[dtype])


# Launch-time variants of the prefill kernel (module knobs of attention_triton; bench/prefill_attention_gpu.py
# --variants times them): how a K/V tile is read, the causal loop split into unmasked and diagonal tiles, and the
# softmax scale folded into exp2's argument.
PREFILL_VARIANTS = {
    # name: (_PREFILL_KV_LOAD, _PREFILL_SPLIT_CAUSAL, _PREFILL_FOLD_SCALE); the shipped one is the last
    "gather": ("gather", False, False),
    "gather+split": ("gather", True, False),
    "block": ("block", False, False),
    "block+split+fold": ("block", True, True),
    "descriptor": ("descriptor", False, False),
    "descriptor+split+fold": ("descriptor", True, True),
}
PREFILL_VARIANT_CASES = [
    # (variant, dtype, group, block_size): every variant at a block of one KV tile (64) and of several (256),
    # where the tile lies inside a block, and at 16, where it straddles blocks (the "block" loads fall back
    # to the per-token gather); GQA groups 1, 3 and 8.
    (variant, dtype, group, block_size)
    for index, variant in enumerate(PREFILL_VARIANTS)
    for dtype, group, block_size in (
        (torch.float16, (1, 3, 8)[index % 3], 64),
        (torch.float32, (3, 8, 1)[index % 3], 256),
        (torch.float16, (8, 1, 3)[index % 3], 16),
    )
]


@under_interpreter
@pytest.mark.parametrize("variant,dtype,group,block_size", PREFILL_VARIANT_CASES)
def test_prefill_variants_match_reference(triton_kernels, monkeypatch, variant, dtype, group, block_size):
    """Each prefill variant, by grid and by a padded work list, against the reference: prefix-cached prompts
    whose cached prefix ends inside a KV tile and on a tile boundary (whole tiles before the diagonal), a prompt
    of several query tiles with nothing cached, a single new token after a full tile, and an empty chunk."""
    for name, value in zip(("_PREFILL_KV_LOAD", "_PREFILL_SPLIT_CAUSAL", "_PREFILL_FOLD_SCALE"),
                           PREFILL_VARIANTS[variant]):
        monkeypatch.setattr(triton_kernels, name, value)
    generator = torch.Generator().manual_seed(group * block_size + len(variant))
    context_lens = [150, 130, 70, 133, 4]
    q_lens = [23, 130, 1, 5, 0]
    batch = make_paged_batch(context_lens, block_size, dtype, generator, padding=-1)
    q = torch.randn((sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, cumulative(q_lens), batch.context_lens, batch.block_tables, 0.125)
    expected = paged_prefill_attention_ref(*arguments)
    out = triton_kernels.paged_prefill_attention_triton(*arguments, max(q_lens))
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    # The work list of a CUDA graph's padded step: the same programs, walked, give the same answer.
    tile = prefill_tile_tokens(NUM_KV_HEADS * group, NUM_KV_HEADS)
    work = prefill_work(torch.tensor(q_lens), tile, capacity=prefill_work_capacity(sum(q_lens) + 16, 8, tile))
    assert torch.equal(triton_kernels.paged_prefill_attention_triton(*arguments, None, work), out)


DECODE_CASES = [
    # (dtype, group, block_size, partition_size: None = automatic; 64 forces several partitions and the merge)
    (torch.float32, 1, 16, None),
    (torch.float32, 3, 32, 64),
    (torch.float32, 8, 16, 64),
    (torch.float16, 1, 32, 64),
    (torch.float16, 3, 16, None),
    (torch.float16, 8, 32, 64),
]


@under_interpreter
@pytest.mark.parametrize("kv_load", ["gather", "block"])
@pytest.mark.parametrize("dtype,group,block_size,partition_size", DECODE_CASES)
def test_decode_matches_reference(triton_kernels, monkeypatch, dtype, group, block_size, partition_size, kv_load):
    # "block" applies where a block holds whole tiles (64 entries): a block of 16 or 32 falls back to "gather".
    monkeypatch.setattr(triton_kernels, "_DECODE_KV_LOAD", kv_load)
    if kv_load == "block":
        block_size *= 4
    generator = torch.Generator().manual_seed(group * block_size + 7)
    # Ragged lengths: several partitions, exactly one partition, one entry, and an empty padding slot.
    context_lens = [200, 64, 1, 0]
    batch = make_paged_batch([max(length, 1) for length in context_lens], block_size, dtype, generator)
    batch.context_lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn((len(context_lens), NUM_KV_HEADS * group, HEAD_DIM), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, 0.125)
    out = triton_kernels.paged_decode_attention_triton(*arguments, partition_size=partition_size)
    assert out.dtype == dtype
    torch.testing.assert_close(out, paged_decode_attention_ref(*arguments), **TOLERANCES[dtype])
    assert torch.count_nonzero(out[3]) == 0


@under_interpreter
@pytest.mark.parametrize("grid_batch", [1, 64])
def test_decode_split_sized_for_another_batch_matches_reference(triton_kernels, grid_batch):
    """`grid_batch` (a graphed mixed step's decode section) changes how many partitions each
    sequence is cut into (many for 1, one for 64), not the result."""
    generator = torch.Generator().manual_seed(11)
    context_lens = [300, 0, 17]
    batch = make_paged_batch([max(length, 1) for length in context_lens], 16, torch.float32, generator)
    batch.context_lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn((len(context_lens), NUM_KV_HEADS * 4, HEAD_DIM), generator=generator)
    arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, 0.125)
    out = triton_kernels.paged_decode_attention_triton(*arguments, grid_batch=grid_batch)
    torch.testing.assert_close(out, paged_decode_attention_ref(*arguments), **TOLERANCES[torch.float32])
    partitions = triton_kernels.decode_num_partitions(grid_batch, NUM_KV_HEADS, triton_kernels._INTERPRETER_SM_COUNT)
    assert (partitions > 1) == (grid_batch == 1)


@under_interpreter
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, False), (torch.float16, True)])
@pytest.mark.parametrize("grid_batch", [None, 1])
def test_balanced_split_matches_reference(triton_kernels, monkeypatch, dtype, fp8, grid_batch):
    """A balanced split (zipage/decode_grid.py) cuts the long row into several partitions and leaves
    the short ones whole, written without the merge: the same answer as the reference, with a
    padding slot's output zero."""
    monkeypatch.setattr(triton_kernels, "_DECODE_SPLIT", "balanced")
    context_lens = [1000, 70, 64, 1, 130, 0]
    # On the interpreter's 2 "SMs" (4 programs each, 5 with FP8; 2 KV heads): an even share is 1265 / 4 (5)
    # entries, so the long row takes 3 partitions of the grid's 4 (5) and every other row one.
    per_sm = triton_kernels._programs_per_sm(fp8)
    grid_partitions = triton_kernels.decode_num_partitions(grid_batch or len(context_lens), NUM_KV_HEADS,
                                                           triton_kernels._INTERPRETER_SM_COUNT, fp8)
    assert grid_partitions == per_sm
    assert [decode_grid.balanced_row_partitions(length, sum(context_lens), NUM_KV_HEADS, 2, grid_partitions,
                                                programs_per_sm=per_sm)
            for length in context_lens] == [3, 1, 1, 1, 1, 1]
    if fp8:
        check_fp8_decode(triton_kernels, dtype, 4, 16, None, context_lens, seed=29, grid_batch=grid_batch)
        return
    generator = torch.Generator().manual_seed(23)
    batch = make_paged_batch([max(length, 1) for length in context_lens], 16, dtype, generator)
    batch.context_lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn((len(context_lens), NUM_KV_HEADS * 4, HEAD_DIM), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, 0.125)
    out = triton_kernels.paged_decode_attention_triton(*arguments, grid_batch=grid_batch)
    torch.testing.assert_close(out, paged_decode_attention_ref(*arguments), **TOLERANCES[dtype])
    assert torch.count_nonzero(out[-1]) == 0


@under_interpreter
@settings(max_examples=examples(8))
@given(lengths=st.lists(st.one_of(st.integers(0, 200), st.integers(200, 1500)), min_size=1, max_size=9),
       split=st.sampled_from(["batch", "balanced"]), grid_batch=st.sampled_from([None, 1, 3]),
       seed=st.integers(0, 2**31 - 1))
def test_any_split_of_any_lengths_matches_reference(triton_kernels, lengths, split, grid_batch, seed):
    """Any batch of lengths (empty slots, one entry, rows many times the others'), either split and
    grid: the reference's answer, and a zero output for an empty slot."""
    generator = torch.Generator().manual_seed(seed)
    batch = make_paged_batch([max(length, 1) for length in lengths], 16, torch.float32, generator)
    batch.context_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn((len(lengths), NUM_KV_HEADS * 3, HEAD_DIM), generator=generator)
    arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, 0.125)
    out = triton_kernels.paged_decode_attention_triton(*arguments, split=split, grid_batch=grid_batch)
    torch.testing.assert_close(out, paged_decode_attention_ref(*arguments), **TOLERANCES[torch.float32])
    for row, length in enumerate(lengths):
        if length == 0:
            assert torch.count_nonzero(out[row]) == 0


# Every model preset's query heads per KV head and head size, (2, 128) to (8, 128) and (3, 64) and
# (7, 64): the groups that are not powers of two run padded lanes. Two KV heads each (the kernels'
# programs split by KV head), so the shapes stay small under the interpreter.
PRESET_HEADS = sorted({(preset.num_heads // preset.num_kv_heads, preset.head_dim)
                       for preset in PRESETS.values()})


@under_interpreter
@pytest.mark.parametrize("group,head_dim", PRESET_HEADS)
def test_every_presets_heads_attend_like_the_reference(triton_kernels, group, head_dim):
    """Decode (split into partitions and merged) and prefill (chunks of several lengths over
    cached context) at each preset's group and head size, against the torch reference."""
    dtype = torch.float16
    generator = torch.Generator().manual_seed(100 * group + head_dim)
    scale = head_dim ** -0.5
    context_lens = [200, 64, 1, 0]
    batch = make_paged_batch([max(length, 1) for length in context_lens], 16, dtype, generator,
                             head_dim=head_dim)
    batch.context_lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn((len(context_lens), NUM_KV_HEADS * group, head_dim), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, scale)
    out = triton_kernels.paged_decode_attention_triton(*arguments, partition_size=64)
    torch.testing.assert_close(out, paged_decode_attention_ref(*arguments), **TOLERANCES[dtype])
    assert torch.count_nonzero(out[3]) == 0
    context_lens, q_lens = [90, 33, 17], [40, 33, 1]
    batch = make_paged_batch(context_lens, 16, dtype, generator, head_dim=head_dim)
    q = torch.randn((sum(q_lens), NUM_KV_HEADS * group, head_dim), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, cumulative(q_lens), batch.context_lens,
                 batch.block_tables, scale)
    out = triton_kernels.paged_prefill_attention_triton(*arguments, max(q_lens))
    torch.testing.assert_close(out, paged_prefill_attention_ref(*arguments), **TOLERANCES[dtype])


@under_interpreter
def test_decode_splits_small_batches_only(triton_kernels):
    decode_num_partitions = triton_kernels.decode_num_partitions
    assert decode_num_partitions(1, 8, streaming_multiprocessors=132) > 1
    assert decode_num_partitions(256, 8, streaming_multiprocessors=132) == 1
    # The fp8 launch holds 5 programs an SM, bfloat16's 4: 40 x 8 heads fill bfloat16's 528 slots once, fp8's
    # 660 twice over (triton_kernels._FP8_PROGRAMS_PER_SM).
    assert decode_num_partitions(40, 8, streaming_multiprocessors=132) == 1
    assert decode_num_partitions(40, 8, streaming_multiprocessors=132, fp8=True) == 2


@under_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_with_a_wide_padded_block_table(triton_kernels, dtype, monkeypatch):
    """A CUDA graph's block table is as wide as max_model_len: the same answer as a tight table, several
    partitions per sequence (split by each sequence's own length), ragged lengths and an empty slot."""
    generator = torch.Generator().manual_seed(11)
    context_lens = [300, 45, 1, 0]
    batch = make_paged_batch([max(length, 1) for length in context_lens], 16, dtype, generator)
    batch.context_lens = torch.tensor(context_lens, dtype=torch.int32)
    wide = torch.full((len(context_lens), 64), -1, dtype=torch.int32)
    wide[:, : batch.block_tables.shape[1]] = batch.block_tables
    q = torch.randn((len(context_lens), NUM_KV_HEADS * 3, HEAD_DIM), generator=generator).to(dtype)
    tight_arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, 0.125)
    wide_arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, wide, 0.125)
    # 4 sequences x 2 KV heads x 4 partitions = 32 programs on the interpreter's 2 "SMs".
    monkeypatch.setattr(triton_kernels, "_PROGRAMS_PER_SM", 16)
    assert triton_kernels.decode_num_partitions(len(context_lens), NUM_KV_HEADS, 2) == 4
    out = triton_kernels.paged_decode_attention_triton(*wide_arguments)
    torch.testing.assert_close(out, paged_decode_attention_ref(*tight_arguments), **TOLERANCES[dtype])
    torch.testing.assert_close(out, triton_kernels.paged_decode_attention_triton(*tight_arguments))
    assert torch.count_nonzero(out[3]) == 0


@under_interpreter
def test_dispatch_uses_reference_for_cpu_tensors_unless_interpreted(triton_kernels, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    generator = torch.Generator().manual_seed(3)
    batch = make_paged_batch([5], 16, torch.float32, generator)
    q = torch.randn((1, NUM_KV_HEADS, HEAD_DIM), generator=generator)
    calls = []
    monkeypatch.setattr(
        triton_kernels,
        "paged_decode_attention_triton",
        lambda *arguments: calls.append(arguments) or torch.zeros_like(q),
    )
    arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, 0.125)
    torch.testing.assert_close(attention.paged_decode_attention(*arguments), paged_decode_attention_ref(*arguments))
    assert not calls
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # forces Triton on CPU tensors
    attention.paged_decode_attention(*arguments)
    assert len(calls) == 1


# ---------------------------------------------------------------- FP8 KV cache (docs/kernels.md, 'FP8 KV cache')

# e4m3 rounding moves a normal value by at most half an ulp (2^-4 of it), a subnormal by half of 2^-9 scale units;
# two correct roundings of the same value (Triton's and torch's) are within one such step of each other.
E4M3_HALF_ULP = 2.0**-4
E4M3_HALF_SUBNORMAL = 2.0**-10


def fp8_paged_batch(context_lens: list[int], block_size: int, generator: torch.Generator) -> tuple:
    """``make_paged_batch``'s float32 cache quantized whole: (batch with fp8 caches, k_scale, v_scale)."""
    batch = make_paged_batch(context_lens, block_size, torch.float32, generator)
    # Keys with outlier channels and values of very different sizes per entry, as a model's are.
    k_values, k_scale = quantize_kv(batch.k_cache * (1 + 20 * (torch.arange(HEAD_DIM) == 5)))
    v_values, v_scale = quantize_kv(batch.v_cache * torch.logspace(-3, 1, block_size)[None, :, None, None])
    batch.k_cache, batch.v_cache = k_values, v_values
    return batch, k_scale, v_scale


@under_interpreter
@pytest.mark.parametrize("dtype,heads_a_program,search", [(torch.float32, 8, "serial"), (torch.float16, 8, "serial"),
                                                          (torch.float32, 1, "serial"), (torch.float32, 1, "parallel"),
                                                          (torch.float16, 2, "parallel")])
def test_store_kv_fp8_quantizes_like_the_reference(triton_kernels, monkeypatch, dtype, heads_a_program, search):
    """The same scale search as the reference (kv_quant_ref.kv_scales), so the same scales and bytes, bit for bit,
    with every KV head of a token in one program or fewer, the candidates tried one after another or side by
    side."""
    monkeypatch.setattr(triton_kernels, "_STORE_FP8_LAUNCHES", ((None, search, heads_a_program, 4),))
    generator = torch.Generator().manual_seed(11)
    shape = (4, 16, NUM_KV_HEADS, HEAD_DIM)
    fused = torch.randn((7, 3, NUM_KV_HEADS, HEAD_DIM), generator=generator) * torch.logspace(-4, 2, 7)[:, None,
                                                                                                        None, None]
    fused[:, :, :, 3] *= 40.0  # an outlier channel
    fused[2] = 0.0  # a zero token: scale 1
    # A constant row of 28 = 448 / 16: amax / 448 (to 448) and amax / 256 (to 256) both represent it exactly, the
    # first candidate wins.
    fused[3, :, 1] = 28.0
    fused = fused.to(dtype)
    # Exact ties and the ends of e4m3's range: 1.0625 and 1.1875 lie halfway between two codes (to even: 1.0 and
    # 1.25), 448 saturates, 2^-8 and 3 * 2^-10 (times the scale) are subnormal codes. The rest of the row holds
    # codes that only the scale amax / 448 = 1 represents exactly, so the search must pick it.
    amax = 448.0
    fused[6, 1, 0, :6] = torch.tensor([amax, 1.0625, -1.1875, 2.0**-8, 3 * 2.0**-10, -amax], dtype=dtype)
    fused[6, 1, 0, 6:] = torch.tensor([288.0, 352.0, 416.0, -320.0], dtype=dtype).repeat(HEAD_DIM)[:HEAD_DIM - 6]
    key, value = fused[:, 1], fused[:, 2]
    slot_mapping = torch.tensor([5, -1, 63, 16, -1, 40, 33], dtype=torch.int64)
    caches = [torch.zeros(shape, dtype=FP8_DTYPE) for _ in range(2)] + [torch.ones(shape[:3]) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    store_kv_ref(key, value, expected[0], expected[1], slot_mapping, k_scale=expected[2], v_scale=expected[3])
    triton_kernels.store_kv_triton(key, value, caches[0], caches[1], slot_mapping, k_scale=caches[2],
                                   v_scale=caches[3])
    torch.testing.assert_close(caches[2], expected[2], rtol=0.0, atol=0.0)
    torch.testing.assert_close(caches[3], expected[3], rtol=0.0, atol=0.0)
    assert torch.equal(caches[0].view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), expected[1].view(torch.uint8))
    # The search is not idle here: some rows took a scale other than amax / 448.
    kept = slot_mapping >= 0
    plain = kv_scales(torch.stack([key[kept], value[kept]]), (1.0,))
    chosen = torch.stack([caches[2], caches[3]]).view(2, -1, NUM_KV_HEADS)[:, slot_mapping[kept]]
    assert bool((chosen > plain * (1 + 1e-3)).any())
    for cache, scales, source in ((caches[0], caches[2], key), (caches[1], caches[3], value)):
        # Each stored value is the input rounded once at its row's scale: within half a step of it.
        original = source[kept].float()
        restored = dequantize_kv(cache, scales).view(-1, NUM_KV_HEADS, HEAD_DIM)[slot_mapping[kept]]
        bound = torch.maximum(E4M3_HALF_ULP * original.abs(), E4M3_HALF_SUBNORMAL * scales.view(-1, NUM_KV_HEADS)[
            slot_mapping[kept]][..., None])
        assert torch.all((restored - original).abs() <= bound * (1 + 1e-6))
    # The hand-picked values, in units of their row's scale (448 / 448 = 1): ties to even, saturation, subnormals.
    torch.testing.assert_close(caches[2][33 // 16, 33 % 16, 0], torch.tensor(1.0), rtol=0.0, atol=0.0)
    row = dequantize_kv(caches[0], caches[2])[33 // 16, 33 % 16, 0, :6] / caches[2][33 // 16, 33 % 16, 0]
    torch.testing.assert_close(row, torch.tensor([amax, 1.0, -1.25, 2.0**-8, 2.0**-9 * 2, -amax]).to(torch.float32),
                               rtol=1e-6, atol=0.0)
    # The constant row: amax / 448 = 1 / 16, the first of the candidates that represent it exactly.
    torch.testing.assert_close(caches[2][16 // 16, 16 % 16, 1], torch.tensor(2.0**-4), rtol=0.0, atol=0.0)


FP8_PREFILL_CASES = [
    # (query dtype, group, block_size, load variant): the gather (16), "block" and "descriptor" (64, with a tile of
    # 64: the shipped FP8 tile of 128 would gather there)
    (torch.float32, 1, 16, "gather"),
    (torch.float16, 3, 16, "gather"),
    (torch.float32, 8, 64, "block"),
    (torch.float16, 1, 64, "block"),
    (torch.float32, 3, 64, "descriptor"),
    # blocks of the FP8 tile (_PREFILL_FP8_KV_TILE, 128) and more: "block" and "descriptor" read FP8 tiles whole
    (torch.float16, 2, 128, "block"),
    (torch.float32, 4, 256, "descriptor"),
]


# (keys, values): the widening modes of _PREFILL_FP8_KEYS / _PREFILL_FP8_VALUES; "f16-asm" runs as "f16" under the
# interpreter, float32 queries keep "queries".
FP8_PREFILL_MODES = [("queries", "weights"), ("f16", "f16-asm"), ("f16-asm", "f16")]
# bfloat16 queries (the engine's dtype) only with float16 keys, which narrow them to float16 for a float16 dot: the
# interpreter mis-computes bfloat16 dots (the GPU checks them: bench/fp8_gpu.py --parts checks).
FP8_PREFILL_BFLOAT16 = [(torch.bfloat16, 4, 64, "descriptor", "f16", "f16-asm"),
                        (torch.bfloat16, 2, 64, "block", "f16-asm", "f16")]


@under_interpreter
@pytest.mark.parametrize("dtype,group,block_size,kv_load,keys,values",
                         [case + modes for case in FP8_PREFILL_CASES for modes in FP8_PREFILL_MODES]
                         + FP8_PREFILL_BFLOAT16)
def test_prefill_reads_fp8_like_the_reference(triton_kernels, monkeypatch, dtype, group, block_size, kv_load,
                                              keys, values):
    monkeypatch.setattr(triton_kernels, "_PREFILL_KV_LOAD", kv_load)
    if kv_load != "gather" and block_size < triton_kernels._PREFILL_FP8_KV_TILE:
        monkeypatch.setattr(triton_kernels, "_PREFILL_FP8_KV_TILE", block_size)
    monkeypatch.setattr(triton_kernels, "_PREFILL_FP8_KEYS", keys)
    monkeypatch.setattr(triton_kernels, "_PREFILL_FP8_VALUES", values)
    generator = torch.Generator().manual_seed(group * block_size + 5)
    context_lens, q_lens = [150, 130, 70, 4], [23, 130, 1, 0]
    batch, k_scale, v_scale = fp8_paged_batch(context_lens, block_size, generator)
    q = torch.randn((sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, cumulative(q_lens), batch.context_lens, batch.block_tables, 0.125)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = triton_kernels.paged_prefill_attention_triton(*arguments, max(q_lens), **scales)
    assert out.dtype == dtype
    torch.testing.assert_close(out, paged_prefill_attention_ref(*arguments, **scales), **TOLERANCES[dtype])
    tile = prefill_tile_tokens(NUM_KV_HEADS * group, NUM_KV_HEADS)
    work = prefill_work(torch.tensor(q_lens), tile, capacity=prefill_work_capacity(sum(q_lens) + 16, 8, tile))
    torch.testing.assert_close(triton_kernels.paged_prefill_attention_triton(*arguments, None, work, **scales), out,
                               rtol=0.0, atol=0.0)


@under_interpreter
@pytest.mark.parametrize("dtype,group,partition_size", [(torch.float32, 1, None), (torch.float32, 8, 64),
                                                        (torch.float16, 3, 64)])
def test_decode_reads_fp8_like_the_reference(triton_kernels, dtype, group, partition_size):
    check_fp8_decode(triton_kernels, dtype, group, 16, partition_size, [200, 64, 1, 0], seed=group + 17)


def check_fp8_decode(triton_kernels, dtype, group: int, block_size: int, partition_size: int | None,
                     context_lens: list[int], seed: int, grid_batch: int | None = None) -> None:
    """The Triton decode over a random fp8 paged batch equals the reference; the last request, of no
    context, gets zeros."""
    generator = torch.Generator().manual_seed(seed)
    batch, k_scale, v_scale = fp8_paged_batch([max(length, 1) for length in context_lens], block_size, generator)
    batch.context_lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn((len(context_lens), NUM_KV_HEADS * group, HEAD_DIM), generator=generator).to(dtype)
    arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, 0.125)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = triton_kernels.paged_decode_attention_triton(*arguments, partition_size=partition_size,
                                                       grid_batch=grid_batch, **scales)
    torch.testing.assert_close(out, paged_decode_attention_ref(*arguments, **scales), **TOLERANCES[dtype])
    assert torch.count_nonzero(out[-1]) == 0


# (query dtype, group, block size, fixed partition size, _DECODE_KV_LOAD, _DECODE_FP8_KV_TILE, _DECODE_FP8_VALUES,
# _DECODE_FP8_KEYS): every variant bench/fp8_decode_gpu.py and bench/step_profile_gpu.py time, including the
# fallbacks (a block of 16 is read by "gather", a fixed partition of 64 by tiles of 64, "f16-asm" as "f16" under the
# interpreter, float32 queries keep "queries").
FP8_DECODE_VARIANTS = [
    (torch.float16, 3, 64, None, "block", 64, "f16", "queries"),
    (torch.float16, 1, 128, 128, "block", 128, "f16", "f16"),
    (torch.float32, 8, 64, 64, "gather", 128, "f16", "f16-asm"),
    (torch.float16, 4, 16, None, "block", 128, "f16-asm", "f16-asm"),
    (torch.float16, 2, 64, None, "block", 64, "weights", "queries"),
    (torch.bfloat16, 4, 64, None, "gather", 128, "f16-asm", "f16"),
    (torch.bfloat16, 7, 16, 128, "gather", 128, "weights", "f16-asm"),
]


@under_interpreter
@pytest.mark.parametrize("dtype,group,block_size,partition_size,kv_load,tile,values,keys", FP8_DECODE_VARIANTS)
def test_decode_variants_read_fp8_like_the_reference(triton_kernels, monkeypatch, dtype, group, block_size,
                                                     partition_size, kv_load, tile, values, keys):
    for name, value in (("_DECODE_KV_LOAD", kv_load), ("_DECODE_FP8_KV_TILE", tile), ("_DECODE_FP8_VALUES", values),
                        ("_DECODE_FP8_KEYS", keys)):
        monkeypatch.setattr(triton_kernels, name, value)
    check_fp8_decode(triton_kernels, dtype, group, block_size, partition_size, [300, 128, 65, 1, 0],
                     seed=group * block_size + tile)


@under_interpreter
@pytest.mark.parametrize("values", ["weights", "f16"])
def test_fp8_decode_keeps_small_values_in_float16(triton_kernels, monkeypatch, values):
    """Values of 1e-6 (scales near 2e-9): with float16 weights the product must not fall into float16's subnormals;
    the error is judged against the output's own size."""
    monkeypatch.setattr(triton_kernels, "_DECODE_FP8_VALUES", values)
    monkeypatch.setattr(triton_kernels, "_DECODE_FP8_KEYS", "f16")
    generator = torch.Generator().manual_seed(3)
    batch, k_scale, v_scale = fp8_paged_batch([300, 65], 64, generator)
    v_scale = v_scale * 1e-6
    q = torch.randn((2, NUM_KV_HEADS * 4, HEAD_DIM), generator=generator).to(torch.float16)
    arguments = (q, batch.k_cache, batch.v_cache, batch.context_lens, batch.block_tables, 0.125)
    want = paged_decode_attention_ref(*arguments, k_scale=k_scale, v_scale=v_scale).float()
    out = triton_kernels.paged_decode_attention_triton(*arguments, k_scale=k_scale, v_scale=v_scale).float()
    assert float(want.abs().max()) < 1e-4
    assert float((out - want).abs().max() / want.abs().max()) < 1e-2


@under_interpreter
def test_decode_variants_must_be_known(triton_kernels, monkeypatch):
    batch, k_scale, v_scale = fp8_paged_batch([20], 16, torch.Generator().manual_seed(0))
    q = torch.randn((1, NUM_KV_HEADS, HEAD_DIM))
    for name in ("_DECODE_FP8_VALUES", "_DECODE_FP8_KEYS"):
        with monkeypatch.context() as patch:
            patch.setattr(triton_kernels, name, "bf16")
            with pytest.raises(ValueError, match=f"{name} must be one of"):
                triton_kernels.paged_decode_attention_triton(q, batch.k_cache, batch.v_cache, batch.context_lens,
                                                             batch.block_tables, 0.125, k_scale=k_scale,
                                                             v_scale=v_scale)


@under_interpreter
@settings(max_examples=examples(12))
@given(seed=st.integers(0, 2**31 - 1), binade=st.integers(-28, 10), search=st.sampled_from(["serial", "parallel"]),
       heads_a_program=st.sampled_from([1, 2, 4]), tokens=st.integers(1, 5),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), outlier=st.booleans())
def test_store_kv_fp8_matches_the_reference_on_any_rows(triton_kernels, seed, binade, search, heads_a_program,
                                                        tokens, dtype, outlier):
    """Finite rows of any magnitude (normal values times 2^binade: float16's subnormals and zeros at the low end,
    its largest values at the top), with or without an outlier channel, in either search and head split: the
    reference's scales and bytes, bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn((2, tokens, NUM_KV_HEADS, HEAD_DIM), generator=generator) * 2.0**binade
    if outlier:
        rows[..., int(torch.randint(HEAD_DIM, (1,), generator=generator))] *= 40.0
    key, value = rows.clamp(-60000.0, 60000.0).to(dtype)  # a model's K/V are finite: float16 ends at 65504
    slot_mapping = torch.randperm(32, generator=generator)[:tokens]
    shape = (2, 16, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, dtype=FP8_DTYPE) for _ in range(2)] + [torch.ones(shape[:3]) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    store_kv_ref(key, value, expected[0], expected[1], slot_mapping, k_scale=expected[2], v_scale=expected[3])
    launches = triton_kernels._STORE_FP8_LAUNCHES
    triton_kernels._STORE_FP8_LAUNCHES = ((None, search, heads_a_program, 2),)
    try:
        triton_kernels.store_kv_triton(key, value, caches[0], caches[1], slot_mapping, k_scale=caches[2],
                                       v_scale=caches[3])
    finally:
        triton_kernels._STORE_FP8_LAUNCHES = launches
    for got, want in zip(caches, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@under_interpreter
def test_store_search_must_be_known(triton_kernels, monkeypatch):
    monkeypatch.setattr(triton_kernels, "_STORE_FP8_LAUNCHES", ((1, "serial", 8, 4), (None, "vectorised", 1, 2)))
    key = torch.randn((2, NUM_KV_HEADS, HEAD_DIM))
    caches = [torch.zeros((1, 16, NUM_KV_HEADS, HEAD_DIM), dtype=FP8_DTYPE) for _ in range(2)]
    with pytest.raises(ValueError, match="_STORE_FP8_LAUNCHES: the search must be one of"):
        scales = [torch.ones((1, 16, NUM_KV_HEADS)) for _ in range(2)]
        triton_kernels.store_kv_triton(key, key, *caches, torch.tensor([0, 1]), k_scale=scales[0], v_scale=scales[1])


@under_interpreter
def test_fp8_cache_needs_both_scales(triton_kernels):
    batch, k_scale, _ = fp8_paged_batch([20], 16, torch.Generator().manual_seed(0))
    q = torch.randn((1, NUM_KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        triton_kernels.paged_decode_attention_triton(q, batch.k_cache, batch.v_cache, batch.context_lens,
                                                     batch.block_tables, 0.125, k_scale=k_scale)


def _compile_all_for_hopper() -> int:
    store, attention = hopper_fp8_launches()
    return (compile_for_hopper(hopper_launches, argument_type)
            or compile_for_hopper(lambda: store, fp8_argument_type("*u8"))
            or compile_for_hopper(lambda: attention, fp8_argument_type("*fp8e4nv")))


if __name__ == "__main__" and sys.argv[1:] == [HOPPER_COMMAND]:
    sys.exit(_compile_all_for_hopper())
