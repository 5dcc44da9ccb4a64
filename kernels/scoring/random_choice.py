"""`random`: a uniformly random choice of the entries outside the window, the floor any scoring
policy must beat.

The scores are a hash of (seed, KV head, position) computed in int64 arithmetic, not a torch
generator: the same on every device, deterministic per compression (the compressor gives each
one a seed from its request's block tables, the same in every run and on every rank) and per
layer (`compress_ref` folds the layer in), and nothing is read back to the host.

Fast path (`batched_torch`, pure torch on the device): the same hash for the whole batch at once,
each (layer, request) seeded as the reference seeds it from the batch's `seeds` tensor, then the
pipeline's top-k and compaction kernels.
"""

from __future__ import annotations

import torch

from zipage.kernels.compress_ref import LAYER_SEED_STRIDE, CompressionParams, ScoreInputs
from zipage.kernels.scoring.base import (
    ScoringPolicy,
    check_scales,
    compact_by_scores,
    with_window,
    without_global_score,
)

_MASK = (1 << 62) - 1  # keeps every intermediate non-negative, so shifts are logical
_MULTIPLIER = 0x5851F42D4C957F2D & _MASK  # odd: a bijection modulo 2^62
_FRACTION_BITS = 24  # a float32 holds 24 bits exactly


def uniform_hash(seed: int | torch.Tensor, kv_heads: int, length: int,
                 device: torch.device) -> torch.Tensor:
    """[kv_heads, length] float32 in [0, 1): a mixed hash of (seed, head, position). `seed` may
    be an int64 tensor [..., 1, 1] (a seed each): then [..., kv_heads, length]. int64 products
    wrap modulo 2^64, which keeps the low 62 bits the mask takes, so a tensor seed hashes as the
    same Python int would."""
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


def batched_torch(k_cache, v_cache, score_cache, query_cache, source_tables, num_source_blocks,
                  target_tables, query_slots, is_compressed, params, scale, *,
                  num_target_blocks=None, k_scale=None, v_scale=None, seeds=None) -> None:
    """The whole batch's hashes [L, R, Hkv, N b] (no KV read), then the compaction. `seeds`
    int64 [R] on the device (None: 0), as `compress_ref` takes them."""
    check_scales(k_cache, k_scale, v_scale)
    layers, kv_heads = k_cache.shape[0], k_cache.shape[3]
    requests, width = source_tables.shape[0], source_tables.shape[1] * params.block_size
    device = k_cache.device
    own = (torch.zeros(requests, dtype=torch.int64, device=device) if seeds is None
           else seeds.to(device=device, dtype=torch.int64))
    layer = torch.arange(layers, dtype=torch.int64, device=device)[:, None]
    seed = ((params.seed + own)[None, :] * LAYER_SEED_STRIDE + layer).view(layers, requests, 1, 1)
    scores = uniform_hash(seed, kv_heads, width, device)
    compact_by_scores(scores, k_cache, v_cache, score_cache, source_tables,
                      num_source_blocks, target_tables, params, num_target_blocks, k_scale,
                      v_scale)


POLICY = ScoringPolicy("random", reference, without_global_score, batched_torch)
