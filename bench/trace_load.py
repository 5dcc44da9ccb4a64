"""Speed of the trace loader, and of `zipage replay --json`, on a trace of N one-token requests.

Writes the trace (default 1,000,000 requests: prompt_len 1, output_len 1, arrival 0, unique ids;
~62 MB of JSON) to a temporary directory, times `load_trace` (read, decode, validate; best of
--repeats), then, unless --no-cli, times the whole CLI run `zipage replay TRACE --json` in a
subprocess (wall clock and peak memory of the child), and with --stages splits the run the CLI
does into its stages in-process: load, `trace_sequences` (prompt-token synthesis for prefix
caching) and the simulation. CPU only.

    python bench/trace_load.py                     # 10^6 requests, loader and CLI
    python bench/trace_load.py --stages            # ... and where the CLI's time goes
    python bench/trace_load.py -n 100000 --no-cli  # loader only
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zipage.trace import load_trace


def write_one_token_trace(path: Path, count: int) -> None:
    lines = [f'{{"id":"r{index}","arrival_s":0,"prompt_len":1,"output_len":1}}'
             for index in range(count)]
    path.write_text('{"version": 1, "name": "one-token", "requests": [\n' + ",\n".join(lines)
                    + "\n]}\n", encoding="utf-8")


def time_cli(path: Path) -> tuple[float, str]:
    command = [sys.executable, "-m", "zipage.cli", "replay", str(path), "--json"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"zipage replay failed ({done.returncode}): {done.stderr[-500:]}")
    # RUSAGE_CHILDREN: the largest resident set of any finished child, i.e. this one.
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return wall, f"{peak_mb:,.0f} MB"


def time_stages(path: Path) -> list[tuple[str, str]]:
    from zipage.core.deployment import ReplaySettings, trace_sequences
    from zipage.sim.simulate import plan_deployment
    from zipage.sim.simulator import Simulator

    started = time.perf_counter()
    trace = load_trace(path)
    loaded = time.perf_counter()
    deployment = plan_deployment(ReplaySettings())
    scheduler = deployment.new_scheduler()
    sequences = trace_sequences(trace, deployment.shape.vocab_size,
                                need_tokens=deployment.config.prefix_cache, scheduler=scheduler)
    synthesised = time.perf_counter()
    Simulator(scheduler, deployment.cost_model).run(sequences)
    simulated = time.perf_counter()
    return [("stage: load_trace", f"{loaded - started:.1f} s"),
            ("stage: trace_sequences", f"{synthesised - loaded:.1f} s"),
            ("stage: simulate", f"{simulated - synthesised:.1f} s")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--requests", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cli", action="store_true", help="time the loader only")
    parser.add_argument("--stages", action="store_true",
                        help="also split the CLI's work into load, synthesis and simulation")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="zipage-trace-load-"))
    try:
        path = workdir / "one-token.json"
        write_one_token_trace(path, args.requests)
        size_mb = path.stat().st_size / 1e6
        loads = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            trace = load_trace(path)
            loads.append(time.perf_counter() - started)
            assert len(trace.requests) == args.requests
            del trace
        rows = [("requests", f"{args.requests:,}"), ("file size", f"{size_mb:,.1f} MB"),
                ("load_trace (best)", f"{min(loads):.2f} s"),
                ("load_trace (all)", ", ".join(f"{t:.2f}" for t in loads) + " s"),
                ("per request", f"{min(loads) / args.requests * 1e6:.2f} us")]
        if not args.no_cli:
            wall, peak = time_cli(path)
            rows += [("zipage replay --json (wall)", f"{wall:.1f} s"),
                     ("zipage replay peak memory", peak)]
        if args.stages:
            rows += time_stages(path)
        rows.append(("machine", f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}"))
        width = max(len(label) for label, _ in rows)
        for label, value in rows:
            print(f"{label:<{width}}  {value}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
