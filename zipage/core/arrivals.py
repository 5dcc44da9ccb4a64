"""Requests waiting for their arrival time: the one rule every step-loop driver follows to feed the
scheduler (the real engine on a wall clock, the instant driver on a step count)."""

from __future__ import annotations

from zipage.core.invariants import InvariantChecker
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence


class ArrivalQueue:
    """A trace's requests in arrival order; `admit_due(now)` adds to the scheduler every one whose
    arrival time has been reached (ties keep trace order)."""

    def __init__(self, sequences: list[Sequence]) -> None:
        self._pending = sorted(sequences, key=lambda seq: seq.arrival_s)
        self._next = 0

    @property
    def has_pending(self) -> bool:
        return self._next < len(self._pending)

    @property
    def next_arrival_s(self) -> float | None:
        """When the next request arrives; None once all have."""
        return self._pending[self._next].arrival_s if self.has_pending else None

    def admit_due(self, scheduler: Scheduler, now: float,
                  checker: InvariantChecker | None = None) -> None:
        while self.has_pending and self._pending[self._next].arrival_s <= now:
            seq = self._pending[self._next]
            scheduler.add(seq)
            if checker:
                checker.note_added(seq)
            self._next += 1
