"""GPU benchmark: where one decode step's time goes, kernel by kernel, against its roofline.

For each model preset (random weights, Full KV) and batch of `--context`-token sequences, times a
whole decode step (`ModelRunner.execute`: inputs, CUDA-graph replay, sampling, tokens on the host;
the plan of bench/decode_overhead_gpu.py), then records `--iterations` steps under torch.profiler
and sums the GPU kernels' time by kind (decode attention, GEMMs, fused norm/activation/RoPE, KV
store, sampling, copies, other). The step minus its kernels is time the GPU waited on the host.
The roofline is (weight bytes + KV bytes read, fp8's scales counted) / measured copy bandwidth; the compute-aware
one takes the weights' part as max(weight bytes / copy bandwidth, GEMM FLOPs / measured matmul
rate), since at batch 256 a 7-8B model's GEMMs are bound by the matmul rate on an H200.

The caches hold random entries (`--fill random`, the default): an engine's caches hold its model's
keys and values, not the zeros the engine allocates (`--fill zeros`; on an H200 both read alike,
2026-12-01). `--fp8-variants` times the FP8 decode kernel's launch variants (tokens a tile / values /
keys / warps / stages / register cap, the `_DECODE_FP8_*` knobs of kernels/attention_triton.py) and
the FP8 store's (`store=SEARCH:HEADS:WARPS`, one row of `_STORE_FP8_LAUNCHES`), each in an engine of its own
(the CUDA graphs capture the launch).

With `--async-scheduling` each step is also timed launched as the async engine loop runs it
(`ModelRunner.launch` of step N+1 before waiting for step N's tokens): the host's part hidden
behind the device's, the same runner, one call.

    python bench/step_profile_gpu.py --models qwen2.5-7b,qwen3-8b,llama-3.1-8b --batches 128,256 --context 1212

Prints a table last and writes step_profile.json under $OUT (or runs/step_profile/).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.memory import GIB, kv_token_bytes, weight_bytes
from zipage.engine.builder import build_engine
from zipage.kernels.kv_quant_ref import FP8_DTYPE, FP8_MAX
from zipage.presets import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_overhead_gpu import decode_plan  # noqa: E402  (a sibling script, not a package)
from engine_gpu import copy_bandwidth  # noqa: E402
from prefill_gpu import matmul_flops  # noqa: E402

# Kernel name fragments -> kind, first match wins (Triton kernels carry their Python names).
KINDS = (
    ("attention", ("decode", "attention", "attn", "merge_partitions")),
    ("kv store", ("store_kv", "store_queries")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "matmul", "splitk")),
    ("norm/act/rope", ("rms", "norm", "silu", "rope", "rotary", "fused")),
    ("sampling", ("argmax", "softmax", "exponential", "topk", "sort", "reduce")),
    ("copy", ("memcpy", "memset", "copy", "fill", "index")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def timed(run_steps, iterations: int) -> float:
    """ms a step of `run_steps(iterations)`, the median of three rounds."""
    samples = []
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run_steps(iterations)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) / iterations * 1000)
    return sorted(samples)[1]


def executed_steps(runner, plan, tokens):
    """`iterations` steps as the synchronous loop runs them, each waited for."""
    def run(iterations: int) -> None:
        for _ in range(iterations):
            runner.execute(plan, tokens)
    return run


def launched_steps(runner, plan, tokens):
    """`iterations` steps as the async loop runs them: launch one, then take the tokens of the
    one before (the launch queued behind it on the device)."""
    def run(iterations: int) -> None:
        previous = None
        for _ in range(iterations):
            launched = runner.launch(plan, tokens, previous)
            if previous is not None:
                previous.tokens()
            previous = launched
        previous.tokens()
    return run


def gemm_flops(model: str, batch: int) -> float:
    """Matmul FLOPs of a decode step: every weight but the input embedding (a gather; tied, it is
    also the LM head, counted once), once a row."""
    shape = get_preset(model)
    embedding = shape.vocab_size * shape.hidden_size
    return 2 * (shape.num_params - (0 if shape.tie_embeddings else embedding)) * batch


# The scales of random FP8 entries: a model's values of ~0.1-10 over e4m3's 448 are of this order.
RANDOM_SCALES = (0.005, 0.05)


def random_entries(shape, dtype: torch.dtype, device, generator=None) -> torch.Tensor:
    """Random cache entries in `dtype`: normal bf16 values, or for FP8 normal values scaled into
    e4m3's range (their scales: RANDOM_SCALES)."""
    entries = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
    if dtype != FP8_DTYPE:
        return entries.to(dtype)
    return (entries * 64).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def fill_caches(engine, seed: int = 0) -> None:
    """Random keys and values in every cache block (`random_entries`, and random scales for FP8), a
    layer at a time so no cache-sized temporary is made."""
    caches = engine.runner.caches
    generator = torch.Generator(caches.kv.device).manual_seed(seed)
    for half in range(2):
        for layer in range(caches.num_layers):
            target = caches.kv[half, layer]
            target.copy_(random_entries(target.shape, target.dtype, target.device, generator))
    if caches.kv_scale is not None:
        caches.kv_scale.uniform_(*RANDOM_SCALES, generator=generator)
    torch.cuda.synchronize()


@contextlib.contextmanager
def decode_variant(spec: str | None):
    """The launch knobs set to `spec`, restored after; None: as shipped. `spec` joins by "/" any of: the FP8
    decode kernel's "TILE/VALUES/KEYS/WARPS/STAGES[/rN]" (`_DECODE_FP8_KV_TILE` ... `_DECODE_FP8_STAGES`, and
    `_DECODE_FP8_MAXNREG` = N), the FP8 store's "store=SEARCH:HEADS:WARPS" (`_STORE_FP8_LAUNCHES` = that one
    launch at any token count), the bfloat16 decode kernel's "b=TILE:WARPS:STAGES" (`_DECODE_KV_TILE`,
    `_DECODE_NUM_WARPS`, `_DECODE_NUM_STAGES`) and the decode grid's "gN" (`_PROGRAMS_PER_SM` and
    `_FP8_PROGRAMS_PER_SM` = N)."""
    from zipage.kernels import attention_triton as kernels

    names = ("_DECODE_FP8_KV_TILE", "_DECODE_FP8_VALUES", "_DECODE_FP8_KEYS", "_DECODE_FP8_WARPS",
             "_DECODE_FP8_STAGES", "_DECODE_FP8_MAXNREG")
    saved = {name: getattr(kernels, name)
             for name in (*names, "_STORE_FP8_LAUNCHES", "_PROGRAMS_PER_SM", "_FP8_PROGRAMS_PER_SM",
                          "_DECODE_KV_TILE", "_DECODE_NUM_WARPS", "_DECODE_NUM_STAGES")}
    decode = []
    for part in [] if spec is None else spec.split("/"):
        if part.startswith("store="):
            search, heads, warps = part.removeprefix("store=").split(":")
            kernels._STORE_FP8_LAUNCHES = ((None, search, int(heads), int(warps)),)
        elif part.startswith("b="):
            tile, warps, stages = part.removeprefix("b=").split(":")
            kernels._DECODE_KV_TILE, kernels._DECODE_NUM_WARPS = int(tile), int(warps)
            kernels._DECODE_NUM_STAGES = int(stages)
        elif part.startswith("g") and part[1:].isdigit():
            kernels._PROGRAMS_PER_SM = kernels._FP8_PROGRAMS_PER_SM = int(part[1:])
        else:
            decode.append(part)
    if decode:
        tile, values, keys, warps, stages, *maxnreg = decode
        if maxnreg and not maxnreg[0].startswith("r"):
            raise ValueError(f"a decode variant ends in /rN (registers a thread), got {spec!r}")
        for name, value in zip(names, (int(tile), values, keys, int(warps), int(stages),
                                       int(maxnreg[0][1:]) if maxnreg else None)):
            setattr(kernels, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)


def shuffle_blocks(plan, seed: int = 0) -> None:
    """Deal the plan's blocks out to its requests in a random order: an engine that has run a
    while holds its requests' blocks scattered over the pool, not in allocation order."""
    blocks = [block for seq in plan.decode for block in seq.block_table]
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed)).tolist()
    dealt = iter(blocks[index] for index in order)
    for seq in plan.decode:
        seq.block_table = [next(dealt) for _ in seq.block_table]


def profile_model(model: str, batches: list[int], context: int, block_size: int, iterations: int,
                  bandwidth: float, flops: float, launch: bool, kv_cache_dtype: str,
                  shuffled: bool = False, fill: str = "random", variant: str | None = None) -> list[dict]:
    largest = max(batches)
    blocks_each = -(-(context + 1) // block_size)
    kv_bytes = kv_token_bytes(get_preset(model), kv_cache_dtype, 2)
    kv_gb = largest * (blocks_each + 2) * block_size * kv_bytes / GIB + 0.5
    config = ZipageConfig(compress=False, block_size=block_size, max_num_seqs=largest,
                          kv_cache_dtype=kv_cache_dtype,
                          max_model_len=(blocks_each + 2) * block_size, async_scheduling=launch)
    settings = ReplaySettings(model=f"random:{model}", dtype="bfloat16", kv_memory_gb=kv_gb, config=config)
    with decode_variant(variant):
        engine = build_engine(settings, "cuda", cuda_graphs=True)
    if fill == "random":
        fill_caches(engine)
    manager = engine.new_scheduler().block_manager
    weights = weight_bytes(get_preset(model), 2)
    rows = []
    try:
        for batch in batches:
            plan, tokens = decode_plan(engine, manager, batch, context, compress=False)
            if shuffled:
                shuffle_blocks(plan)
            for _ in range(5):
                engine.runner.execute(plan, tokens)
            step_ms = timed(executed_steps(engine.runner, plan, tokens), iterations)
            async_ms = timed(launched_steps(engine.runner, plan, tokens), iterations) if launch else None
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iterations):
                    engine.runner.execute(plan, tokens)
                torch.cuda.synchronize()
            by_kind: dict[str, float] = collections.defaultdict(float)
            top: dict[str, float] = collections.defaultdict(float)
            for event in prof.key_averages():
                device_us = getattr(event, "device_time_total", None)
                if device_us is None:
                    device_us = event.cuda_time_total
                if device_us <= 0:
                    continue
                by_kind[kind_of(event.key)] += device_us / iterations / 1000
                top[event.key] += device_us / iterations / 1000
            kernels_ms = sum(by_kind.values())
            kv_ms = batch * context * kv_bytes / bandwidth * 1000
            roofline_ms = weights / bandwidth * 1000 + kv_ms
            compute_ms = max(weights / bandwidth, gemm_flops(model, batch) / flops) * 1000 + kv_ms
            best_ms = min(step_ms, async_ms or step_ms)
            row = {"model": model, "kv_cache_dtype": kv_cache_dtype, "variant": variant or "shipped",
                   "fill": fill, "batch": batch, "context": context,
                   "block_size": block_size, "blocks": "shuffled" if shuffled else "in order",
                   "step_ms": step_ms, "async_ms": async_ms, "kernels_ms": kernels_ms,
                   "host_wait_ms": step_ms - kernels_ms, "roofline_ms": roofline_ms,
                   "compute_roofline_ms": compute_ms, "share": roofline_ms / step_ms,
                   "best_share": roofline_ms / best_ms, "best_compute_share": compute_ms / best_ms,
                   "by_kind_ms": dict(by_kind),
                   "top_kernels_ms": dict(sorted(top.items(), key=lambda item: -item[1])[:8])}
            rows.append(row)
            print(json.dumps(row), flush=True)
            for seq in plan.decode:
                manager.release_all(seq.block_table)
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen2.5-7b,qwen3-8b,llama-3.1-8b")
    parser.add_argument("--batches", default="128,256")
    parser.add_argument("--context", type=int, default=1212,
                        help="KV entries a sequence holds (1212: the R-KV stress shape's mean, 700 + 1024 / 2)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto or fp8, or both (auto,fp8): each model's steps at each, one after the other")
    parser.add_argument("--shuffled-blocks", action="store_true",
                        help="deal each batch's blocks out in a random order (a long-running engine's layout) "
                             "instead of allocation order")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also time each step launched as the async engine loop runs it")
    parser.add_argument("--fill", choices=("random", "zeros"), default="random",
                        help="what the caches hold: random entries (an engine's, to the memory system) or zeros")
    parser.add_argument("--fp8-variants", default="",
                        help="FP8 launches to time instead of the shipped one, comma-separated "
                             "TILE/VALUES/KEYS/WARPS/STAGES[/rN] (the decode kernel, e.g. 128/weights/f16/4/2/r168), "
                             "store=SEARCH:HEADS:WARPS (the KV store, e.g. store=parallel:1:8) or both joined "
                             "by '/'; 'shipped' is the shipped one")
    args = parser.parse_args()
    batches = [int(batch) for batch in args.batches.split(",")]
    bandwidth, flops = copy_bandwidth(), matmul_flops()
    random_bandwidth = copy_bandwidth(fill=True)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s "
          f"({random_bandwidth / 1e12:.2f} of random bytes), matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    if args.fill == "random":
        bandwidth = random_bandwidth  # the roofline of a step over random entries
    variants = [None if spec == "shipped" else spec for spec in args.fp8_variants.split(",") if spec] or [None]
    rows = []
    for model in args.models.split(","):
        for kv_cache_dtype in args.kv_cache_dtype.split(","):
            for variant in variants if kv_cache_dtype == "fp8" else [None]:
                rows += profile_model(model, batches, args.context, args.block_size, args.iterations, bandwidth,
                                      flops, args.async_scheduling, kv_cache_dtype, args.shuffled_blocks,
                                      args.fill, variant)
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "step_profile")
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps(
        {"bandwidth_tbs": bandwidth / 1e12, "matmul_tflops": flops / 1e12, "rows": rows}, indent=1))
    kinds = [kind for kind, _ in KINDS] + ["other"]
    print(f"\ndecode step, context {args.context}, block {args.block_size}, Full KV, blocks "
          f"{'shuffled' if args.shuffled_blocks else 'in order'}, caches of {args.fill}: ms per step; "
          "share = roofline / the faster of step and async step")
    print("| model | KV | batch | step | async step | roofline | share | compute-aware roofline | share | host wait | "
          + " | ".join(kinds) + " |")
    print("|---" * (10 + len(kinds)) + "|")
    for row in rows:
        cells = " | ".join(f"{row['by_kind_ms'].get(kind, 0.0):.2f}" for kind in kinds)
        launched = "-" if row["async_ms"] is None else f"{row['async_ms']:.2f}"
        kv = row["kv_cache_dtype"] + ("" if row["variant"] == "shipped" else f" {row['variant']}")
        print(f"| {row['model']} | {kv} | {row['batch']} | {row['step_ms']:.2f} | {launched} | "
              f"{row['roofline_ms']:.2f} | "
              f"{row['best_share']:.0%} | {row['compute_roofline_ms']:.2f} | {row['best_compute_share']:.0%} | "
              f"{row['host_wait_ms']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
