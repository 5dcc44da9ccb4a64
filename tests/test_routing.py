"""Routing policies over replicas (zipage/core/routing.py) and prefix affinity in the simulated
cluster: requests that share leading blocks land together, within a load bound."""

from __future__ import annotations

import pytest

from zipage.core.deployment import ReplaySettings
from zipage.core.routing import (
    DOWN,
    ROUTING_POLICIES,
    LeastLoaded,
    PrefixAffinity,
    ReplicaLoad,
    RoundRobin,
    choose_up,
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
