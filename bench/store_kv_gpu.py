"""GPU benchmark: the KV store kernel per call, bfloat16 against FP8 and FP8's launch variants.

With an FP8 cache each (token, KV head) searches 8 candidate scales with exact divisions before it
writes (kernels/attention_triton.py, `_quantize_e4m3`); each variant is one row of `_STORE_FP8_LAUNCHES`
at every token count: whether the candidates are tried one after another ("serial") or side by side on
an axis of their own ("parallel"), how many KV heads one program takes and its warps. Each variant first stores
the same random keys and values as the first variant (the same scales and bytes, bit for bit; how
many scales differ from the torch reference on this GPU is printed beside), then is timed inside a
CUDA graph of `LAYERS` calls (a decode step's launches: no launch overhead), at a decode step's token
counts and a prefill chunk's. Llama-3.1-8B / Qwen3-8B: 8 KV heads of 128, block 64.

    python bench/store_kv_gpu.py --tokens 32,128,512,2048

Prints a table last and writes store_kv.json under $OUT (or runs/store_kv/).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from zipage.kernels import attention_triton as kernels
from zipage.kernels.attention_ref import store_kv_ref
from zipage.kernels.kv_quant_ref import FP8_DTYPE

HEADS, HEAD_DIM, BLOCK, LAYERS = 8, 128, 64, 32
# (search, heads a program, warps): the first is the launch of every count until 2026-12-01.
VARIANTS = (("serial", 8, 8), ("serial", 4, 4), ("serial", 1, 4), ("parallel", 1, 2), ("parallel", 1, 4),
            ("parallel", 1, 8), ("parallel", 2, 4), ("parallel", 2, 8), ("parallel", 4, 8))


def caches(blocks: int, fp8: bool, device) -> list[torch.Tensor]:
    shape = (blocks, BLOCK, HEADS, HEAD_DIM)
    if not fp8:
        return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(2)]
    return ([torch.zeros(shape, dtype=FP8_DTYPE, device=device) for _ in range(2)]
            + [torch.ones(shape[:3], device=device) for _ in range(2)])


def graphed_us(store) -> float:
    """Microseconds a call of `store`, from a CUDA graph of LAYERS calls replayed 20 times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            store()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            store()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (20 * LAYERS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="32,128,512,2048")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(5)
    rows, failed = [], False
    for tokens in (int(count) for count in args.tokens.split(",")):
        blocks = tokens // BLOCK + 2
        key = torch.randn((tokens, HEADS, HEAD_DIM), generator=generator, device=device).to(torch.bfloat16)
        value = torch.randn((tokens, HEADS, HEAD_DIM), generator=generator, device=device).to(torch.bfloat16)
        key[:, :, 5] *= 30  # an outlier channel, as a model's keys have
        slots = torch.randperm(blocks * BLOCK, generator=generator, device=device)[:tokens]
        bf16 = caches(blocks, False, device)
        bf16_us = graphed_us(lambda: kernels.store_kv_triton(key, value, *bf16, slots))
        reference = caches(blocks, True, device)
        store_kv_ref(key, value, reference[0], reference[1], slots, k_scale=reference[2], v_scale=reference[3])
        row = {"tokens": tokens, "bf16_us": bf16_us, "fp8_us": {}}
        expected = None
        for search, heads, warps in VARIANTS:
            kernels._STORE_FP8_LAUNCHES = ((None, search, heads, warps),)
            fp8 = caches(blocks, True, device)
            kernels.store_kv_triton(key, value, fp8[0], fp8[1], slots, k_scale=fp8[2], v_scale=fp8[3])
            expected = expected or [cache.clone() for cache in fp8]
            same = all(torch.equal(got.view(torch.uint8), want.view(torch.uint8)) for got, want in zip(fp8, expected))
            scales_off = sum(int((got != want).sum()) for got, want in zip(fp8[2:], reference[2:]))
            failed |= not same
            us = graphed_us(lambda: kernels.store_kv_triton(
                key, value, fp8[0], fp8[1], slots, k_scale=fp8[2], v_scale=fp8[3]))
            row["fp8_us"][f"{search} {heads}h/{warps}w"] = us if same else None
            print(json.dumps({"tokens": tokens, "variant": f"{search} {heads}h/{warps}w", "us": us,
                              "same_as_first": same, "scales_unlike_torch_reference": scales_off}), flush=True)
        rows.append(row)
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "store_kv")
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_kv.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    names = [f"{search} {heads}h/{warps}w" for search, heads, warps in VARIANTS]
    print(f"\n{torch.cuda.get_device_name()}: store_kv per call, us (search, heads a program / warps; "
          f"{names[0]} = before); '-' = bytes differ from the first variant's")
    print("| tokens | bf16 | " + " | ".join(names) + " |")
    print("|---" * (2 + len(names)) + "|")
    for row in rows:
        cells = " | ".join("-" if row["fp8_us"][name] is None else f"{row['fp8_us'][name]:.1f}" for name in names)
        print(f"| {row['tokens']} | {row['bf16_us']:.1f} | {cells} |")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
