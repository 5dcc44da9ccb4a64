"""FP8 KV cache on a GPU (issue #34): kernel checks, the decode step against its halved-byte roofline, and the
headline trace with Full KV / Zipage in bf16 and fp8.

Three parts, in this order (each writes its results under $OUT, or runs/fp8_gpu without it):

1. **Checks** (`checks.json`): on CUDA tensors, every FP8 kernel against its pure-torch reference in bfloat16
   (the interpreter tests cover float32/float16 on the CPU): store_kv (dequantized values within one e4m3 step of
   the reference's, scales to float32 rounding), paged prefill (gather / block / descriptor loads) and split-K
   decode (2e-2, the bfloat16 tolerance of bench/check_attention_gpu.py), and the compression pipeline (final
   scores 1e-5, kept sets equal up to ties, compaction bytes and scales equal to the reference compaction of the
   Triton kept sets). A failed check is reported and the timings still run.
2. **Decode roofline** (`decode.json`): one layer of Qwen3-8B's decode attention (32 query heads, 8 KV heads,
   head dim 128, block 64) at batch 32 / 128 / 256 with 4,096 cached entries each, bf16 and fp8 caches; the
   bytes each reads (K and V, plus the fp8 scales) over the time, against the GPU's measured copy bandwidth.
   **Store** (`store.json`, only when asked: `--parts store`): one layer's store_kv at fp8 with the shipped scale
   search and with one candidate, against bf16, for 128 and 2,048 tokens.
3. **Headline** (`headline.json`): `zipage replay --gpu` of the AMC23-shaped trace of bench/headline_gpu.py
   (qwen3-8b random weights, 6 GB of KV memory, block 64, budget 512) for Full KV bf16, Full KV fp8, Zipage
   bf16, Zipage fp8.

    python bench/fp8_gpu.py                  # everything (about 8-10 minutes on an H200)
    python bench/fp8_gpu.py --parts checks,decode
    python bench/fp8_gpu.py --parts checks,store,headline --variants zipage-fp8   # the store's scale search
    python bench/fp8_gpu.py --parts headline --variants zipage-fp8 --store-search 1   # ... and without it
    python bench/fp8_gpu.py --variants full-kv-fp8,zipage-fp8 --questions 8

The last thing printed is a short table of all three parts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch

BATCHES = (32, 128, 256)
CONTEXT = 4096
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 64
VARIANTS = {
    "full-kv-bf16": dict(compress=False),
    "full-kv-fp8": dict(compress=False, kv_cache_dtype="fp8"),
    "zipage-bf16": dict(),
    "zipage-fp8": dict(kv_cache_dtype="fp8"),
}


def out_dir() -> Path:
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "fp8_gpu")
    out.mkdir(parents=True, exist_ok=True)
    return out


# --------------------------------------------------------------------------- 1. checks


def _paged(context_lens, block_size, generator, device):
    from zipage.kernels.kv_quant_ref import quantize_kv

    blocks_each = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_each) + 2
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    keys = torch.randn(shape, generator=generator, device=device) * (1 + 20 * (torch.arange(HEAD_DIM, device=device)
                                                                           == 3))
    values = torch.randn(shape, generator=generator, device=device)
    k8, k_scale = quantize_kv(keys)
    v8, v_scale = quantize_kv(values)
    order = torch.randperm(num_blocks, generator=generator, device=device).to(torch.int32)
    table = torch.full((len(context_lens), max(blocks_each)), -1, dtype=torch.int32, device=device)
    start = 0
    for row, count in enumerate(blocks_each):
        table[row, :count] = order[start:start + count]
        start += count
    return k8, v8, k_scale, v_scale, table


def check_attention(device) -> dict:
    from zipage.kernels import attention_triton as triton_kernels
    from zipage.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref, store_kv_ref
    from zipage.kernels.kv_quant_ref import FP8_DTYPE, dequantize_kv

    results = {}
    generator = torch.Generator(device).manual_seed(0)
    # store_kv
    key = torch.randn(300, KV_HEADS, HEAD_DIM, generator=generator, device=device).to(torch.bfloat16)
    value = torch.randn(300, KV_HEADS, HEAD_DIM, generator=generator, device=device).to(torch.bfloat16) * 1e-3
    slots = torch.randperm(40 * BLOCK, generator=generator, device=device)[:300]
    caches = [torch.zeros(40, BLOCK, KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE, device=device) for _ in range(2)]
    caches += [torch.ones(40, BLOCK, KV_HEADS, device=device) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    store_kv_ref(key, value, expected[0], expected[1], slots, k_scale=expected[2], v_scale=expected[3])
    triton_kernels.store_kv_triton(key, value, caches[0], caches[1], slots, k_scale=caches[2], v_scale=caches[3])
    worst = 0.0
    for index in (0, 1):
        got, want = dequantize_kv(caches[index], caches[2 + index]), dequantize_kv(expected[index],
                                                                                    expected[2 + index])
        step = torch.maximum(2.0**-3 * want.abs(), 2.0**-9 * caches[2 + index][..., None])
        worst = max(worst, float(((got - want).abs() / step).max()))
        torch.testing.assert_close(caches[2 + index], expected[2 + index], rtol=1e-6, atol=0.0)
    same_bytes = float((caches[0].view(torch.uint8) == expected[0].view(torch.uint8)).float().mean())
    results["store_kv"] = {"ok": worst <= 1.0, "worst_in_e4m3_steps": worst, "identical_bytes": same_bytes}
    # prefill and decode
    lengths = [700, 1500, 64, 3]
    q_lens = [200, 1500, 1, 3]
    shipped = (triton_kernels._PREFILL_FP8_KEYS, triton_kernels._PREFILL_FP8_VALUES)
    # Each load with the shipped widening of FP8 keys and values and the "queries" / "weights" one before it
    # (kernels/attention_triton.py `_PREFILL_FP8_KEYS`, `_PREFILL_FP8_VALUES`), over blocks of BLOCK and, for the
    # loads that read a tile inside one block, of twice the FP8 tile (`_PREFILL_FP8_KV_TILE`: BLOCK gathers it).
    for kv_load, block in (("gather", BLOCK), ("block", BLOCK), ("descriptor", BLOCK),
                           ("block", 2 * triton_kernels._PREFILL_FP8_KV_TILE),
                           ("descriptor", 2 * triton_kernels._PREFILL_FP8_KV_TILE)):
        for keys, values in dict.fromkeys((shipped, ("queries", "weights"))):
            triton_kernels._PREFILL_KV_LOAD = kv_load
            triton_kernels._PREFILL_FP8_KEYS, triton_kernels._PREFILL_FP8_VALUES = keys, values
            k8, v8, k_scale, v_scale, table = _paged(lengths, block, generator, device)
            q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=generator, device=device).to(torch.bfloat16)
            cu = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
            context = torch.tensor(lengths, dtype=torch.int32, device=device)
            arguments = (q, k8, v8, cu, context, table, HEAD_DIM ** -0.5)
            scales = dict(k_scale=k_scale, v_scale=v_scale)
            got = triton_kernels.paged_prefill_attention_triton(*arguments, max(q_lens), **scales)
            want = paged_prefill_attention_ref(*arguments, **scales)
            error = float((got.float() - want.float()).abs().max())
            name = (f"prefill_{kv_load}" + ("" if block == BLOCK else f"_b{block}")
                    + ("" if (keys, values) == shipped else f"_{keys}_{values}"))
            results[name] = {"ok": error <= 2e-2, "max_abs_error": error}
    triton_kernels._PREFILL_KV_LOAD = "descriptor"
    triton_kernels._PREFILL_FP8_KEYS, triton_kernels._PREFILL_FP8_VALUES = shipped
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=generator, device=device).to(torch.bfloat16)
    arguments = (q, k8, v8, context, table, HEAD_DIM ** -0.5)
    for partition_size in (None, 64):
        got = triton_kernels.paged_decode_attention_triton(*arguments, partition_size=partition_size, **scales)
        want = paged_decode_attention_ref(*arguments, **scales)
        error = float((got.float() - want.float()).abs().max())
        results[f"decode_partition_{partition_size or 'auto'}"] = {"ok": error <= 2e-2, "max_abs_error": error}
    return results


def check_compression(device) -> dict:
    from zipage.kernels import compress_triton as triton_kernels
    from zipage.kernels.compress import CompressionInputs
    from zipage.kernels.compress_ref import CompressionParams, compress_ref, final_scores, kept_entries
    from zipage.kernels.kv_quant_ref import dequantize_kv, quantize_kv

    generator = torch.Generator(device).manual_seed(1)
    layers, blocks, window = 2, 40, 16
    shape = (layers, blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k8, k_scale = quantize_kv(torch.randn(shape, generator=generator, device=device))
    v8, v_scale = quantize_kv(torch.randn(shape, generator=generator, device=device))
    sources = torch.randperm(blocks, generator=generator, device=device)[:24].to(torch.int32).view(3, 8)
    batch = CompressionInputs(
        k_cache=k8, v_cache=v8, k_scale=k_scale, v_scale=v_scale,
        score_cache=(0.01 * torch.rand(shape[:4], generator=generator, device=device)).to(torch.bfloat16),
        query_cache=torch.randn(layers, 4, window, HEADS, HEAD_DIM, generator=generator,
                                device=device).to(torch.bfloat16),
        source_tables=sources, num_source_blocks=torch.full((3,), 8, dtype=torch.int32, device=device),
        target_tables=sources[:, :7].contiguous(), query_slots=torch.tensor([0, 2, 3], device=device),
        is_compressed=torch.tensor([True, False, True], device=device))
    params = CompressionParams(block_size=BLOCK, window=window)
    scale = HEAD_DIM ** -0.5
    final, _ = triton_kernels.compression_scores_triton(
        batch.k_cache, batch.score_cache, batch.query_cache, batch.source_tables, batch.num_source_blocks,
        batch.query_slots, batch.is_compressed, params, scale, batch.k_scale)
    worst, kept_equal = 0.0, True
    for layer in range(layers):
        for request in range(3):
            source = sources[request].long()
            keys = dequantize_kv(k8[layer, source].flatten(0, 1), k_scale[layer, source].flatten(0, 1))
            previous = batch.score_cache[layer, source].flatten(0, 1).transpose(0, 1)
            want, _ = final_scores(keys, batch.query_cache[layer, int(batch.query_slots[request])], previous,
                                   bool(batch.is_compressed[request]), params, scale)
            got = final[layer, request]
            finite = torch.isfinite(want)
            worst = max(worst, float((got[finite] - want[finite]).abs().max()))
            keep = 7 * BLOCK
            kept_equal &= bool(torch.equal(kept_entries(got, keep), kept_entries(want, keep)))
    result, reference = batch.clone(), batch.clone()
    triton_kernels.compress_triton(*result.arguments(params, scale), **result.keywords())
    compress_ref(*reference.arguments(params, scale), **reference.keywords())
    same = all(torch.equal(getattr(result, name).view(torch.uint8), getattr(reference, name).view(torch.uint8))
               for name in ("k_cache", "v_cache", "k_scale", "v_scale"))
    # Kept sets may differ only at near-ties of the k-th score; then the caches differ where they do.
    return {"compression": {"ok": worst <= 1e-5 and (same or not kept_equal), "final_score_max_error": worst,
                            "kept_sets_equal": kept_equal, "caches_equal_reference": same}}


# --------------------------------------------------------------------------- 2. decode roofline


def copy_bandwidth(device) -> float:
    import triton

    source = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    milliseconds = triton.testing.do_bench(lambda: target.copy_(source), warmup=5, rep=50, return_mode="median")
    return 2 * source.numel() / (milliseconds * 1e-3)


def time_decode(device) -> list[dict]:
    import triton

    from zipage.kernels import attention_triton as triton_kernels
    from zipage.kernels.kv_quant_ref import FP8_DTYPE

    bandwidth = copy_bandwidth(device)
    rows = []
    for batch in BATCHES:
        blocks_each = CONTEXT // BLOCK
        num_blocks = batch * blocks_each
        table = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_each)
        context = torch.full((batch,), CONTEXT, dtype=torch.int32, device=device)
        q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        for kv in ("bf16", "fp8"):
            shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
            if kv == "bf16":
                k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
                v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
                scales, entry_bytes = {}, HEAD_DIM * 2
            else:
                k_cache = torch.randn(shape, device=device).to(FP8_DTYPE)
                v_cache = torch.randn(shape, device=device).to(FP8_DTYPE)
                scales = dict(k_scale=torch.rand(shape[:3], device=device),
                              v_scale=torch.rand(shape[:3], device=device))
                entry_bytes = HEAD_DIM + 4

            def step(k_cache=k_cache, v_cache=v_cache, scales=scales):
                return triton_kernels.paged_decode_attention_triton(q, k_cache, v_cache, context, table,
                                                                    HEAD_DIM ** -0.5, **scales)

            milliseconds = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
            read = batch * CONTEXT * KV_HEADS * 2 * entry_bytes
            rows.append({"batch": batch, "kv": kv, "time_us": milliseconds * 1e3, "bytes": read,
                         "roofline_us": read / bandwidth * 1e6, "copy_gb_s": bandwidth / 1e9,
                         "share_of_roofline": read / bandwidth / (milliseconds * 1e-3)})
            print("decode", json.dumps(rows[-1]), flush=True)
            del k_cache, v_cache, scales
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- 3. headline


def headline(args) -> dict:
    from zipage.config import ZipageConfig
    from zipage.core.deployment import ReplaySettings
    from zipage.engine.replay import replay_on_engine
    from zipage.workloads import make_trace

    trace = make_trace("amc23", 0, num_questions=args.questions, samples_per_question=args.samples,
                       max_output_len=args.max_output)
    report = {"requests": len(trace.requests), "output_tokens": sum(r.output_len for r in trace.requests)}
    for name in args.variants.split(","):
        config = ZipageConfig(block_size=BLOCK, window=16, kv_budget=512, **VARIANTS[name])
        settings = ReplaySettings(model="random:qwen3-8b", hardware="h200-141gb", kv_memory_gb=6.0, config=config)
        started = time.perf_counter()
        summary, _ = replay_on_engine(trace, settings, "cuda")
        report[name] = {key: summary.get(key) for key in ("tps", "makespan_s", "num_blocks", "max_concurrency",
                                                          "peak_running", "preemptions", "compressions",
                                                          "tpot_p50_ms", "ttft_p50_s")}
        report[name]["wall_s"] = time.perf_counter() - started
        try:
            from zipage.sim.simulate import simulate

            report[name]["simulated_tps"] = simulate(trace, settings)[0]["tps"]
        except ImportError as error:
            report[name]["simulated_tps"] = f"unavailable: {error}"
        print(name, json.dumps(report[name]), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return report


def time_store(device) -> list[dict]:
    """One layer's store_kv at fp8 (Qwen3-8B's 8 KV heads x 128) for a decode batch and a prefill chunk, with the
    shipped scale search and with one candidate (amax / 448 alone, the search's cost left out), against bf16."""
    import triton

    from zipage.kernels import attention_triton as triton_kernels
    from zipage.kernels.kv_quant_ref import FP8_DTYPE, SCALE_SEARCH_SIZE

    rows = []
    for tokens in (128, 2048):
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        value = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        slots = torch.randperm(tokens * 2, device=device)[:tokens]
        num_blocks = -(-tokens * 2 // BLOCK)
        variants = {"bf16": None, "fp8, 1 candidate": 1, f"fp8, {SCALE_SEARCH_SIZE} candidates": SCALE_SEARCH_SIZE}
        for name, search in variants.items():
            dtype = torch.bfloat16 if search is None else FP8_DTYPE
            caches = [torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in (0, 1)]
            scales = {} if search is None else dict(k_scale=torch.ones(num_blocks, BLOCK, KV_HEADS, device=device),
                                                    v_scale=torch.ones(num_blocks, BLOCK, KV_HEADS, device=device))
            triton_kernels.SCALE_SEARCH_SIZE = search or SCALE_SEARCH_SIZE
            try:
                milliseconds = triton.testing.do_bench(
                    lambda: triton_kernels.store_kv_triton(key, value, *caches, slots, **scales),
                    warmup=25, rep=200, return_mode="median")
            finally:
                triton_kernels.SCALE_SEARCH_SIZE = SCALE_SEARCH_SIZE
            rows.append({"tokens": tokens, "variant": name, "time_us": milliseconds * 1e3})
            print("store", json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="checks,decode,headline")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=4096)
    parser.add_argument("--store-search", type=int, default=None, metavar="N",
                        help="the fp8 store's scale search over its first N candidates only (1: amax / 448 alone, "
                             "the scale before the search), to time the search's cost in the headline")
    args = parser.parse_args()
    if args.store_search is not None:
        from zipage.kernels import attention_triton

        attention_triton.SCALE_SEARCH_SIZE = args.store_search
    device = torch.device("cuda")
    out = out_dir()
    parts = args.parts.split(",")
    report: dict = {"device": torch.cuda.get_device_name(device)}
    if "checks" in parts:
        checks = {}
        for function in (check_attention, check_compression):
            try:
                checks |= function(device)
            except Exception:  # report and go on: the timings are still worth having
                checks[function.__name__] = {"ok": False, "error": traceback.format_exc()}
        report["checks"] = checks
        (out / "checks.json").write_text(json.dumps(checks, indent=2))
    if "decode" in parts:
        report["decode"] = time_decode(device)
        (out / "decode.json").write_text(json.dumps(report["decode"], indent=2))
    if "store" in parts:
        report["store"] = time_store(device)
        (out / "store.json").write_text(json.dumps(report["store"], indent=2))
    if "headline" in parts:
        report["headline"] = headline(args)
        (out / "headline.json").write_text(json.dumps(report["headline"], indent=2))
    (out / "fp8_gpu.json").write_text(json.dumps(report, indent=2))

    print(f"\n{report['device']}")
    for name, check in report.get("checks", {}).items():
        detail = {key: value for key, value in check.items() if key not in ("ok", "error")}
        print(f"check {name:<24} {'ok' if check['ok'] else 'FAILED'} {detail if check['ok'] else check}")
    if report.get("decode"):
        print(f"\n{'batch':>5} {'kv':>4} {'us':>9} {'roofline us':>12} {'of roofline':>12} {'fp8 / bf16':>11}")
        bf16 = {row["batch"]: row["time_us"] for row in report["decode"] if row["kv"] == "bf16"}
        for row in report["decode"]:
            ratio = f"{row['time_us'] / bf16[row['batch']]:.2f}x" if row["kv"] == "fp8" else ""
            print(f"{row['batch']:>5} {row['kv']:>4} {row['time_us']:>9.1f} {row['roofline_us']:>12.1f} "
                  f"{row['share_of_roofline']:>11.0%} {ratio:>11}")
    for row in report.get("store", []):
        print(f"store {row['tokens']:>5} tokens  {row['variant']:<18} {row['time_us']:>8.1f} us")
    if report.get("headline"):
        print(f"\n{'variant':<14} {'tok/s':>9} {'blocks':>7} {'slots':>6} {'peak run':>9} {'preempt':>8} "
              f"{'TPOT p50 ms':>12} {'sim tok/s':>10}")
        for name in args.variants.split(","):
            row = report["headline"][name]
            simulated = row["simulated_tps"]
            simulated = f"{simulated:10.1f}" if isinstance(simulated, float) else "         -"
            slots = row["max_concurrency"] if row["max_concurrency"] is not None else "-"  # Full KV
            print(f"{name:<14} {row['tps']:>9.1f} {row['num_blocks']:>7} {slots:>6} "
                  f"{row['peak_running']:>9} {row['preemptions']:>8} {row['tpot_p50_ms'] or 0:>12.1f} {simulated}")


if __name__ == "__main__":
    main()
