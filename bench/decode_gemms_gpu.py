"""GPU benchmark: the decode step's four GEMMs a layer (qkv, o, gate/up, down) at a decode batch,
timed alone under a few ways of calling them, against the time to read their weights once
(issue #46: the GEMMs are what keeps Qwen2.5-7B's decode step under 85 % of its bandwidth
roofline at batch 128; docs/BENCHMARKS.md, 'Beside published tables').

Variants (each a product of the same shape and dtype, bfloat16):

- `linear`: `F.linear(x, W)` with W stored [out, in], as `zipage/engine/layers.py` calls it;
- `mm-t`: `x @ Wt` with the weight stored transposed, [in, out] (cuBLAS's other layout);
- `lt`, `lt-t`: the same two with `torch.backends.cuda.preferred_blas_library("cublaslt")`;
- `autotune` (with `--autotune`): `torch.compile(mode="max-autotune-no-cudagraphs")` of
  `F.linear`, Inductor's Triton GEMM templates searched against cuBLAS for the shape.

Each GEMM cycles through enough copies of its weight (over 400 MB) that no call finds its weight in
L2, as a real step's layers never do; a call is timed as the mean of `--iterations` inside a CUDA
graph (no launch gaps). The copy bandwidth is measured in the same call. Prints a table per model
and batch last and writes decode_gemms.json under $OUT (or runs/decode_gemms/).

    python bench/decode_gemms_gpu.py --models qwen2.5-7b,qwen3-8b,llama-3.1-8b --batches 128,256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from zipage.presets import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import copy_bandwidth  # noqa: E402  (a sibling script, not a package)

VARIANTS = ("linear", "mm-t", "lt", "lt-t")
WEIGHT_POOL_BYTES = 400 * 2**20  # beyond the H200's 50 MB L2 many times over


def gemm_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of each decode GEMM of one layer of preset `name`, unsharded."""
    shape = get_preset(name)
    query, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {"qkv": (shape.hidden_size, query + 2 * kv), "o": (query, shape.hidden_size),
            "gate_up": (shape.hidden_size, 2 * shape.intermediate_size),
            "down": (shape.intermediate_size, shape.hidden_size)}


def time_graph(call, iterations: int) -> float:
    """Mean seconds of `call()` captured `iterations` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iterations):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (5 * iterations)


def time_variant(variant: str, batch: int, features: tuple[int, int], iterations: int) -> float:
    inputs, outputs = features
    copies = max(2, -(-WEIGHT_POOL_BYTES // (inputs * outputs * 2)))
    transposed = variant in ("mm-t", "lt-t")
    weights = [torch.randn((inputs, outputs) if transposed else (outputs, inputs),
                           dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(batch, inputs, dtype=torch.bfloat16, device="cuda")
    if variant == "autotune":
        linear = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    position = [0]

    def call() -> None:
        weight = weights[position[0] % copies]
        position[0] += 1
        # Each product into a fresh output (the graph's pool), as a model's layers run them.
        if transposed:
            torch.mm(x, weight)
        else:
            (linear if variant == "autotune" else F.linear)(x, weight)

    library = torch.backends.cuda.preferred_blas_library()
    try:
        if variant.startswith("lt"):
            torch.backends.cuda.preferred_blas_library("cublaslt")
        return time_graph(call, iterations)
    finally:
        torch.backends.cuda.preferred_blas_library(library)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen2.5-7b,qwen3-8b,llama-3.1-8b")
    parser.add_argument("--batches", default="128,256")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--autotune", action="store_true",
                        help="also Inductor's max-autotune GEMM (compiles per shape: minutes)")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    variants = VARIANTS + (("autotune",) if args.autotune else ())
    rows = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for gemm, features in gemm_shapes(model).items():
                weight_s = features[0] * features[1] * 2 / bandwidth
                row = {"model": model, "batch": batch, "gemm": gemm, "in": features[0],
                       "out": features[1], "weight_read_us": 1e6 * weight_s}
                for variant in variants:
                    row[variant] = 1e6 * time_variant(variant, batch, features, args.iterations)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "runs/decode_gemms"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_gemms.json").write_text(json.dumps(
        {"copy_bandwidth_Bps": bandwidth, "device": torch.cuda.get_device_name(),
         "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; us a call (share of the weight read "
          f"time in brackets: 100 % = the GEMM reads its weight at the copy bandwidth)")
    print(f"{'model':<14} {'batch':>5} {'gemm':<8} {'read us':>8} "
          + " ".join(f"{v:>15}" for v in variants))
    for row in rows:
        print(f"{row['model']:<14} {row['batch']:>5} {row['gemm']:<8} {row['weight_read_us']:>8.1f} "
              + " ".join(f"{row[v]:>7.1f} ({100 * row['weight_read_us'] / row[v]:>3.0f} %)"
                         for v in variants))
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            mine = [r for r in rows if r["model"] == model and r["batch"] == batch]
            layers = get_preset(model).num_layers
            totals = {v: layers * sum(r[v] for r in mine) / 1e3 for v in variants}
            best = layers * sum(min(r[v] for v in variants) for r in mine) / 1e3
            print(f"{model} batch {batch}: a step's GEMMs (ms, {layers} layers) "
                  + ", ".join(f"{v} {t:.2f}" for v, t in totals.items())
                  + f", best of each {best:.2f}, weights read "
                  f"{layers * sum(r['weight_read_us'] for r in mine) / 1e3:.2f}")


if __name__ == "__main__":
    main()
