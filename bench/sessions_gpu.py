"""Sessions on a GPU: Full KV against the two compression scopes on closed-loop session traces.

Replays each trace in the real engine (random weights of a named model) three ways, in one
process: Full KV, Zipage with `--compress-scope all` and with `--compress-scope output` (the two
Zipage variants share one engine: the scope is a scheduler knob). Writes each run directory
(summary, steps, requests: what `zipage compare` and the twin check read) and prints one table:
output tokens/s, makespan, prefix-hit and prefill tokens, TTFT p50/p90, TPOT p50, preemptions,
compressions.

    python bench/sessions_gpu.py --traces agent.jsonl,chat.jsonl --kv-memory-gb 6 \\
        --runs-dir $OUT/runs

A variant may cap the query slots (`output-q8`: `--compress-scope output --query-slots 8`) and
add a host tier (`all-h8`: `--host-kv-gb 8`; `full-kv-h8`, `output-q16-h8`).
`--after-scale X` divides every follow-up's `after_s` (think and tool time) by X: a recorded
hour of conversations in minutes, the load shape kept (docs/BENCHMARKS.md, 'Sessions').
`--repeat N` replays each trace N times per variant on the same engine (runs `NAME`, `NAME.r2`, ...):
the engine's own run-to-run spread, which `zipage compare RUN RUN.r2` measures as it measures the twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.engine.builder import build_engine
from zipage.engine.replay import run_on_engine
from zipage.rundir import write_run
from zipage.trace import Trace, load_trace

KEYS = ("tps", "makespan_s", "completed", "failed", "output_tokens", "prefill_tokens",
        "prefix_hit_tokens", "first_hit_tokens", "ttft_p50_s", "ttft_p90_s", "tpot_p50_ms",
        "preemptions", "compressions", "num_blocks", "max_concurrency", "peak_running", "mean_running",
        "host_hit_tokens", "host_copy_blocks", "num_host_blocks")
VARIANTS = {"full-kv": dict(compress=False), "all": dict(compress_scope="all"),
            "output": dict(compress_scope="output")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--traces", required=True, help="comma-separated trace files")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--hardware", default="h200-141gb")
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--variants", default="full-kv,all,output")
    parser.add_argument("--after-scale", type=float, default=1.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs-dir", default=None)
    parser.add_argument("--tag", default="")
    parser.add_argument("--repeat", type=int, default=1, help="replays of each trace per variant")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "sessions")
    out.mkdir(parents=True, exist_ok=True)
    traces = {Path(path).name.split(".")[0]: _scaled(load_trace(path), args.after_scale)
              for path in args.traces.split(",")}
    variants = args.variants.split(",")
    # (run name, its variant): a repeat's run is NAME.r2, NAME.r3, ...
    runs = [(name + (f".r{rep + 1}" if rep else ""), name)
            for name in variants for rep in range(args.repeat)]
    report: dict = {"args": vars(args)}
    # One engine per capacity: Full KV has no query slots; the scopes with the same query slots
    # and host tier share one engine (the scope is a scheduler knob).
    groups: dict = {}
    for name in variants:
        knobs, host_gb = _variant(name)
        key = (knobs.get("compress", True), knobs.get("query_slots"), host_gb)
        groups.setdefault(key, []).append(name)
    for group in groups.values():
        engine = None
        for trace_name, trace in traces.items():
            for name, variant in runs:
                if variant not in group:
                    continue
                settings = _settings(args, variant)
                if engine is None:
                    started = time.perf_counter()
                    engine = build_engine(settings, args.device)
                    report[f"build_{group[0]}_s"] = time.perf_counter() - started
                started = time.perf_counter()
                summary, run = run_on_engine(engine, trace, settings)
                row = {key: summary.get(key) for key in KEYS}
                row["wall_s"] = time.perf_counter() - started
                report.setdefault(trace_name, {})[name] = row
                print(trace_name, name, json.dumps(row), flush=True)
                if args.runs_dir is not None:
                    write_run(Path(args.runs_dir) / trace_name / name, summary, run.steps,
                              run.requests, [])
                (out / f"sessions_gpu{args.tag}.json").write_text(json.dumps(report, indent=2))
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{'trace':<10} {'variant':<13} {'tok/s':>8} {'makespan':>9} {'hit tok':>10} "
          f"{'1st hit':>9} {'host hit':>9} {'prefill':>10} {'TTFT p50/p90 s':>15} {'TPOT p50':>9} {'preempt':>8} "
          f"{'compr':>6}")
    for trace_name in traces:
        for name, _ in runs:
            row = report[trace_name][name]
            print(f"{trace_name:<10} {name:<13} {row['tps']:>8.1f} {row['makespan_s']:>9.1f} "
                  f"{row['prefix_hit_tokens']:>10,} {row['first_hit_tokens']:>9,} "
                  f"{row['host_hit_tokens']:>9,} "
                  f"{row['prefill_tokens']:>10,} "
                  f"{row['ttft_p50_s']:>7.3f}/{row['ttft_p90_s']:<7.3f} "
                  f"{row['tpot_p50_ms']:>9.1f} {row['preemptions']:>8} {row['compressions']:>6}")


def _variant(name: str) -> tuple[dict, float]:
    """A variant's knobs and host tier (GiB): a name of VARIANTS, optionally with `-qN` (at
    most N query slots), then optionally `-hG` (a host tier of G GiB)."""
    rest, _, host = name.partition("-h")
    base, _, slots = rest.partition("-q")
    try:
        host_gb = float(host) if host else 0.0
    except ValueError:
        host_gb = -1.0
    if base not in VARIANTS or (slots and not slots.isdigit()) or host_gb < 0:
        raise SystemExit(f"--variants: unknown variant {name!r}; use {', '.join(VARIANTS)}, "
                         "a compressing one optionally with -qN (e.g. output-q8), any with -hG "
                         "(a host tier of G GiB, e.g. all-h8)")
    return VARIANTS[base] | ({"query_slots": int(slots)} if slots else {}), host_gb


def _settings(args, name: str) -> ReplaySettings:
    knobs, host_gb = _variant(name)
    config = ZipageConfig(block_size=args.block_size, kv_budget=args.budget, **knobs)
    return ReplaySettings(model=f"random:{args.model}", hardware=args.hardware,
                          kv_memory_gb=args.kv_memory_gb, host_kv_gb=host_gb, config=config)


def _scaled(trace: Trace, factor: float) -> Trace:
    if factor == 1.0:
        return trace
    return Trace(trace.name, [dataclasses.replace(request, after_s=request.after_s / factor)
                              if request.after is not None else request
                              for request in trace.requests])


if __name__ == "__main__":
    main()
