"""`snapkv`: SnapKV's score (Li et al. 2024, "SnapKV: LLM Knows What You Are Looking For Before
Generation"): the window queries' attention over the keys, summed over the window, then
average-pooled with kernel 5 (its code's defaults: `pooling='avgpool'`, `kernel_size=5`, zero
padding counted) so that neighbours of an attended entry survive with it. No global score, no
redundancy.

Differences from SnapKV's code: the window mean instead of its sum (the same order); a KV head's
group of query heads is reduced by the max of their probabilities (SnapKV, written before GQA
models, scores each query head's own copy of the KV); and the window is this pipeline's w, not
SnapKV's 32.
"""

from __future__ import annotations

import dataclasses

import torch

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs, attention_scores
from zipage.kernels.scoring.base import ScoringPolicy, compact_by_scores, with_window

SNAPKV_POOL_KERNEL = 5


def fixed(params: CompressionParams) -> CompressionParams:
    return dataclasses.replace(params, global_score=False, redundancy="off", pooling="off",
                               pool_kernel=SNAPKV_POOL_KERNEL)


def average_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average-pool [..., T] along the sequence, zeros beyond either end counted."""
    flat = scores.reshape(-1, 1, scores.shape[-1])
    pooled = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return pooled.view(scores.shape)


def reference(inputs: ScoreInputs, params: CompressionParams):
    scores = attention_scores(inputs.queries, inputs.keys, inputs.keys.shape[0],
                              params.block_size, inputs.scale, inputs.reduce_group_max)
    return with_window(average_pool(scores, params.pool_kernel), params.window), None


def triton(k_cache, v_cache, score_cache, query_cache, source_tables, num_source_blocks,
           target_tables, query_slots, is_compressed, params, scale, *, num_target_blocks=None,
           k_scale=None, v_scale=None, seeds=None) -> None:
    """The attention kernel of the pipeline, the pooling in torch on the whole batch."""
    from zipage.kernels.compress_triton import attention_scores_triton

    scores = attention_scores_triton(k_cache, None, query_cache, source_tables,
                                     num_source_blocks, query_slots, is_compressed, params,
                                     scale, k_scale)
    # Zero past each request's length, so the pooling pads every request with zeros, as alone.
    positions = torch.arange(scores.shape[-1], device=scores.device)
    lengths = (num_source_blocks.to(torch.int64) * params.block_size).view(1, -1, 1, 1)
    scores = scores.masked_fill(positions >= lengths, 0.0)
    compact_by_scores(average_pool(scores, params.pool_kernel), k_cache, v_cache, score_cache,
                      source_tables, num_source_blocks, target_tables, params,
                      num_target_blocks, k_scale, v_scale)


POLICY = ScoringPolicy("snapkv", reference, fixed, triton)
