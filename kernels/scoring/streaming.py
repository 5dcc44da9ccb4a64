"""`streaming`: StreamingLLM's cache (Xiao et al. 2024, "Efficient Streaming Language Models
with Attention Sinks"): the first 4 entries (the attention sinks) and the most recent ones.

Kept entries stay in order, so after a compression the first entries are still the sequence's
first tokens and the entry index still orders by recency: the score is the position, the sinks
+inf. Reads neither queries nor keys.

Fast path (`batched_torch`, pure torch on the device, no host reads): the same scores for the
whole batch at once, then the pipeline's top-k and compaction kernels.
"""

from __future__ import annotations

import torch

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs
from zipage.kernels.scoring.base import (
    ScoringPolicy,
    check_scales,
    compact_by_scores,
    with_window,
    without_global_score,
)

SINK_ENTRIES = 4


def recency_scores(length: int, device: torch.device) -> torch.Tensor:
    """float32 [length]: each entry's position, the sinks at +inf."""
    positions = torch.arange(length, device=device)
    recency = positions.float()
    scores = recency.masked_fill(positions < SINK_ENTRIES, float("inf"))
    return scores


def reference(inputs: ScoreInputs, params: CompressionParams):
    length, kv_heads = inputs.keys.shape[:2]
    scores = recency_scores(length, inputs.keys.device).expand(kv_heads, length)
    return with_window(scores, params.window), None


def batched_torch(k_cache, v_cache, score_cache, query_cache, source_tables, num_source_blocks,
                  target_tables, query_slots, is_compressed, params, scale, *,
                  num_target_blocks=None, k_scale=None, v_scale=None,
                  seeds=None) -> None:
    """The whole batch's recency scores [L, R, Hkv, N b] (no KV read), then the compaction."""
    check_scales(k_cache, k_scale, v_scale)
    layers, kv_heads = k_cache.shape[0], k_cache.shape[3]
    requests, width = source_tables.shape[0], source_tables.shape[1] * params.block_size
    scores = recency_scores(width, k_cache.device).expand(layers, requests, kv_heads, width)
    compact_by_scores(scores, k_cache, v_cache, score_cache, source_tables,
                      num_source_blocks, target_tables, params, num_target_blocks, k_scale,
                      v_scale)


POLICY = ScoringPolicy("streaming", reference, without_global_score, batched_torch)
