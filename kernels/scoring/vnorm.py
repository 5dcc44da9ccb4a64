"""`vnorm`: the value-norm score (after VaSE and "Attention Score is not All You Need for Token
Importance Indicator in KV Cache Reduction: Value Also Matters", Guo et al. 2024): an entry's
contribution to an attention output is its weight times its value, so at equal attention the
entries whose values have the larger L2 norm matter more. Here the norm alone ranks them, per KV
head: no queries, no attention.
"""

from __future__ import annotations

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs
from zipage.kernels.scoring.base import ScoringPolicy, with_window, without_global_score


def reference(inputs: ScoreInputs, params: CompressionParams):
    norms = inputs.values.float().norm(dim=-1)  # [T, Hkv]
    return with_window(norms.transpose(0, 1), params.window), None


POLICY = ScoringPolicy("vnorm", reference, without_global_score)
