"""Many concurrent streams through the GPU-free twin server, on this machine's CPU.

Starts `zipage serve --simulate` (the live twin, sim/live.py: the core stepping on the wall clock
with a shipped H200 profile), sends `--streams` streamed completions at once with
`zipage bench serve` (all in flight together: `--max-concurrency` = `--streams`), reads the
twin's lag from /metrics, then replays the same trace offline with `zipage replay` (the
simulator, no clock) and prints both side by side. The question: does one CPU machine serve that
many streams in real time, with the latencies the simulator predicts for them? A twin that falls
behind its predicted timeline shows it twice: in `zipage:twin_lag_seconds_total`, and in served
latencies above the offline ones.

    python bench/serve_simulate_streams.py [--streams 1000] [--prompt-len 512] [--output-len 512]

About 45 s of serving on two CPU cores at the defaults (bench client and server on the same
machine). Run from a checkout with the serve extra installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_gpu import _free_port, _stop, _twin_lag, _wait_healthy, _zipage  # noqa: E402

ROWS = [("completed", "completed", "{:g}"), ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
        ("TTFT p90 s", "ttft_p90_s", "{:.3f}"), ("TPOT p50 ms", "tpot_p50_ms", "{:.2f}"),
        ("makespan s", "makespan_s", "{:.2f}"), ("output tok/s", "tps", "{:,.0f}")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=1000, help="requests, all in flight at once")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--cost-model", default="qwen3-8b-h200-b64-k512-zipage")
    parser.add_argument("--kv-memory-gb", type=float, default=20.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/serve_simulate_streams"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    trace.write_text(json.dumps({"version": 1, "name": f"streams-{args.streams}", "requests": [
        {"id": f"s{index}", "arrival_s": 0.0, "prompt_len": args.prompt_len,
         "output_len": args.output_len} for index in range(args.streams)]}))
    knobs = ["--hardware", args.hardware, "--cost-model", args.cost_model, "--kv-memory-gb",
             f"{args.kv_memory_gb:g}", "--block-size", "64", "--budget", "512",
             "--max-num-seqs", str(args.streams)]
    served, lag, wall = _serve(args, knobs, trace, out / "served")
    _zipage("replay", str(trace), "--model", args.model, *knobs, "--json", "--no-progress",
            "--out", str(out / "offline"))
    runs = {name: json.loads((out / name / "summary.json").read_text())
            for name in ("served", "offline")}
    report = {name: {key: summary.get(key) for _, key, _ in ROWS} for name, summary in runs.items()}
    report["twin_lag_s"], report["served_wall_s"] = lag, wall
    (out / "serve_simulate_streams.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{args.streams} streams at once, {args.prompt_len} + {args.output_len} tokens, "
          f"random:{args.model} on a simulated {args.hardware}; {os.cpu_count()} CPUs here")
    print(f"{'':<14}{'served twin':>14}{'offline sim':>14}{'served/sim':>12}")
    for label, key, pattern in ROWS:
        first, second = report["served"][key], report["offline"][key]
        ratio = f"{first / second:>12.3f}" if second else f"{'':>12}"
        print(f"{label:<14}{pattern.format(first):>14}{pattern.format(second):>14}{ratio}")
    print(f"twin lag: {lag:.3f} s behind its predicted timeline in all ({wall:.1f} s served)")


def _serve(args, knobs: list[str], trace: Path, out: Path) -> tuple[dict, float, float]:
    port = _free_port()
    log_path = out.parent / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "zipage.cli", "serve", "--simulate", "--model",
             f"random:{args.model}", "--served-model-name", args.model, *knobs, "--port",
             str(port), "--disable-access-log"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, url, log_path)
        started = time.perf_counter()
        _zipage("bench", "serve", str(trace), "--url", url, "--max-concurrency",
                str(args.streams), "--json", "--no-progress", "--out", str(out))
        wall = time.perf_counter() - started
        lag = _twin_lag(url)
    finally:
        _stop(server)
    return json.loads((out / "summary.json").read_text()), lag, wall


if __name__ == "__main__":
    main()
