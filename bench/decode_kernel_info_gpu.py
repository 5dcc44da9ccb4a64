"""What the compiler made of each decode launch variant: registers, spills, shared memory, the
programs an SM can hold and whether any load was pipelined (asynchronous copies), beside the kernel's
time in a CUDA graph (issue #46, the FP8 decode path).

One layer of Llama-3.1-8B's decode attention (32 query / 8 KV heads, head dim 128, block 64) over
random entries, bf16 and the FP8 variants given as bench/step_profile_gpu.py's `decode_variant` takes
them (TILE/VALUES/KEYS/WARPS/STAGES[/rN], gN: the grid's programs an SM); "shipped/gN" is the shipped FP8
launch on another grid, "bf16/gN" bf16's. Time:
`triton.testing.do_bench_cudagraph`, the median.

    python bench/decode_kernel_info_gpu.py --batches 32,128,512 --context 576 \
        --variants 128/f16-asm/f16/4/3,128/f16-asm/queries/4/3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from zipage.core.memory import kv_entry_bytes
from zipage.kernels.kv_quant_ref import FP8_DTYPE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile_gpu import RANDOM_SCALES, decode_variant, random_entries  # noqa: E402  (a sibling script)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 64
REGISTERS_PER_SM, THREADS_PER_SM = 65536, 2048


def caches(batch: int, context: int, fp8: bool, device) -> dict:
    blocks_each = -(-context // BLOCK)
    shape = (batch * blocks_each, BLOCK, KV_HEADS, HEAD_DIM)
    table = torch.arange(batch * blocks_each, dtype=torch.int32, device=device).view(batch, blocks_each)
    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    arguments = dict(context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
                     block_tables=table)
    arguments |= {name: random_entries(shape, dtype, device) for name in ("k_cache", "v_cache")}
    if not fp8:
        return arguments
    return arguments | {name: torch.empty(shape[:3], device=device).uniform_(*RANDOM_SCALES)
                        for name in ("k_scale", "v_scale")}


def time_decode(q: torch.Tensor, cache: dict, rep: int) -> float:
    """Milliseconds of one decode attention call over `cache` (`caches`' keys) in a CUDA graph,
    the median of `triton.testing.do_bench_cudagraph`."""
    import triton

    from zipage.kernels import attention_triton as kernels

    def step():
        kernels.paged_decode_attention_triton(q, cache["k_cache"], cache["v_cache"], cache["context_lens"],
                                              cache["block_tables"], q.shape[-1] ** -0.5,
                                              k_scale=cache.get("k_scale"), v_scale=cache.get("v_scale"))
    step()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(step, rep=rep, return_mode="median")


def compiled_kernels(function) -> dict:
    """key -> compiled kernel of a Triton JIT function, over the layouts of its device caches."""
    found = {}
    for cache in function.device_caches.values():
        table = cache[0] if isinstance(cache, tuple) else cache
        found.update(table)
    return found


def describe(kernel, smem_per_sm: int) -> dict:
    """Registers, spills, shared memory, the programs an SM holds, and whether the compiler pipelined any
    global load through shared memory (asynchronous copies in its GPU IR and PTX)."""
    warps = kernel.metadata.num_warps
    shared = kernel.metadata.shared
    by_registers = REGISTERS_PER_SM // max(1, kernel.n_regs * warps * 32)
    by_shared = smem_per_sm // shared if shared else 64
    ttgir, ptx = kernel.asm.get("ttgir", ""), kernel.asm.get("ptx", "")
    return {"registers": kernel.n_regs, "spills": kernel.n_spills, "shared_bytes": shared, "warps": warps,
            "programs_per_sm": min(by_registers, by_shared, THREADS_PER_SM // (warps * 32)),
            "async_copies_ir": ttgir.count("async_copy_global_to_local"), "cp_async_ptx": ptx.count("cp.async."),
            "global_loads_ptx": ptx.count("ld.global")}


def main() -> None:

    from zipage.kernels import attention_triton as kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="32,128,512")
    parser.add_argument("--context", type=int, default=576)
    parser.add_argument("--variants", default="shipped")
    args = parser.parse_args()
    device = torch.device("cuda")
    smem_per_sm = torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor
    rows, infos = [], {}
    for batch in [int(batch) for batch in args.batches.split(",")]:  # bf16 first: each row's ratio is against it
        q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        for name in ["bf16", *args.variants.split(",")]:
            fp8 = not name.startswith("bf16")
            cache = caches(batch, args.context, fp8, device)  # noqa: F841  (read by step below)
            before = set(compiled_kernels(kernels._decode_partition_kernel))
            spec = name.removeprefix("bf16").removeprefix("shipped").removeprefix("/") or None
            with decode_variant(spec):
                milliseconds = time_decode(q, cache, rep=50)
            new = [kernel for key, kernel in compiled_kernels(kernels._decode_partition_kernel).items()
                   if key not in before]
            if new:
                infos[name] = describe(new[0], smem_per_sm)
            info = infos.get(name, {})
            read = batch * args.context * KV_HEADS * 2 * kv_entry_bytes(HEAD_DIM, "fp8" if fp8 else "auto", 2)
            rows.append({"batch": batch, "variant": name, "us": milliseconds * 1000,
                         "tb_s": read / (milliseconds * 1e-3) / 1e12, **info})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "decode_kernel_info")
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_kernel_info.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{torch.cuda.get_device_name()}, context {args.context}, one layer (32/8 heads, dim 128, block 64)")
    print("| batch | variant | us | TB/s read | registers | spills | shared KB | programs an SM holds | "
          "async copies (IR / PTX) | global loads (PTX) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {row['variant']} | {row['us']:.1f} | {row['tb_s']:.2f} | "
              f"{row.get('registers', '-')} | {row.get('spills', '-')} | {row.get('shared_bytes', 0) / 1024:.0f} | "
              f"{row.get('programs_per_sm', '-')} | {row.get('async_copies_ir', '-')} / "
              f"{row.get('cp_async_ptx', '-')} | {row.get('global_loads_ptx', '-')} |")


if __name__ == "__main__":
    main()
