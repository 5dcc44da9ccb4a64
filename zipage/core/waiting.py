"""Waiting-queue policies: the order in which waiting requests are tried for admission.

The scheduler admits from the head of `waiting` only (a head that cannot start blocks the queue:
nothing behind it overtakes it), so the queue's order is the whole of a waiting policy
(docs/architecture.md, 'Waiting-queue policies').

- "fcfs": a `collections.deque` in arrival order; a preempted request goes back to its front.
- "priority": `PriorityWaiting`, ordered by a key fixed when a request is first queued,
  (priority x aging_s + arrival_s, order queued). Aging is in the key: a request that has waited
  t seconds competes as if its class were `priority - t / aging_s`, and since every waiting
  request ages at the same rate, that order never changes while they wait; so a heap keeps it.
  A request is therefore never passed by one that arrived more than
  (its priority - the other's) x aging_s seconds after it: the starvation bound. A preempted
  request goes back to its own place (its key), ahead of everything its class queued after it.

Both answer the same calls the scheduler makes: append, appendleft (a preempted request),
popleft, [0], iteration (in order), remove, len.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from zipage.core.sequence import Sequence


def waiting_queue(policy: str, aging_s: float) -> "deque[Sequence] | PriorityWaiting":
    """The waiting queue of a scheduling policy (`ZipageConfig.scheduling_policy`)."""
    return PriorityWaiting(aging_s) if policy == "priority" else deque()


def priority_key(seq: Sequence, aging_s: float) -> float:
    """The class-and-age part of a request's place under the priority policy; lower first."""
    return seq.priority * aging_s + seq.arrival_s


class PriorityWaiting:
    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s
        self._heap: list[tuple[tuple[float, int], Sequence]] = []
        self._queued = 0  # ties of the key go in the order first queued (arrival order)

    def _entry(self, seq: Sequence) -> tuple[tuple[float, int], Sequence]:
        if seq.queue_key is None:
            seq.queue_key = (priority_key(seq, self.aging_s), self._queued)
            self._queued += 1
        return seq.queue_key, seq  # keys are unique: two entries never compare their requests

    def append(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, self._entry(seq))

    appendleft = append  # a preempted request returns to its own place, not the front

    def popleft(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def __getitem__(self, index: int) -> Sequence:
        if index != 0:
            raise IndexError("the priority queue answers only its head ([0])")
        return self._heap[0][1]

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, seq in sorted(self._heap))

    def remove(self, seq: Sequence) -> None:
        """Take out a request that left while waiting (an abort): O(waiting), and rare."""
        for index, (_, queued) in enumerate(self._heap):
            if queued is seq:
                last = self._heap.pop()
                if index < len(self._heap):
                    self._heap[index] = last
                    heapq.heapify(self._heap)
                return
        raise ValueError(f"{seq.seq_id} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
