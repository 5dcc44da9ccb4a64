"""One long row beside many short ones: the decode kernel's split, measured (issue #46; a GPU script).

The decode grid sizes its partitions from the batch alone (zipage/decode_grid.py): at a batch of ~96 each row
gets one partition, so a row still holding 20k entries (a prompt not yet compressed, beside rows compressed to
~2k) is one program walking all of them. TensorRT-LLM's row 2 with FP8 KV: such decode steps took 35-37 ms
against 12.5-13 ms without the long row (docs/cost_model.md, 'The decode section'). This times one layer of
Llama-3.1-8B's decode attention (32 query / 8 KV heads, head dim 128, block 256) in a CUDA graph
(`triton.testing.do_bench_cudagraph`, the median) for batches with and without a long row, bf16 and FP8, over
the partition count the grid gives (`auto`) and forced counts, the shortest partition (`_MIN_TILES_PER_PARTITION`
tiles) and the split rule (`_DECODE_SPLIT`: "batch" cuts every row alike, "balanced" by its share of the step's
entries), to choose a grid rule: a split that helps the long row must not cost the uniform batch. Each variant's
output is checked against the first variant's of its batch (max abs difference, bf16 tolerance 2e-2).

    . bench/env.sh && python bench/decode_long_row_gpu.py [--cases 95x2k+20k,96x2k,...] [--partitions auto,1,4,16]
        [--min-tiles 2,32] [--splits batch,balanced]

Prints a table last and writes decode_long_row.json under $OUT (or runs/decode_long_row/).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

from zipage.kernels.kv_quant_ref import FP8_DTYPE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_kernel_info_gpu import time_decode  # noqa: E402  (sibling scripts)
from step_profile_gpu import RANDOM_SCALES, random_entries  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 256
# (name, context of each row): the row-2 shape with and without its long row, and small batches of long rows.
BATCHES = {
    "95x2k+20k": [2048] * 95 + [20000],
    "96x2k": [2048] * 96,
    "32x20k": [20000] * 32,
    "16x20k": [20000] * 16,
    # the headline's decode (batch ~120 of ~520 entries) and larger batches: what a wider split costs there
    "128x600": [600] * 128,
    "256x600": [600] * 256,
    "512x600": [600] * 512,
    "512x2k": [2048] * 512,
    # a long row beside a few (the decode section's batches) and two long rows beside many short ones
    "7x2k+20k": [2048] * 7 + [20000],
    "190x1k+2x16k": [1024] * 190 + [16384] * 2,
}


def caches(contexts: list[int], fp8: bool, device) -> dict:
    blocks = [-(-context // BLOCK) for context in contexts]
    width = max(blocks)
    table = torch.zeros(len(contexts), width, dtype=torch.int32, device=device)
    start = 0
    for row, count in enumerate(blocks):
        table[row, :count] = torch.arange(start, start + count, dtype=torch.int32, device=device)
        start += count
    shape = (start, BLOCK, KV_HEADS, HEAD_DIM)
    arguments = dict(context_lens=torch.tensor(contexts, dtype=torch.int32, device=device), block_tables=table)
    arguments |= {name: random_entries(shape, FP8_DTYPE if fp8 else torch.bfloat16, device)
                  for name in ("k_cache", "v_cache")}
    if fp8:
        arguments |= {name: torch.empty(shape[:3], device=device).uniform_(*RANDOM_SCALES)
                      for name in ("k_scale", "v_scale")}
    return arguments


def decode(q: torch.Tensor, cache: dict) -> torch.Tensor:
    from zipage.kernels import attention_triton as kernels

    return kernels.paged_decode_attention_triton(q, cache["k_cache"], cache["v_cache"], cache["context_lens"],
                                                 cache["block_tables"], q.shape[-1] ** -0.5,
                                                 k_scale=cache.get("k_scale"), v_scale=cache.get("v_scale"))


def main() -> None:
    from zipage.kernels import attention_triton as kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(BATCHES), help="batches of BATCHES to time")
    parser.add_argument("--partitions", default="auto,1,4,16")
    parser.add_argument("--min-tiles", default="2,32")
    parser.add_argument("--splits", default="batch")
    args = parser.parse_args()
    device = torch.device("cuda")
    grid_rule, min_tiles_shipped = kernels.decode_num_partitions, kernels._MIN_TILES_PER_PARTITION
    split_shipped = kernels._DECODE_SPLIT
    rows, failures = [], []
    for name, fp8 in itertools.product(args.cases.split(","), (False, True)):
        contexts = BATCHES[name]
        cache = caches(contexts, fp8, device)
        q = torch.randn(len(contexts), HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        first = None
        for split, partitions, min_tiles in itertools.product(args.splits.split(","), args.partitions.split(","),
                                                              [int(t) for t in args.min_tiles.split(",")]):
            kernels.decode_num_partitions = grid_rule if partitions == "auto" else (
                lambda *_, count=int(partitions), **__: count)
            kernels._MIN_TILES_PER_PARTITION, kernels._DECODE_SPLIT = min_tiles, split
            try:
                out = decode(q, cache)
                milliseconds = time_decode(q, cache, rep=30)
                used = kernels.decode_num_partitions(
                    len(contexts), KV_HEADS, torch.cuda.get_device_properties(device).multi_processor_count, fp8)
            finally:
                kernels.decode_num_partitions, kernels._MIN_TILES_PER_PARTITION = grid_rule, min_tiles_shipped
                kernels._DECODE_SPLIT = split_shipped
            first = out if first is None else first
            difference = (out.float() - first.float()).abs().max().item()
            if not difference <= 2e-2:
                failures.append(f"{name} {'fp8' if fp8 else 'bf16'} split={split} P={partitions} m={min_tiles}: "
                                f"max abs difference {difference:.3g}")
            rows.append({"batch": name, "kv": "fp8" if fp8 else "bf16", "split": split, "partitions": partitions,
                         "grid_partitions": used, "min_tiles": min_tiles, "us": milliseconds * 1000,
                         "max_abs_difference": difference})
            print(json.dumps(rows[-1]), flush=True)
        cache = None
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "decode_long_row")
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_long_row.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{torch.cuda.get_device_name()}: one layer (32/8 heads, dim 128, block {BLOCK}), us in a CUDA graph")
    columns = list(dict.fromkeys((row["split"], row["partitions"], row["min_tiles"]) for row in rows))
    print(f"{'batch':<16} {'kv':<5}" + "".join(f"{f'{s[:3]} P={p} m={m}':>17}" for s, p, m in columns))
    for (name, kv), group in itertools.groupby(rows, key=lambda row: (row["batch"], row["kv"])):
        by = {(row["split"], row["partitions"], row["min_tiles"]): row for row in group}
        print(f"{name:<16} {kv:<5}" + "".join(
            f"{by[c]['us']:>12.1f} g{by[c]['grid_partitions']:<3}" if c in by else f"{'':>17}" for c in columns))
    print("CHECK", "PASS" if not failures else "FAIL\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
