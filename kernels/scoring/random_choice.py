"""`random`: a uniformly random choice of the entries outside the window, the floor any scoring
policy must beat.

The scores are a hash of (seed, KV head, position) computed in int64 arithmetic, not a torch
generator: the same on every device, deterministic per compression (the compressor gives each
one a seed from its request's block tables, the same in every run and on every rank) and per
layer (`compress_ref` folds the layer in), and nothing is read back to the host.
"""

from __future__ import annotations

import torch

from zipage.kernels.compress_ref import CompressionParams, ScoreInputs
from zipage.kernels.scoring.base import ScoringPolicy, with_window, without_global_score

_MASK = (1 << 62) - 1  # keeps every intermediate non-negative, so shifts are logical
_MULTIPLIER = 0x5851F42D4C957F2D & _MASK  # odd: a bijection modulo 2^62
_FRACTION_BITS = 24  # a float32 holds 24 bits exactly


def uniform_hash(seed: int, kv_heads: int, length: int, device: torch.device) -> torch.Tensor:
    """[kv_heads, length] float32 in [0, 1): a mixed hash of (seed, head, position)."""
    head = torch.arange(kv_heads, device=device, dtype=torch.int64)[:, None]
    position = torch.arange(length, device=device, dtype=torch.int64)[None, :]
    state = (seed & _MASK) ^ ((head << 40) + position)
    for _ in range(3):  # multiply-xorshift rounds: every input bit reaches the top bits
        state = (state * _MULTIPLIER) & _MASK
        state = state ^ (state >> 29)
    top = (state >> (62 - _FRACTION_BITS)).float()
    return top / (1 << _FRACTION_BITS)


def reference(inputs: ScoreInputs, params: CompressionParams):
    length, kv_heads = inputs.keys.shape[:2]
    scores = uniform_hash(inputs.seed, kv_heads, length, inputs.keys.device)
    return with_window(scores, params.window), None


POLICY = ScoringPolicy("random", reference, without_global_score)
