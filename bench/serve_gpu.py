"""Served vs offline on one online trace: `zipage serve` + `zipage bench serve` against
`zipage replay --gpu`, with the simulator's prediction of the same trace beside them.

Builds an AMC23-shaped trace (short prompts, long reasoning outputs) with Poisson arrivals, then
runs three parts, each a `zipage` command in a subprocess, with the same engine flags:

  offline  zipage replay TRACE --gpu ...                       (the engine loop alone)
  served   zipage serve --engine gpu ... &  zipage bench serve TRACE --url ...
  sim      zipage replay TRACE ... --hardware h200             (the simulator twin)

and prints output tokens/s and TTFT / TPOT p50/p90/p99 side by side, with served / offline tok/s
(the target is >= 0.90). Each part writes its run directory under $OUT (or --out) and the table
is rebuilt from whatever parts exist, so the parts can run in separate GPU calls:

    python bench/serve_gpu.py --wheels DIR_OF_SERVE_WHEELS          # all three (~8 min on an H200)
    python bench/serve_gpu.py --parts offline; python bench/serve_gpu.py --parts served,sim

`--wheels DIR` installs the serve extra's wheels first when the image lacks them (pip --no-index):
the server needs fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-inspection
and uvicorn (httpx, anyio, h11, click and prometheus-client are in the GPU image; the openai
client only the tests use). `zipage serve` runs its engine in a child process (docs/serve.md,
'How it works'), started with this interpreter and environment, so PYTHONPATH reaches it too.

A smoke run of the whole script on the CPU (random SmolLM2; 17 s on a 2-core machine):

    python bench/serve_gpu.py --engine cpu --model smollm2-135m --questions 2 --samples 2 \
        --max-output 48 --rate 4 --kv-memory-gb 0.1 --block-size 32 --budget 128 --out /tmp/sg
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROWS = [("output tok/s", "tps", "{:,.1f}"), ("completed", "completed", "{}"),
        ("output tokens", "output_tokens", "{:,}"), ("makespan s", "makespan_s", "{:.1f}"),
        ("TTFT p50 s", "ttft_p50_s", "{:.3f}"), ("TTFT p90 s", "ttft_p90_s", "{:.3f}"),
        ("TTFT p99 s", "ttft_p99_s", "{:.3f}"), ("TPOT p50 ms", "tpot_p50_ms", "{:.2f}"),
        ("TPOT p90 ms", "tpot_p90_ms", "{:.2f}"), ("TPOT p99 ms", "tpot_p99_ms", "{:.2f}"),
        ("mean TPOT ms", "mean_tpot_ms", "{:.2f}"), ("preemptions", "preemptions", "{}"),
        ("compressions", "compressions", "{}")]
PARTS = ("offline", "served", "sim")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b", help="preset; random weights on the GPU")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=2048)
    parser.add_argument("--rate", type=float, default=16.0, help="Poisson arrivals, requests/s")
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--hardware", default="h200-141gb", help="the simulator's GPU")
    parser.add_argument("--cost-model", default="analytic",
                        help="the simulator's cost model (a `zipage calibrate` profile JSON)")
    parser.add_argument("--full-kv", action="store_true",
                        help="the Full-KV baseline (--no-compress) for all three parts")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="every part with --async-scheduling (docs/serve.md, 'How it works')")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument("--wheels", default=None, help="directory of the serve extra's wheels")
    parser.add_argument("--engine", choices=["gpu", "cpu"], default="gpu",
                        help="cpu: a smoke run of the script with a small model")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/serve_gpu"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        _install_wheels(args.wheels)
    trace = out / "trace.json"
    _make_trace(args, trace)
    engine_flags = ["--kv-memory-gb", str(args.kv_memory_gb), "--block-size",
                    str(args.block_size), "--budget", str(args.budget)] + (
                        ["--no-compress"] if args.full_kv else []) + (
                        ["--async-scheduling"] if args.async_scheduling else [])
    for part in args.parts.split(","):
        started = time.perf_counter()
        if part == "offline":
            _zipage("replay", str(trace), "--engine", args.engine, "--model", f"random:{args.model}",
                    *engine_flags, "--json", "--no-progress", "--out", str(out / "offline"))
        elif part == "served":
            _served(args, trace, engine_flags, out)
        elif part == "sim":
            _zipage("replay", str(trace), "--model", args.model, "--hardware", args.hardware,
                    "--cost-model", args.cost_model, *engine_flags, "--json", "--no-progress",
                    "--out", str(out / "sim"))
        else:
            raise SystemExit(f"--parts: unknown part {part!r}; use {', '.join(PARTS)}")
        print(f"{part}: done in {time.perf_counter() - started:.0f} s", flush=True)
    _table(out)


def _make_trace(args, path: Path) -> None:
    from zipage.trace import save_trace, stamp_arrivals
    from zipage.workloads import make_trace

    trace = make_trace("amc23", 0, num_questions=args.questions,
                       samples_per_question=args.samples, max_output_len=args.max_output)
    save_trace(stamp_arrivals(trace, args.rate, seed=0), path)


def _served(args, trace: Path, engine_flags: list[str], out: Path) -> None:
    port = args.port or _free_port()
    log = (out / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "zipage.cli", "serve", "--engine", args.engine, "--model",
         f"random:{args.model}", "--served-model-name", args.model, *engine_flags,
         "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, url, out / "server.log")
        _zipage("bench", "serve", str(trace), "--url", url, "--json", "--no-progress",
                "--out", str(out / "served"))
    finally:
        _stop(server)


def _wait_healthy(server: subprocess.Popen, url: str, log: Path, timeout: float = 420) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("zipage serve exited:\n" + log.read_text()[-4000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("zipage serve did not become healthy:\n" + log.read_text()[-4000:])


def _stop(server: subprocess.Popen) -> None:
    """Stop a server started here: SIGTERM (it finishes in-flight streams), then SIGKILL."""
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def _twin_lag(url: str) -> float:
    """`zipage:twin_lag_seconds_total` of a `--simulate` server, summed over its replicas: how far
    its steps ran behind their predicted ends, in all."""
    import re

    import httpx

    metrics = httpx.get(url + "/metrics", timeout=30).text
    found = re.findall(r"^zipage:twin_lag_seconds_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    if not found:
        raise SystemExit(f"{url}/metrics has no zipage:twin_lag_seconds_total: not a twin")
    return sum(map(float, found))


def _zipage(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "zipage.cli", *argv], check=True,
                   stdout=subprocess.DEVNULL)


def _table(out: Path) -> None:
    runs = {part: json.loads((out / part / "summary.json").read_text())
            for part in PARTS if (out / part / "summary.json").is_file()}
    if not runs:
        return
    report = {part: {key: summary.get(key) for _, key, _ in ROWS} for part, summary in runs.items()}
    if "offline" in runs and "served" in runs and runs["offline"]["tps"]:
        report["served_over_offline_tps"] = runs["served"]["tps"] / runs["offline"]["tps"]
    (out / "serve_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'':<14}" + "".join(f"{part:>14}" for part in runs))
    for label, key, pattern in ROWS:
        cells = [summary.get(key) for summary in runs.values()]
        print(f"{label:<14}" + "".join(
            f"{'-' if value is None else pattern.format(value):>14}" for value in cells))
    if "served_over_offline_tps" in report:
        ratio = report["served_over_offline_tps"]
        print(f"served / offline output tok/s: {ratio:.3f} "
              f"({'meets' if ratio >= 0.9 else 'MISSES'} the 0.90 target)")


def _install_wheels(directory: str) -> None:
    try:  # what `zipage serve` and `zipage bench serve` import (zipage/cli/serve.py, zipage/cli/bench.py)
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
        return
    except ImportError:
        pass
    wheels = sorted(glob.glob(os.path.join(directory, "*.whl")))
    if not wheels:
        raise SystemExit(f"--wheels: no .whl files in {directory}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--quiet", *wheels], check=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
