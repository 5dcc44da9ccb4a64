"""The contract of an eviction scoring policy (docs/architecture.md, 'Adding a scoring policy').

A policy ranks the KV entries of one (layer, request) for a compression; the pipeline keeps the
top k per KV head (`kept_entries`) and compacts them (`write_kept_entries`, `compact_triton`),
the same for every policy. Its facts without torch (flags, cost terms) are its `ScoringSpec` in
`zipage/scoring.py`, under the same name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs


@dataclasses.dataclass(frozen=True)
class ScoringPolicy:
    """name: as in `zipage/scoring.py`. reference(inputs, params) -> (final scores [Hkv, T] with
    the last w entries at +inf, global scores to store [Hkv, T] or None): the pure-torch scorer,
    the CPU path and the test oracle. fixed(params): the constants the policy sets on the
    pipeline's parameters (none for the default). triton: None, or a callable with the signature
    of `compress_triton` that compresses the whole batch on the fast path (imported on first
    use); without one the reference runs on every device."""

    name: str
    reference: Callable[[ScoreInputs, CompressionParams], tuple[torch.Tensor, torch.Tensor | None]]
    fixed: Callable[[CompressionParams], CompressionParams] = lambda params: params
    triton: Callable | None = None


def without_global_score(params: CompressionParams) -> CompressionParams:
    """A policy that keeps no global scores neither reads nor writes the score cache."""
    return dataclasses.replace(params, global_score=False)


def with_window(scores: torch.Tensor, window: int) -> torch.Tensor:
    """`scores` [Hkv, T] as float32 with the last `window` entries at +inf: every policy keeps
    the window (its queries are the next compression's observers)."""
    scores = scores.float().clone()
    scores[:, -window:] = float("inf")
    return scores


def keep_and_compact(final: torch.Tensor, stored: torch.Tensor | None, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, score_cache: torch.Tensor | None,
                     source_tables: torch.Tensor, num_source_blocks: torch.Tensor,
                     target_tables: torch.Tensor, params: CompressionParams,
                     num_target_blocks: torch.Tensor | None, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None) -> None:
    """Steps 6-7 of a fast path on a batch's final scores [L, R, Hkv, N b] (-inf past each
    request's length): the top k_r of each row (`kept_entries`) moved by the compaction kernels,
    nothing read back to the host. `stored`: the global scores to keep, or None."""
    from zipage.kernels.compress_ref import batch_kept_entries
    from zipage.kernels.compress_triton import compact_triton

    kept = batch_kept_entries(final, target_tables.shape[1] * params.block_size, params.block_size,
                              num_target_blocks)
    global_score = stored is not None
    compact_triton(k_cache, v_cache, score_cache if global_score else None, source_tables,
                   num_source_blocks, target_tables, kept, stored if global_score else final,
                   global_score, num_target_blocks, k_scale, v_scale)


def compact_by_scores(scores: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      score_cache: torch.Tensor | None, source_tables: torch.Tensor,
                      num_source_blocks: torch.Tensor, target_tables: torch.Tensor,
                      params: CompressionParams, num_target_blocks: torch.Tensor | None,
                      k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """The end of a fast path that keeps no global scores: a batch's scores [L, R, Hkv, N b]
    windowed (`batch_window`), then top-k and the compaction (`keep_and_compact`)."""
    final = batch_window(scores, num_source_blocks, params)
    keep_and_compact(final, None, k_cache, v_cache, score_cache, source_tables,
                     num_source_blocks, target_tables, params, num_target_blocks, k_scale,
                     v_scale)


def batch_window(scores: torch.Tensor, num_source_blocks: torch.Tensor,
                 params: CompressionParams) -> torch.Tensor:
    """A batch's scores [L, R, Hkv, N b] with each request's last w entries at +inf and the
    entries past its length at -inf (lengths read on the device)."""
    positions = torch.arange(scores.shape[-1], device=scores.device)
    lengths = (num_source_blocks.to(torch.int64) * params.block_size).view(1, -1, 1, 1)
    scores = scores.masked_fill(positions >= lengths - params.window, float("inf"))
    return scores.masked_fill(positions >= lengths, float("-inf"))


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> None:
    """An fp8 cache comes with both scales, any other with none (as `compress_triton` checks)."""
    from zipage.kernels.kv_quant_ref import is_fp8

    if is_fp8(k_cache) != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        needed = "both" if is_fp8(k_cache) else "no"
        raise ValueError(f"a {k_cache.dtype} KV cache takes {needed} k_scale and v_scale")


def batch_entries(cache: torch.Tensor, scales: torch.Tensor | None, source_tables: torch.Tensor,
                  layer: int) -> torch.Tensor:
    """float32 [R, N b, Hkv, d]: the K or V entries of one layer of the group (`cache`
    [L, num_blocks, b, Hkv, d]) for every request's source blocks, gathered on the device; an fp8
    cache's dequantized with its `scales` [L, num_blocks, b, Hkv] (as the reference reads them).
    A request's padding (-1 past its own blocks) reads block 0: mask it by the request's length."""
    from zipage.kernels.kv_quant_ref import dequantize_kv

    tables = source_tables.clamp(min=0).long()
    entries = cache[layer][tables]  # [R, N, b, Hkv, d]
    entry_scales = None if scales is None else scales[layer][tables]
    return dequantize_kv(entries, entry_scales).flatten(1, 2)


def batch_valid(num_source_blocks: torch.Tensor, width: int, params: CompressionParams
                ) -> torch.Tensor:
    """bool [R, width]: which positions of each request lie within its own length (on the device)."""
    positions = torch.arange(width, device=num_source_blocks.device)
    lengths = num_source_blocks.to(torch.int64) * params.block_size
    return positions[None, :] < lengths[:, None]
