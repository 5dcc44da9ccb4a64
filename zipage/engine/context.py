"""The forward context: the per-step batch layout that the attention layers read during a forward pass.

A model's forward only takes token ids and positions; everything attention needs to find a sequence's
KV entries in the paged cache (slot mapping, per-sequence query offsets, cached lengths, block tables)
is set here by the model runner right before the forward and cleared after it. Keeping it out of the
call signatures lets every layer stay a plain `nn.Module` and lets a captured CUDA graph replay with
the same (static) tensors, which the runner refills in place between replays.

Row layout of a step (docs/architecture.md, 'The engine'): the tokens of every prompt chunk first,
sequence after sequence (`cu_seqlens_q`), then one row per decoding request. A decode step has only
decode rows, a prefill step only chunk rows, a mixed step (chunked prefill) both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from zipage.kernels.attention import PrefillWork


@dataclass
class DecodeSection:
    """A padded (graphed) mixed step's decode rows that attend through the split-K decode kernel
    rather than in the prefill launch (zipage/engine/runner.py, 'Prefill graphs'). Its slots are
    fixed in number; a step fills the first few.

    - `rows` int64 [slots]: each slot's row in the step; an empty slot names row 0, always a
      chunk's row, whose prefill output it writes back unchanged.
    - `filled` bool [slots, 1, 1]: the slot holds a decode row.
    - `context_lens` int32 [slots] (0 in an empty slot), `block_tables` int32 [slots, max_blocks].
    - `grid_batch`: the decode kernel's split is sized as for this many rows.
    """

    rows: torch.Tensor
    filled: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    grid_batch: int


@dataclass
class ForwardContext:
    """What one forward step needs beyond token ids and positions. Tensors live on the model's device.

    - `is_prefill`: the step has prompt-chunk rows (a prefill or mixed step); they are rows
      `0 .. num_prefill_tokens - 1` and attention runs the varlen prefill kernel over them.
    - `slot_mapping` int64 [num_tokens]: the KV cache slot (block * block_size + offset) of each token,
      -1 for a token whose KV is not stored.
    - `cu_seqlens_q` int32 [num_seqs + 1]: prefill only, where each sequence's new tokens start and end.
    - `context_lens` int32 [num_seqs]: KV entries of each sequence once this step's tokens are stored
      (the chunk sequences when `is_prefill`, else the decode rows).
    - `block_tables` int32 [num_seqs, max_blocks]: each sequence's blocks; entries past a row's
      ceil(context_len / block_size) are undefined (padding, or stale ids in a graph's table)
      and never read.
    - `max_q_len`: prefill only, the most new tokens of any sequence (sizes the attention kernel's grid
      without reading `cu_seqlens_q` back from the device).
    - `prefill_work` (`PrefillWork`), optional: prefill only, the (sequence, query tile) programs the
      Triton prefill kernel runs (`zipage.kernels.attention.prefill_work`); a padded step gives a
      fixed-size list whose padding items are (-1, -1). None: the kernel sizes a grid by `max_q_len`.
    - `num_prefill_tokens`, `decode_context_lens` int32 [num_decode], `decode_block_tables` int32
      [num_decode, max_blocks]: a mixed step's decode rows, which follow the chunk rows
      (`num_prefill_tokens` of them) and attend through the split-K decode kernel. None on other steps.
    - `decode_section` (`DecodeSection`), optional: a padded step's decode rows that leave the
      prefill launch for the split-K decode kernel; their rows have no prefill work items.
    - `decode_split`, optional: a decode step's split of its rows, "balanced" where the runner
      chose it (zipage/decode_grid.py `takes_balanced_split`); None: the kernel's batch split.
    - `logits_indices` int64 [num_sampled], optional: the rows whose logits the step computes, in the
      order tokens are sampled. None: the last row of each prefill sequence (prefill), every row (decode).
    - `query_slot_mapping` int64 [num_tokens], optional: the compression hook. A token whose entry is
      not -1 has its post-RoPE query written into the query cache at flat index
      `query_slot * window + window_index` (docs/architecture.md, 'Rules', rule 7).
    """

    is_prefill: bool = False
    slot_mapping: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    query_slot_mapping: torch.Tensor | None = None
    max_q_len: int | None = None
    prefill_work: PrefillWork | None = None
    num_prefill_tokens: int | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_section: DecodeSection | None = None
    decode_split: str | None = None
    logits_indices: torch.Tensor | None = None


_current = ForwardContext()


def get_context() -> ForwardContext:
    return _current


def set_context(context: ForwardContext) -> None:
    global _current
    _current = context


def reset_context() -> None:
    set_context(ForwardContext())


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Make `context` current for the duration of a `with` block, resetting it afterwards even on error."""
    set_context(context)
    try:
        yield context
    finally:
        reset_context()
