"""GPU benchmark: what each eviction scoring policy (`--scoring`, kernels/scoring/) costs on the
headline's shape, beside Full KV, with the simulator's prediction of each.

An AMC23-shaped trace (`--questions` x `--samples` requests, outputs up to `--max-output`) on
random Qwen3-8B weights with the headline's memory and knobs (6 GB of KV, block 64, budget 512),
one engine per policy, one run each:

    python bench/scoring_gpu.py --policies zipage,snapkv,rkv,streaming,random,keydiff,vnorm

Prints a table last and writes scoring_gpu.json under $OUT (or runs/scoring_gpu/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.engine.replay import replay_on_engine
from zipage.workloads import make_trace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--policies", default="zipage,snapkv,rkv,streaming,random,keydiff,vnorm")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=2048)
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--full-kv", action=argparse.BooleanOptionalAction, default=True,
                        help="also run Full KV for the ratio")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (use a small --model)")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "scoring_gpu")
    out.mkdir(parents=True, exist_ok=True)
    trace = make_trace("amc23", 0, num_questions=args.questions, samples_per_question=args.samples,
                       max_output_len=args.max_output)
    variants = ([("full-kv", dict(compress=False))] if args.full_kv else []) + [
        (name, dict(scoring=name)) for name in args.policies.split(",")]
    report = {"model": args.model, "requests": len(trace.requests), "args": vars(args), "rows": []}
    for name, knobs in variants:
        config = ZipageConfig(block_size=args.block_size, kv_budget=args.budget, **knobs)
        settings = ReplaySettings(model=f"random:{args.model}", hardware="h200-141gb",
                                  kv_memory_gb=args.kv_memory_gb, config=config)
        started = time.perf_counter()
        summary, run = replay_on_engine(trace, settings, args.device)
        row = {"variant": name, "tps": summary["tps"], "makespan_s": summary["makespan_s"],
               "compressions": summary.get("compressions"), "preemptions": summary.get("preemptions"),
               "peak_running": summary.get("peak_running"), "tpot_p50_ms": summary.get("tpot_p50_ms"),
               "wall_s": time.perf_counter() - started}
        try:
            from zipage.sim.simulate import simulate

            row["simulated_tps"] = simulate(trace, settings)[0]["tps"]
        except ImportError as error:  # simpy is not on every GPU image
            row["simulated_tps"] = f"unavailable: {error}"
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        (out / "scoring_gpu.json").write_text(json.dumps(report, indent=1))
        del run
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    base = next((row["tps"] for row in report["rows"] if row["variant"] == "full-kv"), None)
    pipeline = next((row["tps"] for row in report["rows"] if row["variant"] == "zipage"), None)
    print(f"\n{args.model}, {len(trace.requests)} requests, {args.kv_memory_gb} GB KV, block {args.block_size}, "
          f"budget {args.budget}")
    print("| policy | tok/s | vs Full KV | vs zipage | compressions | preempt | peak running | TPOT p50 ms "
          "| sim tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in report["rows"]:
        simulated = row["simulated_tps"]
        simulated = f"{simulated:,.0f}" if isinstance(simulated, float) else "-"
        versus_full = f"{row['tps'] / base:.2f}x" if base else "-"
        versus_zipage = f"{row['tps'] / pipeline:.2f}x" if pipeline else "-"
        print(f"| {row['variant']} | {row['tps']:,.0f} | {versus_full} | {versus_zipage} | {row['compressions']} | "
              f"{row['preemptions']} | {row['peak_running']} | {row['tpot_p50_ms']:.1f} | {simulated} |")


if __name__ == "__main__":
    main()
