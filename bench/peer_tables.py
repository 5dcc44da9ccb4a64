"""GPU benchmark: our engine beside another engine's published table, on the same shape.

A published table is a small JSON file (bench/peer/*.json): the source, the device and model it was
measured with, the workload (requests, prompt and output lengths, all submitted at once, EOS
ignored), our variants (knobs) and which published column each is set beside, and one row per
setting (a KV pool in tokens, or per-row lengths), with the published figures. This script builds
the workload as a trace, replays it on the engine for every row and variant (random weights of the
named preset: throughput does not depend on the weights when output lengths are fixed), and
prints ours beside theirs with the ratio. Published figures come from another machine: they are
labelled as such, and our run-to-run spread is the `--repeat` min-max.

Each run is also taken apart from its own step records: the share of the run in steps that
prefill, in decode-only steps, and between steps (host gaps); and the decode-only steps' time
against their bandwidth roofline, (weight bytes + KV bytes read) / measured copy bandwidth, at
the batch they ran; and compression's cost a step, where it is pure overhead: the mean large
decode step beyond the median of those that neither launch a compression batch nor report one.

    python bench/peer_tables.py bench/peer/rkv_vllm_stress_h100.json [--rows 0,3] [--variants full-kv]

Prints a table last and writes peer_<name>.json under $OUT (or runs/peer_tables/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.memory import GIB, kv_token_bytes, weight_bytes
from zipage.engine.replay import replay_on_engine
from zipage.presets import get_preset
from zipage.trace import Trace, TraceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import copy_bandwidth  # noqa: E402  (a sibling script, not a package)


def workload(table: dict, row: dict) -> Trace:
    prompt_len = row.get("prompt_len", table.get("prompt_len"))
    output_len = row.get("output_len", table.get("output_len"))
    requests = row.get("requests", table.get("requests"))
    return Trace(f"{table['name']}-{prompt_len}-{output_len}",
                 [TraceRequest(id=f"r{index}", arrival_s=0.0, prompt_len=prompt_len, output_len=output_len)
                  for index in range(requests)])


def breakdown(run, model: str, bandwidth: float, kv_cache_dtype: str = "auto") -> dict:
    """Where the run's time went, from its step records (the decode roofline at the run's KV bytes a token)."""
    steps = sorted(run.steps, key=lambda step: step.t_start)
    if not steps:
        return {}
    span = steps[-1].t_end - steps[0].t_start
    prefill = sum(step.t_end - step.t_start for step in steps if step.prefill_tokens > 0)
    decode_steps = [step for step in steps if step.prefill_tokens == 0 and step.n_decode > 0]
    decode = sum(step.t_end - step.t_start for step in decode_steps)
    gaps = sum(max(0.0, later.t_start - earlier.t_end) for earlier, later in zip(steps, steps[1:]))
    weights = weight_bytes(get_preset(model), 2)
    per_token = kv_token_bytes(get_preset(model), kv_cache_dtype, 2)
    shares, large, clean = [], [], []
    for step in decode_steps:
        roofline = (weights + step.decode_context_tokens * per_token) / bandwidth
        shares.append(roofline / (step.t_end - step.t_start))
        if step.n_decode >= 128:
            large.append((step.t_end - step.t_start, roofline, step.n_decode))
            if step.n_compress == 0 and step.batches_done == 0:
                clean.append(step.t_end - step.t_start)
    # Compression's cost where it is pure overhead: what the large decode steps took beyond the
    # median of those that neither launch a compression batch nor report one done, per step.
    mean_large = sum(t for t, _, _ in large) / len(large) if large else None
    extra = (mean_large - statistics.median(clean)
             if large and clean and len(clean) < len(large) else None)
    return {
        "span_s": span, "prefill_steps_s": prefill, "decode_steps_s": decode, "gaps_s": gaps,
        "other_steps_s": span - prefill - decode - gaps,
        "decode_steps": len(decode_steps),
        "decode_roofline_share_median": statistics.median(shares) if shares else None,
        "decode_step_ms_batch_ge_128": 1000 * statistics.median([t for t, _, _ in large]) if large else None,
        "decode_roofline_ms_batch_ge_128": 1000 * statistics.median([r for _, r, _ in large]) if large else None,
        "decode_batch_median": statistics.median([step.n_decode for step in decode_steps]) if decode_steps else None,
        "compression_ms_per_step": None if extra is None else 1000 * extra,
        "compression_share": None if extra is None else extra / mean_large,
    }


def compression_text(cell: dict) -> str:
    if cell.get("compression_ms_per_step") is None:
        return "-"
    return f"{cell['compression_ms_per_step']:.2f} ms ({cell['compression_share']:.1%})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("table", help="a published table, bench/peer/*.json")
    parser.add_argument("--rows", default=None, help="row indices to run (default: all)")
    parser.add_argument("--variants", default=None, help="our variants to run (default: all of the table's)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each cell (median; min-max beside)")
    parser.add_argument("--hardware", default="h100-80gb", help="recorded with the runs (the engine measures)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (with --model, --head)")
    parser.add_argument("--model", default=None, help="another preset than the table's (smoke runs)")
    parser.add_argument("--head", type=int, default=None, help="only the first N requests of each row")
    parser.add_argument("--lengths", default=None, help="PROMPT,OUTPUT instead of the table's (smoke runs)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="run each variant also with async scheduling, named VARIANT+async, right after it")
    args = parser.parse_args()
    table = json.loads(Path(args.table).read_text())
    rows = list(range(len(table["rows"]))) if args.rows is None else [int(i) for i in args.rows.split(",")]
    variants = list(table["variants"]) if args.variants is None else args.variants.split(",")
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "peer_tables")
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        bandwidth, device = copy_bandwidth(), torch.cuda.get_device_name()
    else:
        from zipage.hardware import get_hardware

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        bandwidth, device = get_hardware(args.hardware).achievable_bandwidth, "cpu"
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    model = args.model or table["model"]
    results = {"table": table["name"], "source": table["source"], "device": device,
               "copy_bandwidth_tbs": bandwidth / 1e12, "cells": []}
    for index in rows:
        row = table["rows"][index]
        trace = workload(table, row)
        if args.head is not None or args.lengths is not None:
            prompt_len, output_len = (map(int, args.lengths.split(",")) if args.lengths else
                                      (trace.requests[0].prompt_len, trace.requests[0].output_len))
            trace = Trace(trace.name, [replace(request, prompt_len=prompt_len, output_len=output_len)
                                       for request in trace.requests[:args.head]])
        runs = [(name, False) for name in variants]
        if args.async_scheduling:
            runs = [(name, mode) for name in variants for mode in (False, True)]
        for name, async_scheduling in runs:
            variant = table["variants"][name]
            knobs = dict(variant["config"])
            if async_scheduling:
                knobs["async_scheduling"] = True
            max_model_len = row.get("max_model_len", table.get("max_model_len"))
            if max_model_len is not None:
                knobs.setdefault("max_model_len", max_model_len)
            knobs.setdefault("max_num_seqs", len(trace.requests))
            config = ZipageConfig(**knobs)
            # The published pool in tokens at our bf16 bytes a token (the same memory for every
            # variant: Zipage's query slots come out of it, as R-KV's buffers came out of vLLM's).
            pool = row.get("pool_tokens")
            kv_gb = None if pool is None else pool * kv_token_bytes(get_preset(model), "auto", 2) / GIB
            if args.device == "cpu":
                kv_gb = 0.05
            settings = ReplaySettings(model=f"random:{model}", hardware=args.hardware, kv_memory_gb=kv_gb,
                                      config=config)
            samples = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                summary, run = replay_on_engine(trace, settings, args.device)
                wall = time.perf_counter() - started
                samples.append((summary["tps"], summary, run, wall))
                gc.collect()
                torch.cuda.empty_cache()
            samples.sort(key=lambda sample: sample[0])
            tps, summary, run, wall = samples[len(samples) // 2]
            cell = {"row": index, "variant": name + ("+async" if async_scheduling else ""),
                    "against": variant["against"],
                    "pool_tokens": pool, "prompt_len": trace.requests[0].prompt_len,
                    "output_len": trace.requests[0].output_len, "requests": len(trace.requests),
                    "tps": tps, "tps_min": samples[0][0], "tps_max": samples[-1][0],
                    "published": row["published"].get(variant["against"]),
                    "peak_running": summary.get("peak_running"), "preemptions": summary.get("preemptions"),
                    "compressions": summary.get("compressions"), "makespan_s": summary.get("makespan_s"),
                    "tpot_p50_ms": summary.get("tpot_p50_ms"), "wall_s": wall,
                    **breakdown(run, model, bandwidth, config.kv_cache_dtype)}
            results["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            (out / f"peer_{table['name']}.json").write_text(json.dumps(results, indent=1))
            del run, samples
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n{table['name']}: ours ({device}, random {model} bf16) beside the published figures "
          f"({table['published_device']}, {table['published_model']}; {table['source']})")
    print("| row | variant | published | ours tok/s (min-max) | ours / published | peak running | preempt "
          "| prefill / decode / gaps s | decode ms at batch>=128 (roofline) | share | compression a step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in results["cells"]:
        label = (f"pool {cell['pool_tokens'] // 1000}K" if cell["pool_tokens"]
                 else f"{cell['prompt_len']}/{cell['output_len']} x {cell['requests']}")
        published = cell["published"]
        ratio = "-" if not published else f"{cell['tps'] / published:.2f}x"
        step_ms = cell.get("decode_step_ms_batch_ge_128")
        roof_ms = cell.get("decode_roofline_ms_batch_ge_128")
        decode_col = "-" if step_ms is None else f"{step_ms:.2f} ({roof_ms:.2f})"
        share = cell.get("decode_roofline_share_median")
        print(f"| {label} | {cell['variant']} | {published or '-'} {cell['against']} | {cell['tps']:,.0f} "
              f"({cell['tps_min']:,.0f}-{cell['tps_max']:,.0f}) | {ratio} | {cell['peak_running']} "
              f"| {cell['preemptions']} | {cell.get('prefill_steps_s', 0):.1f} / {cell.get('decode_steps_s', 0):.1f} / "
              f"{cell.get('gaps_s', 0):.1f} | {decode_col} | {'-' if share is None else f'{share:.0%}'} "
              f"| {compression_text(cell)} |")


if __name__ == "__main__":
    main()
