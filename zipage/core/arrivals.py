"""Requests waiting for their arrival time: the one rule every step-loop driver follows to feed the
scheduler (the real engine on a wall clock, the instant driver on a step count)."""

from __future__ import annotations

from collections.abc import Callable

from zipage.core.sequence import Sequence


class ArrivalQueue:
    """A trace's requests in arrival order; `admit_due(now)` adds to the recorder every one whose
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

    def admit_due(self, add: Callable[[Sequence], object], now: float) -> None:
        """Hand every request due by `now` to `add` (a `StepRecorder.add`)."""
        while self.has_pending and self._pending[self._next].arrival_s <= now:
            add(self._pending[self._next])
            self._next += 1
