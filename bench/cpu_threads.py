"""CPU engine thread count: a small linear and an end-to-end replay, by thread count, with the
machine's cores idle or kept busy by other processes (a shared CI machine).

    python bench/cpu_threads.py                      # cores as they are
    python bench/cpu_threads.py --busy 2             # plus 2 spinning processes (a busy machine)
    python bench/cpu_threads.py --busy 2 --no-replay # the linear only (seconds, not minutes)

Each measurement runs in its own process with OMP_NUM_THREADS unset, so torch starts from its own
default and only `torch.set_num_threads` / `--threads` differ. Prints one table last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINEAR_SCRIPT = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
linear = torch.nn.Linear(576, 1536)  # SmolLM2-135M's MLP up projection
for rows in (1, 16, 256):
    x = torch.randn(rows, 576)
    with torch.no_grad():
        for _ in range(20):
            linear(x)
        start = time.perf_counter()
        for _ in range(200):
            linear(x)
    print(rows, (time.perf_counter() - start) / 200 * 1e3)
"""


def _spin() -> None:
    while True:
        pass


def _environment() -> dict:
    environment = dict(os.environ)
    environment.pop("OMP_NUM_THREADS", None)
    environment.pop("ZIPAGE_CPU_THREADS", None)
    return environment


def linear_ms(threads: int) -> dict[int, float]:
    output = subprocess.run([sys.executable, "-c", LINEAR_SCRIPT, str(threads)], check=True,
                            capture_output=True, text=True, env=_environment()).stdout
    return {int(rows): float(ms) for rows, ms in (line.split() for line in output.splitlines())}


def replay_s(threads: int, timeout_s: float) -> str:
    command = [sys.executable, "-m", "zipage.cli", "replay", str(ROOT / "traces" / "tiny.json"),
               "--engine", "cpu", "--model", "random:smollm2-135m", "--threads", str(threads),
               "--json", "--no-progress"]
    start = time.perf_counter()
    try:
        output = subprocess.run(command, check=True, capture_output=True, text=True,
                                env=_environment(), timeout=timeout_s).stdout
    except subprocess.TimeoutExpired:
        return f">{timeout_s:.0f}"
    wall = time.perf_counter() - start
    return f"{wall:.1f} (run {json.loads(output)['wall_s']:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=0, help="spinning processes to start")
    parser.add_argument("--threads", default=None, help="comma list (default: 1..cores)")
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("--replay-timeout", type=float, default=600.0)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    counts = ([int(t) for t in args.threads.split(",")] if args.threads
              else list(range(1, cores + 1)))
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    try:
        rows = []
        for threads in counts:
            linear = linear_ms(threads)
            replay = "-" if args.no_replay else replay_s(threads, args.replay_timeout)
            rows.append((threads, linear, replay))
    finally:
        for spinner in spinners:
            spinner.terminate()
    load = os.getloadavg()[0]
    print(f"\n{cores} cores, {args.busy} spinning processes, load average {load:.2f}")
    print(f"{'threads':>7} {'linear 1 row':>13} {'16 rows':>9} {'256 rows':>9}  "
          "replay tiny.json --engine cpu, s")
    for threads, linear, replay in rows:
        print(f"{threads:>7} {linear[1]:>10.3f} ms {linear[16]:>6.3f} ms {linear[256]:>6.2f} ms  "
              f"{replay}")


if __name__ == "__main__":
    main()
