"""The engine's entry points for paged attention: each call goes to the Triton kernel or to the torch reference.

The rule of ``dispatch.py`` decides (Triton on CUDA tensors or under the Triton interpreter, else the pure-torch
reference of ``attention_ref.py``). The Triton module is imported only when
first needed, so CPU-only use never pays for (or depends on) importing Triton.
"""

from __future__ import annotations

from types import ModuleType

import torch

from zipage.kernels.attention_ref import (  # noqa: F401 (the work-list helpers are public here)
    PrefillWork,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    prefill_tile_tokens,
    prefill_work,
    prefill_work_capacity,
    store_kv_ref,
    store_queries_ref,
)
from zipage.kernels.dispatch import use_triton


def _triton_backend(tensor: torch.Tensor) -> ModuleType | None:
    """The Triton kernels module if this call should use it (kernels/dispatch.py), else None."""
    if not use_triton(tensor):
        return None
    from zipage.kernels import attention_triton

    return attention_triton


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into cache slots
    ``block_id * block_size + offset`` given by ``slot_mapping`` (int64, -1 = skip), in place. A float8 cache
    comes with ``k_scale``/``v_scale`` (float32 ``[num_blocks, block_size, num_kv_heads]``): each entry is
    quantized with a scale of its own (``kv_quant_ref``)."""
    backend = _triton_backend(key)
    if backend is None:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    else:
        backend.store_kv_triton(key, value, k_cache, v_cache, slot_mapping, **_scales(k_scale, v_scale))


def store_queries(query: torch.Tensor, query_cache: torch.Tensor, query_slot_mapping: torch.Tensor) -> None:
    """Write each token's query ``[num_tokens, num_heads, head_dim]`` into the query cache ``[num_slots, window,
    num_heads, head_dim]`` at flat row ``query_slot_mapping`` (int64, -1 = skip), in place: the window queries
    a compression scores with (docs/architecture.md, 'Rules', rule 7)."""
    backend = _triton_backend(query)
    if backend is None:
        store_queries_ref(query, query_cache, query_slot_mapping)
    else:
        backend.store_queries_triton(query, query_cache, query_slot_mapping)


def paged_prefill_attention(
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
    """Causal attention of the new tokens ``q`` ``[total_q_tokens, num_heads, head_dim]`` of each sequence over
    its paged cache (cached prefix + the new tokens, already stored); see ``paged_prefill_attention_ref``.
    ``max_q_len``, the most new tokens of any sequence, lets the Triton kernel size its grid without reading
    ``cu_seqlens_q`` back from the device (a host sync per layer); ``work`` (``prefill_work``) replaces the
    grid by a list of programs of fixed size, for CUDA graphs. ``k_scale``/``v_scale``: a float8 cache's scales,
    dequantized as read."""
    backend = _triton_backend(q)
    if backend is None:
        return paged_prefill_attention_ref(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                           max_q_len, work, k_scale=k_scale, v_scale=v_scale)
    return backend.paged_prefill_attention_triton(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, max_q_len, work,
        **_scales(k_scale, v_scale),
    )


def paged_decode_attention(
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
    """One query per sequence, ``q`` ``[batch, num_heads, head_dim]``, over its ``context_lens[i]`` cached
    entries; see ``paged_decode_attention_ref``. ``grid_batch``: split the contexts as for a batch of that many
    sequences (None: ``q``'s rows); ``split``: "batch" or "balanced" (zipage/decode_grid.py; None: the kernel's
    default)."""
    backend = _triton_backend(q)
    if backend is None:
        return paged_decode_attention_ref(q, k_cache, v_cache, context_lens, block_tables, scale,
                                          grid_batch=grid_batch, split=split, k_scale=k_scale, v_scale=v_scale)
    # (as the scales: only when set, so a launcher of an older signature still takes the call)
    shape = {name: value for name, value in (("grid_batch", grid_batch), ("split", split)) if value is not None}
    return backend.paged_decode_attention_triton(q, k_cache, v_cache, context_lens, block_tables, scale,
                                                 **shape, **_scales(k_scale, v_scale))


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> dict:
    """The scale keywords of a Triton call: only for an fp8 cache, so a cache in the compute dtype makes the
    call it always made."""
    return {} if k_scale is None and v_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
