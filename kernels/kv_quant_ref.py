"""FP8 KV cache: quantization and dequantization of K and V entries (docs/kernels.md, 'FP8 KV cache').

With `--kv-cache-dtype fp8` the K and V caches hold float8 e4m3 (`torch.float8_e4m3fn`) values and one float32
scale per (entry, KV head): `scale = amax / 448` over that entry's `head_dim` values (1 where they are all zero),
`value = round_to_nearest_even(x / scale)` saturated at +-448, and `x ~ value * scale`. The scale layout is the
score cache's, `[num_blocks, block_size, num_kv_heads]` per layer, so a compaction moves an entry's scale with
its bytes and never requantizes; why per entry and head rather than per tensor, head or block is measured in
docs/BENCHMARKS.md ('FP8 KV cache').

These are the pure-torch definitions every reference kernel uses; the Triton store kernel encodes bit-identical
bytes (`attention_triton._quantize_e4m3`).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def kv_scales(x: torch.Tensor) -> torch.Tensor:
    """float32 `[...]`: the scale of each row of `x` `[..., head_dim]` (amax / 448, or 1 for a zero row)."""
    amax = x.float().abs().amax(dim=-1)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values `[..., head_dim]`, float32 scales `[...]`) of `x` `[..., head_dim]`, one scale per row."""
    scale = kv_scales(x)
    values = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 `values * scale` (`values` `[..., head_dim]`, `scale` `[...]`); without a scale, `values` in
    float32 (a cache in the compute dtype)."""
    if scale is None:
        return values.float()
    return values.float() * scale[..., None]
