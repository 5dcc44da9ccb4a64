"""Routing policies over replicas (zipage/core/routing.py) and prefix affinity in the simulated
cluster: requests that share leading blocks land together, within a load bound. Session affinity:
a session's turns stay on the replica of its previous turn within the same bound, spill to the
least loaded past it (and move there), fall back to prefix affinity without a session, remember a
bounded number of sessions, and forget a restarted replica's (a property test against a model of
the rule). Its simulated cluster runs are in tests/test_session_routing.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zipage.core.deployment import ReplaySettings
from zipage.core.routing import (
    DOWN,
    ROUTING_POLICIES,
    LeastLoaded,
    PrefixAffinity,
    ReplicaLoad,
    RoundRobin,
    SessionAffinity,
    choose_up,
    least_loaded,
    make_policy,
)
from zipage.sim.cluster import simulate_cluster
from zipage.trace import parse_trace


def test_round_robin_and_least_loaded():
    policy = RoundRobin(3)
    assert [policy.choose([], [9, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert LeastLoaded(3).choose([], [4, 2, 2]) == 1


def test_prefix_affinity_follows_the_longest_shared_run():
    policy = PrefixAffinity(3)
    policy.routed(0, [10, 11])
    policy.routed(1, [10, 11, 12, 13])
    # Replica 1 shares three leading blocks, replica 0 two; loads are equal.
    assert policy.choose([10, 11, 12, 99], [1, 1, 1]) == 1
    # A chained key that breaks the run ends it: only [10] is shared, replica 0 wins the tie.
    assert policy.choose([10, 77, 12], [1, 1, 1]) == 0
    # Nothing shared: least-loaded.
    assert policy.choose([5, 6], [3, 2, 1]) == 2


def test_prefix_affinity_yields_to_the_load_bound():
    policy = PrefixAffinity(2, load_slack=1.5, load_margin=4)
    policy.routed(0, [1, 2, 3])
    assert policy.choose([1, 2, 3], [10, 4]) == 0  # 10 <= 1.5 * 4 + 4
    assert policy.choose([1, 2, 3], [11, 4]) == 1  # 11 > 10: the least loaded instead


def test_prefix_affinity_forgets_the_least_recently_routed():
    policy = PrefixAffinity(2, memory_blocks=2)
    policy.routed(0, [1, 2])
    policy.routed(0, [3])
    assert policy._seen[0].keys() == {2, 3}
    assert policy.choose([3], [3, 0]) == 0 and policy.choose([2], [3, 0]) == 0
    assert policy.choose([1], [3, 0]) == 1  # forgotten: the least loaded


def test_every_policy_has_a_maker():
    assert {make_policy(name, 2).name for name in ROUTING_POLICIES} == set(ROUTING_POLICIES)


TALKS, TURNS = 3, 4


def conversations():
    """Three conversations of four turns, each turn extending its conversation's hashed prompt,
    interleaved in time: round-robin scatters a conversation over the replicas."""
    requests = []
    for turn in range(TURNS):
        for talk in range(TALKS):
            chain = [100 * talk + block for block in range(4 + 2 * turn)]
            requests.append({"id": f"t{talk}-{turn}", "arrival_s": 0.5 * (TALKS * turn + talk),
                             "prompt_len": 256 * len(chain) - 17, "block_hashes": chain,
                             "output_len": 32})
    return parse_trace({"version": 1, "hash_block_size": 256, "requests": requests})


@pytest.mark.parametrize("replicas", [2, 4])
def test_prefix_affinity_keeps_a_conversation_on_one_replica(replicas):
    trace = conversations()
    settings = ReplaySettings(model="qwen3-0.6b", hardware="h100", kv_memory_gb=4.0)
    results = {policy: simulate_cluster(trace, settings, replicas=replicas, routing=policy)
               for policy in ("round-robin", "prefix-affinity")}
    affinity, round_robin = results["prefix-affinity"], results["round-robin"]
    assert affinity["completed"] == round_robin["completed"] == TALKS * TURNS
    # Every later turn finds the full blocks of its conversation's previous prompt cached (all
    # but its last, partial, block).
    reused = TALKS * sum(256 * (3 + 2 * (turn - 1)) for turn in range(1, TURNS))
    assert affinity["prefix_hit_tokens"] >= reused > round_robin["prefix_hit_tokens"]


def test_a_replica_that_is_down_is_never_chosen():
    """Where round-robin's turn falls on a replica that is down, the least loaded takes it."""
    loads = [ReplicaLoad(3, 10), DOWN, ReplicaLoad(1, 50), ReplicaLoad(1, 20)]
    policy = RoundRobin(4)
    assert [choose_up(policy, [], loads) for _ in range(4)] == [0, 3, 2, 3]
    assert choose_up(LeastLoaded(4), [], loads) == 3


# ---------------------------------------------------------------- session affinity


def test_every_policy_takes_a_session_and_the_older_ones_ignore_it():
    for name in ("round-robin", "least-loaded", "prefix-affinity"):
        plain, with_session = make_policy(name, 3), make_policy(name, 3)
        for step in range(6):
            loads = [ReplicaLoad(step % 3, 0), ReplicaLoad(1, step), ReplicaLoad(2, 1)]
            keys = [step % 2, 10 + step]
            index = plain.choose(keys, loads)
            assert with_session.choose(keys, loads, f"s{step % 2}") == index
            plain.routed(index, keys)
            with_session.routed(index, keys, f"s{step % 2}")


def test_session_affinity_keeps_a_session_on_its_replica():
    policy = SessionAffinity(3)
    assert policy.choose([1, 2], [2, 1, 1], "a") == 1  # new session: prefix rule (none shared)
    policy.routed(1, [1, 2], "a")
    # Its next turns share no block with the first (say the context was summarised) and another
    # replica is lighter: the session stays where its context is.
    assert policy.choose([7], [0, 3, 0], "a") == 1
    policy.routed(1, [7], "a")
    assert policy._sessions == {"a": 1}
    # Without the session the same request goes where the prefix rule sends it.
    assert policy.choose([7], [0, 3, 0]) == 1  # it shares block 7 with replica 1, within bound
    assert policy.choose([8], [0, 3, 0]) == 0  # nothing shared: the least loaded
    assert policy.choose([8], [0, 3, 0], "") == 0  # the empty session is no session


def test_session_affinity_spills_past_the_load_bound_and_moves_the_session():
    policy = SessionAffinity(2, load_slack=1.5, load_margin=4)
    policy.routed(0, [1, 2, 3], "a")
    assert policy.choose([9], [10, 4], "a") == 0  # 10 <= 1.5 * 4 + 4
    assert policy.choose([9], [11, 4], "a") == 1  # 11 > 10: the least loaded instead
    policy.routed(1, [9], "a")
    assert policy._sessions["a"] == 1  # the session moved with its context
    assert policy.choose([10], [0, 3], "a") == 1  # and stays there, within the bound
    # A replica that is down is past every bound: its sessions go to the least loaded.
    assert policy.choose([10], [ReplicaLoad(5, 0), DOWN], "a") == 0
    assert choose_up(policy, [10], [ReplicaLoad(5, 0), DOWN], "a") == 0


def test_session_affinity_remembers_a_bounded_number_of_sessions():
    policy = SessionAffinity(2, memory_sessions=2)
    policy.routed(0, [], "a")
    policy.routed(1, [], "b")
    policy.routed(0, [], "a")  # a is now the most recently routed
    policy.routed(1, [], "c")  # three sessions, room for two: b goes
    assert list(policy._sessions.items()) == [("a", 0), ("c", 1)]
    assert policy.choose([], [1, 0], "a") == 0
    assert policy.choose([], [0, 1], "c") == 1
    assert policy.choose([], [1, 0], "b") == 1  # forgotten: a new session (least loaded)


def test_session_affinity_forgets_a_restarted_replica():
    policy = SessionAffinity(2)
    policy.routed(0, [1, 2], "a")
    policy.routed(1, [3], "b")
    policy.forget(0)
    assert policy._sessions == {"b": 1} and not policy._seen[0]
    assert policy.choose([1, 2], [1, 0], "a") == 1  # its context is gone: the least loaded
    assert policy.choose([4], [0, 1], "b") == 1


def _reference_session_choice(homes: dict, keys, loads, session, prefix: PrefixAffinity) -> int:
    """The rule, written out again: the session's replica within the bound, else the least
    loaded; no session (or an unknown one): prefix affinity's choice."""
    least = least_loaded(loads)
    if session and session in homes:
        home = homes[session]
        bound = 1.5 * loads[least].requests + 4
        return home if loads[home].requests <= bound else least
    return prefix.choose(keys, loads)


_load = st.builds(ReplicaLoad, st.integers(0, 12), st.integers(0, 40))
_step = st.tuples(st.lists(st.integers(0, 5), max_size=4).map(lambda keys: [
    hash(tuple(keys[:depth + 1])) for depth in range(len(keys))]),  # chained, like block keys
    st.one_of(st.none(), st.sampled_from("abcdef")),
    st.one_of(st.none(), st.none(), st.none(), st.integers(0, 3)))  # now and then a restart


@settings(max_examples=examples(150))
@given(replicas=st.integers(1, 4), memory=st.integers(1, 4), data=st.data(),
       steps=st.lists(_step, max_size=40))
def test_session_affinity_follows_its_rule(replicas, memory, data, steps):
    """Against a model: the choice; the sessions remembered (the `memory` most recently routed,
    each at the replica of its latest turn, less those of a replica restarted since); the bound;
    and determinism (a second policy fed the same inputs chooses the same)."""
    policy, twin = SessionAffinity(replicas, memory_sessions=memory), SessionAffinity(
        replicas, memory_sessions=memory)
    prefix = PrefixAffinity(replicas)  # the rule for requests without a known session
    homes: dict[str, int] = {}  # session -> replica, in order of the latest routing
    for keys, session, restarted in steps:
        if restarted is not None and restarted < replicas:
            for each in (policy, twin, prefix):
                each.forget(restarted)
            homes = {name: home for name, home in homes.items() if home != restarted}
        loads = data.draw(st.lists(_load, min_size=replicas, max_size=replicas))
        index = policy.choose(keys, loads, session)
        assert index == _reference_session_choice(homes, keys, loads, session, prefix)
        assert index == twin.choose(keys, loads, session)
        least = least_loaded(loads)
        assert index == least or loads[index].requests <= 1.5 * loads[least].requests + 4
        policy.routed(index, keys, session)
        twin.routed(index, keys, session)
        prefix.routed(index, keys)
        if session:
            homes.pop(session, None)
            homes[session] = index
            while len(homes) > memory:
                del homes[next(iter(homes))]
        assert list(policy._sessions.items()) == list(homes.items())
