"""`streaming`: StreamingLLM's cache (Xiao et al. 2024, "Efficient Streaming Language Models
with Attention Sinks"): the first 4 entries (the attention sinks) and the most recent ones.

Kept entries stay in order, so after a compression the first entries are still the sequence's
first tokens and the entry index still orders by recency: the score is the position, the sinks
+inf. Reads neither queries nor keys.
"""

from __future__ import annotations

import torch

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs
from zipage.kernels.scoring.base import ScoringPolicy, with_window, without_global_score

SINK_ENTRIES = 4


def reference(inputs: ScoreInputs, params: CompressionParams):
    length, kv_heads = inputs.keys.shape[:2]
    positions = torch.arange(length, device=inputs.keys.device)
    recency = positions.float().expand(kv_heads, length)
    scores = recency.masked_fill(positions < SINK_ENTRIES, float("inf"))
    return with_window(scores, params.window), None


POLICY = ScoringPolicy("streaming", reference, without_global_score)
