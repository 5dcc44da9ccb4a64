"""`rkv`: R-KV's score (Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for
Reasoning Models"), as its reference code computes it.

Importance: the window queries' softmax over the keys, averaged over the window, max-pooled
with kernel 7. Redundancy: cosine similarity of all key pairs, the diagonal zeroed and, of two
keys above the 0.5 threshold, the pair with the newest zeroed; the mean similarity of each key,
softmaxed over the sequence. Score = 0.1 importance - 0.9 redundancy (the paper's lambda; the
code's default is 0.07). No global score. That is the pipeline with these constants: flash
redundancy divided by the sequence length (tau 1), pooling at every compression, so the Triton
kernels serve it too.

Differences from R-KV's code: a KV head's group of query heads is reduced by the max of their
probabilities after each head's softmax (R-KV takes the max of the logits before one softmax),
and the softmax runs over the window's own keys as well (causally), as in the rest of the
pipeline; both change the importance's scale, not which keys a query attends to.
"""

from __future__ import annotations

import dataclasses

from zipage.kernels.compress_ref import CompressionParams, pipeline_scorer
from zipage.kernels.scoring.base import ScoringPolicy
from zipage.kernels.scoring.zipage_pipeline import POLICY as PIPELINE

RKV_LAMBDA = 0.1
RKV_POOL_KERNEL = 7
RKV_THRESHOLD = 0.5


def fixed(params: CompressionParams) -> CompressionParams:
    return dataclasses.replace(params, global_score=False, redundancy="flash", tau=1.0,
                               lambda_weight=RKV_LAMBDA, similarity_threshold=RKV_THRESHOLD,
                               pooling="always", pool_kernel=RKV_POOL_KERNEL)


POLICY = ScoringPolicy("rkv", pipeline_scorer, fixed, PIPELINE.triton)
