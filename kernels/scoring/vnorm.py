"""`vnorm`: the value-norm score (after VaSE and "Attention Score is not All You Need for Token
Importance Indicator in KV Cache Reduction: Value Also Matters", Guo et al. 2024): an entry's
contribution to an attention output is its weight times its value, so at equal attention the
entries whose values have the larger L2 norm matter more. Here the norm alone ranks them, per KV
head: no queries, no attention.

Fast path (`batched_torch`, pure torch on the device, no host reads): every request's values
gathered from the paged cache through its source table (an fp8 cache's dequantized with
`v_scale`, as the reference reads them), one layer of the group at a time, then the pipeline's
top-k and compaction kernels.
"""

from __future__ import annotations

import torch

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs
from zipage.kernels.scoring.base import (
    ScoringPolicy,
    batch_entries,
    check_scales,
    compact_by_scores,
    with_window,
    without_global_score,
)


def reference(inputs: ScoreInputs, params: CompressionParams):
    norms = inputs.values.float().norm(dim=-1)  # [T, Hkv]
    return with_window(norms.transpose(0, 1), params.window), None


def batched_torch(k_cache, v_cache, score_cache, query_cache, source_tables, num_source_blocks,
                  target_tables, query_slots, is_compressed, params, scale, *,
                  num_target_blocks=None, k_scale=None, v_scale=None,
                  seeds=None) -> None:
    """The whole batch's value norms [L, R, Hkv, N b], then the compaction."""
    check_scales(k_cache, k_scale, v_scale)
    norms = torch.stack([
        batch_entries(v_cache, v_scale, source_tables, layer).norm(dim=-1).transpose(1, 2)
        for layer in range(v_cache.shape[0])])  # [L, R, Hkv, N b]
    compact_by_scores(norms, k_cache, v_cache, score_cache, source_tables,
                      num_source_blocks, target_tables, params, num_target_blocks, k_scale,
                      v_scale)


POLICY = ScoringPolicy("vnorm", reference, without_global_score, batched_torch)
