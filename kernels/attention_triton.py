"""Triton paged attention: storing K/V into cache slots, prefill over variable-length prompts, split-K decode.

Same signatures and semantics as ``attention_ref.py`` (the oracle the tests compare against). Each kernel reads a
sequence's KV entries through its block table one token tile at a time, gathering the slot of every token, so any
block size works and a tile may straddle blocks. Grouped-query attention is handled by giving one program all the
query heads of a KV head: the group's heads become rows of the same matrix product, so each K/V tile is loaded once
per group instead of once per query head. Softmax is the online (running max and sum) form in float32, in base 2
with ``scale * log2(e)`` folded into the logits.

Decode splits each sequence into partitions processed by separate programs, then a second kernel merges the
partial results with their log-sum-exp. The number of partitions comes from the batch size only and each
sequence's partition length from its context length, read on the device, so a decode step can be captured in a
CUDA graph and a wide (padded) block table costs nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from zipage import decode_grid
from zipage.kernels.attention_ref import PrefillWork
from zipage.kernels.kv_quant_ref import FP8_DTYPE, FP8_MAX, SCALE_SEARCH_SIZE, SCALE_SEARCH_STEP, SEARCH_FIXED_POINT

_LOG2_E = 1.4426950408889634

# Tokens per K/V tile in the prefill loop. 64 keeps a [64, 128] bfloat16 tile (16 KiB) per operand in shared memory
# with room for double buffering.
_KV_TILE = 64
# Query rows (tokens x heads of a group) per prefill program.
_PREFILL_ROWS = 64
_PREFILL_NUM_WARPS = 4
_PREFILL_NUM_STAGES = 3
# How a prefill program reads a K/V tile (launch-time variants, compared by bench/prefill_attention_gpu.py):
#   "gather"     one block-table entry per token and a [KV_TILE, HEAD_DIM] offset tensor built from them (any
#                block size; a tile may straddle blocks);
#   "block"      when the block size is a multiple of KV_TILE a tile lies inside one cache block: one block id
#                per tile (a scalar load) and the tile's offsets as a scalar base + arange, provably contiguous;
#   "descriptor" as "block", through a host-built TMA tensor descriptor of the whole cache (Hopper's bulk
#                tensor copy engine), where the cache's layout allows one ([blocks * slots, heads * head_dim]).
# (tl.make_block_ptr is no option: Triton 3.7+ removed block pointers in favour of tensor descriptors.)
# "block" and "descriptor" fall back to "gather" when BLOCK_SIZE % KV_TILE != 0, and "descriptor" to
# "block" when the cache cannot be described (padded head_dim, strided blocks). Shipped: "descriptor" with the
# split and the fold below, 1.27-1.47x faster than "gather" from 2k tokens on an H200 (docs/BENCHMARKS.md, 'Prefill').
_PREFILL_KV_LOAD = "descriptor"
# Split the causal KV loop: the tiles that every row of a program sees whole run without the causal and
# token masks, only the last (diagonal) tiles apply them.
_PREFILL_SPLIT_CAUSAL = True
# Keep the logits unscaled and apply scale * log2(e) inside exp2's argument (a fused multiply-add), as
# Triton's fused-attention tutorial does, instead of scaling every logit first.
_PREFILL_FOLD_SCALE = True
_PREFILL_KV_LOADS = ("gather", "block", "descriptor")
# How a prefill program widens FP8 keys and values: the modes of _DECODE_FP8_KEYS / _DECODE_FP8_VALUES below.
# The decode's choice ("f16" keys, "f16-asm" values): 8-11 % faster than "queries" / "weights" (the bytes widened
# after shared memory, one at a time on Hopper) over a 2k-token chunk with 0-16k cached entries on an H200, still
# ~2x bfloat16's kernel (docs/BENCHMARKS.md, 'Beside published tables', TensorRT-LLM's row 2).
_PREFILL_FP8_KEYS = "f16"
_PREFILL_FP8_VALUES = "f16-asm"
# K/V tile and pipelining depth of a prefill program with an FP8 cache (rows and warps as bfloat16's): 128-token
# tiles in 2 stages were the fastest of six launch configs at every point timed on an H200, 5-10 % under 64 / 3
# from 2,048 new tokens at Qwen3-8B's and 0.6B's shapes, with a block of 64 (so read by the gather load; docs/
# BENCHMARKS.md, 'Beside published tables', launch configs by shape). A block that is no multiple of the tile
# gathers, as bfloat16's does.
_PREFILL_FP8_KV_TILE = 128
_PREFILL_FP8_NUM_STAGES = 2
# Resident prefill programs per SM when a work list is walked (a CUDA graph's padded step): one wave of
# programs, each taking several items, instead of one program per item of a mostly padded list.
_PREFILL_PROGRAMS_PER_SM = 2
# tl.dot on tensor cores needs every dimension to be at least 16.
_MIN_DOT_DIM = 16
# Decode: tokens per K/V tile, warps per program and software-pipelining depth of the partition kernel.
_DECODE_KV_TILE = 64
_DECODE_NUM_WARPS = 4
_DECODE_NUM_STAGES = 3
# Launch-time variants of decode (issue #34; bench/fp8_decode_gpu.py checks and times them on a GPU):
#   _DECODE_KV_LOAD      "gather": a block-table entry per token (any block size); "block": a tile lies inside
#                        one cache block (BLOCK_SIZE % tile == 0, else "gather"): one block id per tile and
#                        contiguous offsets;
#   _DECODE_FP8_KV_TILE  tokens per tile with an FP8 cache (a partition is cut into whole tiles; a fixed
#                        partition_size that is not a multiple of it falls back to _DECODE_KV_TILE);
#   _DECODE_FP8_VALUES   how FP8 values reach the weights @ values product: "weights" (widened to the queries'
#                        dtype where the compiler puts it, after shared memory, where Hopper reads the byte
#                        operand one byte at a time; the value scales on the weights), "f16-asm" (widened to
#                        float16 in registers by inline assembly before shared memory: a 16-bit transposing
#                        ldmatrix), "f16" (the same math, the widening placed by the compiler: what the
#                        interpreter runs for "f16-asm").
#   _DECODE_FP8_KEYS     how FP8 keys reach the queries @ keys product: "queries" (widened to the queries' dtype,
#                        bfloat16 through float32), "f16" (the queries narrowed to float16 once a program, clamped
#                        to its range; the keys widened by the compiler), "f16-asm" (the same, the keys widened
#                        by inline assembly before shared memory, like the values);
#   _DECODE_FP8_WARPS, _DECODE_FP8_STAGES  warps per program and pipelining depth with an FP8 cache;
#   _DECODE_FP8_MAXNREG  registers a thread may hold with an FP8 cache (None: the compiler's choice): the programs
#                        an SM holds at once follow from it.
# Chosen on an H200 in the engine's decode step (docs/BENCHMARKS.md, 'FP8 KV cache', 2026-12-01): 64-token FP8
# tiles, values widened by inline assembly, float16 queries and keys, 2 warps and 2 stages a program. The compiler
# gives it 196 registers a thread, no spill, 38 KB of shared memory: 5 programs an SM (decode_grid's
# FP8_PROGRAMS_PER_SM), against 3 for the 4-warp launch of 128-token tiles capped at 168 registers (spilling) that
# it replaced: 0.81-0.85x bfloat16's attention time at batch 64-512 where that one took 0.94-1.18x.
_DECODE_KV_LOAD = "gather"
_DECODE_FP8_KV_TILE = 64
_DECODE_FP8_VALUES = "f16-asm"
_DECODE_FP8_KEYS = "f16"
_DECODE_FP8_WARPS = 2
_DECODE_FP8_STAGES = 2
_DECODE_FP8_MAXNREG = None
_DECODE_KV_LOADS = ("gather", "block")
_DECODE_FP8_VALUE_MODES = ("weights", "f16", "f16-asm")
_DECODE_FP8_KEY_MODES = ("queries", "f16", "f16-asm")
# Store with an FP8 cache: how each call launches, by its token count: rows of (at most this many tokens, None =
# any; the search; KV heads a program; warps a program), the first row that holds the call wins. Each (token,
# head) picks its scale by a search of 8 candidates with exact divisions. "serial" tries them one after another,
# a chain of eight reductions whose length follows the elements each thread holds; "parallel" side by side on an
# axis of their own, one reduction. Measured in a CUDA graph on an H200 (bench/store_kv_gpu.py, docs/BENCHMARKS.md
# 'FP8 KV cache'): serial with a token's 8 heads a program and 8 warps (4 elements a thread) took 6.5 us a call up
# to 128 tokens, 8.4 at 256, 47 at 2,048, the fastest serial launch at every count (bfloat16's copy: 1.2-3.6 us);
# parallel with one head and 2 warps a program 4.2 us at 32 tokens and 6.3 at 128, but 9.9 at 256 and 62 at 2,048
# (the same work over 8x the programs).
_STORE_FP8_LAUNCHES = ((128, "parallel", 1, 2), (None, "serial", 8, 8))
_STORE_FP8_SEARCHES = ("serial", "parallel")
# A decode partition is never shorter than this many tiles: below it the partial write and the merge cost more
# than the parallelism gained.
_MIN_TILES_PER_PARTITION = 2
# The decode grid's rule lives in zipage/decode_grid.py (the analytic cost model reads it too); these module
# globals are its knobs here, so tests and bench/check_attention_gpu.py can patch them.
_PROGRAMS_PER_SM = decode_grid.PROGRAMS_PER_SM
_FP8_PROGRAMS_PER_SM = decode_grid.FP8_PROGRAMS_PER_SM
# Round the partition count up instead of down (the first version's rule, kept for bench/check_attention_gpu.py).
_ROUND_PARTITIONS_UP = False
# How a step's rows are split into partitions (zipage/decode_grid.py DECODE_SPLITS): "batch" or "balanced".
_DECODE_SPLIT = "batch"
# Lengths summed per iteration where a balanced split sums the step's context lengths.
_SPLIT_SUM_TILE = 256
# Partial results merged per iteration of the decode merge kernel.
_MERGE_TILE = 16
# The interpreter has no streaming multiprocessors to fill; a small count keeps its grids small.
_INTERPRETER_SM_COUNT = 2


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise run as tf32 on the GPU and differ from the reference by ~1e-3.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _streaming_multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            "k_cache and v_cache must share one layout [num_blocks, block_size, num_kv_heads, head_dim] with a "
            f"contiguous head_dim; got strides {tuple(k_cache.stride())} and {tuple(v_cache.stride())}"
        )


def _check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the cache is float8 (then both scales must be given, float32 ``[num_blocks, block_size,
    num_kv_heads]`` with one layout and a contiguous head axis); a cache in the compute dtype takes none."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"a {k_cache.dtype} KV cache takes {'both' if fp8 else 'no'} k_scale and v_scale")
    if fp8 and (k_scale.dtype != torch.float32 or k_scale.shape != k_cache.shape[:3]
                or k_scale.stride() != v_scale.stride() or k_scale.stride(2) != 1):
        raise ValueError("k_scale and v_scale must be float32 [num_blocks, block_size, num_kv_heads] with one "
                         f"layout and a contiguous head axis; got {tuple(k_scale.shape)} {k_scale.dtype}")
    return fp8


def _scale_strides(k_scale: torch.Tensor | None) -> tuple[int, int]:
    """The block and slot strides of a scale tensor (zeros where there is none: the kernel never reads it)."""
    return (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)


def _group_size(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def _with_contiguous_head_dim(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


@triton.jit
def _encode_e4m3(y):
    """The float8 e4m3fn bytes (uint8) of float32 ``y`` with ``|y| <= 448``, rounded to nearest even: bit-identical
    to torch's ``.to(torch.float8_e4m3fn)``. Spelled out in integer arithmetic because the Triton interpreter's
    float32 -> float8e4nv conversion is wrong (it rounds ties away, drops the carry into the exponent, flushes
    subnormals and wraps past 448; docs/kernels.md, 'FP8 KV cache'), and one code path must serve the tests and
    the GPU."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    # Normal range (>= 2^-6): keep 3 of float32's 23 mantissa bits, round to nearest even on the bits (a carry
    # into the exponent is the right answer), rebias the exponent from 127 to 7.
    rounded = magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    # Subnormal range: multiples of 2^-9; adding 2^23 to magnitude * 2^9 (exact) rounds it to an integer, to
    # nearest even, in float32 (code 8 is the smallest normal, 2^-6, as it should be).
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(magnitude >= 0.015625, normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _e4m3_magnitude(magnitude):
    """The float32 value of ``magnitude`` (``0 <= magnitude <= 448``) rounded to e4m3 as ``_encode_e4m3`` rounds it:
    what the code decodes to, for the scale search."""
    magnitude_bits = magnitude.to(tl.uint32, bitcast=True)
    # Normal range: the rounded bits with the 20 dropped mantissa bits cleared are the rounded float32.
    normal = ((magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    return tl.where(magnitude >= 0.015625, normal, subnormal)


@triton.jit
def _quantize_e4m3(x, mask, FP8_MAX: tl.constexpr, SEARCH_STEP: tl.constexpr, SEARCH_SIZE: tl.constexpr,
                   FIXED_POINT: tl.constexpr):
    """(bytes, scales) of rows ``x`` ``[heads, head_dim]`` (masked elements zero): one scale per row, of amax / 448
    * (1 + j * SEARCH_STEP) for j < SEARCH_SIZE the one of least squared round-trip error, the first of equals (1
    for a zero row), as ``kv_quant_ref.quantize_kv``: the same IEEE divisions, and each element's squared error
    truncated to int64 fixed point before the sum, so the choice, the scales and the bytes match torch's."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    amax = tl.max(tl.abs(x), axis=1)
    nonzero = amax > 0
    base = tl.where(nonzero, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
    best_scale = base
    best_scaled = x
    best_error = tl.full(amax.shape, 9223372036854775807, tl.int64)
    for j in tl.static_range(SEARCH_SIZE):
        candidate = 1.0 + j * SEARCH_STEP
        scale = tl.where(nonzero, base * candidate, 1.0)
        scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        magnitude = tl.abs(scaled)
        # Exact, as the reference's: the rounded value lies within a factor 2 of the value (or is 0).
        error = (magnitude - _e4m3_magnitude(tl.minimum(magnitude, FP8_MAX))) * candidate
        total = tl.sum((error * error * FIXED_POINT).to(tl.int64), axis=1)
        better = total < best_error
        best_scale = tl.where(better, scale, best_scale)
        best_scaled = tl.where(better[:, None], scaled, best_scaled)
        best_error = tl.where(better, total, best_error)
    scaled = tl.minimum(tl.maximum(best_scaled, -FP8_MAX), FP8_MAX)
    return _encode_e4m3(scaled), best_scale


@triton.jit
def _quantize_e4m3_parallel(x, mask, FP8_MAX: tl.constexpr, SEARCH_STEP: tl.constexpr, SEARCH_SIZE: tl.constexpr,
                            FIXED_POINT: tl.constexpr):
    """``_quantize_e4m3`` with the candidates side by side on an axis of their own ([heads, candidates,
    head_dim]) instead of one after another: the same divisions and sums, so the same scales and bytes, but one
    reduction where the loop waits on eight (a short store is latency, not work)."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    amax = tl.max(tl.abs(x), axis=1)
    nonzero = amax > 0
    base = tl.where(nonzero, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
    index = tl.arange(0, SEARCH_SIZE)
    candidate = 1.0 + index.to(tl.float32) * SEARCH_STEP  # exact: SEARCH_STEP is a power of two
    scale = tl.where(nonzero[:, None], base[:, None] * candidate[None, :], 1.0)
    scaled = tl.math.div_rn(tl.broadcast_to(x[:, None, :], (x.shape[0], SEARCH_SIZE, x.shape[1])),
                            tl.broadcast_to(scale[:, :, None], (x.shape[0], SEARCH_SIZE, x.shape[1])))
    magnitude = tl.abs(scaled)
    error = (magnitude - _e4m3_magnitude(tl.minimum(magnitude, FP8_MAX))) * candidate[None, :, None]
    total = tl.sum((error * error * FIXED_POINT).to(tl.int64), axis=2)
    least = tl.min(total, axis=1)
    best = tl.min(tl.where(total == least[:, None], index[None, :], SEARCH_SIZE), axis=1)  # the first of equals
    best_scale = tl.sum(tl.where(index[None, :] == best[:, None], scale, 0.0), axis=1)  # one term: exact
    scaled = tl.math.div_rn(x, tl.broadcast_to(best_scale[:, None], x.shape))
    scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
    return _encode_e4m3(scaled), best_scale


@triton.jit
def _head_tile(NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PADDED: tl.constexpr,
               HEAD_DIM_PADDED: tl.constexpr):
    """One token's [heads, head_dim] tile, padded to powers of two: its row and column indices
    and the mask of the real lanes (what the store kernels copy)."""
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    return heads, dims, (heads < NUM_HEADS) & (dims < HEAD_DIM)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    scale_block_stride,
    scale_slot_stride,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    SEARCH_STEP: tl.constexpr,
    SEARCH_SIZE: tl.constexpr,
    SEARCH_FIXED_POINT: tl.constexpr,
    SEARCH_PARALLEL: tl.constexpr,
):
    # Program (token, g) stores the token's KV heads g * HEAD_GROUP .. (g + 1) * HEAD_GROUP - 1.
    token = tl.program_id(0)
    first_head = tl.program_id(1) * HEAD_GROUP
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = first_head + tl.arange(0, HEAD_GROUP)[:, None]
        dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        cache_offsets = (slot // BLOCK_SIZE) * cache_block_stride + (slot % BLOCK_SIZE) * cache_slot_stride
        cache_offsets += heads * cache_head_stride + dims
        token_offset = token.to(tl.int64)
        key = tl.load(key_ptr + token_offset * key_token_stride + heads * key_head_stride + dims, mask=mask,
                      other=0.0)
        value = tl.load(value_ptr + token_offset * value_token_stride + heads * value_head_stride + dims, mask=mask,
                        other=0.0)
        if FP8:
            # The caches come as uint8 views: the bytes are encoded here, one scale per (token, head).
            scale_heads = first_head + tl.arange(0, HEAD_GROUP)
            scale_offsets = (slot // BLOCK_SIZE) * scale_block_stride + (slot % BLOCK_SIZE) * scale_slot_stride
            if SEARCH_PARALLEL:
                key_bytes, key_scale = _quantize_e4m3_parallel(key, mask, FP8_MAX, SEARCH_STEP, SEARCH_SIZE,
                                                               SEARCH_FIXED_POINT)
                value_bytes, value_scale = _quantize_e4m3_parallel(value, mask, FP8_MAX, SEARCH_STEP, SEARCH_SIZE,
                                                                   SEARCH_FIXED_POINT)
            else:
                key_bytes, key_scale = _quantize_e4m3(key, mask, FP8_MAX, SEARCH_STEP, SEARCH_SIZE,
                                                      SEARCH_FIXED_POINT)
                value_bytes, value_scale = _quantize_e4m3(value, mask, FP8_MAX, SEARCH_STEP, SEARCH_SIZE,
                                                          SEARCH_FIXED_POINT)
            tl.store(k_cache_ptr + cache_offsets, key_bytes, mask=mask)
            tl.store(v_cache_ptr + cache_offsets, value_bytes, mask=mask)
            tl.store(k_scale_ptr + scale_offsets + scale_heads, key_scale, mask=scale_heads < NUM_KV_HEADS)
            tl.store(v_scale_ptr + scale_offsets + scale_heads, value_scale, mask=scale_heads < NUM_KV_HEADS)
        else:
            tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_queries_kernel(
    query_ptr,
    query_cache_ptr,
    query_slot_mapping_ptr,
    query_token_stride,
    query_head_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    index = tl.load(query_slot_mapping_ptr + token).to(tl.int64)
    if index >= 0:
        heads, dims, mask = _head_tile(NUM_HEADS, HEAD_DIM, HEADS_PADDED, HEAD_DIM_PADDED)
        row = tl.load(query_ptr + token.to(tl.int64) * query_token_stride + heads * query_head_stride + dims,
                      mask=mask, other=0.0)
        offsets = index * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
        tl.store(query_cache_ptr + offsets, row.to(query_cache_ptr.dtype.element_ty), mask=mask)


def store_queries_triton(query: torch.Tensor, query_cache: torch.Tensor, query_slot_mapping: torch.Tensor) -> None:
    """Write ``query`` ``[num_tokens, num_heads, head_dim]`` into the contiguous query cache ``[num_slots, window,
    num_heads, head_dim]`` at flat row ``query_slot_mapping`` (int64, -1 = skip). One program per token, each
    deciding on the device whether to store, so a captured decode step costs one launch per layer whatever rows
    are kept."""
    if not query_cache.is_contiguous():
        raise ValueError("query_cache must be contiguous: rows are addressed as index * heads * head_dim")
    query = _with_contiguous_head_dim(query)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    _store_queries_kernel[(num_tokens,)](
        query,
        query_cache,
        query_slot_mapping,
        query.stride(0),
        query.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PADDED=triton.next_power_of_2(num_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the slots of ``slot_mapping``
    (``block_id * block_size + offset``, -1 = skip). One program per token (per token and a few heads with a
    float8 cache, as ``_STORE_FP8_LAUNCHES`` says). A float8 cache comes with its scales (float32
    ``[num_blocks, block_size, num_kv_heads]``): each (token, head) is quantized with its own."""
    _check_cache(k_cache, v_cache)
    fp8 = _check_scales(k_cache, k_scale, v_scale)
    key = _with_contiguous_head_dim(key)
    value = _with_contiguous_head_dim(value)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # bfloat16: a copy, one program a token; FP8: the scale search, launched by `_STORE_FP8_LAUNCHES`.
    heads_padded = triton.next_power_of_2(num_kv_heads)
    search, head_group, warps = "serial", heads_padded, 4
    if fp8:
        search, heads, warps = next(row[1:] for row in _STORE_FP8_LAUNCHES if row[0] is None or num_tokens <= row[0])
        if search not in _STORE_FP8_SEARCHES:
            raise ValueError(f"_STORE_FP8_LAUNCHES: the search must be one of {_STORE_FP8_SEARCHES}, not {search!r}")
        head_group = min(heads, heads_padded)
    _store_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, head_group))](
        key,
        value,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping,
        k_scale if fp8 else slot_mapping,
        v_scale if fp8 else slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *_scale_strides(k_scale),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_GROUP=head_group,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        FP8=fp8,
        FP8_MAX=FP8_MAX,
        SEARCH_STEP=SCALE_SEARCH_STEP,
        SEARCH_SIZE=SCALE_SEARCH_SIZE,
        SEARCH_FIXED_POINT=SEARCH_FIXED_POINT,
        SEARCH_PARALLEL=search == "parallel",
        num_warps=warps,
    )


@triton.jit
def _attend_kv_tile(
    queries,
    running_max,
    running_sum,
    accumulator,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,
    kv_head,
    tile_start,
    kv_end,
    visible_until,
    qk_scale,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_LOAD: tl.constexpr,
    MASKED: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    k_desc,
    v_desc,
    k_scale_ptr,
    v_scale_ptr,
    scale_block_stride,
    scale_slot_stride,
    FP8: tl.constexpr,
    FP8_VALUES: tl.constexpr,
    FP8_KEYS: tl.constexpr,
):
    """One online-softmax step: fold the KV entries ``tile_start .. tile_start + KV_TILE - 1`` (those below
    ``kv_end``) into the running state of every query row; row ``r`` sees entries ``<= visible_until[r]``.

    ``KV_LOAD`` is how the tile is read (``_PREFILL_KV_LOAD``; every mode but "gather" needs the tile inside one
    cache block, BLOCK_SIZE % KV_TILE == 0). Without ``MASKED`` the caller guarantees that every row sees every
    entry of the tile and that the tile ends at or before ``kv_end``: no causal or token mask is applied. With
    ``FOLD_SCALE`` the logits stay unscaled and ``qk_scale`` is applied inside the exponent's argument (one fused
    multiply-add per entry instead of a multiply and a subtraction), as the scale is positive. With ``FP8`` the
    tile's keys and values are float8 with a float32 scale per entry (this KV head's): they are widened to the
    queries' dtype (exact) for the products, the key scales multiply the logits' columns and the value scales
    the softmax weights' columns, which is the dot with the dequantized entries."""
    tokens = tile_start + tl.arange(0, KV_TILE)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    if MASKED:
        token_mask = tokens < kv_end
    if KV_LOAD == "gather":
        if MASKED:
            block_ids = tl.load(block_table_row_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        else:
            block_ids = tl.load(block_table_row_ptr + tokens // BLOCK_SIZE).to(tl.int64)
        token_offsets = block_ids * cache_block_stride + (tokens % BLOCK_SIZE) * cache_slot_stride
        token_offsets += kv_head * cache_head_stride
        kv_offsets = token_offsets[:, None] + dims[None, :]
        if FP8:
            scale_offsets = block_ids * scale_block_stride + (tokens % BLOCK_SIZE) * scale_slot_stride + kv_head
    else:
        # The tile lies inside one block: its first entry's block id is the whole tile's.
        block_id = tl.load(block_table_row_ptr + tile_start // BLOCK_SIZE).to(tl.int64)
        slot = tile_start % BLOCK_SIZE
        if FP8:
            scale_offsets = (block_id * scale_block_stride + (slot + tl.arange(0, KV_TILE)) * scale_slot_stride
                             + kv_head)
        if KV_LOAD == "block":
            tile_base = block_id * cache_block_stride + slot * cache_slot_stride + kv_head * cache_head_stride
            kv_offsets = tile_base + (tl.arange(0, KV_TILE) * cache_slot_stride)[:, None] + dims[None, :]
    if KV_LOAD == "descriptor":
        # Rows of the descriptor are cache slots (block * BLOCK_SIZE + slot), columns heads x head_dim.
        keys = k_desc.load([(block_id * BLOCK_SIZE + slot).to(tl.int32), kv_head * HEAD_DIM])
    else:
        if MASKED:
            kv_mask = token_mask[:, None] & (dims[None, :] < HEAD_DIM)
            keys = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        elif HEAD_DIM == HEAD_DIM_PADDED:
            keys = tl.load(k_cache_ptr + kv_offsets)
        else:
            keys = tl.load(k_cache_ptr + kv_offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    if FP8:
        if MASKED:
            key_scales = tl.load(k_scale_ptr + scale_offsets, mask=token_mask, other=0.0)
            value_scales = tl.load(v_scale_ptr + scale_offsets, mask=token_mask, other=0.0)
        else:
            key_scales = tl.load(k_scale_ptr + scale_offsets)
            value_scales = tl.load(v_scale_ptr + scale_offsets)
        if FP8_KEYS == "f16-asm":
            keys = _e4m3_to_f16(keys)  # the queries were narrowed to float16 by the caller
        else:
            keys = keys.to(queries.dtype)
    logits = tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION)
    if FP8:
        logits = logits * key_scales[None, :]
    if not FOLD_SCALE:
        logits = logits * qk_scale
    if MASKED:
        visible = token_mask[None, :] & (tokens[None, :] <= visible_until[:, None])
        logits = tl.where(visible, logits, float("-inf"))
    # Every row sees entry 0 and the first tile starts there, so the running max is finite after one step and
    # a row with nothing visible in a later tile just gets zero weights.
    if FOLD_SCALE:
        new_max = tl.maximum(running_max, tl.max(logits, axis=1) * qk_scale)
        weights = tl.exp2(logits * qk_scale - new_max[:, None])
    else:
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        weights = tl.exp2(logits - new_max[:, None])
    rescale = tl.exp2(running_max - new_max)
    running_sum = running_sum * rescale + tl.sum(weights, axis=1)
    if KV_LOAD == "descriptor":
        values = v_desc.load([(block_id * BLOCK_SIZE + slot).to(tl.int32), kv_head * HEAD_DIM])
        if FP8:
            # Widened here, before the mask below (as the other loads' widening further down would be).
            if FP8_VALUES == "f16-asm":
                values = _e4m3_to_f16(values)
            elif FP8_VALUES != "weights" or queries.dtype == tl.float16:
                values = values.to(tl.float16)
            else:
                values = values.to(queries.dtype)
        if MASKED:
            # The descriptor reads whole tiles: entries past kv_end hold whatever the block holds (zero weight,
            # but 0 * inf or 0 * nan would poison the sum).
            values = tl.where(token_mask[:, None], values, 0.0)
    else:
        if MASKED:
            values = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        elif HEAD_DIM == HEAD_DIM_PADDED:
            values = tl.load(v_cache_ptr + kv_offsets)
        else:
            values = tl.load(v_cache_ptr + kv_offsets, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    if FP8 and (FP8_VALUES != "weights" or queries.dtype == tl.float16):
        # Widened to float16 in registers, before the tile reaches shared memory, so that the product reads a
        # 16-bit operand (a transposing ldmatrix); left to the compiler, the widening moves after the shared
        # memory load, where an 8-bit operand that is not contiguous along the product's K axis (the tokens)
        # is read one byte at a time. float16 holds every e4m3 value exactly (bfloat16 would cost a widening
        # through float32 per element); the weights, scaled by the value scales over the tile's largest one,
        # lie in [0, 1], where float16 is three bits finer than bfloat16. Float16 weights take this path in
        # the "weights" mode too ("f16" keys narrowed the queries, or a float16 model): weight x scale far
        # below 1 would fall into float16's subnormals.
        if KV_LOAD == "descriptor":
            pass  # widened to float16 at the load
        elif FP8_VALUES == "f16-asm":
            values = _e4m3_to_f16(values)
        else:
            values = values.to(tl.float16)
        if queries.dtype == tl.float32:
            values = values.to(tl.float32)  # float32 compute keeps float32 weights
        value_scale_max = tl.max(value_scales, axis=0)
        value_scale_max = tl.where(value_scale_max > 0, value_scale_max, 1.0)
        weights = weights * (value_scales / value_scale_max)[None, :]
        accumulator = accumulator * rescale[:, None] + value_scale_max * tl.dot(
            weights.to(values.dtype), values, input_precision=DOT_PRECISION)
    else:
        if FP8 and KV_LOAD != "descriptor":
            values = values.to(queries.dtype)
        if FP8:
            # The running sum above took the plain weights; the value scales only weigh the values.
            weights = weights * value_scales[None, :]
        accumulator = accumulator * rescale[:, None] + tl.dot(
            weights.to(values.dtype), values, input_precision=DOT_PRECISION
        )
    return new_max, running_sum, accumulator


@triton.jit
def _e4m3_to_f16(x):
    """float16 of ``x`` (float8 e4m3fn, exact) by the hardware's conversion (sm_89+), in inline assembly the
    compiler treats as having effects, so that it stays where it is written, before the shared memory store
    (the same conversion spelled ``x.to(tl.float16)`` is moved after it). The interpreter cannot run inline
    assembly: under it the launch asks for "f16" instead (``_decode_fp8_values``)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


# Integer arguments that change from step to step. Triton specialises an integer argument on
# being 1 or a multiple of 16 and compiles a variant for each: a prefill whose widest block table
# had one block (a 64-token prompt at b = 64) compiled a new kernel in the middle of an H200 run and
# took 810 ms. Not specialising them costs an unproven alignment hint on an index computation.
_STEP_VARYING = ["block_table_stride", "num_partitions", "fixed_partition_size", "batch"]


@triton.jit
def _queries_to_f16(queries):
    """The queries narrowed to float16 for float16 keys: float16 holds every e4m3 key exactly and widens it in one
    instruction; a query beyond its range (never seen in practice) is clamped rather than made infinite."""
    return tl.minimum(tl.maximum(queries.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _prefill_tile(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    seq,
    query_tile,
    qk_scale,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    block_table_stride,
    kv_head,
    k_desc,
    v_desc,
    k_scale_ptr,
    v_scale_ptr,
    scale_block_stride,
    scale_slot_stride,
    GROUP: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    QUERY_TOKENS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_LOAD: tl.constexpr,
    SPLIT_CAUSAL: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_KEYS: tl.constexpr,
    FP8_VALUES: tl.constexpr,
):
    """Attention of query tile ``query_tile`` of sequence ``seq`` (``QUERY_TOKENS`` new tokens times the
    ``GROUP`` query heads of ``kv_head``) over the sequence's paged KV, up to each row's causal limit."""
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    first_token = query_tile * QUERY_TOKENS

    # Row r of this program is query token first_token + r // GROUP_PADDED, head r % GROUP_PADDED of the group.
    rows = tl.arange(0, QUERY_TOKENS * GROUP_PADDED)
    row_tokens = first_token + rows // GROUP_PADDED
    row_heads = kv_head * GROUP + rows % GROUP_PADDED
    row_mask = (row_tokens < q_len) & (rows % GROUP_PADDED < GROUP)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q_offsets = (q_start + row_tokens).to(tl.int64)[:, None] * q_token_stride
    q_offsets += row_heads[:, None] * q_head_stride + dims[None, :]
    queries = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    if FP8 and FP8_KEYS != "queries":
        queries = _queries_to_f16(queries)

    # The new tokens are the last q_len cached entries; causality is by KV index.
    cached_prefix = context_len - q_len
    visible_until = cached_prefix + row_tokens
    last_token = tl.minimum(first_token + QUERY_TOKENS, q_len) - 1
    # A tile past the end of the sequence (the grid is sized for the longest one) loops zero times.
    kv_end = tl.where(first_token < q_len, cached_prefix + last_token + 1, 0)

    running_max = tl.full([QUERY_TOKENS * GROUP_PADDED], float("-inf"), tl.float32)
    running_sum = tl.zeros([QUERY_TOKENS * GROUP_PADDED], tl.float32)
    accumulator = tl.zeros([QUERY_TOKENS * GROUP_PADDED, HEAD_DIM_PADDED], tl.float32)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    masked_start = 0
    if SPLIT_CAUSAL:
        # Tiles that end at or before the first row's causal limit are seen whole by every row (and end before
        # kv_end, which is past that limit): no masks. Only the tiles from there on (the diagonal) need them.
        masked_start = tl.minimum((cached_prefix + first_token + 1) // KV_TILE * KV_TILE, kv_end)
        for tile_start in range(0, masked_start, KV_TILE):
            running_max, running_sum, accumulator = _attend_kv_tile(
                queries, running_max, running_sum, accumulator, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
                kv_head, tile_start, kv_end, visible_until, qk_scale, cache_block_stride, cache_slot_stride,
                cache_head_stride, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, KV_TILE, DOT_PRECISION, KV_LOAD,
                False, FOLD_SCALE, k_desc, v_desc, k_scale_ptr, v_scale_ptr, scale_block_stride,
                scale_slot_stride, FP8, FP8_VALUES, FP8_KEYS)
    for tile_start in range(masked_start, kv_end, KV_TILE):
        running_max, running_sum, accumulator = _attend_kv_tile(
            queries, running_max, running_sum, accumulator, k_cache_ptr, v_cache_ptr, block_table_row_ptr,
            kv_head, tile_start, kv_end, visible_until, qk_scale, cache_block_stride, cache_slot_stride,
            cache_head_stride, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, KV_TILE, DOT_PRECISION, KV_LOAD,
            True, FOLD_SCALE, k_desc, v_desc, k_scale_ptr, v_scale_ptr, scale_block_stride, scale_slot_stride,
            FP8, FP8_VALUES, FP8_KEYS)

    out = accumulator / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    out_offsets = (q_start + row_tokens).to(tl.int64)[:, None] * out_token_stride
    out_offsets += row_heads[:, None] * out_head_stride + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["block_table_stride", "num_work_items"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    work_items_ptr,
    num_work_items,
    qk_scale,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    block_table_stride,
    k_desc,
    v_desc,
    k_scale_ptr,
    v_scale_ptr,
    scale_block_stride,
    scale_slot_stride,
    GROUP: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    QUERY_TOKENS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WORK_ITEMS: tl.constexpr,
    KV_LOAD: tl.constexpr,
    SPLIT_CAUSAL: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_KEYS: tl.constexpr,
    FP8_VALUES: tl.constexpr,
):
    kv_head = tl.program_id(2)
    if USE_WORK_ITEMS:
        # A fixed set of programs walks the work list: in round r, program p takes item r * P + p, or
        # r * P + (P - 1 - p) in odd rounds (a sequence's later tiles attend to more entries, so the
        # snake order pairs each program's cheap items with expensive ones). Padding items (-1, -1)
        # cost two loads, where a program each (a CUDA graph's list is sized for its bucket's worst
        # case: mostly padding) cost ~40 us a layer in empty programs on an H200.
        programs = tl.num_programs(0)
        program = tl.program_id(0)
        for round_start in range(0, num_work_items, programs):
            odd = (round_start // programs) % 2
            item = (round_start + tl.where(odd == 1, programs - 1 - program, program)).to(tl.int64)
            if item < num_work_items:
                work_seq = tl.load(work_items_ptr + 2 * item)
                if work_seq >= 0:
                    _prefill_tile(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                                  block_tables_ptr, work_seq, tl.load(work_items_ptr + 2 * item + 1), qk_scale,
                                  q_token_stride, q_head_stride, out_token_stride, out_head_stride,
                                  cache_block_stride, cache_slot_stride, cache_head_stride, block_table_stride,
                                  kv_head, k_desc, v_desc, k_scale_ptr, v_scale_ptr, scale_block_stride,
                                  scale_slot_stride, GROUP, GROUP_PADDED, QUERY_TOKENS, BLOCK_SIZE,
                                  HEAD_DIM, HEAD_DIM_PADDED, KV_TILE, DOT_PRECISION, KV_LOAD, SPLIT_CAUSAL,
                                  FOLD_SCALE, FP8, FP8_KEYS, FP8_VALUES)
    else:
        # The eager grid: one program per (query tile, sequence), no loop around it: a step's rows
        # are known at launch, so no work list is needed.
        _prefill_tile(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                      block_tables_ptr, tl.program_id(1), tl.program_id(0), qk_scale,
                      q_token_stride, q_head_stride, out_token_stride, out_head_stride,
                      cache_block_stride, cache_slot_stride, cache_head_stride, block_table_stride,
                      kv_head, k_desc, v_desc, k_scale_ptr, v_scale_ptr, scale_block_stride, scale_slot_stride,
                      GROUP, GROUP_PADDED, QUERY_TOKENS, BLOCK_SIZE, HEAD_DIM,
                      HEAD_DIM_PADDED, KV_TILE, DOT_PRECISION, KV_LOAD, SPLIT_CAUSAL, FOLD_SCALE, FP8,
                      FP8_KEYS, FP8_VALUES)


def _prefill_kv_load(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, head_dim: int, head_dim_padded: int, kv_tile: int
) -> tuple[str, object, object]:
    """The K/V tile load mode of this launch (``_PREFILL_KV_LOAD`` where the shapes allow it, else the nearest one
    that works) and, for "descriptor", the TMA descriptors of the two caches (else None)."""
    mode = _PREFILL_KV_LOAD
    if mode not in _PREFILL_KV_LOADS:
        raise ValueError(f"_PREFILL_KV_LOAD must be one of {_PREFILL_KV_LOADS}, got {mode!r}")
    if mode == "gather" or block_size % kv_tile != 0:
        return "gather", None, None
    if mode == "descriptor":
        num_blocks, _, num_kv_heads, _ = k_cache.shape
        slot_stride = k_cache.stride(1)
        describable = (
            head_dim == head_dim_padded
            and k_cache.stride(2) == head_dim
            and slot_stride >= num_kv_heads * head_dim
            and k_cache.stride(0) == block_size * slot_stride
            and num_blocks * block_size < 2**31
            and all(cache.data_ptr() % 16 == 0 for cache in (k_cache, v_cache))
            and (slot_stride * k_cache.element_size()) % 16 == 0
        )
        if not describable:
            return "block", None, None
        from triton.tools.tensor_descriptor import TensorDescriptor

        shape = [num_blocks * block_size, num_kv_heads * head_dim]
        strides, tile = [slot_stride, 1], [kv_tile, head_dim]
        return (mode, TensorDescriptor(k_cache, shape, strides, tile), TensorDescriptor(v_cache, shape, strides, tile))
    return mode, None, None


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    work: PrefillWork | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged cache (prefix + new tokens, stored).

    Grid: (query tiles of the longest sequence, batch, num_kv_heads). A program owns ``QUERY_TOKENS`` new tokens
    times the ``GROUP`` query heads of one KV head and walks the KV tiles up to its last token's causal limit.
    The grid is sized by ``max_q_len``; without it the longest query length is read back from the device (a host
    sync, so the engine passes it). It must be the true maximum: a smaller value leaves rows unwritten.

    With ``work`` (``PrefillWork``: a list of (sequence, query tile) items and the tile size it was cut with) the
    grid is (P, 1, num_kv_heads) instead, P programs per KV head (about ``_PREFILL_PROGRAMS_PER_SM`` per SM, at
    most one per item) walking the list; padding items (-1, -1) write nothing. Its size depends on the list's
    length only, whatever the batch, which is what lets a CUDA graph capture a padded step. Rows that no item
    covers (padding rows of a padded step) are left unwritten. A float8 cache comes with its scales
    ``k_scale``/``v_scale`` and is dequantized in registers (``_attend_kv_tile``)."""
    _check_cache(k_cache, v_cache)
    fp8 = _check_scales(k_cache, k_scale, v_scale)
    if q.dtype != k_cache.dtype and not fp8:
        raise ValueError(f"q is {q.dtype} but the KV cache is {k_cache.dtype}; they must match")
    q = _with_contiguous_head_dim(q)
    total_q_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    batch = context_lens.shape[0]
    out = torch.empty((total_q_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total_q_tokens == 0 or batch == 0:
        return out
    group = _group_size(num_heads, num_kv_heads)
    group_padded = triton.next_power_of_2(group)
    if work is not None:
        query_tokens = work.tile_tokens
        streaming_multiprocessors = (
            _streaming_multiprocessor_count(q.device.index or 0) if q.is_cuda else _INTERPRETER_SM_COUNT
        )
        programs = max(streaming_multiprocessors * _PREFILL_PROGRAMS_PER_SM // num_kv_heads, 1)
        grid = (min(work.items.shape[0], programs), 1, num_kv_heads)
        work_items = work.items
    else:
        query_tokens = max(_PREFILL_ROWS // group_padded, 1)
        if max_q_len is None:
            max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
        grid = (triton.cdiv(max_q_len, query_tokens), batch, num_kv_heads)
        work_items = cu_seqlens_q  # unread: a placeholder pointer
    if grid[0] == 0:
        return out
    block_size = k_cache.shape[1]
    head_dim_padded = max(triton.next_power_of_2(head_dim), _MIN_DOT_DIM)
    kv_tile, stages = (_PREFILL_FP8_KV_TILE, _PREFILL_FP8_NUM_STAGES) if fp8 else (_KV_TILE, _PREFILL_NUM_STAGES)
    kv_load, k_desc, v_desc = _prefill_kv_load(k_cache, v_cache, block_size, head_dim, head_dim_padded, kv_tile)
    fp8_keys, fp8_values = _fp8_widening("_PREFILL", _PREFILL_FP8_KEYS, _PREFILL_FP8_VALUES, q.is_cuda, q.dtype)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        context_lens,
        block_tables,
        work_items,
        work_items.shape[0] if work is not None else 0,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_desc,
        v_desc,
        k_scale if fp8 else q,
        v_scale if fp8 else q,
        *_scale_strides(k_scale),
        GROUP=group,
        GROUP_PADDED=group_padded,
        QUERY_TOKENS=query_tokens,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        KV_TILE=kv_tile,
        DOT_PRECISION=_dot_precision(q.dtype),
        USE_WORK_ITEMS=work is not None,
        KV_LOAD=kv_load,
        SPLIT_CAUSAL=_PREFILL_SPLIT_CAUSAL,
        FOLD_SCALE=_PREFILL_FOLD_SCALE,
        FP8=fp8,
        FP8_KEYS=fp8_keys,
        FP8_VALUES=fp8_values,
        num_warps=_PREFILL_NUM_WARPS,
        num_stages=stages,
    )
    return out


@triton.jit
def _decode_partition_tokens(
    context_len, num_partitions, fixed_partition_size, context_lens_ptr, batch, row_programs,
    KV_TILE: tl.constexpr, MIN_TILES: tl.constexpr, BALANCED: tl.constexpr, SUM_TILE: tl.constexpr,
):
    """Entries per partition of one sequence: ``fixed_partition_size`` when it is positive, else the sequence's own
    length cut into whole tiles, at least ``MIN_TILES`` of them: into ``num_partitions``, or with ``BALANCED``
    into as many as its share of the step's entries asks (zipage/decode_grid.py `balanced_row_partitions`: the
    batch's lengths summed here, an even share being their sum over ``row_programs``), at most ``num_partitions``.
    Read on the device from ``context_lens``, so a CUDA graph replays it correctly for any lengths."""
    if fixed_partition_size > 0:
        partition_size = fixed_partition_size
    else:
        parts = num_partitions
        if BALANCED:
            total = tl.zeros([SUM_TILE], tl.int64)
            for start in range(0, batch, SUM_TILE):
                rows = start + tl.arange(0, SUM_TILE)
                total += tl.load(context_lens_ptr + rows, mask=rows < batch, other=0).to(tl.int64)
            share = tl.maximum(tl.cdiv(tl.sum(total, axis=0), row_programs), MIN_TILES * KV_TILE)
            parts = tl.minimum(tl.maximum(context_len // share, 1), num_partitions).to(tl.int32)
        partition_tiles = tl.cdiv(tl.cdiv(context_len, parts), KV_TILE)
        partition_size = tl.maximum(partition_tiles, MIN_TILES) * KV_TILE
    return partition_size


@triton.jit(do_not_specialize=_STEP_VARYING)
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_log_sum_ptr,
    context_lens_ptr,
    block_tables_ptr,
    qk_scale,
    q_batch_stride,
    q_head_stride,
    out_batch_stride,
    out_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    block_table_stride,
    num_partitions,
    fixed_partition_size,
    batch,
    row_programs,
    NUM_HEADS: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    BALANCED: tl.constexpr,
    SUM_TILE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_TILE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    k_scale_ptr,
    v_scale_ptr,
    scale_block_stride,
    scale_slot_stride,
    FP8: tl.constexpr,
    KV_LOAD: tl.constexpr,
    FP8_VALUES: tl.constexpr,
    FP8_KEYS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    partition_size = _decode_partition_tokens(context_len, num_partitions, fixed_partition_size, context_lens_ptr,
                                              batch, row_programs, KV_TILE, MIN_TILES, BALANCED, SUM_TILE)
    partition_start = partition * partition_size
    partition_end = tl.minimum(partition_start + partition_size, context_len)

    group_rows = tl.arange(0, GROUP_PADDED)
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, HEAD_DIM_PADDED)
    io_mask = (group_rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q_offsets = seq.to(tl.int64) * q_batch_stride + heads[:, None] * q_head_stride + dims[None, :]
    queries = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    if FP8 and FP8_KEYS != "queries":
        queries = _queries_to_f16(queries)

    running_max = tl.full([GROUP_PADDED], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PADDED], tl.float32)
    accumulator = tl.zeros([GROUP_PADDED, HEAD_DIM_PADDED], tl.float32)
    # The one query sits after every cached entry, so nothing is masked causally.
    visible_until = tl.full([GROUP_PADDED], 2147483647, tl.int32)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    # A partition past the sequence's end (a short sequence needs fewer than num_partitions) loops zero times.
    for tile_start in range(partition_start, partition_end, KV_TILE):
        running_max, running_sum, accumulator = _attend_kv_tile(
            queries,
            running_max,
            running_sum,
            accumulator,
            k_cache_ptr,
            v_cache_ptr,
            block_table_row_ptr,
            kv_head,
            tile_start,
            partition_end,
            visible_until,
            qk_scale,
            cache_block_stride,
            cache_slot_stride,
            cache_head_stride,
            BLOCK_SIZE,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            KV_TILE,
            DOT_PRECISION,
            # Triton 3.6 cannot pass a helper's constexpr defaults: every argument is spelled out.
            KV_LOAD,
            True,
            False,
            None,
            None,
            k_scale_ptr,
            v_scale_ptr,
            scale_block_stride,
            scale_slot_stride,
            FP8,
            FP8_VALUES,
            FP8_KEYS,
        )

    # An empty sequence (a padding slot of a captured batch) has a zero sum and gets a zero output.
    out = accumulator / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    # A sequence whose entries fit one partition (or none: a padding slot) is done here, merged by nobody.
    if SINGLE_PARTITION or partition_size >= context_len:
        if partition == 0:
            out_offsets = seq.to(tl.int64) * out_batch_stride + heads[:, None] * out_head_stride + dims[None, :]
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # Partial results are [batch, num_heads, num_partitions, HEAD_DIM_PADDED] and [batch, num_heads,
        # num_partitions]; the merge reads only the partitions that hold entries, so empty ones write nothing.
        partial_rows = (seq.to(tl.int64) * NUM_HEADS + heads) * num_partitions + partition
        if partition_start < context_len:
            tl.store(partial_out_ptr + partial_rows[:, None] * HEAD_DIM_PADDED + dims[None, :], out, mask=io_mask)
            tl.store(
                partial_log_sum_ptr + partial_rows, running_max + tl.log2(running_sum), mask=group_rows < GROUP
            )


@triton.jit(do_not_specialize=_STEP_VARYING[1:])
def _decode_merge_kernel(
    out_ptr,
    partial_out_ptr,
    partial_log_sum_ptr,
    context_lens_ptr,
    out_batch_stride,
    out_head_stride,
    num_partitions,
    fixed_partition_size,
    batch,
    row_programs,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_TILE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MERGE_TILE: tl.constexpr,
    BALANCED: tl.constexpr,
    SUM_TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    partition_size = _decode_partition_tokens(context_len, num_partitions, fixed_partition_size, context_lens_ptr,
                                              batch, row_programs, KV_TILE, MIN_TILES, BALANCED, SUM_TILE)
    if partition_size >= context_len:
        return  # the partition kernel wrote this sequence's output
    num_used_partitions = tl.cdiv(context_len, partition_size)
    first_row = (seq.to(tl.int64) * NUM_HEADS + head) * num_partitions
    dims = tl.arange(0, HEAD_DIM_PADDED)

    # Partition p's output was normalised by its own sum 2^log_sum[p]; weighting it by 2^(log_sum[p] - max) and
    # dividing by the total weight gives the softmax over the whole sequence.
    running_max = tl.full([1], float("-inf"), tl.float32)
    total_weight = tl.zeros([1], tl.float32)
    accumulator = tl.zeros([HEAD_DIM_PADDED], tl.float32)
    for merge_start in range(0, num_used_partitions, MERGE_TILE):
        partitions = merge_start + tl.arange(0, MERGE_TILE)
        used = partitions < num_used_partitions
        log_sums = tl.load(partial_log_sum_ptr + first_row + partitions, mask=used, other=float("-inf"))
        new_max = tl.maximum(running_max, tl.max(log_sums, axis=0))
        rescale = tl.exp2(running_max - new_max)
        weights = tl.exp2(log_sums - new_max)
        partial_outs = tl.load(
            partial_out_ptr + (first_row + partitions)[:, None] * HEAD_DIM_PADDED + dims[None, :],
            mask=used[:, None],
            other=0.0,
        )
        accumulator = accumulator * rescale + tl.sum(weights[:, None] * partial_outs, axis=0)
        total_weight = total_weight * rescale + tl.sum(weights, axis=0)
        running_max = new_max

    out = accumulator / tl.where(total_weight > 0, total_weight, 1.0)
    out_offsets = seq.to(tl.int64) * out_batch_stride + head * out_head_stride + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_num_partitions(batch: int, num_kv_heads: int, streaming_multiprocessors: int, fp8: bool = False,
                          split: str | None = None) -> int:
    """Partitions per sequence of the grid (zipage/decode_grid.py `decode_grid_partitions`) with the split
    ``split`` (None: ``_DECODE_SPLIT``). Each sequence's partition length is then cut from its own ``context_len``,
    on the device, so neither the block table's width (a CUDA graph's table is as wide as ``max_model_len``) nor
    the lengths of this step change the grid."""
    split = _DECODE_SPLIT if split is None else split
    if split not in decode_grid.DECODE_SPLITS:
        raise ValueError(f"the decode split must be one of {decode_grid.DECODE_SPLITS}, got {split!r}")
    return decode_grid.decode_grid_partitions(batch, num_kv_heads, streaming_multiprocessors,
                                              programs_per_sm=_programs_per_sm(fp8),
                                              round_up=_ROUND_PARTITIONS_UP, split=split)


def _programs_per_sm(fp8: bool) -> int:
    return _FP8_PROGRAMS_PER_SM if fp8 else _PROGRAMS_PER_SM


def _fp8_widening(prefix: str, keys: str, values: str, on_gpu: bool, dtype: torch.dtype) -> tuple[str, str]:
    """The (keys, values) widening modes a launch runs for the knobs `prefix`_FP8_KEYS / _VALUES: checked, with
    "f16-asm" run as "f16" off the GPU and float32 queries keeping "queries"."""
    if values not in _DECODE_FP8_VALUE_MODES:
        raise ValueError(f"{prefix}_FP8_VALUES must be one of {_DECODE_FP8_VALUE_MODES}, got {values!r}")
    if keys not in _DECODE_FP8_KEY_MODES:
        raise ValueError(f"{prefix}_FP8_KEYS must be one of {_DECODE_FP8_KEY_MODES}, got {keys!r}")
    # Inline assembly needs the GPU; the interpreter runs the same arithmetic with Triton's own widening.
    values = "f16" if values == "f16-asm" and not on_gpu else values
    keys = "f16" if keys == "f16-asm" and not on_gpu else keys
    if dtype == torch.float32:
        keys = "queries"  # float32 queries keep their precision (the CPU oracle's dtype)
    return keys, values


def _decode_variant(fp8: bool, block_size: int, partition_size: int | None, on_gpu: bool,
                    dtype: torch.dtype) -> tuple[int, dict, dict]:
    """(tokens per tile, the kernel's variant constants, launch options) of a decode launch from the ``_DECODE_*``
    variants, where the shapes allow them."""
    if _DECODE_KV_LOAD not in _DECODE_KV_LOADS:
        raise ValueError(f"_DECODE_KV_LOAD must be one of {_DECODE_KV_LOADS}, got {_DECODE_KV_LOAD!r}")
    kv_tile = _DECODE_FP8_KV_TILE if fp8 else _DECODE_KV_TILE
    if partition_size is not None and partition_size % kv_tile != 0:
        kv_tile = _DECODE_KV_TILE
    fp8_keys, fp8_values = _fp8_widening("_DECODE", _DECODE_FP8_KEYS, _DECODE_FP8_VALUES, on_gpu, dtype)
    constants = dict(KV_LOAD=_DECODE_KV_LOAD if block_size % kv_tile == 0 else "gather", FP8_VALUES=fp8_values,
                     FP8_KEYS=fp8_keys)
    if not fp8:
        return kv_tile, constants, dict(num_warps=_DECODE_NUM_WARPS, num_stages=_DECODE_NUM_STAGES)
    options = dict(num_warps=_DECODE_FP8_WARPS, num_stages=_DECODE_FP8_STAGES)
    if _DECODE_FP8_MAXNREG is not None and on_gpu:
        options["maxnreg"] = _DECODE_FP8_MAXNREG
    return kv_tile, constants, options


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    partition_size: int | None = None,
    grid_batch: int | None = None,
    split: str | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its ``context_lens[i]`` cached entries, split-K.

    Grid of the first pass: (batch, num_kv_heads, partitions); each program attends the whole query group of one
    KV head to one partition of the sequence. With more than one partition a merge pass, grid (batch, num_heads),
    combines the partial outputs by their log-sum-exp. The number of partitions follows from the batch size
    (``decode_num_partitions``) and each sequence's partition length from its ``context_lens`` entry, read on the
    device, so nothing is read back and the call can be captured in a CUDA graph.
    ``partition_size`` (a multiple of ``_DECODE_KV_TILE``) instead fixes every partition's length, with enough
    partitions for the block table's capacity; tests use it to force the merge. ``grid_batch`` sizes the partition
    count as for a batch of that many sequences instead of ``q``'s rows: a graphed mixed step's decode section
    (zipage/prefill_buckets.py) has a fixed number of rows of which a step may fill a few. ``split`` cuts the rows
    alike ("batch") or each by its share of the step's entries ("balanced", zipage/decode_grid.py; None:
    ``_DECODE_SPLIT``). A float8 cache comes with its scales ``k_scale``/``v_scale``, dequantized in registers."""
    _check_cache(k_cache, v_cache)
    fp8 = _check_scales(k_cache, k_scale, v_scale)
    if q.dtype != k_cache.dtype and not fp8:
        raise ValueError(f"q is {q.dtype} but the KV cache is {k_cache.dtype}; they must match")
    q = _with_contiguous_head_dim(q)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = _group_size(num_heads, num_kv_heads)
    head_dim_padded = max(triton.next_power_of_2(head_dim), _MIN_DOT_DIM)
    kv_tile, variant, launch_options = _decode_variant(fp8, block_size, partition_size, q.is_cuda, q.dtype)
    if partition_size is None:
        streaming_multiprocessors = (
            _streaming_multiprocessor_count(q.device.index or 0) if q.is_cuda else _INTERPRETER_SM_COUNT
        )
        split = _DECODE_SPLIT if split is None else split
        num_partitions = decode_num_partitions(batch if grid_batch is None else grid_batch, num_kv_heads,
                                               streaming_multiprocessors, fp8, split)
        fixed_partition_size = 0
        row_programs = max(1, _programs_per_sm(fp8) * streaming_multiprocessors // num_kv_heads)
    elif partition_size <= 0 or partition_size % kv_tile != 0:
        raise ValueError(f"partition_size must be a positive multiple of {kv_tile}, got {partition_size}")
    else:
        num_partitions = max(1, triton.cdiv(block_tables.shape[1] * block_size, partition_size))
        fixed_partition_size = partition_size
        row_programs = 1
    balanced = dict(BALANCED=split == "balanced" and num_partitions > 1, SUM_TILE=_SPLIT_SUM_TILE)
    if num_partitions > 1:
        partial_out = torch.empty(
            (batch, num_heads, num_partitions, head_dim_padded), dtype=torch.float32, device=q.device
        )
        partial_log_sum = torch.empty((batch, num_heads, num_partitions), dtype=torch.float32, device=q.device)
    else:
        # Unused by the single-partition kernel, which writes the output directly.
        partial_out = partial_log_sum = out
    _decode_partition_kernel[(batch, num_kv_heads, num_partitions)](
        q,
        k_cache,
        v_cache,
        out,
        partial_out,
        partial_log_sum,
        context_lens,
        block_tables,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_partitions,
        fixed_partition_size,
        batch,
        row_programs,
        NUM_HEADS=num_heads,
        SINGLE_PARTITION=num_partitions == 1,
        **balanced,
        GROUP=group,
        GROUP_PADDED=max(triton.next_power_of_2(group), _MIN_DOT_DIM),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        KV_TILE=kv_tile,
        MIN_TILES=_MIN_TILES_PER_PARTITION,
        DOT_PRECISION=_dot_precision(q.dtype),
        k_scale_ptr=k_scale if fp8 else q,
        v_scale_ptr=v_scale if fp8 else q,
        scale_block_stride=_scale_strides(k_scale)[0],
        scale_slot_stride=_scale_strides(k_scale)[1],
        FP8=fp8,
        **variant,
        **launch_options,
    )
    if num_partitions > 1:
        _decode_merge_kernel[(batch, num_heads)](
            out,
            partial_out,
            partial_log_sum,
            context_lens,
            out.stride(0),
            out.stride(1),
            num_partitions,
            fixed_partition_size,
            batch,
            row_programs,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            KV_TILE=kv_tile,
            MIN_TILES=_MIN_TILES_PER_PARTITION,
            MERGE_TILE=_MERGE_TILE,
            **balanced,
        )
    return out
