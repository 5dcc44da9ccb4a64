"""`keydiff`: KeyDiff's score (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache
Eviction for Long-Context LLM Inference"): keep the keys least like the others, with no
attention, so no window queries are read. Per KV head the anchor is the mean of the normalised
keys; an entry's score is minus the cosine similarity of its key to the anchor.

Fast path (`batched_torch`, pure torch on the device, no host reads): every request's keys
gathered from the paged cache through its source table (an fp8 cache's dequantized with
`k_scale`, as the reference reads them), one layer of the group at a time; each request's anchor
is the mean over its own entries only (the padding past its length is left out), then the
pipeline's top-k and compaction kernels.
"""

from __future__ import annotations

import torch

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs
from zipage.kernels.scoring.base import (
    ScoringPolicy,
    batch_entries,
    batch_valid,
    check_scales,
    compact_by_scores,
    with_window,
    without_global_score,
)


def reference(inputs: ScoreInputs, params: CompressionParams):
    keys = torch.nn.functional.normalize(inputs.keys.float(), dim=-1)  # [T, Hkv, d]
    anchor = keys.mean(dim=0)  # [Hkv, d]
    similarity = torch.nn.functional.cosine_similarity(keys, anchor[None], dim=-1)  # [T, Hkv]
    return with_window(-similarity.transpose(0, 1), params.window), None


def batch_scores(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[R, Hkv, N b]: minus each key's cosine similarity to its request's and head's anchor, the
    mean normalised key over the request's valid entries (`keys` [R, N b, Hkv, d], `valid` bool
    [R, N b]); the scores past a request's length are meaningless (the caller masks them)."""
    normalised = torch.nn.functional.normalize(keys, dim=-1)
    inside = valid[:, :, None, None]
    # torch.where, not a product: padding may hold anything, NaN included.
    total = torch.where(inside, normalised, torch.zeros_like(normalised)).sum(dim=1)  # [R, Hkv, d]
    anchor = total / valid.sum(dim=1).clamp(min=1).to(total.dtype)[:, None, None]
    similarity = torch.nn.functional.cosine_similarity(normalised, anchor[:, None], dim=-1)
    return -similarity.transpose(1, 2)


def batched_torch(k_cache, v_cache, score_cache, query_cache, source_tables, num_source_blocks,
                  target_tables, query_slots, is_compressed, params, scale, *,
                  num_target_blocks=None, k_scale=None, v_scale=None,
                  seeds=None) -> None:
    """The whole batch's scores [L, R, Hkv, N b], then the compaction."""
    check_scales(k_cache, k_scale, v_scale)
    valid = batch_valid(num_source_blocks, source_tables.shape[1] * params.block_size, params)
    scores = torch.stack([
        batch_scores(batch_entries(k_cache, k_scale, source_tables, layer), valid)
        for layer in range(k_cache.shape[0])])  # [L, R, Hkv, N b]
    compact_by_scores(scores, k_cache, v_cache, score_cache, source_tables,
                      num_source_blocks, target_tables, params, num_target_blocks, k_scale,
                      v_scale)


POLICY = ScoringPolicy("keydiff", reference, without_global_score, batched_torch)
