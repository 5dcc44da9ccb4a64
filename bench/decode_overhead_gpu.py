"""GPU benchmark: what a decode step costs with compression on and nothing to compress.

Times one whole decode step (`ModelRunner.execute`: inputs, CUDA-graph replay, sampling, tokens on
the host) at each batch of `--context`-token sequences, three ways in one process:

- `full-kv`: compression off (no query cache, no window queries);
- `zipage`: compression on, a budget above the context (so nothing compresses), every sequence
  holding a query slot and writing its window query this step (the worst case: in-block offset
  >= b - w), the shipped Triton `store_queries`;
- `zipage-torch-store` (with `--torch-store`): the same with the window queries written by the
  graph-safe torch formulation the engine used before the Triton kernel (about a dozen small
  kernels a layer instead of one launch), to report the change before/after in one call.

    python bench/decode_overhead_gpu.py --model qwen3-8b --batches 1,4,8,32,128 --torch-store

Prints a table last and writes decode_overhead.json under $OUT (or runs/decode_overhead/).
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
from zipage.core.memory import GIB, kv_token_bytes
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.core.step import DECODE, StepPlan
from zipage.engine import layers
from zipage.engine.builder import build_engine
from zipage.presets import get_preset


def torch_store_queries(query: torch.Tensor, query_cache: torch.Tensor, query_slot_mapping: torch.Tensor) -> None:
    """The engine's window-query store before the Triton kernel (graph-safe torch: every row written,
    dropped rows sent to the first kept row's index with its value)."""
    flat = query_cache.view(-1, *query_cache.shape[2:])
    keep = query_slot_mapping >= 0
    anchor = torch.argmax(keep.int()).view(1)
    anchor_index = query_slot_mapping.index_select(0, anchor).clamp(min=0)
    anchor_value = torch.where(keep.index_select(0, anchor)[:, None, None],
                               query.index_select(0, anchor).to(flat.dtype),
                               flat.index_select(0, anchor_index))
    indices = torch.where(keep, query_slot_mapping, anchor_index)
    values = torch.where(keep[:, None, None], query.to(flat.dtype), anchor_value)
    flat.index_copy_(0, indices, values)


def decode_plan(engine, manager, batch: int, context: int, compress: bool) -> tuple[StepPlan, dict]:
    """A decode step of `batch` sequences of `context` KV entries each (blocks from `manager`),
    and each one's last token: what `ModelRunner.execute` takes."""
    block_size = engine.config.block_size
    blocks_each = -(-(context + 1) // block_size)
    slots = engine.capacity.num_query_slots
    greedy = SamplingParams(temperature=0.0)
    sequences, tokens = [], {}
    for index in range(batch):
        seq = Sequence(f"s{index}", None, 16, prompt_len=context - 1, sampling=greedy)
        seq.block_table = [manager.allocate() for _ in range(blocks_each)]
        seq.set_counters(context - 1, 1)
        seq.query_slot = index % slots if compress else None
        sequences.append(seq)
        tokens[seq.seq_id] = [index % engine.shape.vocab_size]
    return StepPlan(step_id=0, kind=DECODE, decode=sequences), tokens


def time_decode(model: str, variant: str, batches: list[int], context: int, block_size: int,
                iterations: int) -> list[dict]:
    shape = get_preset(model)
    compress = variant != "full-kv"
    blocks_each = -(-(context + 1) // block_size)
    budget = (blocks_each + 1) * block_size  # above the context: nothing would compress
    largest = max(batches)
    kv_per_token = kv_token_bytes(shape, "auto", 2)
    kv_gb = largest * (blocks_each + 3) * block_size * kv_per_token * 1.05 / GIB + 1
    config = ZipageConfig(compress=compress, block_size=block_size, kv_budget=budget, max_num_seqs=largest,
                          max_model_len=budget + block_size)
    settings = ReplaySettings(model=f"random:{model}", dtype="bfloat16", kv_memory_gb=kv_gb, config=config)
    saved = layers.store_queries
    if variant == "zipage-torch-store":
        layers.store_queries = torch_store_queries  # before the build: the graphs capture it
    try:
        engine = build_engine(settings, "cuda", cuda_graphs=True)
    finally:
        layers.store_queries = saved
    runner, manager = engine.runner, engine.new_scheduler().block_manager
    slots = engine.capacity.num_query_slots
    rows = []
    try:
        for batch in batches:
            plan, tokens = decode_plan(engine, manager, batch, context, compress)
            sequences = plan.decode
            for _ in range(3):
                runner.execute(plan, tokens)
            torch.cuda.synchronize()
            samples = []
            for _ in range(3):  # three timed rounds: the spread goes beside the median
                started = time.perf_counter()
                for _ in range(iterations):
                    runner.execute(plan, tokens)
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - started) / iterations * 1000)
            samples.sort()
            row = {"model": model, "variant": variant, "batch": batch, "context": context,
                   "step_ms": samples[1], "min_ms": samples[0], "max_ms": samples[2], "query_slots": slots}
            rows.append(row)
            print(json.dumps(row), flush=True)
            for seq in sequences:
                manager.release_all(seq.block_table)
    finally:
        engine.close()
        del engine, runner
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--batches", default="1,4,8,32,128")
    parser.add_argument("--context", type=int, default=2047,
                        help="KV entries before the step; 2047 with block 64 writes a window query")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--torch-store", action="store_true", help="also time the old torch query store")
    args = parser.parse_args()
    batches = [int(batch) for batch in args.batches.split(",")]
    variants = ["full-kv", "zipage"] + (["zipage-torch-store"] if args.torch_store else [])
    rows = []
    for variant in variants:
        rows += time_decode(args.model, variant, batches, args.context, args.block_size, args.iterations)
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "decode_overhead")
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_overhead.json").write_text(json.dumps(rows, indent=1))
    by_key = {(row["variant"], row["batch"]): row for row in rows}
    print(f"\n{args.model}, context {args.context}, block {args.block_size}: decode step ms (median of 3 rounds "
          f"of {args.iterations}; min-max), and vs full-kv")
    print("| batch | " + " | ".join(variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for batch in batches:
        base = by_key[("full-kv", batch)]["step_ms"]
        cells = []
        for variant in variants:
            row = by_key[(variant, batch)]
            cells.append(f"{row['step_ms']:.2f} ({row['min_ms']:.2f}-{row['max_ms']:.2f}) "
                         f"{row['step_ms'] / base:.3f}x")
        print(f"| {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
