"""Tensor parallelism on two GPUs (run on nvidia-h200-x2; results go to docs/BENCHMARKS.md).

Part A - decode step, TP=1 vs TP=2: random:qwen3-8b at batch 32/128/256 with 2k-token contexts,
one whole engine step (inputs, forward with CUDA graphs, logits gather, sampling), against the
bandwidth roofline of the GPUs it runs on: (weight bytes + KV bytes read) / N / copy bandwidth.

Part B - the headline on random:qwen3-32b at TP=2: an AMC23-shaped trace (as bench/headline_gpu.py,
lengths scaled to fit a 10-minute call), Full KV then Zipage, KV memory per GPU capped so that
Full KV is memory-bound; output tokens/s of each and the ratio, and the simulator's analytic
prediction of the same runs (--tensor-parallel 2 on an H200).

Part C - runs to fit calibrated profiles from (`zipage calibrate --from-run`): the same engine
settings on a *different* trace (GSM8K-shaped: short outputs), Full KV and Zipage, so the
calibrated simulator's prediction of part B is made with a profile that never saw part B's trace.

Parts B and C write their run directories (summary.json, steps.csv, requests.csv) under
$OUT/runs/ and pack them as $OUT/tp_runs.tar.gz.

    . bench/env.sh && python bench/tp_gpu.py [--parts A,B] [--questions 8 --samples 8 ...]

Prints a table last and writes tp_gpu.json under $OUT (or the current directory).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import time
import traceback
from pathlib import Path

import torch

from zipage.core.config import ZipageConfig
from zipage.deployment import ReplaySettings
from zipage.engine.replay import replay_on_engine
from zipage.rundir import write_run
from zipage.trace import save_trace
from zipage.workloads import make_trace

# The single-GPU decode benchmark's bandwidth probe and decode-step timing (bench/ is the
# script's path); here with tensor_parallel ranks.
from engine_gpu import copy_bandwidth, decode_roofline  # noqa: E402

DEVICE = os.environ.get("ZIPAGE_BENCH_DEVICE", "cuda")  # "cpu": a smoke run of parts B and C


def headline(args, out: Path, trace_kind: str = "amc23", label: str = "headline") -> dict:
    if trace_kind == "amc23":
        trace = make_trace("amc23", 0, num_questions=args.questions,
                           samples_per_question=args.samples, max_output_len=args.max_output)
    else:
        trace = make_trace(trace_kind, 1, num_questions=args.fit_questions,
                           samples_per_question=4, max_output_len=args.max_output)
    report = {"model": args.model, "tp": args.tp, "trace": trace_kind,
              "requests": len(trace.requests),
              "output_tokens": sum(r.output_len for r in trace.requests)}
    (out / "runs").mkdir(parents=True, exist_ok=True)
    save_trace(trace, out / "runs" / f"{label}-trace.json")
    for name, knobs in (("full-kv", dict(compress=False)), ("zipage", dict())):
        config = ZipageConfig(block_size=args.block_size, window=args.window,
                              kv_budget=args.budget, **knobs)
        settings = ReplaySettings(model=f"random:{args.model}", hardware="h200-141gb",
                                  kv_memory_gb=args.kv_memory_gb, tensor_parallel=args.tp,
                                  config=config)
        started = time.perf_counter()
        try:
            summary, run = replay_on_engine(trace, settings, DEVICE)
        except Exception:  # noqa: BLE001 - e.g. a collective that a CUDA graph cannot capture
            report.setdefault("graph_errors", []).append(traceback.format_exc())
            traceback.print_exc()
            summary, run = replay_on_engine(trace, settings, DEVICE, cuda_graphs=False)
            summary["cuda_graphs"] = False
        write_run(out / "runs" / f"{label}-{name}", summary, run.steps, run.requests, [],
                  decisions="none")
        row = {key: summary.get(key) for key in ("tps", "makespan_s", "peak_running",
                                                 "mean_running", "preemptions", "compressions",
                                                 "num_blocks", "steps")}
        row["wall_s"] = time.perf_counter() - started
        try:
            from zipage.sim.simulate import simulate

            simulated, _ = simulate(trace, settings)
            row["simulated_tps"] = simulated["tps"]
        except ImportError as error:
            row["simulated_tps"] = f"unavailable: {error}"
        report[name] = row
        print(name, json.dumps(row), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    report["speedup"] = report["zipage"]["tps"] / report["full-kv"]["tps"]
    sims = [report[name]["simulated_tps"] for name in ("zipage", "full-kv")]
    if all(isinstance(value, float) for value in sims):
        report["simulated_speedup"] = sims[0] / sims[1]
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="A,B")
    parser.add_argument("--decode-model", default="qwen3-8b")
    parser.add_argument("--batches", default="32,128,256")
    parser.add_argument("--decode-worlds", default=None, help="part A's ranks (default: 1,TP)")
    parser.add_argument("--model", default="qwen3-32b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=2048)
    parser.add_argument("--kv-memory-gb", type=float, default=3.0,
                        help="per GPU; Qwen3-32B at TP=2 holds 128 KiB of KV per token per GPU")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--fit-questions", type=int, default=24,
                        help="part C: GSM8K-shaped questions (4 samples each)")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    parts = args.parts.split(",")
    report: dict = {"args": vars(args), "gpus": torch.cuda.device_count()}
    if "A" in parts:
        bandwidth = copy_bandwidth()
        report["copy_bandwidth"] = bandwidth
        batches = [int(b) for b in args.batches.split(",")]
        report["decode"] = []
        for world in [int(w) for w in (args.decode_worlds or f"1,{args.tp}").split(",")]:
            try:
                report["decode"] += decode_roofline(args.decode_model, batches, bandwidth,
                                                     tensor_parallel=world, eager=False)
            except Exception:  # noqa: BLE001 - keep part B
                report.setdefault("errors", []).append(traceback.format_exc())
                traceback.print_exc()
        (out / "tp_gpu.json").write_text(json.dumps(report, indent=2))
    for part, key, kind in (("B", "headline", "amc23"), ("C", "fit", "gsm8k")):
        if part not in parts:
            continue
        try:
            report[key] = headline(args, out, kind, key)
        except Exception:  # noqa: BLE001 - keep the other parts
            report.setdefault("errors", []).append(traceback.format_exc())
            traceback.print_exc()
        (out / "tp_gpu.json").write_text(json.dumps(report, indent=2))
        subprocess.run(["tar", "czf", str(out / "tp_runs.tar.gz"), "-C", str(out), "runs"],
                       check=False)
    print(f"\n{'model':<10} {'tp':>3} {'batch':>6} {'step ms':>8} {'roofline ms':>12} {'share':>6}")
    for row in report.get("decode", []):
        print(f"{row['model']:<10} {row['tp']:>3} {row['batch']:>6} {row['graphs'] * 1e3:>8.2f} "
              f"{row['roofline_s'] * 1e3:>12.2f} {row['bandwidth_share']:>6.0%}")
    for key in ("headline", "fit"):
        if key not in report:
            continue
        h = report[key]
        print(f"\n{key}: {h['trace']} {h['model']} TP={h['tp']}, {h['requests']} requests")
        for name in ("full-kv", "zipage"):
            row = h[name]
            print(f"{name:<8} {row['tps']:>9.1f} tok/s  peak running {row['peak_running']}  "
                  f"preemptions {row['preemptions']}  simulated {row['simulated_tps']}")
        print(f"Zipage / Full KV: {h['speedup']:.2f}x (simulated "
              f"{h.get('simulated_speedup', float('nan')):.2f}x)")


if __name__ == "__main__":
    main()
