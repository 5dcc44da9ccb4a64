"""`zipage serve --ray local --data-parallel 2`: the replicas as Ray Serve deployments on a new
local Ray instance (docs/serve.md, 'On a Ray cluster').

One module-scoped server of two replicas of random SmolLM2 weights (prompts as token ids), routed
by prefix affinity through `ZipageRouter`: /health reports both replicas running; prompts sharing
their leading blocks go to one replica while two unrelated ones at once go one to each; /metrics
labels each replica's series; killing one replica's engine process fails only the request it was
running (503) while the other's completes, Ray replaces the replica, and both serve again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
from test_serve_process import _free_port, _wait_for  # noqa: E402
from test_serve_replicas import BLOCK, _complete, _series, start_two_replicas  # noqa: E402


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
    port = _free_port()
    log = tmp_path_factory.mktemp("ray") / "server.log"
    process = start_two_replicas(log, port, "--ray", "local")
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
    before = _series(url, "requests_routed_total")
    system = list(range(1, 3 * BLOCK + 1))
    for turn in range(4):
        _complete(url, system + [100 + turn] * 5)
    after = _series(url, "requests_routed_total")
    moved = sorted(after.get(replica, 0.0) - before.get(replica, 0.0) for replica in ("0", "1"))
    assert moved == [0.0, 4.0], (before, after)


def test_a_killed_ray_replica_fails_alone_and_is_replaced(served):
    url = served.url
    engines = _engines(served.process.pid)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            body = {"max_tokens": 150, "ignore_eos": True, "stream": True}
            streams = [http.stream("POST", "/v1/completions",
                                   json={**body, "prompt": [300 + index] * 20})
                       for index in range(2)]
            async with streams[0] as first, streams[1] as second:
                lines = [first.aiter_lines(), second.aiter_lines()]
                heads = [await anext(lines[0]), await anext(lines[1])]
                routed = _series(url, "requests_routed_total")
                os.kill(engines[0], signal.SIGKILL)
                rests = [[line async for line in stream if line] for stream in lines]
            return heads, routed, rests

    before = _series(url, "requests_routed_total")
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
