"""Pure-torch paged attention: the CPU path of the engine and the oracle the Triton kernels are tested against.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``; a sequence's
KV entry number ``i`` lives in block ``block_tables[seq, i // block_size]`` at offset ``i % block_size``. These
functions have exactly the signatures of the Triton versions in ``attention_triton.py`` and favour obviousness
over speed: one sequence at a time, softmax in float32, output in the query's dtype. Grouped-query attention
follows the usual convention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zipage.kernels.kv_quant_ref import dequantize_kv, quantize_kv

# Query rows (new tokens x heads of a GQA group) per prefill program when the engine cuts a work list: the
# Triton kernel's default tile (``attention_triton._PREFILL_ROWS``).
PREFILL_WORK_ROWS = 64


@dataclass(frozen=True)
class PrefillWork:
    """The programs of a prefill launch as a list: ``items`` int32 ``[num_items, 2]``, each (sequence, query
    tile), the tile being ``tile_tokens`` new tokens of that sequence; (-1, -1) is a padding item that computes
    nothing. A fixed-size list (padded) makes the launch's grid independent of the batch (CUDA graphs). It
    only decides which program computes what: results never depend on it, so the reference ignores it."""

    items: torch.Tensor
    tile_tokens: int


def prefill_tile_tokens(num_heads: int, num_kv_heads: int) -> int:
    """New tokens per work item: ``PREFILL_WORK_ROWS`` rows shared by the query heads of one KV head."""
    group_padded = 1 << (num_heads // num_kv_heads - 1).bit_length()
    return max(PREFILL_WORK_ROWS // group_padded, 1)


def prefill_work_capacity(num_tokens: int, num_seqs: int, tile_tokens: int) -> int:
    """Most items any batch of at most ``num_tokens`` new tokens in at most ``num_seqs`` sequences needs: each
    sequence adds at most one partial tile to ``num_tokens / tile_tokens`` full ones."""
    return -(-num_tokens // tile_tokens) + num_seqs


def prefill_work(query_lens: torch.Tensor, tile_tokens: int, capacity: int | None = None) -> PrefillWork:
    """The work list of sequences with ``query_lens`` (int, host) new tokens: their query tiles in order, then
    padding items up to ``capacity`` (None: no padding).

    Built with numpy, not torch: every padded (graphed) prefill step builds one on the host, and torch's CPU
    ``repeat_interleave`` splits even a few elements across its whole thread pool (grain size 1), which cost
    0.2-1.6 ms of host time a step on a 16-core H200 host."""
    lens = query_lens.numpy().astype(np.int64)
    tiles = -(-lens // tile_tokens)
    total = int(tiles.sum())
    if capacity is not None and total > capacity:
        raise ValueError(f"{total} prefill work items do not fit a capacity of {capacity}")
    items = np.full((total if capacity is None else capacity, 2), -1, dtype=np.int32)
    seqs = np.repeat(np.arange(len(lens)), tiles)
    items[:total, 0] = seqs
    items[:total, 1] = np.arange(total) - (np.cumsum(tiles) - tiles)[seqs]
    return PrefillWork(torch.from_numpy(items), tile_tokens)


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the cache slots named by
    ``slot_mapping`` (``block_id * block_size + offset``); a slot of -1 means the token is not stored.
    With ``k_scale``/``v_scale`` (float32 ``[num_blocks, block_size, num_kv_heads]``) the caches are float8:
    each (token, head) is quantized with its own scale (``kv_quant_ref.quantize_kv``)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for source, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = source[keep]
        if scales is not None:
            rows, row_scales = quantize_kv(rows)
            scales.view(-1, num_kv_heads)[slots] = row_scales
        cache.view(-1, num_kv_heads, head_dim)[slots] = rows.to(cache.dtype)


def store_queries_ref(query: torch.Tensor, query_cache: torch.Tensor, query_slot_mapping: torch.Tensor) -> None:
    """Write each token's query ``[num_tokens, num_heads, head_dim]`` into the query cache ``[num_slots, window,
    num_heads, head_dim]`` at flat row ``query_slot_mapping`` (``slot * window + window_index``; -1 = skip)."""
    keep = query_slot_mapping >= 0
    query_cache.view(-1, *query_cache.shape[2:])[query_slot_mapping[keep]] = query[keep].to(query_cache.dtype)


def gather_sequence_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first ``context_len`` entries of one sequence, densely: ``[context_len, num_kv_heads, head_dim]``
    (float32, dequantized, when ``scales`` of a float8 cache are given). Only the blocks that hold those entries
    are read, so the table's padding (-1 or 0) is never dereferenced."""
    block_size = cache.shape[1]
    num_used_blocks = -(-context_len // block_size)
    blocks = block_table_row[:num_used_blocks].long()
    entries = cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:context_len]
    if scales is None:
        return entries
    return dequantize_kv(entries, scales[blocks].reshape(-1, cache.shape[2])[:context_len])


def _attend_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    context_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q_len`` new queries that are the last ``q_len`` of a sequence's ``context_len``
    cached entries. Returns ``[q_len, num_heads, head_dim]`` in the query's dtype."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = gather_sequence_kv(k_cache, block_table_row, context_len, k_scale).float()
    values = gather_sequence_kv(v_cache, block_table_row, context_len, v_scale).float()
    # [num_kv_heads, group, q_len, head_dim] against [num_kv_heads, 1, context_len, head_dim]: one KV head
    # serves its whole group by broadcasting instead of being copied per query head.
    queries = q.float().reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    keys = keys.permute(1, 0, 2).unsqueeze(1)
    values = values.permute(1, 0, 2).unsqueeze(1)
    logits = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    query_positions = torch.arange(context_len - q_len, context_len, device=q.device).unsqueeze(1)
    key_positions = torch.arange(context_len, device=q.device).unsqueeze(0)
    logits = logits.masked_fill(key_positions > query_positions, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    out = torch.matmul(probabilities, values)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    work: PrefillWork | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of variable-length new tokens over the paged cache.

    ``max_q_len`` (the longest sequence's new tokens) and ``work`` (the Triton kernel's programs as a list) only
    shape the Triton launch; unused here. Rows past ``cu_seqlens_q[-1]`` (padding) get zeros.

    ``q`` is ``[total_q_tokens, num_heads, head_dim]``; sequence ``i`` owns rows ``cu_seqlens_q[i]`` to
    ``cu_seqlens_q[i+1]`` and has ``context_lens[i]`` cached entries, its new tokens already stored as the last
    ones. Query ``j`` of the sequence sees KV entries ``0 .. context_lens[i] - q_len + j``, so a cached prefix
    (``context_lens[i] > q_len``) is attended to fully."""
    out = torch.zeros_like(q)
    cu_seqlens = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    for seq, context_len in enumerate(lengths):
        start, end = cu_seqlens[seq], cu_seqlens[seq + 1]
        if end == start:
            continue
        out[start:end] = _attend_sequence(q[start:end], k_cache, v_cache, block_tables[seq], context_len, scale,
                                          k_scale, v_scale)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    grid_batch: int | None = None,
    split: str | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (``q`` is ``[batch, num_heads, head_dim]``) over its ``context_lens[i]`` cached
    entries. A sequence with no entries (a padding slot of a captured batch) gets a zero output. A float8 cache
    comes with ``k_scale``/``v_scale`` (float32 ``[num_blocks, block_size, num_kv_heads]``), dequantized as read.
    ``grid_batch`` and ``split`` shape the Triton kernel's split only (the result does not depend on them)."""
    out = torch.zeros_like(q)
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        out[seq : seq + 1] = _attend_sequence(
            q[seq : seq + 1], k_cache, v_cache, block_tables[seq], context_len, scale, k_scale, v_scale
        )
    return out
