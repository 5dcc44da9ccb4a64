"""The split-K decode kernel with an FP8 KV cache against its halved-byte roofline (issue #34), per variant.

The variants are the launch-time knobs of kernels/attention_triton.py: `_DECODE_KV_LOAD` (gather / block),
`_DECODE_FP8_KV_TILE` (64 / 128 tokens a tile) and `_DECODE_FP8_VALUES` (weights / f16-asm); the others (keys,
warps, stages, register cap) stay as shipped. The shipped launch was chosen inside the engine's decode step
(`bench/step_profile_gpu.py --fp8-variants`), whose bf16 figures this per-call bench did not reproduce
(docs/BENCHMARKS.md, 'FP8 KV cache'). On a GPU:

1. every variant against the pure-torch reference (bfloat16 queries, random fp8 K/V with an outlier channel
   and per-entry scales spread over four decades; the worst error within 2e-2 of the largest output, the
   bfloat16 tolerance of bench/fp8_gpu.py);
2. one layer of Qwen3-8B's decode attention (32 query / 8 KV heads, head dim 128, block 64) at batch
   32 / 128 / 256, with the contexts of the headline trace: 576 entries (Zipage, budget 512 plus one block)
   and 4,096 (Full KV); bf16 and every fp8 variant. Bytes: K and V, the fp8 scales (4 bytes per entry, head
   and K or V), the queries read and the outputs written. "of roofline": those bytes at the HBM's 4.8 TB/s
   over the time (the measured copy bandwidth is printed beside it);
3. a table last; everything also goes to $OUT/fp8_decode.json and $OUT/fp8_decode.log.

    python bench/fp8_decode_gpu.py          # about a minute on an H200
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 64
BATCHES = (32, 128, 256)
CONTEXTS = {"zipage-576": 576, "full-kv-4096": 4096}
HBM_BYTES_PER_S = 4.8e12  # H200
TOLERANCE = 2e-2
# (name, cache dtype, _DECODE_KV_LOAD, _DECODE_FP8_KV_TILE, _DECODE_FP8_VALUES).
VARIANTS = [("bf16", "bf16", "gather", 64, "weights"), ("bf16 block", "bf16", "block", 64, "weights")]
VARIANTS += [(f"fp8 {load} t{tile} {values}", "fp8", load, tile, values)
             for values, load, tile in itertools.product(("weights", "f16-asm"), ("gather", "block"), (64, 128))
             if not (load == "block" and tile > BLOCK)]  # a tile of 128 spans two blocks of 64: "gather" only


@contextlib.contextmanager
def variant(kernels, load: str, tile: int, values: str):
    saved = kernels._DECODE_KV_LOAD, kernels._DECODE_FP8_KV_TILE, kernels._DECODE_FP8_VALUES
    kernels._DECODE_KV_LOAD, kernels._DECODE_FP8_KV_TILE, kernels._DECODE_FP8_VALUES = load, tile, values
    try:
        yield
    finally:
        kernels._DECODE_KV_LOAD, kernels._DECODE_FP8_KV_TILE, kernels._DECODE_FP8_VALUES = saved


def paged_cache(batch: int, context: int, kv: str, device, generator) -> dict:
    """Random K/V of `batch` sequences of `context` entries in shuffled blocks; fp8 with per-entry scales."""
    from zipage.kernels.kv_quant_ref import quantize_kv

    blocks_each = -(-context // BLOCK)
    num_blocks = batch * blocks_each
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    table = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32).view(batch, blocks_each)
    arguments = dict(context_lens=torch.full((batch,), context, dtype=torch.int32, device=device), block_tables=table)
    outlier = 1 + 20 * (torch.arange(HEAD_DIM, device=device) == 3)
    spread = torch.logspace(-2, 2, BLOCK, device=device)[None, :, None, None]
    keys = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * outlier
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * spread
    if kv == "bf16":
        return arguments | dict(k_cache=keys, v_cache=values)
    (k8, k_scale), (v8, v_scale) = quantize_kv(keys), quantize_kv(values)
    return arguments | dict(k_cache=k8, v_cache=v8, k_scale=k_scale, v_scale=v_scale)


def decode(kernels, q, cache: dict, partition_size=None):
    scales = {name: cache[name] for name in ("k_scale", "v_scale") if name in cache}
    return kernels.paged_decode_attention_triton(q, cache["k_cache"], cache["v_cache"], cache["context_lens"],
                                                 cache["block_tables"], HEAD_DIM ** -0.5,
                                                 partition_size=partition_size, **scales)


def check(kernels, device, log) -> dict:
    from zipage.kernels.attention_ref import paged_decode_attention_ref

    generator = torch.Generator(device).manual_seed(0)
    results = {}
    for kv in ("bf16", "fp8"):
        cache = paged_cache(6, 700, kv, device, generator)
        cache["context_lens"] = torch.tensor([700, 513, 64, 65, 1, 0], dtype=torch.int32, device=device)
        q = torch.randn(6, HEADS, HEAD_DIM, generator=generator, device=device, dtype=torch.bfloat16)
        scales = {name: cache[name] for name in ("k_scale", "v_scale") if name in cache}
        want = paged_decode_attention_ref(q, cache["k_cache"], cache["v_cache"], cache["context_lens"],
                                          cache["block_tables"], HEAD_DIM ** -0.5, **scales).float()
        for name, cache_kv, load, tile, values in VARIANTS:
            if cache_kv != kv:
                continue
            with variant(kernels, load, tile, values):
                # Relative to the largest output: the values' scales span four decades.
                errors = [float((decode(kernels, q, cache, size).float() - want).abs().max() / want.abs().max())
                          for size in (None, 128)]  # the batch's own split, and a forced merge
            results[name] = {"ok": max(errors) <= TOLERANCE and bool(torch.isfinite(torch.tensor(errors)).all()),
                             "max_error_vs_largest_output": max(errors)}
            log(f"check {name:<24} {'ok' if results[name]['ok'] else 'FAILED'} {max(errors):.2e}")
    return results


def copy_bandwidth(device) -> float:
    import triton

    source = torch.empty(1024**3, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    milliseconds = triton.testing.do_bench(lambda: target.copy_(source), warmup=5, rep=50, return_mode="median")
    return 2 * source.numel() / (milliseconds * 1e-3)


def time_all(kernels, device, log) -> list[dict]:
    import triton

    generator = torch.Generator(device).manual_seed(1)
    rows = []
    for (context_name, context), batch in itertools.product(CONTEXTS.items(), BATCHES):
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator, device=device, dtype=torch.bfloat16)
        io_bytes = 2 * q.numel() * q.element_size()  # queries read, outputs written
        for kv in ("bf16", "fp8"):
            cache = paged_cache(batch, context, kv, device, generator)
            entry_bytes = HEAD_DIM * 2 if kv == "bf16" else HEAD_DIM + 4  # fp8 values + a float32 scale
            read = batch * context * KV_HEADS * 2 * entry_bytes + io_bytes
            for name, cache_kv, load, tile, values in VARIANTS:
                if cache_kv != kv:
                    continue
                with variant(kernels, load, tile, values):
                    step = functools.partial(decode, kernels, q, cache)
                    milliseconds = triton.testing.do_bench(step, warmup=10, rep=60, return_mode="median")
                rows.append({"context": context_name, "batch": batch, "variant": name, "time_us": milliseconds * 1e3,
                             "bytes": read, "achieved_gb_s": read / milliseconds / 1e6,
                             "of_roofline": read / HBM_BYTES_PER_S / (milliseconds * 1e-3)})
                log(json.dumps(rows[-1]))
            del cache
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], checks: dict) -> str:
    bf16 = {(row["context"], row["batch"]): row["time_us"] for row in rows if row["variant"] == "bf16"}
    lines = [f"{'context':<13} {'batch':>5} {'variant':<24} {'us':>8} {'GB/s':>7} {'of 4.8 TB/s':>11} "
             f"{'vs bf16':>8} check"]
    for row in rows:
        key = (row["context"], row["batch"])
        ok = checks.get(row["variant"], {}).get("ok")
        lines.append(f"{row['context']:<13} {row['batch']:>5} {row['variant']:<24} {row['time_us']:>8.1f} "
                     f"{row['achieved_gb_s']:>7.0f} {row['of_roofline']:>11.0%} "
                     f"{row['time_us'] / bf16[key]:>7.2f}x {'ok' if ok else 'FAILED'}")
    return "\n".join(lines)


def main() -> None:
    from zipage.kernels import attention_triton as kernels

    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "fp8_decode_gpu")
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "fp8_decode.log").open("w")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")

    device = torch.device("cuda")
    started = time.perf_counter()
    report = {"device": torch.cuda.get_device_name(device), "copy_gb_s": copy_bandwidth(device) / 1e9}
    log(f"{report['device']}: copy bandwidth {report['copy_gb_s']:.0f} GB/s")
    report["checks"] = check(kernels, device, log)
    report["timings"] = time_all(kernels, device, log)
    report["wall_s"] = time.perf_counter() - started
    (out / "fp8_decode.json").write_text(json.dumps(report, indent=1))
    log(f"\n{report['device']}, {report['wall_s']:.0f} s; measured copy {report['copy_gb_s']:.0f} GB/s")
    log(table(report["timings"], report["checks"]))
    log_file.close()
    sys.exit(0 if all(check["ok"] for check in report["checks"].values()) else 1)


if __name__ == "__main__":
    main()
