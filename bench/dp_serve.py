"""Data-parallel serving, measured against its prediction: `zipage serve --data-parallel R
--routing P` driven by `zipage bench serve`, beside the simulated cluster `zipage plan --replicas R
--routing P` builds (`sim.cluster.simulate_cluster`, the same router code) for the same trace.

`--trace FILE` replays a trace of your own instead (a session trace: `zipage bench serve` sends
each turn after its predecessor's answer, the simulated cluster on its clock), `--rows` picks the
rows (`2:round-robin,2:session-affinity`), and `--no-predict` measures only (a GPU image without
simpy: predict on any machine afterwards with `--predict-only`).

The default trace: requests of a few prefix groups (a shared system prompt each, then a tail of their
own), Poisson arrivals. For each (replicas, routing) row the script starts a server, checks
correctness first (a greedy request's token ids must equal the first row's: every replica is the
same engine), replays the trace with `zipage bench serve --out` (its run's
`requests_per_replica`: how the router spread the trace, from /metrics), stops the server, and
simulates the same row. The table last: measured output tok/s, TTFT p50 / p90, requests per
replica, and the prediction's tok/s, TTFT p90, requests per replica, with measured / predicted
ratios. Logs, run directories and `table.json` go under $OUT (or --out).

CPU (the committed table; random SmolLM2-135M, one thread per replica):

    python bench/dp_serve.py --engine cpu --cost-model /tmp/cpu-profile.json --out /tmp/dp

where the profile comes from `zipage calibrate --engine cpu` with the same knobs (the script's
--knobs, see docs/BENCHMARKS.md). GPU (two H200s): `--engine gpu --model DIR --hardware h200
--cost-model PROFILE --kv-memory-gb 40 --requests 400 --rate 20`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from zipage.core.deployment import ReplaySettings
from zipage.trace import Trace, TraceRequest, load_trace, save_trace

ROWS = [(1, "least-loaded"), (2, "round-robin"), (2, "least-loaded"), (2, "prefix-affinity")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--hardware", default="h200", help="the simulator's hardware entry")
    parser.add_argument("--cost-model", default="analytic")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-memory-gb", type=float, default=0.1)
    parser.add_argument("--knobs", default="--block-size 16 --window 4 --budget 64",
                        help="engine knobs given to the server and the simulator alike")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=192)
    parser.add_argument("--tail-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/dp_serve"))
    parser.add_argument("--trace", default=None,
                        help="replay this trace (e.g. a session trace, in closed loop) instead "
                             "of the generated prefix groups")
    parser.add_argument("--rows", default=None,
                        help="REPLICAS:ROUTING,... (default: the four rows of the table)")
    parser.add_argument("--no-predict", action="store_true",
                        help="measure only (a machine without simpy); --predict-only later")
    parser.add_argument("--predict-only", action="store_true",
                        help="keep the measured rows of OUT/table.json, simulate again (e.g. "
                             "with another --cost-model) and print the table")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or ("float32" if args.engine == "cpu" else "bfloat16")
    trace = load_trace(args.trace) if args.trace else make_trace(args)
    rows_wanted = ROWS if args.rows is None else [
        (int(row.split(":")[0]), row.split(":")[1]) for row in args.rows.split(",")]
    if args.predict_only:
        rows = json.loads((out / "table.json").read_text())
        for row in rows:
            row["predicted"] = predict(trace, args, dtype, row["replicas"], row["routing"])
        (out / "table.json").write_text(json.dumps(rows, indent=1))
        print_table(rows)
        return 0
    trace_path = out / "trace.json"
    save_trace(trace, trace_path)
    engine_flags = ["--model", args.model, "--engine", args.engine, "--dtype", dtype,
                    "--kv-memory-gb", str(args.kv_memory_gb), *args.knobs.split()]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows, reference = [], None
    for replicas, routing in rows_wanted:
        name = f"r{replicas}-{routing}"
        measured = serve_and_bench(engine_flags, replicas, routing, trace_path, out / name, env)
        if reference is None:
            reference = measured["check"]
        if measured["check"] != reference:  # correctness before any timing is read
            print(f"{name}: greedy tokens differ from the first row's: {measured['check']} vs "
                  f"{reference}", file=sys.stderr)
            return 1
        predicted = None if args.no_predict else predict(trace, args, dtype, replicas, routing)
        rows.append({"replicas": replicas, "routing": routing, "measured": measured,
                     "predicted": predicted})
        (out / "table.json").write_text(json.dumps(rows, indent=1))
    if not args.no_predict:
        print_table(rows)
    return 0


def make_trace(args) -> Trace:
    """Poisson arrivals (a fixed seed); request i belongs to prefix group i mod groups."""
    import random

    draw = random.Random(0)
    now, requests = 0.0, []
    for index in range(args.requests):
        now += draw.expovariate(args.rate)
        requests.append(TraceRequest(
            id=f"q{index}", arrival_s=round(now, 4), prompt_len=args.prefix_len + args.tail_len,
            output_len=args.output_len, prefix_group=f"g{index % args.groups}",
            prefix_len=args.prefix_len))
    return Trace("dp-prefix-groups", requests)


def serve_and_bench(engine_flags, replicas, routing, trace_path, out: Path, env) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "zipage.cli", "serve", *engine_flags, "--data-parallel",
         str(replicas), "--routing", routing, "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(server, url, out / "server.log")
        check = httpx.post(url + "/v1/completions", timeout=300, json={
            "prompt": list(range(1, 41)), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}).json()["choices"][0]["token_ids"]
        bench = subprocess.run(
            [sys.executable, "-m", "zipage.cli", "bench", "serve", str(trace_path), "--url", url,
             "--out", str(out / "run"), "--no-progress"],
            capture_output=True, text=True, env=env, timeout=3600)
        (out / "bench.log").write_text(bench.stdout + bench.stderr)
        if bench.returncode != 0:
            raise SystemExit(f"zipage bench serve failed:\n{bench.stderr[-2000:]}")
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()
    summary = json.loads((out / "run" / "summary.json").read_text())
    return {"check": check, "tok_s": summary["tps"],
            "ttft_p50_s": summary["ttft_p50_s"], "ttft_p90_s": summary["ttft_p90_s"],
            "completed": summary["completed"], "makespan_s": summary["makespan_s"],
            "per_replica": summary["requests_per_replica"],
            # Beside the client's mean TTFT, the server's (its /metrics histogram): what the
            # HTTP path added is the difference (docs/serve.md, 'Benchmark a server').
            "ttft_mean_s": summary["mean_ttft_s"],
            "server_ttft_mean_s": summary.get("server_ttft_mean_s")}


def predict(trace, args, dtype, replicas, routing) -> dict:
    from zipage.cli.parser import build_parser
    from zipage.sim.cluster import simulate_cluster

    parsed = build_parser().parse_args(["replay", "traces/tiny.json", *args.knobs.split()])
    from zipage.cli.flags import settings_from_args

    base = settings_from_args(parsed)
    settings = ReplaySettings(model=args.model, hardware=args.hardware, dtype=dtype,
                              kv_memory_gb=args.kv_memory_gb, cost_model=args.cost_model,
                              config=base.config)
    summary = simulate_cluster(trace, settings, replicas=replicas, routing=routing)
    return {"tok_s": summary["tps"], "ttft_p50_s": summary["ttft_p50_s"],
            "ttft_p90_s": summary["ttft_p90_s"], "per_replica": summary["requests_per_replica"],
            "makespan_s": summary["makespan_s"],
            "prefix_hit_tokens": summary.get("prefix_hit_tokens")}


def print_table(rows) -> None:
    print("| replicas | routing | tok/s | TTFT p50 s | TTFT p90 s | TTFT mean s, client / server "
          "| requests per replica | predicted tok/s | predicted TTFT p90 s | predicted per replica "
          "| tok/s measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        m, p = row["measured"], row["predicted"]
        server = m.get("server_ttft_mean_s")
        means = (f"{m['ttft_mean_s']:.3f} / {server:.3f}" if server is not None
                 and m.get("ttft_mean_s") is not None else "-")
        print(f"| {row['replicas']} | {row['routing']} | {m['tok_s']:.1f} | {m['ttft_p50_s']:.2f} "
              f"| {m['ttft_p90_s']:.2f} | {means} | "
              f"{'/'.join(f'{x:g}' for x in m['per_replica'])} | "
              f"{p['tok_s']:.1f} | {p['ttft_p90_s']:.2f} | "
              f"{'/'.join(str(x) for x in p['per_replica'])} | {m['tok_s'] / p['tok_s']:.2f} |")


def _wait_healthy(server, url: str, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("zipage serve exited:\n" + log.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit("zipage serve never became healthy:\n" + log.read_text()[-3000:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
