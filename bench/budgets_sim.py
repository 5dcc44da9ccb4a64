"""Elastic vs fixed KV budgets in the simulator, at the same memory (docs/BENCHMARKS.md, 'Elastic budgets').

Replays the AMC23-shaped headline trace, the online mixture and a few-requests case (the first
`--few` requests of the headline trace, arriving together: memory to spare) with the flags of the
GPU headline (`--model qwen3-8b --hardware h200 --kv-memory-gb 6 --block-size 64 --budget 512`),
under the fixed and the elastic budget policy, with async and sync compression, and Full KV for
the few-requests case; prints one markdown table: output tok/s, elastic / fixed, the budget the
requests kept on average (`mean_kept_budget`), compressions, preemptions, TPOT and TTFT.

    python bench/budgets_sim.py [--few 4] [--cost-model PROFILE] [--contention X] [--out DIR]

No GPU: the analytic H200 cost model, or `--cost-model` a profile (e.g.
sim/profiles/qwen3-8b-h200-b64-k512-zipage.json, measured on the H200). `--contention X` replaces
the cost model's contention factor (a what-if: how much a step that runs beside an async
compression batch is slowed, docs/cost_model.md). `--out DIR` writes each run's directory
(DIR/<trace>-<mode>-<policy>) for `python -m zipage.analysis.attribution`.
`bench/headline_gpu.py --variants zipage,zipage-elastic` is the same comparison on a GPU.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.rundir import write_run
from zipage.sim.simulate import simulate
from zipage.trace import Trace, load_trace

TRACES = Path(__file__).resolve().parent.parent / "traces"


def run_label(trace: str, mode: str, policy: str) -> str:
    """Directory name of one run: headline-async-fixed, few-full-kv, ..."""
    parts = (trace, mode.replace(" ", "-").lower(), policy)
    return "-".join(part for part in parts if part != "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--few", type=int, default=4, help="requests of the few-requests case")
    parser.add_argument("--cost-model", default="analytic",
                        help="'analytic' or a profile JSON (default: analytic)")
    parser.add_argument("--contention", type=float, default=None,
                        help="contention factor instead of the cost model's (a what-if)")
    parser.add_argument("--out", default=None, help="write each run's directory under this folder")
    args = parser.parse_args()
    headline = load_trace(TRACES / "amc23-headline.json")
    cases = {
        "AMC23 headline (128 requests)": ("headline", headline),
        "online mixture (160 requests)": ("online", load_trace(TRACES / "online-mixture.json")),
        f"few requests ({args.few} of the headline)":
            ("few", Trace("few", headline.requests[:args.few])),
    }
    base = ReplaySettings(model="qwen3-8b", hardware="h200", kv_memory_gb=6.0,
                          cost_model=args.cost_model,
                          config=ZipageConfig(block_size=64, kv_budget=512))
    print("| trace | compression | policy | tok/s | elastic / fixed | kept budget | "
          "compressions | preemptions | TPOT p50 / p99 ms | TTFT p90 s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (short, trace) in cases.items():
        modes = [("async", {}), ("sync", {"async_compress": False})]
        if name.startswith("few"):
            modes.append(("Full KV", {"compress": False}))
        for mode, knobs in modes:
            policies = ["fixed", "elastic"] if mode != "Full KV" else ["-"]
            fixed_tps = None
            for policy in policies:
                config = replace(base.config, **knobs,
                                 **({} if policy == "-" else {"budget_policy": policy}))
                summary, run = simulate(trace, replace(base, config=config),
                                        contention_factor=args.contention)
                if args.out is not None:
                    write_run(Path(args.out) / run_label(short, mode, policy), summary,
                              run.steps, run.requests, [], decisions="none")
                fixed_tps = summary["tps"] if policy == "fixed" else fixed_tps
                ratio = f"{summary['tps'] / fixed_tps:.3f}" if policy == "elastic" else ""
                print(f"| {name} | {mode} | {policy} | {summary['tps']:,.0f} | {ratio} | "
                      f"{summary['mean_kept_budget']:,.0f} | {summary['compressions']:,} | "
                      f"{summary['preemptions']} | {summary['tpot_p50_ms']:.2f} / "
                      f"{summary['tpot_p99_ms']:.2f} | {summary['ttft_p90_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
