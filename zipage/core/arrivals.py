"""Requests waiting to arrive: the one rule every driver follows to feed the scheduler (the real
engine on a wall clock, the simulator on its clock, the instant driver on a step count, a
step-time replay on an engine's measured clock).

A request arrives at its `arrival_s`, except a follow-up turn of a session (`seq.turn.follows`
names its predecessor): it arrives `turn.after_s` after its predecessor finished, so a slower
engine is sent its next turns later, as real users and agents send them (docs/architecture.md,
'Sessions'). A follow-up whose predecessor failed (rejected or aborted) fails with it, alone.
With `users`, at most that many sessions run at once: a closed population of users, each starting
its next session when its last one ended (a request in no session is a session of one turn).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import NamedTuple, Protocol

from zipage.core.sequence import Sequence, SequenceStatus

_ARRIVAL = attrgetter("arrival_s")


class Sink(Protocol):
    """Where due requests go: a `StepRecorder` (or a router in front of several). `add` answers
    False for a request the core rejected; `refuse` fails one that will never be added."""

    def add(self, seq: Sequence) -> bool: ...

    def refuse(self, seq: Sequence, reason: str) -> None: ...


class Done(NamedTuple):
    """What a follow-up needs of its finished (or failed) predecessor."""

    seq_id: str
    time: float  # when it finished (its last token), or failed
    error: str | None  # None: finished; else the failure its session's chain started from
    prompt_len: int
    reasoning_len: int


class ArrivalQueue:
    """A trace's requests, handed to a sink as they come due.

    `sequences`: a list in any order (sorted by arrival here; ties keep their order) or, when
    `ordered`, an iterable in arrival order read lazily, one request past the present at a time,
    so a streamed trace holds only what has arrived; its follow-ups may sit anywhere after their
    predecessor, and are read when the reader passes them (docs/traces.md, 'Sessions', says why
    a session's turns are written before the requests that start after it).

    `on_release(seq, predecessor)`: called as a follow-up comes due, before it is added (the
    engine builds its prompt from the predecessor's tokens there). `users`: run at most that
    many sessions at once, each starting at its arrival or when a user is free, whichever is
    later (None: every session at its arrival)."""

    def __init__(self, sequences: Iterable[Sequence], ordered: bool = False,
                 on_release: Callable[[Sequence, Done], None] | None = None,
                 users: int | None = None) -> None:
        if not ordered:
            sequences = sorted(sequences, key=_ARRIVAL)
        self._source = iter(sequences)
        self._exhausted = False
        self._on_release = on_release
        # Due times of what has been read: (time, order, request, its predecessor or None).
        self._due: list[tuple[float, int, Sequence, Done | None]] = []
        self._order = itertools.count()
        self._waiting: dict[str, list[Sequence]] = {}  # predecessor id -> its follow-ups
        self._live: set[str] = set()  # turns read and not yet done (follow-ups may name them)
        self._done: dict[str, Done] = {}  # turns done, while a later one may still follow them
        self._read_to = float("-inf")  # every request arriving by then has been read
        self.late = 0  # follow-ups read after they were due (a stream written out of order)
        # Called when a finish or failure made requests due: a driver that waits for the next
        # due time looks again.
        self.on_change: Callable[[], None] | None = None
        # A closed population: free users, sessions read but not started, the turns of each
        # running session not yet done.
        self.users = users
        self._free_users = users or 0
        self._held: deque[Sequence] = deque()
        self._open_turns: dict[str, int] = {}
        self._holding: set[str] = set()  # sessions a user runs now
        if not ordered:
            self._read(float("inf"))

    @property
    def has_pending(self) -> bool:
        return bool(self._due or self._waiting or self._held or not self._exhausted)

    @property
    def waits_for_finishes(self) -> bool:
        """Whether a finish may yet make something due earlier than `next_arrival_s`: follow-ups
        wait for requests in flight, or sessions for a free user."""
        return bool(self._waiting or self._held)

    @property
    def next_arrival_s(self) -> float | None:
        """When the next request known now comes due; None while only follow-ups of requests in
        flight (or sessions waiting for a user) wait, or once all have arrived."""
        if not self._exhausted and not self._due:
            self._read(self._read_to)
        return self._due[0][0] if self._due else None

    def admit_due(self, sink: Sink, now: float) -> None:
        """Hand every request due by `now` to `sink`, in order of due time (ties keep the order
        they became known in: the trace's among equal arrival times)."""
        self._read(now)
        due = self._due
        while due and due[0][0] <= now:
            due_time, _, seq, predecessor = heapq.heappop(due)
            cause = None  # the chain's first failure, when `seq` fails with its predecessor
            if predecessor is None:
                seq.arrival_s = due_time  # (a session a free user started later)
                accepted = sink.add(seq)
            elif predecessor.error is not None:
                accepted, cause = False, predecessor.error
                seq.arrival_s = due_time
                sink.refuse(seq, followed_failure(seq.seq_id, predecessor))
            else:
                seq.arrival_s = due_time
                if self._on_release is not None:
                    self._on_release(seq, predecessor)
                accepted = sink.add(seq)
            if not accepted:
                self.done(seq, due_time, cause)
            self._read(now)

    def done(self, seq: Sequence, time: float, cause: str | None = None) -> None:
        """`seq` finished or failed at `time`: its follow-ups come due then (plus their
        `after_s`), or at once, to fail with it; the last turn of a session frees its user.
        `cause`: the failure its session's chain started from, when it failed with its
        predecessor; its follow-ups name that one, not its own message (nesting each
        predecessor's message in the next would give a long failed session's n-th turn n
        messages: quadratic memory)."""
        turn = seq.turn
        changed = False
        if turn is not None:
            error = None if seq.status is SequenceStatus.FINISHED else (
                cause or seq.error or "aborted")
            record = Done(seq.seq_id, time, error, seq.prompt_len, turn.reasoning_len)
            self._live.discard(seq.seq_id)
            self._done[seq.seq_id] = record
            followers = self._waiting.pop(seq.seq_id, None)
            if followers:
                for follower in followers:
                    self._follow(follower, record)
                changed = True
        if self.users is not None:
            session = turn.session if turn is not None else seq.seq_id
            left = self._open_turns[session] - 1
            if left:
                self._open_turns[session] = left
            else:  # the session is over: its user starts the next one
                del self._open_turns[session]
                if session in self._holding:
                    self._holding.discard(session)
                    self._free_users += 1
                    changed |= self._start_sessions(time)
        if changed and self.on_change is not None:
            self.on_change()

    # ---- reading

    def _read(self, now: float) -> None:
        """Read the source until a request arriving after `now` (kept as the next due, or with
        `users` held for a free user)."""
        if self._exhausted or self._read_to > now:
            return
        users = self.users
        # When a session a free user takes now starts (at its arrival, when reading ahead).
        clock = now if now != float("inf") else float("-inf")
        while True:
            seq = next(self._source, None)
            if seq is None:
                self._end_of_source(now)
                return
            turn = seq.turn
            if turn is not None:
                self._live.add(seq.seq_id)
            if users is not None:
                session = turn.session if turn is not None else seq.seq_id
                self._open_turns[session] = self._open_turns.get(session, 0) + 1
            if turn is not None and turn.follows is not None:
                self._wait(seq, now)
                continue
            if users is not None:
                self._held.append(seq)
                self._start_sessions(clock)
            else:
                heapq.heappush(self._due, (seq.arrival_s, next(self._order), seq, None))
            if seq.arrival_s > now:
                self._read_to = seq.arrival_s
                return

    def _end_of_source(self, now: float) -> None:
        self._exhausted = True
        self._read_to = float("inf")
        # Follow-ups of a request that never came (a list a caller built by hand; a trace's
        # loader refuses them) fail rather than wait forever.
        for follows in [key for key in self._waiting if key not in self._live]:
            missing = Done(follows, now if now != float("inf") else 0.0,
                           "it is not among the requests", 0, 0)
            for follower in self._waiting.pop(follows):
                self._follow(follower, missing)

    def _start_sessions(self, time: float) -> bool:
        """Give free users the sessions read and waiting, each due at its arrival or `time`,
        whichever is later; whether one started."""
        started = False
        while self._held:
            seq = self._held[0]
            session = seq.turn.session if seq.turn is not None else seq.seq_id
            if session not in self._holding:  # (a second first turn joins its session's user)
                if not self._free_users:
                    break
                self._free_users -= 1
                self._holding.add(session)
            self._held.popleft()
            start = seq.arrival_s if seq.arrival_s > time else time
            heapq.heappush(self._due, (start, next(self._order), seq, None))
            started = True
        return started

    def _wait(self, seq: Sequence, now: float) -> None:
        follows = seq.turn.follows
        predecessor = self._done.get(follows)
        if predecessor is None:
            self._waiting.setdefault(follows, []).append(seq)
            return
        if predecessor.error is None and predecessor.time + seq.turn.after_s < now:
            self.late += 1
        self._follow(seq, predecessor)

    def _follow(self, seq: Sequence, predecessor: Done) -> None:
        """Due `after_s` after its predecessor finished; at once, to fail, if it failed."""
        time = predecessor.time + (seq.turn.after_s if predecessor.error is None else 0.0)
        heapq.heappush(self._due, (time, next(self._order), seq, predecessor))


def followed_failure(seq_id: str, predecessor: Done) -> str:
    """Why a follow-up fails with its failed predecessor: the predecessor, and the failure its
    session's chain started from (`Done.error` carries that one: `ArrivalQueue.done`)."""
    return (f"request {seq_id}: the turn it follows, {predecessor.seq_id}, failed "
            f"({predecessor.error})")
