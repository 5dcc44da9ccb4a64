"""`zipage serve --data-parallel 2` over HTTP on localhost, and the router in process.

In process (`ReplicaSet` over stand-in engine clients): each policy of `zipage.core.routing`
routes as specified (round-robin in turn, least-loaded by requests then KV use, prefix affinity
keeps a shared prefix on one replica, session affinity a request body's session), and a replica
that is down is skipped. Over HTTP, one module-scoped server of two replicas with prefix-affinity
routing (random weights, prompts as token ids: it starts in seconds): /health lists both; prompts
sharing their leading blocks all go to one replica while unrelated ones spread; /metrics labels
every engine series with its replica and the per-replica counts add up to what was sent; a killed
replica fails only its own requests in flight (503), the other's complete, /health says
"degraded" until the replica is back, and then both serve again. A server of its own, routed
session-affinity, keeps a session's turns on one replica while the other is idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from zipage.core.routing import ReplicaLoad

pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from serve_helpers import free_port, replica_series  # noqa: E402
from test_serve_process import ENV, FLAGS, MODEL, _alive, _children, _wait_for  # noqa: E402

from zipage.errors import ConfigError  # noqa: E402
from zipage.serve.replicas import ReplicaSet, replica_setups  # noqa: E402
from zipage.serve.wire import Setup  # noqa: E402

BLOCK = 16  # --block-size in FLAGS


class FakeClient:
    """What `ReplicaSet` reads of an `EngineClient`: its load, whether it is up, and `submit`."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.alive = True
        self.error = None
        self.requests = self.blocks = 0
        self.info = SimpleNamespace(config=SimpleNamespace(block_size=BLOCK))
        self.admission = None
        self.label = ""

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.requests, self.blocks)

    def submit(self, prompt, sampling):
        self.requests += 1
        return [SimpleNamespace(replica=self.index)]


def _replicas(routing: str, count: int = 2) -> ReplicaSet:
    return ReplicaSet([FakeClient(index) for index in range(count)], routing)


def _sent(replicas: ReplicaSet, prompt: list[int]) -> int:
    return replicas.submit(prompt, None)[0].replica


def test_round_robin_takes_turns_and_skips_a_replica_that_is_down():
    replicas = _replicas("round-robin", 3)
    assert [_sent(replicas, [1]) for _ in range(4)] == [0, 1, 2, 0]
    replicas.clients[1].alive = False
    # Replica 1's turn goes to the least loaded of those up (replica 2: one request, 0 has two);
    # then the turns go on: 2, 0.
    assert [_sent(replicas, [1]) for _ in range(3)] == [2, 2, 0]


def test_least_loaded_compares_requests_then_kv_use():
    replicas = _replicas("least-loaded", 3)
    replicas.clients[0].requests, replicas.clients[1].requests = 2, 1
    replicas.clients[2].requests, replicas.clients[2].blocks = 1, 9
    assert _sent(replicas, [1]) == 1  # 1 request and no blocks beats 1 request and 9 blocks
    replicas.clients[1].alive = replicas.clients[2].alive = False
    assert _sent(replicas, [1]) == 0
    replicas.clients[0].alive = False
    with pytest.raises(Exception, match="no engine process|stopped"):
        _sent(replicas, [1])


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica():
    replicas = _replicas("prefix-affinity", 2)
    system = list(range(3 * BLOCK))  # three full blocks every prompt starts with
    first = _sent(replicas, system + [900])
    others = [_sent(replicas, system + [901 + turn] * BLOCK) for turn in range(4)]
    assert others == [first] * 4
    assert _sent(replicas, [7] * (2 * BLOCK)) != first  # nothing shared: the least loaded
    # Past the load bound (1.5 x the least load + 4) the prefix yields to balance.
    replicas.clients[first].requests = 20
    assert _sent(replicas, system) != first

    # Within the bound the prefix wins over a lighter replica; once its replica is replaced
    # (Ray's router forgets it: a new replica's cache is empty) the lighter one takes it.
    fresh = _replicas("prefix-affinity", 2)
    assert _sent(fresh, system) == 0
    fresh.clients[0].requests, fresh.clients[1].requests = 2, 0
    assert _sent(fresh, system + [5]) == 0
    fresh.clients[0].requests = 2
    fresh.policy.forget(0)
    assert _sent(fresh, system + [6]) == 1


def _sent_in(replicas: ReplicaSet, prompt: list[int], session: str | None) -> int:
    return replicas.submit(prompt, None, session=session)[0].replica


def test_session_affinity_keeps_a_session_on_its_replica():
    replicas = _replicas("session-affinity", 2)
    assert _sent_in(replicas, [1] * BLOCK, "a") == 0  # a new session: the least loaded
    assert _sent_in(replicas, [2] * BLOCK, "b") == 1
    # Each session's later turns, sharing no block with its first, stay on its replica, though
    # the other is lighter.
    replicas.clients[0].requests, replicas.clients[1].requests = 2, 0
    assert [_sent_in(replicas, [3 + turn] * BLOCK, "a") for turn in range(3)] == [0, 0, 0]
    replicas.clients[0].requests, replicas.clients[1].requests = 0, 3
    assert _sent_in(replicas, [9] * BLOCK, "b") == 1
    assert _sent_in(replicas, [9] * BLOCK, None) == 1  # no session: the prefix it shares
    # Past the bound (1.5 x the least load + 4) a session moves to the least loaded, and stays.
    replicas.clients[0].requests, replicas.clients[1].requests = 11, 4
    assert _sent_in(replicas, [10] * BLOCK, "a") == 1
    replicas.clients[0].requests = replicas.clients[1].requests = 0
    assert _sent_in(replicas, [11] * BLOCK, "a") == 1
    # A replica that is down sends its sessions to the least loaded; one that restarted (its
    # cache empty) is forgotten with them.
    replicas.clients[1].alive = False
    assert _sent_in(replicas, [12] * BLOCK, "a") == 0
    replicas.clients[1].alive = True
    replicas.clients[0].requests, replicas.clients[1].requests = 3, 0
    assert _sent_in(replicas, [13] * BLOCK, "a") == 0  # it moved while 1 was down
    replicas.clients[1].on_restarted()
    replicas.clients[0].requests, replicas.clients[1].requests = 0, 2
    assert _sent_in(replicas, [14] * BLOCK, "b") == 0  # forgotten: the least loaded


def test_each_replica_gets_its_own_cores_or_gpus(monkeypatch):
    cpu = Setup(settings=None, device="cpu", cuda_graphs=False, prefill_graphs=None, threads=None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert [setup.cpus for setup in replica_setups(cpu, 2)] == [(0, 1), (2, 3)]
    assert replica_setups(cpu, 1) == [cpu]  # one engine: the parent's cores, as before
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert [setup.cpus for setup in replica_setups(cpu, 2)] == [None, None]  # they share it
    gpu = Setup(settings=None, device="cuda", cuda_graphs=True, prefill_graphs=None, threads=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [setup.visible_devices for setup in replica_setups(gpu, 2, 2)] == ["4,5", "6,7"]
    assert [setup.visible_devices for setup in replica_setups(gpu, 3)] == ["4", "5", "6"]
    with pytest.raises(ConfigError, match=r"--data-parallel: 3 replicas of 2 GPUs need 6 GPUs, 4 "):
        replica_setups(gpu, 3, 2)


def test_data_parallel_below_one_is_a_one_line_error():
    result = subprocess.run([sys.executable, "-m", "zipage.cli", "serve", "--model",
                             "/nonexistent/model.gguf", "--engine", "cpu", "--data-parallel", "0"],
                            capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 2
    assert result.stderr.strip() == "zipage: error: --data-parallel: got 0, expected >= 1 replicas"


# ---------------------------------------------------------------- two engine processes over HTTP


def start_two_replicas(log, port: int, *flags: str, model: str = MODEL) -> subprocess.Popen:
    """`zipage serve` of `model` (the test model) as two prefix-affinity replicas (and `flags`)
    on `port`, its output in `log`."""
    with log.open("w") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "zipage.cli", "serve", "--model", model, *FLAGS,
             "--data-parallel", "2", "--routing", "prefix-affinity", *flags,
             "--port", str(port)], stdout=handle, stderr=subprocess.STDOUT, env=ENV)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("replicas") / "server.log"
    process = start_two_replicas(log, port)
    url = f"http://127.0.0.1:{port}"
    engines: list[int] = []
    try:
        _wait_for(lambda: process.poll() is not None or _healthy(url), 240,
                  "the server to be healthy")
        assert process.poll() is None, "zipage serve exited:\n" + log.read_text()[-3000:]
        engines = _children(process.pid)
        assert len(engines) == 2, f"expected two engine processes, found {engines}"
        yield SimpleNamespace(process=process, url=url, log=log)
    finally:
        _stop(process, engines)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).json().get("status") == "ok"
    except (httpx.HTTPError, ValueError):
        return False


def _complete(url: str, prompt: list[int], tokens: int = 2) -> dict:
    reply = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_health_lists_each_replica(served):
    health = httpx.get(served.url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert [(replica["replica"], replica["status"]) for replica in health["replicas"]] == [
        (0, "ok"), (1, "ok")]
    assert sorted(replica["pid"] for replica in health["replicas"]) == sorted(
        _children(served.process.pid))


def test_shared_prefix_stays_on_one_replica_and_metrics_add_up(served):
    before = replica_series(served.url, "requests_routed_total")
    finished_before = sum(replica_series(served.url, "request_success_total").values())
    system = list(range(1, 3 * BLOCK + 1))
    for turn in range(5):
        _complete(served.url, system + [100 + turn] * 5)
    after = replica_series(served.url, "requests_routed_total")
    moved = {replica: after[replica] - before.get(replica, 0.0) for replica in after}
    assert sorted(moved.values()) == [0.0, 5.0], moved  # all five on one replica
    # Two requests at once with nothing shared: the second goes to the other (least loaded).
    async def both():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
            bodies = [{"prompt": [200 + index] * 40, "max_tokens": 24, "ignore_eos": True}
                      for index in range(2)]
            return await asyncio.gather(*(http.post("/v1/completions", json=body)
                                          for body in bodies))

    assert [reply.status_code for reply in asyncio.run(both())] == [200, 200]
    last = replica_series(served.url, "requests_routed_total")
    assert all(last[replica] - after[replica] == 1.0 for replica in ("0", "1")), (after, last)
    finished = sum(replica_series(served.url, "request_success_total").values())
    assert finished - finished_before == 7
    tokens = replica_series(served.url, "generation_tokens_total")
    assert set(tokens) == {"0", "1"} and all(value > 0 for value in tokens.values())


def test_a_killed_replica_fails_alone_and_comes_back(served):
    url = served.url
    pids = {replica["replica"]: replica["pid"]
            for replica in httpx.get(url + "/health", timeout=10).json()["replicas"]}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            body = {"max_tokens": 150, "ignore_eos": True, "stream": True}
            streams = [http.stream("POST", "/v1/completions", json={**body, "prompt": [300 + i] * 40})
                       for i in range(2)]
            async with streams[0] as first, streams[1] as second:
                lines = [first.aiter_lines(), second.aiter_lines()]
                heads = [await anext(lines[0]), await anext(lines[1])]
                # Each stream runs on its own replica (least loaded, nothing shared).
                running = replica_series(url, "num_requests_running")
                assert running == {"0": 1.0, "1": 1.0}, running
                os.kill(pids[0], signal.SIGKILL)
                health = (await http.get("/health")).json()
                rests = [[line async for line in stream if line] for stream in lines]
            return heads, rests, health

    heads, rests, health = asyncio.run(main())
    assert all(head.startswith("data: {") for head in heads)
    errors = [rest for rest in rests if '"error"' in rest[-2]]
    assert len(errors) == 1, "exactly one stream (the killed replica's) fails"
    error = json.loads(errors[0][-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "engine process stopped" in error["message"]
    survivor = next(rest for rest in rests if rest is not errors[0])
    finish = json.loads(survivor[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
    assert finish == "length" and survivor[-1] == "data: [DONE]"
    # While replica 0 restarts the server stays up, serving from replica 1.
    assert health["status"] in ("degraded", "ok")
    _complete(url, [5, 6, 7])
    _wait_for(lambda: _healthy(url), 120, "the killed replica to come back")
    replicas = httpx.get(url + "/health", timeout=10).json()["replicas"]
    assert replicas[0]["pid"] != pids[0] and replicas[1]["pid"] == pids[1]
    assert replica_series(url, "engine_restarts_total") == {"0": 1.0, "1": 0.0}
    assert "replica 0: engine process" in served.log.read_text()
    before = replica_series(url, "requests_routed_total")
    for index in range(2):  # one after the other: each ties on load and goes to replica 0
        _complete(url, [400 + index] * 3, tokens=4)
    after = replica_series(url, "requests_routed_total")
    assert after["0"] - before["0"] == 2  # the new engine process serves


def test_a_session_stays_on_its_replica_over_http(tmp_path):
    """`--routing session-affinity`: the turns of a request body's `session_id` go to the replica
    of its first turn, though their prompts share nothing and a lighter replica is free; another
    session starts on the lighter replica and stays there; a request without a session goes to
    the least loaded."""
    port = free_port()
    process = start_two_replicas(tmp_path / "server.log", port, "--routing", "session-affinity")
    url = f"http://127.0.0.1:{port}"
    engines: list[int] = []
    try:
        _wait_for(lambda: process.poll() is not None or _healthy(url), 240,
                  "the server to be healthy")
        assert process.poll() is None, ("zipage serve exited:\n"
                                        + (tmp_path / "server.log").read_text()[-3000:])
        engines = _children(process.pid)

        def turn(session: str | None, token: int) -> str:
            """The replica that served one request of `session`."""
            before = replica_series(url, "requests_routed_total")
            body = {"prompt": [token] * 20, "max_tokens": 1, "ignore_eos": True,
                    "session_id": session}
            reply = httpx.post(url + "/v1/completions", timeout=120, json=body)
            assert reply.status_code == 200, reply.text
            after = replica_series(url, "requests_routed_total")
            (replica,) = [name for name in after if after[name] != before.get(name, 0.0)]
            return replica

        first = turn("chat-a", 11)  # both idle: replica 0

        async def while_busy():
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                body = {"prompt": [7] * 40, "max_tokens": 2000, "ignore_eos": True,
                        "stream": True}  # runs past the turns below; closed (aborted) after
                async with http.stream("POST", "/v1/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    await anext(lines)  # running (on replica 0: a tie goes to the lowest)
                    busy = {name for name, value in replica_series(url, "num_requests_running").items()
                            if value}
                    sent = await asyncio.to_thread(lambda: (
                        [turn("chat-a", 12 + index) for index in range(2)],
                        turn("chat-b", 21)))
                    running = replica_series(url, "num_requests_running")[first]
            return busy, sent, running

        busy, (a_turns, b_first), running = asyncio.run(while_busy())
        assert busy == {first} and running == 1.0, (busy, running)  # busy all along
        # chat-a stays where its context is, though the other replica is idle; chat-b starts on
        # the idle one (the least loaded).
        assert a_turns == [first, first], a_turns
        assert b_first != first
        # Once both are idle, chat-b stays on its replica: a request without a session would
        # go to replica 0 (the tie).
        assert turn("chat-b", 22) == b_first and turn(None, 31) == "0"
    finally:
        _stop(process, engines)


def _stop(process, engines: list[int]) -> None:
    """Kill a server and every engine process it had (none may outlive the test)."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for pid in engines + _children(process.pid):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
