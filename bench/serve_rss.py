"""Memory of a long-running `zipage serve`: RSS of its two processes over many short requests.

Starts `zipage serve` on the CPU (random weights by default: prompts as token ids), sends
`--requests` short completions (prompts of `--prompt-len` token ids at most, `--max-tokens`
each, `--concurrency` at a time; half heed end-of-sequence tokens, a quarter stream), and prints
a markdown table of the engine process's and the HTTP process's resident memory every `--every`
requests. Growth that keeps going after the first few hundred requests (allocator warm-up) is
per-request state kept forever.

    python bench/serve_rss.py [--model random:smollm2-135m] [--requests 5000] [--every 500]

Run from a checkout: the server is `python -m zipage.cli serve` in the current directory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

FLAGS = ["--engine", "cpu", "--dtype", "float32", "--kv-memory-gb", "0.25", "--block-size", "16",
         "--budget", "64", "--window", "4"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def engine_pid(server: int) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == server:
            return int(stat.parent.name)
    raise RuntimeError("the server has no engine process")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, port: int, log: Path) -> subprocess.Popen:
    with log.open("w") as handle:
        server = subprocess.Popen(
            [sys.executable, "-m", "zipage.cli", "serve", "--model", model, *FLAGS, "--port",
             str(port)], stdout=handle, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("zipage serve exited:\n" + log.read_text()[-2000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit("zipage serve did not become healthy")


def print_row(done: int, pids: tuple[int, int], first: float | None, elapsed: float) -> float:
    """One row of the table, printed as it is measured (a long run shows its progress); returns
    the engine's RSS."""
    engine, http = rss_mb(pids[0]), rss_mb(pids[1])
    print(f"| {done:,} | {engine:,.0f} | {engine - (first or engine):+,.0f} | {http:,.0f} | "
          f"{elapsed:,.0f} |", flush=True)
    return engine


async def drive(url: str, args, pids: tuple[int, int]) -> None:
    done = 0
    failed = 0
    started = time.monotonic()
    rng = random.Random(0)
    queue: asyncio.Queue = asyncio.Queue()
    for index in range(args.requests):
        queue.put_nowait(index)

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal done, failed
        while not queue.empty():
            index = queue.get_nowait()
            length = rng.randrange(1, args.prompt_len + 1)
            body = {"prompt": [rng.randrange(1, 30000) for _ in range(length)],
                    "max_tokens": args.max_tokens, "ignore_eos": index % 2 == 0,
                    "stream": index % 4 == 1}
            reply = await http.post("/v1/completions", json=body)
            failed += reply.status_code != 200
            done += 1
            if done % args.every == 0:
                print_row(done, pids, first, time.monotonic() - started)

    print("| requests | engine RSS (MB) | engine growth (MB) | HTTP process RSS (MB) | "
          "elapsed (s) |")
    print("|---:|---:|---:|---:|---:|")
    first = print_row(0, pids, None, 0.0)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=4, help="prompts of 1..N token ids")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--log", default="serve_rss.log", help="the server's output")
    args = parser.parse_args()
    port = free_port()
    server = start_server(args.model, port, Path(args.log))
    try:
        asyncio.run(drive(f"http://127.0.0.1:{port}", args,
                          (engine_pid(server.pid), server.pid)))
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
