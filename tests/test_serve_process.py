"""`zipage serve`'s processes and sockets: startup, failure, shutdown, over HTTP on localhost.

The engine runs in a child of the server process (zipage/serve/engine_process.py). Covered: a
bad model file is the child's one-line error and exit 2 in the parent; a crash of the child while
it starts is reported, not hung on; `--threads` sets the child's torch threads; SIGTERM stops the
child with the server, exit 0; a server killed outright (SIGKILL) leaves no engine process behind;
an engine process that dies fails the requests in flight (a stream gets an error event, a plain
request a 503), is replaced by a new one (/health recovers, requests succeed), and past
--max-engine-restarts the server exits 1; with `--tensor-parallel 3` (steps synchronous or async)
the engine process starts the other ranks, serves the one-rank tokens, and SIGTERM stops every
rank. Flags checked before
the model loads (--port out of range or taken, no CUDA for the default --engine gpu); `zipage
bench serve --out` end to end; slow request heads closed after --header-timeout; SIGTERM drains,
fails what outlives --drain-timeout, exits 0.
The servers here serve random weights (`random:smollm2-135m`, prompts as token ids): they start
in seconds and need no model file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from serve_helpers import free_port, start_server, wait_healthy  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="finds the engine process through /proc (Linux)")

MODEL = "random:smollm2-135m"
FLAGS = ["--engine", "cpu", "--dtype", "float32", "--kv-memory-gb", "0.1", "--block-size", "16",
         "--budget", "64", "--window", "4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (None: no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")  # a zombie has exited; only its parent's wait is due


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


@contextlib.contextmanager
def _server(tmp_path: Path, *extra: str):
    """A `zipage serve` subprocess, healthy; yields (process, url, engine pid, log path)."""
    served = start_server(["--model", MODEL, *FLAGS, *extra], tmp_path / "server.log", ENV)
    process, url, log = served.process, served.url, served.log
    engines: list[int] = []
    try:
        wait_healthy(served, 180, request_timeout=1)
        engines = _children(process.pid)
        assert len(engines) == 1, f"expected one engine process, found {engines}"
        yield process, url, engines[0], log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in engines:  # never leave one behind, whatever the test asserted
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_bad_model_file_is_the_engines_one_line_error_and_exit_2(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    result = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "serve", "--model", str(broken), "--engine", "cpu",
         "--port", str(free_port())], capture_output=True, text=True, timeout=180, env=ENV)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"zipage: error: model: {broken} is not a readable GGUF file (GGUF magic invalid)"]


def test_engine_crash_while_starting_is_reported(capfd):
    from zipage.serve.engine_client import EngineClient, EngineProcessError
    from zipage.serve.wire import Setup

    with pytest.raises(EngineProcessError, match="failed while starting: AttributeError"):
        EngineClient.start(Setup(settings=None, device="cpu", cuda_graphs=False,
                                 prefill_graphs=False, threads=1))
    assert "Traceback" in capfd.readouterr().err  # the child's own, for the bug report


def test_sigterm_stops_the_engine_process_and_threads_flag(tmp_path):
    with _server(tmp_path, "--threads", "2") as (process, url, engine, log):
        assert "2 torch threads" in log.read_text()  # the engine process's count, not the env's
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        _wait_for(lambda: not _alive(engine), 5, "the engine process to exit")
        assert "the engine process exited with code" not in log.read_text()  # it exited 0


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_killed_server_leaves_no_engine_process(tmp_path, busy):
    """Idle, the engine waits for a command and reads the end of the socket; busy, it learns
    between two steps."""
    with _server(tmp_path) as (process, url, engine, log):
        with contextlib.ExitStack() as stack:
            if busy:
                body = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True,
                        "stream": True}
                reply = stack.enter_context(
                    httpx.stream("POST", url + "/v1/completions", json=body, timeout=60))
                next(reply.iter_lines())  # the engine is stepping
            process.kill()
            process.wait()
        _wait_for(lambda: not _alive(engine), 20, "the orphaned engine process to exit")


def test_dead_engine_fails_its_requests_is_restarted_and_the_bound_exits_1(tmp_path):
    """A killed engine process: its requests in flight get a clean error, /health is 503 until
    a new engine process is ready, then requests succeed; past --max-engine-restarts the server
    exits 1 for its supervisor."""
    # Without the access and stats lines, the fatal error is the log's last line.
    with _server(tmp_path, "--max-engine-restarts", "1", "--disable-access-log",
                 "--disable-log-stats") as (process, url, engine, log):
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                body = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}
                plain = asyncio.create_task(http.post("/v1/completions", json=body))
                async with http.stream("POST", "/v1/completions",
                                       json={**body, "stream": True}) as reply:
                    lines = reply.aiter_lines()
                    first = await anext(lines)
                    await _until_running(http, 2)  # both requests are in the engine
                    os.kill(engine, signal.SIGKILL)
                    rest = [line async for line in lines if line]
                return first, rest, await plain, await http.get("/health")

        first, rest, plain, health = asyncio.run(main())
        assert first.startswith("data: {")
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "engine process stopped" in error["message"] and error["code"] == 503
        assert "restarting" in error["message"]
        assert plain.status_code == 503
        assert plain.json()["error"]["type"] == "server_error"
        assert "engine process stopped" in plain.json()["error"]["message"]
        assert health.status_code == 503 and "engine process stopped" in health.json()["error"]
        _wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 120,
                  "/health to recover")
        again = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
        assert again.status_code == 200
        assert len(again.json()["choices"][0]["token_ids"]) == 4
        assert not _alive(engine)
        (second,) = _children(process.pid)
        assert second != engine and "restart 1 of at most 1" in log.read_text()
        os.kill(second, signal.SIGKILL)  # the second death within the window: over the bound
        assert process.wait(timeout=60) == 1
        assert "--max-engine-restarts 1" in log.read_text().splitlines()[-1]


async def _running(http) -> float:
    text = (await http.get("/metrics")).text
    line = next(line for line in text.splitlines()
                if line.startswith("zipage:num_requests_running{"))
    return float(line.split()[-1])


async def _until_running(http, count: int, timeout: float = 60) -> None:
    """Poll /metrics until `count` requests run in the engine; a bounded wait, so a request that
    came and went between two polls fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while await _running(http) < count:
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {count} running"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("flags", [(), ("--async-scheduling",)])
def test_tensor_parallel_server_matches_one_rank_and_stops_every_rank(tmp_path, flags):
    from zipage.core.sampling import SamplingParams
    from zipage.engine.llm import LLM

    prompt = [1, 2, 3, 4, 5]
    with _server(tmp_path, "--tensor-parallel", "3", *flags) as (process, url, engine, log):
        ranks = _children(engine)
        assert len(ranks) == 2  # ranks 1 and 2; rank 0 is the engine process
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        served = reply.json()["choices"][0]["token_ids"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        for pid in [engine, *ranks]:
            _wait_for(lambda: not _alive(pid), 10, f"process {pid} to exit")
        assert "the engine process exited with code" not in log.read_text()
    llm = LLM(MODEL, device="cpu", dtype="float32", kv_memory_gb=0.1, threads=1, block_size=16,
              kv_budget=64, window=4)
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True), progress=False)[0]
    assert served == expected.token_ids


# ---------------------------------------------------------------- flags checked before the model


def _serve_fails_at_once(*flags: str) -> str:
    """`zipage serve` with a model path that does not exist: an error about anything but the
    model proves it came before the model was read. Its one line on stderr; exit 2."""
    result = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "serve", "--model", "/nonexistent/model.gguf",
         *flags], capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


def test_port_out_of_range_is_a_one_line_error_before_the_model_loads():
    line = _serve_fails_at_once("--engine", "cpu", "--port", "70000")
    assert line == "zipage: error: --port: got 70000, expected 1..65535"


def test_port_in_use_is_a_one_line_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _serve_fails_at_once("--engine", "cpu", "--port", str(port))
    assert line == (f"zipage: error: --port: 127.0.0.1:{port} is already in use (another "
                    "server?); stop it or choose another --port")


def test_default_engine_without_cuda_names_the_default_not_gpu_flag():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = _serve_fails_at_once("--port", str(free_port()))
    assert line == ("zipage: error: --engine gpu (the default): no CUDA device is visible; use "
                    "--engine cpu (small models)")


# ---------------------------------------------------------------- bench serve, slow clients, drain


def test_bench_serve_command_writes_its_run_and_prints_the_summary(tmp_path):
    from zipage.trace import Trace, TraceRequest, save_trace

    trace_path = tmp_path / "trace.json"
    save_trace(Trace("small", [TraceRequest(id=f"r{index}", arrival_s=0.1 * index,
                                            prompt_len=8 + index, output_len=3 + index)
                               for index in range(4)]), trace_path)
    out = tmp_path / "runs" / "served"
    with _server(tmp_path) as (process, url, engine, log):
        result = subprocess.run(
            [sys.executable, "-m", "zipage.cli", "bench", "serve", str(trace_path), "--url", url,
             "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=120,
            env=ENV)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"small served by {MODEL} at {url}"
    assert any(line.split() == ["completed", "4"] for line in lines)
    assert lines[-1] == f"wrote {out}/summary.json, requests.csv"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["requests_per_replica"] == [4]  # one engine: replica "0" took them all


async def _slow_clients(port: int, count: int) -> list:
    """`count` connections that send half a request head and then nothing."""
    clients = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: slow\r\n")
        await writer.drain()
        clients.append((reader, writer))
    return clients


def test_slow_request_heads_are_closed_after_the_header_timeout(tmp_path):
    count = 300
    with _server(tmp_path, "--header-timeout", "2") as (process, url, engine, log):
        port = int(url.rsplit(":", 1)[1])

        async def main():
            clients = await _slow_clients(port, count)
            opened = time.monotonic()
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                healthy = (await http.get("/health")).status_code  # served meanwhile
            ends = await asyncio.wait_for(asyncio.gather(*(
                reader.read() for reader, _ in clients)), timeout=30)
            waited = time.monotonic() - opened
            for _, writer in clients:
                writer.close()
            return healthy, ends, waited

        healthy, ends, waited = asyncio.run(main())
        assert healthy == 200
        assert ends == [b""] * count  # closed by the server, no response written
        assert waited < 15
        reply = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": [1, 2], "max_tokens": 2})
        assert reply.status_code == 200


def test_sigterm_drains_then_fails_what_outlives_the_drain_deadline_and_exits_0(tmp_path):
    with _server(tmp_path, "--drain-timeout", "8") as (process, url, engine, log):
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                # Long enough to be seen running (the gauge moves once a step) and short enough
                # to finish well inside the drain: 3 tokens can come and go between two polls (CI hung here).
                short = {"prompt": [1, 2, 3], "max_tokens": 24, "ignore_eos": True}
                long = {**short, "max_tokens": 2000, "stream": True}
                async with http.stream("POST", "/v1/completions", json=long) as reply:
                    lines = reply.aiter_lines()
                    await anext(lines)
                    finishing = asyncio.create_task(http.post("/v1/completions", json=short))
                    await _until_running(http, 2)
                    process.send_signal(signal.SIGTERM)
                    stopped = time.monotonic()
                    rest = [line async for line in lines if line]
                    return await finishing, rest, time.monotonic() - stopped

        finished, rest, took = asyncio.run(main())
        assert finished.status_code == 200  # drained: it ran to its end
        assert len(finished.json()["choices"][0]["token_ids"]) == 24
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "--drain-timeout 8" in error["message"] and error["code"] == 503
        assert 7.5 < took < 30
        assert process.wait(timeout=30) == 0
        _wait_for(lambda: not _alive(engine), 10, "the engine process to exit")
