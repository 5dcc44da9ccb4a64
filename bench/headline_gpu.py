"""The headline: Zipage vs Full KV on an AMC23-shaped trace, same GPU, same trace, same KV memory.

Runs `zipage replay --gpu` twice in one process (Full KV, then Zipage) on a scaled AMC23 trace
(short prompts, long reasoning outputs) with random weights of a named model, the KV memory
capped so that Full KV is memory-bound (as on the paper's A100), and prints output tokens/s of
each and the ratio. Also replays the same trace in the simulator with the same flags, so the
simulated and measured speed-ups sit side by side.

    python bench/headline_gpu.py --model qwen3-8b --questions 16 --samples 8 --max-output 4096 \
        --kv-memory-gb 6 --budget 512 --block-size 64

The defaults are the paper's AMC23 setting with every length divided by 4 (max output 16384 ->
4096, budget 2048 -> 512, block 256 -> 64), so output / budget stays 8 as in the paper.
`--variants` runs a subset (a 10-minute GPU call fits Full KV or the two Zipage variants of the
8B model, not all three); `--tag` names the JSON file so separate calls do not overwrite each other.
The `-elastic` variants run the elastic budget policy (docs/architecture.md, 'Per-request and
elastic budgets'); `--trace FILE` replays a shipped trace instead of generating the AMC23 one, e.g.
the elastic-vs-fixed comparison of docs/BENCHMARKS.md:

    python bench/headline_gpu.py --variants zipage,zipage-elastic --tag _elastic
    python bench/headline_gpu.py --trace traces/online-mixture.json \
        --variants zipage,zipage-elastic --tag _elastic_online
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

from zipage.core.config import ZipageConfig
from zipage.engine.replay import replay_on_engine
from zipage.deployment import ReplaySettings
from zipage.trace import load_trace
from zipage.workloads import make_trace

KEYS = ("tps", "makespan_s", "completed", "output_tokens", "peak_running", "mean_running",
        "preemptions", "compressions", "max_blocks_after_compress", "mean_kept_budget",
        "tpot_p50_ms", "tpot_p99_ms", "ttft_p90_s", "num_blocks", "max_concurrency", "steps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=4096)
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--layer-stride", type=int, default=8,
                        help="layers per compression launch group (>= the layer count: all in one)")
    parser.add_argument("--hardware", default="h200-141gb")
    parser.add_argument("--variants", default="full-kv,zipage,zipage-sync")
    parser.add_argument("--tag", default="", help="suffix of the output file name")
    parser.add_argument("--trace", default=None,
                        help="replay this trace file instead of the generated AMC23 one")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    if args.trace is not None:
        trace = load_trace(args.trace)
    else:
        trace = make_trace("amc23", 0, num_questions=args.questions,
                           samples_per_question=args.samples, max_output_len=args.max_output)
    variants = {
        "full-kv": dict(compress=False),
        "zipage": dict(),
        "zipage-sync": dict(async_compress=False),
        "zipage-elastic": dict(budget_policy="elastic"),
        "zipage-elastic-sync": dict(budget_policy="elastic", async_compress=False),
    }
    report = {"model": args.model, "requests": len(trace.requests),
              "output_tokens": sum(r.output_len for r in trace.requests), "args": vars(args)}
    for name in args.variants.split(","):
        config = ZipageConfig(block_size=args.block_size, window=args.window,
                              kv_budget=args.budget, layer_stride=args.layer_stride,
                              **variants[name])
        settings = ReplaySettings(model=f"random:{args.model}", hardware=args.hardware,
                                  kv_memory_gb=args.kv_memory_gb, config=config)
        started = time.perf_counter()
        summary, _ = replay_on_engine(trace, settings, "cuda")
        report[name] = {key: summary[key] for key in KEYS}
        report[name]["wall_s"] = time.perf_counter() - started
        try:
            from zipage.sim.simulate import simulate

            simulated, _ = simulate(trace, settings)
            report[name]["simulated_tps"] = simulated["tps"]
        except ImportError as error:  # simpy is not on every GPU image
            report[name]["simulated_tps"] = f"unavailable: {error}"
        print(name, json.dumps(report[name]), flush=True)
        gc.collect()  # free this variant's caches and graphs before the next engine is built
        torch.cuda.empty_cache()
        (out / f"headline_gpu{args.tag}.json").write_text(json.dumps(report, indent=2))
    if "full-kv" in report and "zipage" in report:
        report["speedup"] = report["zipage"]["tps"] / report["full-kv"]["tps"]
        (out / f"headline_gpu{args.tag}.json").write_text(json.dumps(report, indent=2))
    print(f"\n{'variant':<20} {'tok/s':>10} {'makespan s':>11} {'peak run':>9} "
          f"{'preempt':>8} {'compress':>9} {'kept':>7} {'sim tok/s':>10}")
    for name in args.variants.split(","):
        row = report[name]
        simulated = row["simulated_tps"]
        simulated = f"{simulated:10.1f}" if isinstance(simulated, float) else "         -"
        print(f"{name:<20} {row['tps']:>10.1f} {row['makespan_s']:>11.1f} "
              f"{row['peak_running']:>9} {row['preemptions']:>8} {row['compressions']:>9} "
              f"{row['mean_kept_budget']:>7.0f} {simulated}")
    if "zipage" in report and "zipage-elastic" in report:
        ratio = report["zipage-elastic"]["tps"] / report["zipage"]["tps"]
        print(f"elastic / fixed: {ratio:.3f}x tok/s, kept budget "
              f"{report['zipage-elastic']['mean_kept_budget']:.0f} vs "
              f"{report['zipage']['mean_kept_budget']:.0f}")
    if "speedup" in report:
        print(f"Zipage / Full KV: {report['speedup']:.2f}x")


if __name__ == "__main__":
    main()
