"""Which shard of a tensor-parallel model this process runs, and the collectives its layers call.

One process per rank (`zipage/engine/parallel.py` starts them). A process sets its `ShardGroup`
once, before it builds its model; the layers read it when they size their vocabulary shards and
at every forward (`all_reduce` after a row-parallel linear, `gather_vocab` for the logits). With
one rank (the default) both are no-ops, so a single-GPU engine never touches torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardGroup:
    rank: int = 0
    world: int = 1
    group: Any = None  # the torch.distributed process group of all ranks (None: one process)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank) of this rank's vocabulary shard. Every rank holds the same
        number of rows, the last one zero-padded, so the logits gather in one equal-sized piece."""
        per_rank = -(-vocab_size // self.world)
        return self.rank * per_rank, per_rank


_current = ShardGroup()


def get_shard_group() -> ShardGroup:
    return _current


def set_shard_group(group: ShardGroup) -> None:
    global _current
    _current = group


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place (the end of a row-parallel linear)."""
    shard = _current
    if shard.world > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor, group=shard.group)
    return tensor


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab / world] logits of this rank's vocabulary shard -> [rows, vocab_size]."""
    shard = _current
    if shard.world == 1:
        return logits
    import torch.distributed as dist

    rows, per_rank = logits.shape
    gathered = torch.empty(shard.world * rows, per_rank, dtype=logits.dtype, device=logits.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, logits.contiguous(), group=shard.group)
    # [world, rows, per_rank] -> [rows, world * per_rank]: rank r's columns are vocab rows r * per_rank...
    full = gathered.view(shard.world, rows, per_rank).transpose(0, 1).reshape(rows, -1)
    return full[:, :vocab_size]


@contextmanager
def shard_group(group: ShardGroup) -> Iterator[ShardGroup]:
    """Make `group` current inside a `with` block (e.g. `ShardGroup()` to build a whole model)."""
    previous = _current
    set_shard_group(group)
    try:
        yield group
    finally:
        set_shard_group(previous)
