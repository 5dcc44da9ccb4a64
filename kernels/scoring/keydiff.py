"""`keydiff`: KeyDiff's score (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache
Eviction for Long-Context LLM Inference"): keep the keys least like the others, with no
attention, so no window queries are read. Per KV head the anchor is the mean of the normalised
keys; an entry's score is minus the cosine similarity of its key to the anchor.
"""

from __future__ import annotations

import torch

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs
from zipage.kernels.scoring.base import ScoringPolicy, with_window, without_global_score


def reference(inputs: ScoreInputs, params: CompressionParams):
    keys = torch.nn.functional.normalize(inputs.keys.float(), dim=-1)  # [T, Hkv, d]
    anchor = keys.mean(dim=0)  # [Hkv, d]
    similarity = torch.nn.functional.cosine_similarity(keys, anchor[None], dim=-1)  # [T, Hkv]
    return with_window(-similarity.transpose(0, 1), params.window), None


POLICY = ScoringPolicy("keydiff", reference, without_global_score)
