"""Pure-torch reference of the compression pipeline (docs/architecture.md, 'Compression pipeline').

The CPU path and the test oracle of the Triton kernels (it runs on any device, so a GPU check can
compare on the GPU). One call compresses a batch of requests
over a group of layers (the runner passes `layer_stride` layers at a time). Shapes, with L layers
in the group, R requests, N source blocks at most, b the block size, w the window:

- k_cache, v_cache  [L, num_blocks, b, Hkv, d]   the paged KV cache of the group's layers
- score_cache       [L, num_blocks, b, Hkv]      global scores F (None, or ignored, when the global score
                                                 is off)
- query_cache       [L, num_slots, w, Hq, d]     window queries, post-RoPE
- source_tables     int [R, N]                   blocks being compressed (padded with -1)
- num_source_blocks int [R]                      N_r; every source block is full
- target_tables     int [R, T]                   the blocks receiving the kept entries (padded with -1)
- query_slots       int [R]
- is_compressed     bool [R]                     compressed before (global-score decay, pooling)
- num_target_blocks int [R], keyword, optional   T_r <= T: request r's target blocks (its own
                                                 N_max - 1, or more under the elastic policy);
                                                 None: every request fills all T
- k_scale, v_scale  [L, num_blocks, b, Hkv], keywords, optional: an fp8 cache's float32 scales
                                                 (kernels/kv_quant_ref.py); the scores read the
                                                 dequantized keys, the compaction moves the fp8
                                                 bytes and their scales unchanged
- seeds             int64 [R], keyword, optional     each compression's own seed (the random
                                                 scoring policy's; None: 0)
- scorer            keyword, optional                the reference scorer of the scoring policy
                                                 (`kernels/scoring`); None: the pipeline below,
                                                 `params.scoring` = "zipage"

Every step is computed in float32 per (layer, request, kv head), then the top k_r = T_r * b
entries are kept in their original order and written densely into the request's target blocks.
All kept entries are gathered before any is written, so a target block may also be a source
block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from zipage.config import ZipageConfig, window_violation
from zipage.kernels.kv_quant_ref import dequantize_kv
from zipage.scoring import DEFAULT_SCORING

_KNOBS = ZipageConfig()  # the knobs' defaults are declared once, on ZipageConfig
# A compression's seed for layer l of its group: seed * LAYER_SEED_STRIDE + l (one per layer).
LAYER_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class CompressionParams:
    """The compression knobs a kernel needs (a subset of `ZipageConfig`, same names)."""

    block_size: int
    window: int
    alpha: float = _KNOBS.alpha
    global_score: bool = _KNOBS.global_score
    pooling: str = _KNOBS.pooling  # "first" | "always" | "off"
    redundancy: str = _KNOBS.redundancy  # "lightning" | "flash" | "off"
    lambda_weight: float = _KNOBS.lambda_weight
    tau: float = _KNOBS.tau
    similarity_threshold: float = _KNOBS.similarity_threshold
    pool_kernel: int = 5  # the paper's max-pooling width; not a user knob
    scoring: str = _KNOBS.scoring  # the policy that ranks the entries (kernels/scoring)
    seed: int = 0  # added to every compression's own seed (the random policy's); not a knob

    def __post_init__(self) -> None:
        # Beyond half a block the Triton kernels and this reference disagree (3.4e-2 on the
        # final scores at w = 24, b = 16); ZipageConfig rejects such a window, so do the kernels.
        if expected := window_violation(self.block_size, self.window):
            raise ValueError(f"window: got {self.window!r}, expected {expected}")

    @classmethod
    def from_config(cls, config: ZipageConfig) -> "CompressionParams":
        names = {f.name for f in fields(cls)} & {f.name for f in fields(ZipageConfig)}
        return cls(**{name: getattr(config, name) for name in names})


def attention_scores(queries: torch.Tensor, keys: torch.Tensor, length: int, block_size: int,
                     scale: float, reduce_group_max=None) -> torch.Tensor:
    """S [Hkv, length]: softmax of the window queries over the keys, max over each kv head's
    group of query heads, mean over the w window rows (causal inside the final block).

    queries [w, Hq, d], keys [length, Hkv, d] (length = N * b, the final block is full).
    `reduce_group_max` (tensor parallelism with replicated KV heads, whose query heads are split
    across ranks): applied to the group max [Hkv, w, length] before the window mean; it must
    return the max over the ranks holding the same KV head.
    """
    window, query_heads, _ = queries.shape
    kv_heads = keys.shape[1]
    group = query_heads // kv_heads
    grouped_keys = keys.float().repeat_interleave(group, dim=1)  # [length, Hq, d]
    logits = torch.einsum("whd,thd->hwt", queries.float(), grouped_keys) * scale
    # Window query u sits at in-block offset b - w + u of the final block and sees offsets <= it.
    entry = torch.arange(length, device=keys.device)
    query_entry = length - window + torch.arange(window, device=keys.device)
    logits = logits.masked_fill(entry[None, :] > query_entry[:, None], float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)  # [Hq, w, length]
    per_kv_head = probabilities.view(kv_heads, group, window, length).amax(dim=1)
    if reduce_group_max is not None:
        per_kv_head = reduce_group_max(per_kv_head)
    return per_kv_head.mean(dim=1)  # [Hkv, length]


def update_global_scores(scores: torch.Tensor, previous: torch.Tensor, compressed: bool,
                         block_size: int, alpha: float) -> torch.Tensor:
    """The decayed max of historical scores (G-KV): scores and previous are [Hkv, length].

    For a request compressed before, every entry but those of the final block (decoded since the
    last compression) becomes max(alpha * F, S); an uncompressed request just takes S.
    """
    if not compressed:
        return scores
    history = scores[:, :-block_size]
    merged = torch.maximum(alpha * previous[:, :-block_size].float(), history)
    return torch.cat([merged, scores[:, -block_size:]], dim=1)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool along the sequence (SnapKV): neighbours of a high score score high too."""
    return torch.nn.functional.max_pool1d(scores[:, None, :], kernel, stride=1,
                                          padding=kernel // 2)[:, 0, :]


def redundancy_scores(keys: torch.Tensor, mode: str, block_size: int, threshold: float,
                      tau: float) -> torch.Tensor:
    """R [Hkv, length]: how redundant each key is among its comparison set (R-KV style).

    Cosine similarity among normalised keys — within each block ("lightning", O(N b^2)) or all
    pairs ("flash") — with the diagonal zeroed; in each column the similarity to the newest row
    above the threshold is zeroed, so of two near-duplicates the newer survives. Row sums over
    tau times the number of keys compared, softmax over the sequence.
    """
    length, kv_heads, _ = keys.shape
    normalised = torch.nn.functional.normalize(keys.float(), dim=-1).transpose(0, 1)  # [H, T, d]
    if mode == "lightning":
        blocks = normalised.reshape(kv_heads, length // block_size, block_size, -1)
        similarity = blocks @ blocks.transpose(-1, -2)  # [H, N, b, b]
        compared = block_size
    else:
        similarity = (normalised @ normalised.transpose(-1, -2))[:, None]  # [H, 1, T, T]
        compared = length
    size = similarity.shape[-1]
    similarity = similarity * (1 - torch.eye(size, device=keys.device))
    rows = torch.arange(size, device=keys.device)[:, None].expand(size, size)
    above = similarity > threshold
    newest = torch.where(above, rows, torch.full_like(rows, -1)).amax(dim=-2, keepdim=True)
    similarity = similarity.masked_fill((rows == newest) & above, 0.0)
    redundancy = similarity.sum(dim=-1).reshape(kv_heads, length) / (tau * compared)
    return torch.softmax(redundancy, dim=-1)


def final_scores(keys: torch.Tensor, queries: torch.Tensor, previous: torch.Tensor | None,
                 compressed: bool, params: CompressionParams, scale: float,
                 reduce_group_max=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(final score [Hkv, length] with the window at +inf, new global scores or None)."""
    length = keys.shape[0]
    scores = attention_scores(queries, keys, length, params.block_size, scale, reduce_group_max)
    stored = None
    if params.global_score:
        scores = update_global_scores(scores, previous, compressed, params.block_size,
                                      params.alpha)
        stored = scores
    if params.pooling == "always" or (params.pooling == "first" and not compressed):
        scores = pool_scores(scores, params.pool_kernel)
    if params.redundancy != "off":
        redundancy = redundancy_scores(keys, params.redundancy, params.block_size,
                                       params.similarity_threshold, params.tau)
        scores = params.lambda_weight * scores - (1 - params.lambda_weight) * redundancy
    scores = scores.clone()
    scores[:, -params.window:] = float("inf")
    return scores, stored


@dataclass(frozen=True)
class ScoreInputs:
    """What a scoring policy's reference scorer reads of one (layer, request) (kernels/scoring):
    keys [T, Hkv, d] (dequantized), the window queries [w, Hq, d], the stored global scores
    [Hkv, T] (None: none kept), whether it was compressed before, the attention scale, its seed,
    the tensor-parallel group-max hook, and its values [T, Hkv, d], gathered only when read."""

    keys: torch.Tensor
    queries: torch.Tensor
    previous: torch.Tensor | None
    compressed: bool
    scale: float
    seed: int
    reduce_group_max: Callable | None
    gather_values: Callable[[], torch.Tensor]

    @property
    def values(self) -> torch.Tensor:
        return self.gather_values()


def pipeline_scorer(inputs: ScoreInputs, params: CompressionParams
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The paper's pipeline as a scorer: `final_scores` of the inputs."""
    return final_scores(inputs.keys, inputs.queries, inputs.previous, inputs.compressed, params,
                        inputs.scale, inputs.reduce_group_max)


def kept_entries(scores: torch.Tensor, keep: int | torch.Tensor,
                 width: int | None = None) -> torch.Tensor:
    """Indices [..., width] of the `keep` highest scores of each row (the last dim), in their
    original order. Among equal scores the lowest position wins, on every device (torch.topk
    leaves ties unspecified). No value is read back to the host: an async compression never
    stalls the thread that launches decode steps.

    `keep` is one count for every row (then `width` = `keep`), or an int64 tensor of each row's
    count shaped like `scores[..., :1]`, each at most `width` (requests with their own budgets
    in one batch); past its count a row holds the last position of the sequence, which a
    compaction that stops at the row's count never reads."""
    width = keep if width is None else width
    values = scores.topk(width, dim=-1).values
    # The keep-th highest score of each row.
    cut = values[..., -1:] if isinstance(keep, int) else values.gather(-1, keep - 1)
    above = scores > cut
    tied = scores == cut
    # Entries at the cut fill the rows' remaining places, lowest positions first.
    room = keep - above.sum(dim=-1, keepdim=True)
    kept = above | (tied & (tied.cumsum(dim=-1) <= room))
    # The j-th kept entry is the first position where the running count of kept entries
    # reaches j + 1 (each row keeps exactly its count; past it, the search runs off the end).
    counts = kept.cumsum(dim=-1)
    ranks = torch.arange(1, width + 1, device=scores.device).expand(*scores.shape[:-1], width)
    return torch.searchsorted(counts, ranks.contiguous()).clamp_(max=scores.shape[-1] - 1)


def batch_kept_entries(final: torch.Tensor, width: int, block_size: int,
                       num_target_blocks: torch.Tensor | None) -> torch.Tensor:
    """`kept_entries` of a batch's final scores [L, R, Hkv, T]: the top `width` of each row, or
    each request's own `num_target_blocks[r]` blocks' worth (its budget), one top-k of the widest
    cut per row on the device."""
    if num_target_blocks is None:
        return kept_entries(final, width)
    counts = (num_target_blocks.to(torch.int64) * block_size).view(1, -1, 1, 1)
    return kept_entries(final, counts.expand(*final.shape[:-1], 1), width)


def write_kept_entries(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
                       source: torch.Tensor, target: torch.Tensor, kept: torch.Tensor,
                       stored: torch.Tensor | None, *, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """Compaction of one (layer, request): the entries `kept` [Hkv, keep] (sorted) of the blocks `source`
    move densely, in order, into the blocks `target` of one layer's caches (k_cache [num_blocks, b, Hkv, d]);
    the global scores `stored` [Hkv, length] of the kept entries go to `score_cache` when both are given.
    Everything is gathered before anything is written, so a target block may also be a source block. An fp8
    cache's scales `k_scale`/`v_scale` [num_blocks, b, Hkv] move with their entries (nothing is requantized)."""
    keys = k_cache[source].flatten(0, 1)  # [N*b, Hkv, d]
    values = v_cache[source].flatten(0, 1)
    block_size = k_cache.shape[1]
    keep = kept.shape[1]
    heads = torch.arange(keys.shape[1], device=keys.device)[:, None]
    kept_keys = keys[kept, heads]  # [Hkv, keep, d]
    kept_values = values[kept, heads]
    shape = (keep // block_size, block_size) + keys.shape[1:]
    k_cache[target] = kept_keys.transpose(0, 1).reshape(shape)
    v_cache[target] = kept_values.transpose(0, 1).reshape(shape)
    for scales in (k_scale, v_scale):
        if scales is not None:
            kept_scales = torch.gather(scales[source].flatten(0, 1).transpose(0, 1), 1, kept)
            scales[target] = kept_scales.transpose(0, 1).reshape(keep // block_size, block_size, -1)
    if score_cache is not None and stored is not None:
        kept_scores = torch.gather(stored, 1, kept)  # [Hkv, keep]
        score_cache[target] = kept_scores.transpose(0, 1).reshape(
            keep // block_size, block_size, -1).to(score_cache.dtype)


def compress_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, score_cache: torch.Tensor | None,
                 query_cache: torch.Tensor, source_tables: torch.Tensor,
                 num_source_blocks: torch.Tensor, target_tables: torch.Tensor,
                 query_slots: torch.Tensor, is_compressed: torch.Tensor,
                 params: CompressionParams, scale: float, reduce_group_max=None, *,
                 num_target_blocks: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 seeds: torch.Tensor | None = None, scorer: Callable | None = None) -> None:
    if scorer is None:
        if params.scoring != DEFAULT_SCORING:
            raise ValueError(f"scoring {params.scoring!r}: pass its scorer (kernels/scoring), "
                             "or call kernels.compress.compress, which looks it up")
        scorer = pipeline_scorer
    if params.global_score and score_cache is None:
        raise ValueError("the global score is on but score_cache is None")
    # Without the global score the score cache (if any) is neither read nor written.
    score_cache = score_cache if params.global_score else None
    for request in range(source_tables.shape[0]):
        count = int(num_source_blocks[request])
        source = source_tables[request, :count].long()
        targets = (target_tables.shape[1] if num_target_blocks is None
                   else int(num_target_blocks[request]))
        if not 1 <= targets < count:
            raise ValueError(f"request {request}: {targets} target blocks for {count} source "
                             "blocks; a compression keeps at least one block and fewer than it "
                             "reads")
        target = target_tables[request, :targets].long()
        keep = targets * params.block_size
        slot = int(query_slots[request])
        compressed = bool(is_compressed[request])
        seed = params.seed + (0 if seeds is None else int(seeds[request]))
        for layer in range(k_cache.shape[0]):
            keys = _entries(k_cache, k_scale, layer, source)  # [N*b, Hkv, d]
            previous = (score_cache[layer, source].flatten(0, 1).transpose(0, 1)
                        if score_cache is not None else None)
            inputs = ScoreInputs(
                keys, query_cache[layer, slot], previous, compressed, scale,
                seed * LAYER_SEED_STRIDE + layer, reduce_group_max,
                lambda layer=layer: _entries(v_cache, v_scale, layer, source))
            scores, stored = scorer(inputs, params)
            write_kept_entries(k_cache[layer], v_cache[layer],
                               score_cache[layer] if score_cache is not None else None,
                               source, target, kept_entries(scores, keep), stored,
                               k_scale=None if k_scale is None else k_scale[layer],
                               v_scale=None if v_scale is None else v_scale[layer])


def _entries(cache: torch.Tensor, scales: torch.Tensor | None, layer: int,
             source: torch.Tensor) -> torch.Tensor:
    """The K or V entries [N*b, Hkv, d] of one layer's blocks `source`; an fp8 cache's
    dequantized (the scores read values, the compaction moves the stored bytes)."""
    entries = cache[layer, source].flatten(0, 1)
    if scales is None:
        return entries
    return dequantize_kv(entries, scales[layer, source].flatten(0, 1))
