"""Routing requests over replicas: the policies a router in front of several engines follows.

A router asks `policy.choose(block_keys, loads, session)` which replica takes a request, given
the request's chained prompt-block keys (what the prefix cache hashes), each replica's load and
the request's session (a chat's or an agent run's name; None for a request on its own), then tells
it `policy.routed(index, block_keys, session)`. A load is a `ReplicaLoad` (requests queued or
running, KV blocks in use) or a bare request count. Pure Python and deterministic: the simulated
cluster (`zipage plan --replicas N --routing P`, `sim/cluster.py`) feeds it each simulated
engine's scheduler state and the trace's sessions, `zipage serve --data-parallel N --routing P`
(`zipage/serve/replicas.py`) and `zipage serve --ray` (`zipage/serve/ray_serve.py`) each engine's
requests in flight, its reported KV use and the request body's `session_id`, and all make the same
choice from the same inputs.

- round-robin: replica i takes the i-th request, whatever it is.
- least-loaded: the replica with the fewest requests; ties to the one with the fewest KV blocks
  in use, then to the lowest index.
- prefix-affinity: the replica whose earlier requests share the longest run of leading blocks
  with this one (its prefix cache most likely holds them), unless that replica carries more than
  `load_slack` times the least load plus `load_margin` requests; then, and when no replica shares
  a block, least-loaded. A replica remembers at most `memory_blocks` block keys (least recently
  routed forgotten first), like a cache of that size.
- session-affinity: a session's turn goes to the replica that took its previous turn (whose prefix
  cache holds the session's context so far), unless that replica carries more than `load_slack`
  times the least load plus `load_margin` requests (or is down); then to the least loaded, and the
  session moves there. A request without a session (or of a session not routed yet, or forgotten)
  follows prefix-affinity's rule. At most `memory_sessions` sessions are remembered (least
  recently routed forgotten first); a replica that restarts is forgotten with its sessions.

Every policy takes `session` and the ones before session-affinity ignore it. A session named by
the empty string is no session.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import NamedTuple

ROUND_ROBIN = "round-robin"
LEAST_LOADED = "least-loaded"
PREFIX_AFFINITY = "prefix-affinity"
SESSION_AFFINITY = "session-affinity"
ROUTING_POLICIES = (ROUND_ROBIN, LEAST_LOADED, PREFIX_AFFINITY, SESSION_AFFINITY)

# Prefix (and session) affinity yields to balance when the preferred replica has this much more
# load: a shared system prompt (or a busy session) must not pile every request on one replica.
LOAD_SLACK = 1.5
LOAD_MARGIN = 4
MEMORY_BLOCKS = 1 << 16
MEMORY_SESSIONS = 1 << 16


class ReplicaLoad(NamedTuple):
    """What a router knows of one replica. Compared as a tuple: requests first, then KV use."""

    requests: int
    kv_blocks_used: int = 0


# A replica that is down (a real router's; the simulator's never are): never the least loaded.
DOWN = ReplicaLoad(sys.maxsize, sys.maxsize)


def requests_of(load: ReplicaLoad | int) -> int:
    return load.requests if isinstance(load, ReplicaLoad) else load


class RoundRobin:
    name = ROUND_ROBIN

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self._next = 0

    def choose(self, block_keys: list[int], loads: list[ReplicaLoad] | list[int],
               session: str | None = None) -> int:
        index = self._next
        self._next = (self._next + 1) % self.replicas
        return index

    def routed(self, index: int, block_keys: list[int], session: str | None = None) -> None:
        pass

    def forget(self, index: int) -> None:
        """Replica `index` was replaced by a new one: its cache starts empty."""


class LeastLoaded(RoundRobin):
    name = LEAST_LOADED

    def choose(self, block_keys: list[int], loads: list[ReplicaLoad] | list[int],
               session: str | None = None) -> int:
        return least_loaded(loads)


class PrefixAffinity(RoundRobin):
    name = PREFIX_AFFINITY

    def __init__(self, replicas: int, load_slack: float = LOAD_SLACK,
                 load_margin: int = LOAD_MARGIN, memory_blocks: int = MEMORY_BLOCKS) -> None:
        super().__init__(replicas)
        self.load_slack, self.load_margin = load_slack, load_margin
        self.memory_blocks = memory_blocks
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]

    def choose(self, block_keys: list[int], loads: list[ReplicaLoad] | list[int],
               session: str | None = None) -> int:
        fallback = least_loaded(loads)
        bound = self._bound(loads, fallback)
        best, best_depth = fallback, 0
        for index, seen in enumerate(self._seen):
            depth = _shared_depth(block_keys, seen)
            if depth > best_depth and requests_of(loads[index]) <= bound:
                best, best_depth = index, depth
        return best

    def _bound(self, loads: list[ReplicaLoad] | list[int], least: int) -> float:
        """The most requests a preferred replica may carry and still be preferred."""
        return self.load_slack * requests_of(loads[least]) + self.load_margin

    def routed(self, index: int, block_keys: list[int], session: str | None = None) -> None:
        seen = self._seen[index]
        for key in block_keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.memory_blocks:
            seen.popitem(last=False)

    def forget(self, index: int) -> None:
        self._seen[index].clear()


class SessionAffinity(PrefixAffinity):
    name = SESSION_AFFINITY

    def __init__(self, replicas: int, load_slack: float = LOAD_SLACK,
                 load_margin: int = LOAD_MARGIN, memory_blocks: int = MEMORY_BLOCKS,
                 memory_sessions: int = MEMORY_SESSIONS) -> None:
        super().__init__(replicas, load_slack, load_margin, memory_blocks)
        self.memory_sessions = memory_sessions
        # session -> the replica that took its latest turn, least recently routed first.
        self._sessions: OrderedDict[str, int] = OrderedDict()

    def choose(self, block_keys: list[int], loads: list[ReplicaLoad] | list[int],
               session: str | None = None) -> int:
        home = self._sessions.get(session) if session else None
        if home is None:
            return super().choose(block_keys, loads)
        fallback = least_loaded(loads)
        # A replica that is down carries sys.maxsize requests: past any bound.
        return home if requests_of(loads[home]) <= self._bound(loads, fallback) else fallback

    def routed(self, index: int, block_keys: list[int], session: str | None = None) -> None:
        super().routed(index, block_keys)
        if session:
            sessions = self._sessions
            sessions[session] = index
            sessions.move_to_end(session)
            while len(sessions) > self.memory_sessions:
                sessions.popitem(last=False)

    def forget(self, index: int) -> None:
        super().forget(index)
        for session in [name for name, home in self._sessions.items() if home == index]:
            del self._sessions[session]


def make_policy(name: str, replicas: int) -> RoundRobin:
    policies = {ROUND_ROBIN: RoundRobin, LEAST_LOADED: LeastLoaded,
                PREFIX_AFFINITY: PrefixAffinity, SESSION_AFFINITY: SessionAffinity}
    return policies[name](replicas)


def choose_up(policy: RoundRobin, block_keys: list[int], loads: list[ReplicaLoad],
              session: str | None = None) -> int:
    """`policy.choose`, never a replica that is DOWN: where round-robin's turn (or a prefix, or a
    session) falls on one, the least loaded takes the request. At least one replica must be up."""
    index = policy.choose(block_keys, loads, session)
    return least_loaded(loads) if loads[index] == DOWN else index


def least_loaded(loads: list[ReplicaLoad] | list[int]) -> int:
    # min keeps the first of equal keys: ties go to the lowest index.
    return min(range(len(loads)), key=loads.__getitem__)


def _shared_depth(block_keys: list[int], seen: OrderedDict[int, None]) -> int:
    # Keys are chained (each covers every block before it), so the shared run ends at the first
    # key this replica has not seen.
    depth = 0
    for key in block_keys:
        if key not in seen:
            break
        depth += 1
    return depth
