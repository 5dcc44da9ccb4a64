"""Steady decoding: the running requests with nothing to decide, decoded every step untouched.

A steady request's counters follow the decode clock (`Sequence.join_steady`), so a decode step
costs O(requests with an event), not O(running requests): the scheduler hands each joining request
the number of steps until its next decision (its last block is full, or it reaches the window of a
block that may compress and holds no slot) or its finish, and `SteadyDecoding` keeps, per future
tick, who is due then (docs/architecture.md, 'Why the core is fast enough'). An entry carries the
request's `steady_epoch`: it is live exactly while the request stays in the steady run it was made
in, so a request that left (preempted, compressed, aborted) needs no search through the lists.
"""

from __future__ import annotations

from collections import defaultdict

from zipage.core.sequence import DecodeClock, Sequence


class SteadyDecoding:
    def __init__(self) -> None:
        self.clock = DecodeClock()
        # The steady requests (in the order they joined) and each one's kv_len - clock.ticks,
        # constant while it decodes steadily; and the sum of those.
        self.offsets: dict[Sequence, int] = {}
        self._offset_sum = 0
        # The largest of those offsets (a decode step's time follows its longest context too),
        # or None when the request that held it left: worked out again at the next decode step.
        # Every steady offset stays what it was while its request decodes, so only a join can
        # raise the largest and only the leave of one that holds it can lower it (the longest
        # request leaves every few hundred steps; a rescan is one C-level max over the batch).
        self._max_offset: int | None = None
        self._decision_due: defaultdict[int, list] = defaultdict(list)
        self._finish_due: defaultdict[int, list] = defaultdict(list)

    def __len__(self) -> int:
        return len(self.offsets)

    def join(self, seq: Sequence, steps_to_decision: int) -> None:
        """Decode `seq` every step from now on, until its decision `steps_to_decision` steps
        ahead or its finish, whichever comes first."""
        ticks = self.clock.ticks
        kv_len = seq.settled_kv_len  # not steady yet: settled
        remaining = seq.max_output_tokens - seq.settled_output_tokens
        seq.join_steady(self.clock)
        offset = kv_len - ticks
        self.offsets[seq] = offset
        self._offset_sum += offset
        longest = self._max_offset
        if longest is not None and offset > longest:
            self._max_offset = offset
        if remaining <= steps_to_decision:
            self._finish_due[ticks + remaining].append((seq, seq.steady_epoch))
        else:
            self._decision_due[ticks + steps_to_decision].append((seq, seq.steady_epoch))

    def leave(self, seq: Sequence) -> None:
        """`seq` stops decoding steadily (a decision, a preemption, its end); settles its
        counters. A request that is not steady is left as it is."""
        offset = self.offsets.pop(seq, None)  # None: not steady
        if offset is not None:
            self._offset_sum -= offset
            if offset == self._max_offset:
                self._max_offset = None  # it held the largest: rescan when next asked
            seq.settle()

    def due_decisions(self) -> list[Sequence]:
        """The requests whose decision is due at this decode step, out of the steady run."""
        due = []
        for seq, epoch in self._decision_due.pop(self.clock.ticks, ()):
            if seq.steady_epoch == epoch:  # still in the steady run the entry was made in
                self.leave(seq)
                due.append(seq)
        return due

    def tick(self) -> list[Sequence]:
        """A decode step is done: the clock advances; the requests that finish with it."""
        self.clock.ticks += 1
        return [seq for seq, epoch in self._finish_due.pop(self.clock.ticks, ())
                if seq.steady_epoch == epoch]

    def context_tokens(self) -> tuple[int, int]:
        """The entries this step's steady decodes attend (each its cached entries plus the token
        it decodes now), and the longest one's."""
        ticks = self.clock.ticks
        longest = self._max_offset
        if longest is None:
            longest = self._max_offset = max(self.offsets.values())
        return self._offset_sum + len(self.offsets) * (ticks + 1), longest + ticks + 1
