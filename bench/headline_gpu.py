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

Every variant runs chunked prefill, the default (`--max-num-batched-tokens` per step, default
2048); the `-unchunked` variants prefill whole prompts in steps of their own, the comparison of
issue #13:

    python bench/headline_gpu.py --trace traces/online-mixture.json --no-simulate \
        --variants zipage,zipage-unchunked,full-kv,full-kv-unchunked --runs-dir $OUT/runs

`--runs-dir` writes each variant's run directory (summary, steps, requests: what `zipage
compare` and the twin-fidelity study read). To time an older checkout, run that checkout's own
copy of this script (`. OLD/bench/env.sh` first).
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
from zipage.trace import Trace, load_trace
from zipage.workloads import make_trace

KEYS = ("tps", "makespan_s", "completed", "output_tokens", "peak_running", "mean_running",
        "preemptions", "compressions", "max_blocks_after_compress", "mean_kept_budget",
        "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
        "prefill_tokens", "prefix_hit_tokens", "num_blocks", "max_concurrency", "steps")


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
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--head", type=int, default=None,
                        help="replay only the trace's first N requests")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="step token budget (default: the engine's for the prefill mode)")
    parser.add_argument("--runs-dir", default=None,
                        help="write each variant's run directory under this folder")
    parser.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=True,
                        help="also replay each variant in the simulator (needs simpy)")
    parser.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="prefill and mixed steps as CUDA graphs too (default: the engine's, on)")
    args = parser.parse_args()
    # $OUT when set (the GPU harness collects it), else the ignored runs/ of the repository.
    out = Path(os.environ.get("OUT")
               or Path(__file__).resolve().parents[1] / "runs" / "headline_gpu")
    out.mkdir(parents=True, exist_ok=True)
    if args.trace is not None:
        trace = load_trace(args.trace)
    else:
        trace = make_trace("amc23", 0, num_questions=args.questions,
                           samples_per_question=args.samples, max_output_len=args.max_output)
    variants = {
        "full-kv": dict(compress=False),
        "zipage": dict(),
        "zipage-sync": dict(async_compress=False),
        # Admission stops at the M query slots (hybrid scheduling off).
        "zipage-constrained": dict(hybrid=False),
        "zipage-elastic": dict(budget_policy="elastic"),
        "zipage-elastic-sync": dict(budget_policy="elastic", async_compress=False),
        # Whole prompts in prefill-only steps (the default until chunked prefill took over).
        "zipage-unchunked": dict(chunked_prefill=False),
        "full-kv-unchunked": dict(compress=False, chunked_prefill=False),
        # FP8 KV cache: the headline check of the shipped FP8 profile (issue #49).
        "zipage-fp8": dict(kv_cache_dtype="fp8"),
        # Each step planned while the one before runs (docs/architecture.md, 'Async scheduling').
        "zipage-async": dict(async_scheduling=True),
        "full-kv-async": dict(compress=False, async_scheduling=True),
    }
    if args.head is not None:
        trace = Trace(trace.name, trace.requests[:args.head])
    report = {"model": args.model, "requests": len(trace.requests),
              "output_tokens": sum(r.output_len for r in trace.requests), "args": vars(args)}
    for name in args.variants.split(","):
        config = ZipageConfig(block_size=args.block_size, window=args.window,
                              kv_budget=args.budget, layer_stride=args.layer_stride,
                              max_num_batched_tokens=args.max_num_batched_tokens, **variants[name])
        settings = ReplaySettings(model=f"random:{args.model}", hardware=args.hardware,
                                  kv_memory_gb=args.kv_memory_gb, config=config)
        started = time.perf_counter()
        # A run directory carries the decision log, which step-time replay compares against.
        summary, run = replay_on_engine(trace, settings, args.device,
                                        prefill_graphs=args.prefill_graphs,
                                        log_decisions=args.runs_dir is not None)
        # Older checkouts lack some keys; the steps still say how many prompt tokens were computed.
        summary.setdefault("prefill_tokens", sum(step.prefill_tokens for step in run.steps))
        report[name] = {key: summary.get(key) for key in KEYS}
        report[name]["wall_s"] = time.perf_counter() - started
        if args.runs_dir is not None:
            from zipage.rundir import write_run

            write_run(Path(args.runs_dir) / name, summary, run.steps, run.requests,
                      run.decision_log)
        report[name]["simulated_tps"] = "not run"
        try:
            if args.simulate:
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
    print(f"\n{'variant':<18} {'tok/s':>9} {'makespan':>9} {'preempt':>8} {'compress':>9} "
          f"{'kept':>6} {'prefill tok':>11} {'TTFT p50/p90/p99 s':>20} "
          f"{'TPOT p50/p90/p99 ms':>21} {'sim tok/s':>10}")
    for name in args.variants.split(","):
        row = report[name]
        simulated = row["simulated_tps"]
        simulated = f"{simulated:10.1f}" if isinstance(simulated, float) else "         -"
        kept = "-" if row["mean_kept_budget"] is None else f"{row['mean_kept_budget']:.0f}"
        ttft = "/".join("-" if row[key] is None else f"{row[key]:.2f}"
                        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"))
        tpot = "/".join("-" if row[key] is None else f"{row[key]:.1f}"
                        for key in ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms"))
        print(f"{name:<18} {row['tps']:>9.1f} {row['makespan_s']:>9.1f} {row['preemptions']:>8} "
              f"{row['compressions']:>9} {kept:>6} {row['prefill_tokens']:>11,} {ttft:>20} "
              f"{tpot:>21} {simulated}")
    if "zipage" in report and "zipage-elastic" in report:
        ratio = report["zipage-elastic"]["tps"] / report["zipage"]["tps"]
        print(f"elastic / fixed: {ratio:.3f}x tok/s, kept budget "
              f"{report['zipage-elastic']['mean_kept_budget']:.0f} vs "
              f"{report['zipage']['mean_kept_budget']:.0f}")
    if "speedup" in report:
        print(f"Zipage / Full KV: {report['speedup']:.2f}x")


if __name__ == "__main__":
    main()
