"""How big a trace the simulator takes: wall time and peak memory on production-shaped traces.

    python bench/streaming_sim.py --shape azure-conv --requests 1000000
    python bench/streaming_sim.py --shape mooncake --requests 300000
    python bench/streaming_sim.py --shape azure-conv --source AzureLLMInferenceTrace_conv.csv

Each run is one child process (one core: numpy's threads are pinned to one), so its peak RSS is
the simulator's alone: the trace is written to a gzipped JSON Lines file first, then `zipage
replay` reads it as its simulated clock reaches the requests (docs/traces.md, 'Streamed
traces'). With `--run-dir` the replay also writes its run directory (steps.csv, requests.csv,
summary.json; no decision log) and plots timeline.png from it, all inside the measured process.
Shapes:
- `azure-conv`: the Azure LLM inference conversation hour's lengths and arrivals. With `--source`
  (the public CSV) its rows are tiled hour after hour; without, lengths are drawn from lognormals
  with the hour's medians and means (prompt 1,020 / 1,155 tokens, output 129 / 211) and arrivals
  are Poisson at its rate (5.53 requests/s). `--speedup` compresses time (default 4: a busy
  engine, the shape issue #32's targets name).
- `mooncake`: Mooncake-shaped requests, 12k-token prompts (lognormal around 12,035) in 512-token
  hashed blocks whose leading blocks repeat as a tree (a third of the prompts extend an earlier
  prompt's chain), outputs of ~350 tokens, Poisson arrivals at 3.4 requests/s x speedup.
Prints one table: requests, steps, simulated makespan, wall time, peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from zipage.trace import Trace, TraceRequest, save_trace
from zipage.trace_import import import_trace

CONV_RATE = 5.53  # requests/s of the Azure 2023 conversation hour
MOONCAKE_RATE = 3.4  # requests/s of the Mooncake FAST'25 conversation trace
HASH_BLOCK = 512


def lognormal(rng, median: float, mean: float, size: int, high: int) -> np.ndarray:
    sigma = np.sqrt(2 * np.log(mean / median))
    return np.clip(rng.lognormal(np.log(median), sigma, size).astype(np.int64), 1, high)


def azure_conv(count: int, speedup: float, source: str | None, seed: int) -> Trace:
    if source is not None:
        hour = import_trace("azure", source)[0].requests
        span = hour[-1].arrival_s + 1.0
        rows = [(hour[i % len(hour)], (i // len(hour)) * span) for i in range(count)]
        return Trace("azure-conv", [
            TraceRequest(id=f"c{i}", arrival_s=round((r.arrival_s + shift) / speedup, 6),
                         prompt_len=r.prompt_len, output_len=r.output_len)
            for i, (r, shift) in enumerate(rows)])
    rng = np.random.default_rng(seed)
    prompts = lognormal(rng, 1020, 1155, count, 14_000)
    outputs = lognormal(rng, 129, 211, count, 1_000)
    arrivals = np.cumsum(rng.exponential(1.0 / (CONV_RATE * speedup), count))
    return Trace("azure-conv", [
        TraceRequest(id=f"c{i}", arrival_s=round(float(t - arrivals[0]), 6), prompt_len=int(p),
                     output_len=int(o)) for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs))])


def mooncake(count: int, speedup: float, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    prompts = lognormal(rng, 6_900, 12_035, count, 120_000)
    outputs = lognormal(rng, 350, 343 * 1.05, count, 2_000)
    arrivals = np.cumsum(rng.exponential(1.0 / (MOONCAKE_RATE * speedup), count))
    chains: list[list[int]] = []
    next_hash = 0
    requests = []
    for i in range(count):
        blocks = -(-int(prompts[i]) // HASH_BLOCK)
        chain: list[int] = []
        if chains and rng.random() < 1 / 3:  # extend a recent prompt's chain, as a conversation
            earlier = chains[-1 - int(rng.integers(0, min(len(chains), 64)))]
            chain = earlier[:min(len(earlier), blocks)]
        while len(chain) < blocks:
            chain.append(next_hash)
            next_hash += 1
        chains.append(chain)
        if len(chains) > 64:
            chains.pop(0)
        requests.append(TraceRequest(
            id=f"m{i}", arrival_s=round(float(arrivals[i] - arrivals[0]), 6),
            prompt_len=int(prompts[i]), output_len=int(outputs[i]), block_hashes=tuple(chain),
            hash_block_size=HASH_BLOCK))
    return Trace("mooncake", requests)


# Runs `zipage ...` and, at exit, prints its own peak resident memory to stderr. The peak is read
# from /proc (VmHWM: this process image's), not from getrusage: a child started with vfork
# inherits the high-water mark of this (big, trace-generating) process in its rusage.
REPLAY_AND_REPORT = """
import atexit, re, runpy, sys
def report():
    status = open("/proc/self/status").read()
    print("peak_rss_kb", re.search(r"VmHWM:\\s*(\\d+)", status).group(1), file=sys.stderr)
atexit.register(report)
sys.argv = ["zipage"] + sys.argv[1:]
runpy.run_module("zipage.cli", run_name="__main__")
"""


def replay(path: Path, flags: list[str]) -> dict:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", REPLAY_AND_REPORT, "replay", str(path),
                            "--json", *flags], capture_output=True, text=True, env=environment)
    wall = time.perf_counter() - started
    if child.returncode not in (0, 3):
        raise SystemExit(child.stderr)
    import json

    summary = json.loads(child.stdout)
    peak_kb = int(child.stderr.rsplit("peak_rss_kb", 1)[1].split()[0])
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU time (user + system) does not move with the load of a shared machine; wall time does.
    return {"summary": summary, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_gb": peak_kb / 2**20, "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["azure-conv", "mooncake"], default="azure-conv")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--speedup", type=float, default=4.0)
    parser.add_argument("--source", default=None, help="the Azure conversation CSV to tile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", default=None, metavar="PATH",
                        help="also save the generated trace here (to profile or replay it again)")
    parser.add_argument("--flags", default="--model qwen3-8b --hardware h200",
                        help="zipage replay flags (default: %(default)s)")
    parser.add_argument("--run-dir", action="store_true",
                        help="also write the run directory and its timeline (--out, "
                             "--decisions none) in the measured process")
    args = parser.parse_args()
    if args.shape == "azure-conv":
        trace = azure_conv(args.requests, args.speedup, args.source, args.seed)
    else:
        trace = mooncake(args.requests, args.speedup, args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"{args.shape}.jsonl.gz"
        save_trace(trace, path)
        if args.keep:
            save_trace(trace, args.keep)
        del trace
        flags = args.flags.split()
        if args.run_dir:
            flags += ["--out", str(Path(scratch) / "run"), "--decisions", "none"]
        result = replay(path, flags)
    summary = result["summary"]
    rows = [("shape", args.shape), ("requests", f"{summary['requests']:,}"),
            ("completed", f"{summary['completed']:,}"), ("steps", f"{summary['steps']:,}"),
            ("makespan (simulated)", f"{summary['makespan_s']:,.0f} s"),
            ("simulation wall", f"{summary['wall_s']:.1f} s"),
            ("process wall (load + simulate)", f"{result['wall_s']:.1f} s"),
            ("process CPU (user + system)", f"{result['cpu_s']:.1f} s"),
            ("load average (1 min, at the end)", f"{result['load']:.1f}"),
            ("peak RSS", f"{result['peak_rss_gb']:.2f} GB")]
    for name, value in rows:
        print(f"{name:32s} {value}")


if __name__ == "__main__":
    main()
