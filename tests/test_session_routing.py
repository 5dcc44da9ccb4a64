"""Session affinity in the simulated cluster (`zipage plan --replicas N --routing
session-affinity`, sim/cluster.py): the router hands the policy each request's session (the
trace's; a follow-up's is its predecessor's), so under light load every turn of a session lands on
the replica that took its first, whose prefix cache holds the session's history, and the prefix
cache hits more tokens than round-robin's scatter. The policy's own rule is tested in
tests/test_routing.py."""

from __future__ import annotations

from collections import defaultdict

import pytest
from tolerance import close

from zipage.cli.parser import main
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.routing import ROUTING_POLICIES, SESSION_AFFINITY, make_policy
from zipage.sim import cluster
from zipage.sim.cluster import simulate_cluster
from zipage.trace import Trace, parse_trace, save_trace

SESSIONS, TURNS = 4, 4
FIRST, NEW, OUTPUT = 1000, 300, 60


def session_trace(sessions: int = SESSIONS, gap_s: float = 0.0, think_s: float = 0.5) -> Trace:
    """`sessions` chats of TURNS turns, starting `gap_s` apart (together by default, so their
    first turns spread over the replicas); each follow-up comes `think_s` after its
    predecessor's answer, its prompt the whole history (prompt and answer) and NEW tokens.
    Follow-ups name no session: the loader gives them their predecessor's."""
    requests = []
    for number in range(sessions):
        name, prompt = f"chat{number}", FIRST
        requests.append({"id": f"{name}-0", "arrival_s": gap_s * number, "session": name,
                         "prompt_len": prompt, "output_len": OUTPUT})
        for turn in range(1, TURNS):
            history = prompt + OUTPUT
            prompt = history + NEW
            requests.append({"id": f"{name}-{turn}", "after": f"{name}-{turn - 1}",
                             "after_s": think_s, "prompt_len": prompt, "prefix_len": history,
                             "output_len": OUTPUT})
    return parse_trace({"version": 1, "name": "chats", "requests": requests})


def settings() -> ReplaySettings:
    return ReplaySettings(model="qwen3-0.6b", hardware="h100", kv_memory_gb=4.0)


def routed_by_session(monkeypatch, trace: Trace, routing: str, replicas: int = 2,
                      blind: bool = False):
    """The cluster's summary, and each session's replicas in the order of its turns (what the
    router told the policy). `blind`: the policy is told no session."""
    placed: dict[str | None, list[int]] = defaultdict(list)

    def recording(name: str, count: int):
        policy = make_policy(name, count)
        choose, routed = policy.choose, policy.routed

        def chosen(block_keys, loads, session=None):
            return choose(block_keys, loads, None if blind else session)

        def record(index, block_keys, session=None):
            placed[session].append(index)
            routed(index, block_keys, None if blind else session)

        policy.choose, policy.routed = chosen, record
        return policy

    monkeypatch.setattr(cluster, "make_policy", recording)
    return simulate_cluster(trace, settings(), replicas=replicas, routing=routing), placed


def test_the_loader_gives_follow_ups_their_session():
    trace = session_trace()
    assert {request.session for request in trace.requests} == {
        f"chat{number}" for number in range(SESSIONS)}


def test_session_affinity_keeps_each_session_on_one_replica(monkeypatch):
    trace = session_trace()
    summary, placed = routed_by_session(monkeypatch, trace, SESSION_AFFINITY)
    assert summary["completed"] == SESSIONS * TURNS and summary["first_error"] is None
    assert None not in placed  # every request came with its session
    assert set(placed) == {f"chat{number}" for number in range(SESSIONS)}
    for session, replicas in placed.items():
        assert len(replicas) == TURNS and len(set(replicas)) == 1, (session, replicas)
    # The first turns come together and share no block: the least loaded takes each, so they
    # alternate; then a replica carries at most two chats, far within the bound.
    assert [placed[f"chat{number}"][0] for number in range(SESSIONS)] == [0, 1, 0, 1]
    assert summary["requests_per_replica"] == [TURNS * 2, TURNS * 2]


def test_session_affinity_hits_the_prefix_cache_more_than_round_robin(monkeypatch):
    trace = session_trace()
    affinity, _ = routed_by_session(monkeypatch, trace, SESSION_AFFINITY)
    round_robin, scattered = routed_by_session(monkeypatch, trace, "round-robin")
    assert round_robin["completed"] == affinity["completed"] == SESSIONS * TURNS
    assert any(len(set(replicas)) > 1 for replicas in scattered.values())
    # Each later turn finds the full blocks of its predecessor's prompt on its replica: as many
    # as one replica holding every chat hits.
    block = ZipageConfig().block_size
    prompts = [FIRST + (OUTPUT + NEW) * turn for turn in range(TURNS - 1)]
    reused = SESSIONS * sum(block * (prompt // block) for prompt in prompts)
    one = simulate_cluster(trace, settings(), replicas=1)
    assert affinity["prefix_hit_tokens"] == one["prefix_hit_tokens"] == reused
    assert reused > round_robin["prefix_hit_tokens"]


def test_a_session_past_the_load_bound_spills_and_moves(monkeypatch):
    """Sixteen chats start at once: their first turns alternate over the two replicas (nothing
    shared: the least loaded). The odd ones end after one turn, so replica 1 empties while the
    eight long chats on replica 0 go on: past the bound (1.5 x replica 1's requests + 4) a
    follow-up spills to replica 1, its session moves there and stays (its context is there now),
    and once the loads are within the bound nothing moves again."""
    requests = []
    for number in range(16):
        name, prompt = f"chat{number}", FIRST
        requests.append({"id": f"{name}-0", "arrival_s": 0.0, "session": name,
                         "prompt_len": prompt, "output_len": OUTPUT})
        for turn in range(1, 6 if number % 2 == 0 else 1):
            history = prompt + OUTPUT
            prompt = history + NEW
            requests.append({"id": f"{name}-{turn}", "after": f"{name}-{turn - 1}",
                             "prompt_len": prompt, "prefix_len": history, "output_len": OUTPUT})
    trace = parse_trace({"version": 1, "name": "long-and-short", "requests": requests})
    summary, placed = routed_by_session(monkeypatch, trace, SESSION_AFFINITY)
    assert summary["completed"] == len(requests)
    assert [placed[f"chat{number}"][0] for number in range(16)] == [0, 1] * 8
    moved = [replicas for replicas in placed.values() if len(set(replicas)) > 1]
    assert moved, placed
    for replicas in moved:  # from 0 to 1 once, never back
        first = replicas.index(1)
        assert replicas[:first] == [0] * first and replicas[first:] == [1] * (6 - first)
    assert len(moved) < 8  # a session moves only while its replica is past the bound


def test_plan_routes_by_session_affinity(tmp_path, capsys):
    assert SESSION_AFFINITY in ROUTING_POLICIES
    path = tmp_path / "chats.jsonl"
    save_trace(session_trace(), path)
    code = main(["plan", str(path), "--model", "qwen3-0.6b", "--hardware", "h100",
                 "--replicas", "2", "--routing", SESSION_AFFINITY, "--workers", "1",
                 "--no-progress", "--no-cache"])
    assert code == 0
    assert "1 point" in capsys.readouterr().out


@pytest.mark.parametrize("routing", ["round-robin", "least-loaded", "prefix-affinity"])
def test_the_other_policies_ignore_the_session(monkeypatch, routing):
    """The router hands every policy the session; those before session-affinity place each
    request as they would without it."""
    trace = session_trace(sessions=6, gap_s=0.05, think_s=0.1)
    told, placed = routed_by_session(monkeypatch, trace, routing)
    blind, placed_blind = routed_by_session(monkeypatch, trace, routing, blind=True)
    assert placed == placed_blind
    assert told["prefix_hit_tokens"] == blind["prefix_hit_tokens"]
    assert told["makespan_s"] == close(blind["makespan_s"])


def test_without_sessions_session_affinity_is_prefix_affinity(monkeypatch):
    trace = session_trace(sessions=6, gap_s=0.05, think_s=0.1)
    _, sessionless = routed_by_session(monkeypatch, trace, SESSION_AFFINITY, blind=True)
    _, prefix = routed_by_session(monkeypatch, trace, "prefix-affinity")
    assert sessionless == prefix
