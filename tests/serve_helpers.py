"""One `zipage serve` subprocess for the end-to-end tests: start it on a free port, its output
into a log file, wait until /health answers, stop it.

Its output goes to a file, not a pipe: nobody reads a pipe while the server serves, and a full
pipe stops a server. A server that exits, or is not healthy in time, fails the test with the
tail of that log (the server's own error).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

LOG_TAIL = 3000  # characters of the server's log a failed start shows


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_thread_env() -> dict[str, str]:
    """The environment the tests serve in: torch on one thread (a 2-core machine is shared by
    the test process and the server's engine)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@dataclass
class Served:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return self.log.read_text()[-LOG_TAIL:]


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> Served:
    """`python -m zipage.cli serve ARGS --port PORT` on a free port, not waited for (a test
    may load its own model meanwhile)."""
    port = free_port()
    with log.open("w") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "zipage.cli", "serve", *args, "--port", str(port)],
            stdout=handle, stderr=subprocess.STDOUT,
            env=one_thread_env() if env is None else env)
    return Served(process, port, log)


def status_ok(response: httpx.Response) -> bool:
    return response.status_code == 200


def healthy(url: str, timeout: float = 2.0,
            ok: Callable[[httpx.Response], bool] = status_ok) -> bool:
    """/health answers, and `ok` of its answer (by default: status 200)."""
    try:
        return ok(httpx.get(url + "/health", timeout=timeout))
    except (httpx.HTTPError, ValueError):  # (ValueError: an `ok` that reads a body not JSON)
        return False


def wait_healthy(served: Served, timeout_s: float, poll_s: float = 0.2,
                 request_timeout: float = 2.0,
                 ok: Callable[[httpx.Response], bool] = status_ok) -> None:
    """Until /health answers `ok`; fails the test with the server's log when the server exits
    first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not healthy(served.url, request_timeout, ok):
        if served.process.poll() is not None:
            pytest.fail(f"zipage serve exited ({served.process.returncode}):\n"
                        + served.log_tail())
        if time.monotonic() > deadline:
            pytest.fail(f"zipage serve not healthy after {timeout_s:g} s:\n" + served.log_tail())
        time.sleep(poll_s)


def stop_server(served: Served, timeout_s: float = 30) -> None:
    """Terminate (the server ends its streams and its engine), kill if it takes too long."""
    served.process.terminate()
    try:
        served.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        served.process.kill()
        served.process.wait()


@contextmanager
def serving(args: list[str], log: Path, timeout_s: float, poll_s: float = 0.2,
            request_timeout: float = 2.0, env: dict[str, str] | None = None,
            ok: Callable[[httpx.Response], bool] = status_ok):
    """A healthy server for the block, stopped after it whatever happened."""
    served = start_server(args, log, env)
    try:
        wait_healthy(served, timeout_s, poll_s, request_timeout, ok)
        yield served
    finally:
        stop_server(served)


def replica_series(url: str, name: str) -> dict[str, float]:
    """replica -> value of one zipage: metric of a replicated server (summed over its other labels)."""
    values: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for labels, value in re.findall(rf"^zipage:{name}\{{([^}}]*)\}}\s+(\S+)$", text, re.M):
        replica = re.search(r'replica="(\d+)"', labels).group(1)
        values[replica] = values.get(replica, 0.0) + float(value)
    return values
