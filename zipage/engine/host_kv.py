"""The host tier's memory: one host slot per host block, holding what a GPU block holds.

The core decides which prompt blocks go to host memory and which come back
(zipage/core/host_tier.py, `StepPlan.kv_saves` and `kv_loads`); this module copies them. A slot
holds a block's K and V of every layer, and its fp8 scales and global scores where the cache
has them: exactly what `KVCaches.copy_blocks` copies between two GPU blocks. On a GPU the slots
are pinned host memory and the copies are asynchronous on the step's stream, ordered before its
forward (saves first: a block saved in a step may be the one a load of that step fills). Under
tensor parallelism each rank keeps its own heads' share.
"""

from __future__ import annotations

import torch

from zipage.engine.caches import KVCaches


class HostKV:
    def __init__(self, caches: KVCaches, num_slots: int) -> None:
        self.pinned = caches.kv.device.type == "cuda"
        # (GPU cache, its block axis, host slots [num_slots, ...the cache's other axes]).
        self.parts: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        for cache, axis in ((caches.kv, 2), (caches.kv_scale, 2), (caches.score, 1)):
            if cache is None:
                continue
            shape = (num_slots,) + cache.shape[:axis] + cache.shape[axis + 1:]
            host = torch.empty(shape, dtype=cache.dtype, device="cpu", pin_memory=self.pinned)
            self.parts.append((cache, axis, host))

    @property
    def nbytes(self) -> int:
        return sum(host.numel() * host.element_size() for _, _, host in self.parts)

    def copy(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """(GPU block, slot) saves, then (slot, GPU block) loads, one block at a time: a block of
        an 8B model is ~9 MB, a size at which one copy reaches the link's speed."""
        for cache, axis, host in self.parts:
            for block, slot in saves:
                host[slot].copy_(cache.select(axis, block), non_blocking=self.pinned)
            for slot, block in loads:
                cache.select(axis, block).copy_(host[slot], non_blocking=self.pinned)
