"""Triton fused elementwise kernels of a decoder layer: RMSNorm with an optional residual add, SiLU-and-mul, and
RoPE of queries and keys with an optional per-head RMSNorm first.

Same signatures and semantics as ``fused_ops_ref.py`` (the oracle the tests compare against). Each kernel reads its
inputs once, does the maths in float32 registers and writes its outputs once, replacing the chain of small torch
kernels (casts, pow, mean, rsqrt, muls, chunk/cat, adds) that the reference launches. It rounds to the activation
dtype exactly where the reference's torch ops do (the residual sum, the normalised value before the weight
multiply, ``silu(gate)`` before the multiply by ``up``, a normalised head before its rotation), so the two differ
only by float32 summation order and by which side of a rounding boundary that leaves a value: at most one unit in
the last place of bfloat16/float16. Outputs are new contiguous tensors; inputs are never written. Inputs may have
any leading strides (a query sliced out of the fused qkv projection is read in place) but need a contiguous last
dimension, else they are copied first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipage.kernels.attention_triton import _with_contiguous_head_dim

# Heads of the query and of the key that one rotary program handles for one token: enough work per program for a
# long prefill, yet num_heads / 4 programs per token, so that a batch-1 decode still spreads over several SMs.
_ROTARY_HEADS_PER_PROGRAM = 4
# Intermediate columns per SiLU-and-mul program: a Qwen3-8B decode token (12288 columns) gets 12 programs.
_SILU_AND_MUL_BLOCK = 1024
# Elements per thread when sizing a program's warps: two 16-byte vectors of bfloat16.
_ELEMENTS_PER_THREAD = 16
_MAX_WARPS = 8


def _num_warps(block_elements: int) -> int:
    """Warps for a program over ``block_elements`` (a power of two) elements."""
    return max(1, min(_MAX_WARPS, block_elements // (32 * _ELEMENTS_PER_THREAD)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, x.shape[-1]]`` with a contiguous last dimension (a view whenever the strides allow)."""
    return _with_contiguous_head_dim(x.reshape(-1, x.shape[-1]))


@triton.jit
def _scale_by_weight(normed, activation_dtype: tl.constexpr, weight, out_dtype: tl.constexpr):
    # The reference casts the normalised value to the activation dtype before the weight multiply (HF's order).
    return (normed.to(activation_dtype).to(tl.float32) * weight.to(tl.float32)).to(out_dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_row_stride,
    residual_row_stride,
    hidden_size,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row per program: with ADD_RESIDUAL, add the residual row and store the sum; then normalise, scale."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < hidden_size
    x = tl.load(x_ptr + row * x_row_stride + columns, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + columns, mask=mask, other=0.0)
        # Rounded to the stream's dtype before the norm reads it, like the reference's `residual + x`.
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden_size + columns, x, mask=mask)
    x32 = x.to(tl.float32)
    inverse_rms = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / hidden_size + eps)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0)
    out = _scale_by_weight(x32 * inverse_rms, x.dtype, weight, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden_size + columns, out, mask=mask)


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    """Fill ``out`` (and ``residual_out`` when ``residual`` is given), both new contiguous tensors shaped like x."""
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight must be [{hidden_size}], the size of x's rows; got {tuple(weight.shape)}")
    x_rows = _rows(x)
    if x_rows.shape[0] == 0:
        return
    add_residual = residual is not None
    # Without a residual the kernel never touches its residual pointers: any tensor fills those slots.
    residual_rows = _rows(residual) if add_residual else x_rows
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows,
        residual_rows,
        weight.contiguous(),
        out,
        residual_out if add_residual else out,
        x_rows.stride(0),
        residual_rows.stride(0),
        hidden_size,
        eps,
        ADD_RESIDUAL=add_residual,
        BLOCK=block,
        num_warps=_num_warps(block),
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension; one program per row."""
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None)
    return out


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``; one program per row reads x and residual once."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    stream_dtype = torch.promote_types(x.dtype, residual.dtype)
    new_residual = torch.empty(x.shape, dtype=stream_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, stream_dtype), device=x.device)
    _launch_rms_norm(x, residual, weight, eps, out, new_residual)
    return out, new_residual


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, row_stride, intermediate_size, BLOCK: tl.constexpr):
    """Program (row, tile) computes BLOCK columns of one row's silu(gate) * up."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < intermediate_size
    gate = tl.load(gate_up_ptr + row * row_stride + columns, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * row_stride + intermediate_size + columns, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    # torch's F.silu returns the activation dtype before the multiply; round there too, like the reference.
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * intermediate_size + columns, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[..., 2 * intermediate]`` -> ``[..., intermediate]``."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up's last dimension must be [gate | up], an even size; got {width}")
    intermediate_size = width // 2
    out = torch.empty((*gate_up.shape[:-1], intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    rows = _rows(gate_up)
    if out.numel() == 0:
        return out
    block = min(_SILU_AND_MUL_BLOCK, triton.next_power_of_2(intermediate_size))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(intermediate_size, block))](
        rows, out, rows.stride(0), intermediate_size, BLOCK=block, num_warps=_num_warps(block)
    )
    return out


@triton.jit
def _norm_and_rotate_heads(
    in_ptr,
    head_stride,
    out_ptr,
    norm_weight_ptr,
    heads,
    num_heads,
    cos,
    sin,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    NORM: tl.constexpr,
):
    """RMS-normalise (when NORM) and rotate the given heads of one token (those below num_heads). ``in_ptr`` and
    ``out_ptr`` point at the token's first head; pairs are (i, i + HEAD_DIM / 2), HF's half-split layout."""
    pairs = tl.arange(0, HALF_PADDED)
    pair_mask = pairs < HEAD_DIM // 2
    mask = (heads[:, None] < num_heads) & pair_mask[None, :]
    in_offsets = heads[:, None] * head_stride + pairs[None, :]
    first = tl.load(in_ptr + in_offsets, mask=mask, other=0.0)
    second = tl.load(in_ptr + in_offsets + HEAD_DIM // 2, mask=mask, other=0.0)
    out_dtype = out_ptr.dtype.element_ty
    if NORM:
        first32, second32 = first.to(tl.float32), second.to(tl.float32)
        mean_square = (tl.sum(first32 * first32, axis=1) + tl.sum(second32 * second32, axis=1)) / HEAD_DIM
        inverse_rms = tl.math.rsqrt(mean_square + eps)[:, None]
        first_weight = tl.load(norm_weight_ptr + pairs, mask=pair_mask, other=0.0)[None, :]
        second_weight = tl.load(norm_weight_ptr + HEAD_DIM // 2 + pairs, mask=pair_mask, other=0.0)[None, :]
        first = _scale_by_weight(first32 * inverse_rms, first.dtype, first_weight, out_dtype)
        second = _scale_by_weight(second32 * inverse_rms, second.dtype, second_weight, out_dtype)
    first, second = first.to(tl.float32), second.to(tl.float32)
    out_offsets = heads[:, None] * HEAD_DIM + pairs[None, :]
    tl.store(out_ptr + out_offsets, (first * cos - second * sin).to(out_dtype), mask=mask)
    tl.store(out_ptr + out_offsets + HEAD_DIM // 2, (second * cos + first * sin).to(out_dtype), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    query_ptr,
    key_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_weight_ptr,
    k_norm_weight_ptr,
    query_out_ptr,
    key_out_ptr,
    query_token_stride,
    query_head_stride,
    key_token_stride,
    key_head_stride,
    cos_token_stride,
    sin_token_stride,
    num_heads,
    num_kv_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    NORM_QUERY: tl.constexpr,
    NORM_KEY: tl.constexpr,
):
    """Program (token, tile) handles heads ``tile * HEADS_PER_PROGRAM ..`` of the token's query and of its key,
    sharing one load of the token's cos and sin; a tile past the last key head only does the query."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    pairs = tl.arange(0, HALF_PADDED)
    pair_mask = pairs < HEAD_DIM // 2
    cos = tl.load(cos_ptr + token * cos_token_stride + pairs, mask=pair_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * sin_token_stride + pairs, mask=pair_mask, other=0.0).to(tl.float32)[None, :]
    _norm_and_rotate_heads(
        query_ptr + token * query_token_stride,
        query_head_stride,
        query_out_ptr + token * num_heads * HEAD_DIM,
        q_norm_weight_ptr,
        heads,
        num_heads,
        cos,
        sin,
        eps,
        HEAD_DIM,
        HALF_PADDED,
        NORM_QUERY,
    )
    _norm_and_rotate_heads(
        key_ptr + token * key_token_stride,
        key_head_stride,
        key_out_ptr + token * num_kv_heads * HEAD_DIM,
        k_norm_weight_ptr,
        heads,
        num_kv_heads,
        cos,
        sin,
        eps,
        HEAD_DIM,
        HALF_PADDED,
        NORM_KEY,
    )


def rotary_qk_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm then RoPE of ``query`` ``[num_tokens, num_heads, head_dim]`` and ``key``
    ``[num_tokens, num_kv_heads, head_dim]``, one launch for both; returns new contiguous tensors."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or head_dim % 2:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} need the same token count and an even head_dim"
        )
    if cos.shape != (num_tokens, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"cos and sin must be [{num_tokens}, {head_dim // 2}]; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    for weight in (q_norm_weight, k_norm_weight):
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(f"a q/k norm weight must be [{head_dim}]; got {tuple(weight.shape)}")
    query, key = _with_contiguous_head_dim(query), _with_contiguous_head_dim(key)
    cos, sin = _with_contiguous_head_dim(cos), _with_contiguous_head_dim(sin)
    query_out = torch.empty(query.shape, dtype=_normed_dtype(query, q_norm_weight), device=query.device)
    key_out = torch.empty(key.shape, dtype=_normed_dtype(key, k_norm_weight), device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    half_padded = triton.next_power_of_2(head_dim // 2)
    tiles = triton.cdiv(max(num_heads, num_kv_heads), _ROTARY_HEADS_PER_PROGRAM)
    # A missing norm weight is never read (NORM_* is False): the input fills its slot.
    _rotary_qk_kernel[(num_tokens, tiles)](
        query,
        key,
        cos,
        sin,
        query if q_norm_weight is None else q_norm_weight.contiguous(),
        key if k_norm_weight is None else k_norm_weight.contiguous(),
        query_out,
        key_out,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        num_kv_heads,
        eps,
        HEAD_DIM=head_dim,
        HALF_PADDED=half_padded,
        HEADS_PER_PROGRAM=_ROTARY_HEADS_PER_PROGRAM,
        NORM_QUERY=q_norm_weight is not None,
        NORM_KEY=k_norm_weight is not None,
        num_warps=_num_warps(4 * _ROTARY_HEADS_PER_PROGRAM * half_padded),
    )
    return query_out, key_out


def _normed_dtype(x: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.dtype:
    """The dtype of ``rms_norm(x, norm_weight)``, which the rotation keeps (x's own without a norm)."""
    return x.dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, x.dtype)
