"""Which defaults hold on real shapes: the default knobs against their alternatives, simulated.

    python bench/defaults_sim.py --trace azure-conv=conv.jsonl.gz --trace mooncake=mc.jsonl.gz

Replays each trace (production windows made with `zipage trace import`, and the shipped
reasoning and serving traces by default) under the defaults and one alternative at a time:
whole-prompt (unchunked) prefill, chunked prefill at larger token budgets, hybrid scheduling
off, budgets 1024 and 4096. Qwen3-8B on
an H200 with 40 GiB of KV cache (the GPU runs of docs/BENCHMARKS.md, 'Defaults on real shapes'),
the analytic cost model. Prints, per trace, each variant's throughput and latency tails as
ratios to the defaults' (a ratio above 1 is worse for a latency, better for throughput), and
writes the table to $OUT or runs/defaults_sim/defaults_sim.json.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.sim.simulate import simulate
from zipage.trace_import import load_trace_file

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {"amc23": "traces/amc23.json", "online-mixture": "traces/online-mixture.json",
           "longbench": "traces/longbench.json"}
VARIANTS = {
    "defaults": {},
    "unchunked": {"chunked_prefill": False},
    "chunked 4096": {"chunked_prefill": True, "max_num_batched_tokens": 4096},
    "chunked 8192": {"chunked_prefill": True, "max_num_batched_tokens": 8192},
    "hybrid off": {"hybrid": False},
    "budget 1024": {"kv_budget": 1024},
    "budget 4096": {"kv_budget": 4096},
}
METRICS = ("tps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", action="append", default=[], metavar="NAME=FILE",
                        help="a trace to add (repeat); the shipped ones are always in")
    parser.add_argument("--kv-memory-gb", type=float, default=40.0)
    args = parser.parse_args()
    traces = {name: ROOT / path for name, path in SHIPPED.items()}
    for item in args.trace:
        name, _, path = item.partition("=")
        traces[name] = Path(path)
    base = ReplaySettings(model="qwen3-8b", hardware="h200", kv_memory_gb=args.kv_memory_gb)
    table: dict[str, dict[str, dict]] = {}
    for name, path in traces.items():
        trace = load_trace_file(path)
        table[name] = {}
        for variant, knobs in VARIANTS.items():
            config = ZipageConfig.from_dict({**ZipageConfig().to_dict(), **knobs})
            summary, _ = simulate(trace, replace(base, config=config))
            table[name][variant] = {key: summary[key] for key in (*METRICS, "completed", "failed")}
    out = Path(os.environ.get("OUT") or ROOT / "runs" / "defaults_sim")
    out.mkdir(parents=True, exist_ok=True)
    (out / "defaults_sim.json").write_text(json.dumps(table, indent=2))
    for name, rows in table.items():
        reference = rows["defaults"]
        print(f"\n{name}: defaults {reference['tps']:,.0f} tok/s, TTFT p50/p99 "
              f"{reference['ttft_p50_s']:.2f}/{reference['ttft_p99_s']:.2f} s, TPOT p50/p99 "
              f"{reference['tpot_p50_ms']:.1f}/{reference['tpot_p99_ms']:.1f} ms, "
              f"{reference['failed']} failed")
        print(f"  {'variant':<14}" + "".join(f"{key:>13}" for key in METRICS) + f"{'failed':>8}")
        for variant, row in rows.items():
            ratios = [row[key] / reference[key] if reference[key] else float("nan")
                      for key in METRICS]
            print(f"  {variant:<14}" + "".join(f"{ratio:>12.2f}x" for ratio in ratios)
                  + f"{row['failed']:>8}")


if __name__ == "__main__":
    main()
