"""FP8 KV cache: quantization and dequantization of K and V entries (docs/kernels.md, 'FP8 KV cache').

With `--kv-cache-dtype fp8` the K and V caches hold float8 e4m3 (`torch.float8_e4m3fn`) values and one float32
scale per (entry, KV head), `value = round_to_nearest_even(x / scale)` saturated at +-448 and `x ~ value * scale`.
The scale is the one of a fixed candidate set that loses least in that round trip: `amax / 448 * c` for each
`c` of `SCALE_CANDIDATES` (amax over the entry's `head_dim` values; 1 for a zero row), the candidate with the
least squared round-trip error wins, ties to the first. e4m3 has 3 mantissa bits at any magnitude, so what a
scale changes is where the row's values fall between the codes; a search over one octave of scales cuts the
round-trip RMS error of real K/V by about an eighth against `amax / 448` alone (docs/BENCHMARKS.md, 'FP8 KV
cache').
The scale layout is the score cache's, `[num_blocks, block_size, num_kv_heads]` per layer, so a compaction moves
an entry's scale with its bytes and never requantizes; every reader just multiplies by the stored scale.

These are the pure-torch definitions every reference kernel uses; the Triton store kernel encodes bit-identical
bytes and scales (`attention_triton._quantize_e4m3`). For that the search compares errors exactly, independent
of summation order: each element's error is taken in the scaled domain (`x / scale - value`, exact), converted
to units of `amax / 448`, squared, and truncated to a fixed-point int64 (`SEARCH_FIXED_POINT`) before the sum.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# The candidate scales, as multiples of amax / 448: 1 + j / 8 for j = 0..7 spans one octave (a scale twice another
# puts every value on the same code one binade lower), in steps exact in float32. Eight, the knee measured on
# SmolLM2's K/V (docs/BENCHMARKS.md, 'FP8 KV cache'): 4 -> 8 cut 0.8 % of the RMS error per added candidate, 8 -> 16
# and 16 -> 32 0.3 % and 0.15 % (-12.5 % at 8, -17 % at 32, each doubling doubles the store's work); candidates
# below 1 saturate the row's largest value and were never chosen.
SCALE_SEARCH_STEP = 0.125
SCALE_SEARCH_SIZE = 8
SCALE_CANDIDATES = tuple(1.0 + j * SCALE_SEARCH_STEP for j in range(SCALE_SEARCH_SIZE))
# Squared errors in units of (amax / 448)^2 are summed as int64 multiples of 2^-32 of that unit: exact, so any
# summation order (torch's, a Triton reduction's) picks the same candidate. An element's squared error is at most
# 448^2 units (candidates >= 1/2), so 2^49.6 a value and < 2^63 for rows of up to 1,024 values.
SEARCH_FIXED_POINT = 2.0**32


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def kv_scales(x: torch.Tensor, candidates: tuple[float, ...] = SCALE_CANDIDATES) -> torch.Tensor:
    """float32 `[...]`: the scale of each row of `x` `[..., head_dim]`: of `amax / 448 * c` for `c` in
    `candidates`, the one with the least squared round-trip error (the first of equals; 1 for a zero row)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    nonzero = amax > 0
    base = torch.where(nonzero, amax / FP8_MAX, torch.ones_like(amax))
    # All candidates at once, on a leading axis (one pass of small ops, not one per candidate: the CPU engine
    # quantizes every layer's new entries with this).
    factors = torch.tensor(candidates, dtype=torch.float32, device=x.device).view(-1, *([1] * base.dim()))
    scales = torch.where(nonzero, base * factors, torch.ones_like(base))  # [C, ...]
    scaled = x / scales[..., None]
    rounded = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    # Exact: a value rounded to e4m3 lies within a factor 2 of it (or is 0), and so does 448 of a saturated value.
    error = (scaled - rounded) * factors[..., None]
    squared = (error * error * SEARCH_FIXED_POINT).to(torch.int64).sum(dim=-1)  # [C, ...]
    best = squared.argmin(dim=0, keepdim=True)  # the first of equal minima
    return scales.gather(0, best)[0]


def quantize_kv(x: torch.Tensor, candidates: tuple[float, ...] = SCALE_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values `[..., head_dim]`, float32 scales `[...]`) of `x` `[..., head_dim]`, one scale per row
    (`kv_scales`; `candidates=(1.0,)` is plain amax / 448)."""
    scale = kv_scales(x, candidates)
    values = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 `values * scale` (`values` `[..., head_dim]`, `scale` `[...]`); without a scale, `values` in
    float32 (a cache in the compute dtype)."""
    if scale is None:
        return values.float()
    return values.float() * scale[..., None]
