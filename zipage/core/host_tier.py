"""The host tier: prompt blocks the GPU's prefix index drops, kept in host memory.

A prompt block leaves the GPU's prefix index when its block is handed out again (the free list
reuses it) or when a compression rewrites it (docs/architecture.md, 'Rules', rule 7). With a host
tier (`--host-kv-gb`) its KV is first copied to a host slot, keyed by the same chained hash, and
a later prefix lookup that stops on the GPU continues here: each further hit is copied back into
a fresh GPU block instead of being computed (docs/architecture.md, 'Host tier').

This module is the bookkeeping only: which hash is in which slot, least recently used first.
The block manager decides what is saved and loaded and writes the copies into the step's plan
(`StepPlan.kv_saves`, `StepPlan.kv_loads`); a driver executes them before anything else of the
step, saves first (the engine copies; the simulator prices the bytes).
"""

from __future__ import annotations


class HostTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # hash -> slot, least recently used first (a dict keeps insertion order; a use moves
        # the entry to the end).
        self.slot_of: dict[int, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        # Slots a load of the step being planned reads: never reused before that step ran.
        self.pinned: set[int] = set()

    def lookup(self, block_hash: int) -> int | None:
        return self.slot_of.get(block_hash)

    def use(self, block_hash: int) -> int:
        """The slot of `block_hash`, now the most recently used, pinned for this step's load."""
        slot = self.slot_of.pop(block_hash)
        self.slot_of[block_hash] = slot
        self.pinned.add(slot)
        return slot

    def save(self, block_hash: int) -> int | None:
        """A slot to copy the block of `block_hash` into, or None: already here (the same hash
        names the same prefix, so the same KV), or every slot is pinned by this step's loads."""
        slot_of = self.slot_of
        if block_hash in slot_of:
            slot_of[block_hash] = slot_of.pop(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((entry for entry, slot in slot_of.items()
                           if slot not in self.pinned), None)
            if victim is None:
                return None
            slot = slot_of.pop(victim)
        slot_of[block_hash] = slot
        return slot

    def end_step(self) -> None:
        """The step's copies are in its plan: its loads' slots may be reused from the next."""
        self.pinned.clear()
