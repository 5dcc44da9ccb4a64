"""Check the Triton paged-attention kernels against the torch reference in bfloat16 on a GPU, then time them.

Part 1 compares ``store_kv``, ``paged_prefill_attention`` (with prefix-cached prompts) and ``paged_decode_attention``
(automatic split and a forced many-partition split) with the references of ``zipage.kernels.attention_ref`` over
random cases: GQA ratios 1/3/8, head_dim 64/128 (and 80, which is padded inside the kernels), block sizes
16/64/256, ragged context lengths. Part 2 times decode for a Qwen3-8B-shaped layer (32 query heads, 8 KV heads,
head_dim 128) at batch 1/32/128/256 x 2k contexts and at 32k contexts, and reports the bandwidth achieved on the KV
bytes read; part 3 times one prefill against torch's dense scaled_dot_product_attention for scale.

Usage: ``python bench/check_attention_gpu.py`` (needs a CUDA GPU). Prints a short table; with ``$OUT`` set, also
writes ``$OUT/check_attention_gpu.log`` and ``$OUT/check_attention_gpu.json``. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.testing

from zipage.kernels.attention_ref import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from zipage.kernels.attention_triton import (
    decode_partition_size,
    paged_decode_attention_triton,
    paged_prefill_attention_triton,
    store_kv_triton,
)

DEVICE = "cuda"
DTYPE = torch.bfloat16
# bfloat16 keeps 8 bits of mantissa; the kernels round the softmax weights to it before the second product.
ATOL = RTOL = 2e-2
CHECK_KV_HEADS = 2
TIMED_HEADS, TIMED_KV_HEADS, TIMED_HEAD_DIM = 32, 8, 128


def log(line: str = "") -> None:
    """Print, and append to $OUT/check_attention_gpu.log when $OUT is set (line by line, so a crash keeps the
    lines before it)."""
    print(line, flush=True)
    output_dir = os.environ.get("OUT")
    if output_dir:
        with open(os.path.join(output_dir, "check_attention_gpu.log"), "a") as log_file:
            log_file.write(line + "\n")


def random_paged_cache(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache full of random values (so reading a wrong block shows), blocks assigned to sequences in random
    order, and block tables padded with -1 plus one spare column."""
    blocks_per_sequence = [max(1, triton.cdiv(length, block_size)) for length in context_lens]
    num_blocks = sum(blocks_per_sequence) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator, device=DEVICE).to(DTYPE)
    v_cache = torch.randn(shape, generator=generator, device=DEVICE).to(DTYPE)
    order = torch.randperm(num_blocks, generator=generator, device=DEVICE).to(torch.int32)
    block_tables = torch.full((len(context_lens), max(blocks_per_sequence) + 1), -1, dtype=torch.int32, device=DEVICE)
    next_block = 0
    for seq, count in enumerate(blocks_per_sequence):
        block_tables[seq, :count] = order[next_block : next_block + count]
        next_block += count
    return k_cache, v_cache, block_tables


def slots_of(block_tables: torch.Tensor, seq: int, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_tables[seq, positions // block_size].long() * block_size + positions % block_size


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> dict:
    error = (actual.float() - expected.float()).abs().max().item() if actual.numel() else 0.0
    if exact:
        passed = torch.equal(actual, expected)
    else:
        passed = torch.allclose(actual.float(), expected.float(), atol=ATOL, rtol=RTOL)
    return {"case": name, "max_abs_error": error, "passed": bool(passed)}


def check_configuration(group: int, head_dim: int, block_size: int, generator: torch.Generator) -> list[dict]:
    label = f"group={group} head_dim={head_dim} block={block_size}"
    num_heads = CHECK_KV_HEADS * group
    scale = head_dim**-0.5
    results = []

    # Prefill: cached prefixes are whole blocks (what the prefix cache shares); new chunks are ragged, one is a
    # single token, one spans many query tiles, one sequence has nothing cached.
    cached_lens = [2 * block_size, 0, block_size, 3 * block_size, 0]
    new_lens = [37, 700, 1, 130, 5]
    context_lens = [cached + new for cached, new in zip(cached_lens, new_lens)]
    k_cache, v_cache, block_tables = random_paged_cache(context_lens, block_size, CHECK_KV_HEADS, head_dim, generator)
    new_slots = []
    for seq, (cached, length) in enumerate(zip(cached_lens, context_lens)):
        prefix = torch.arange(cached, device=DEVICE)
        prefix_keys, prefix_values = (
            torch.randn((cached, CHECK_KV_HEADS, head_dim), generator=generator, device=DEVICE).to(DTYPE)
            for _ in range(2)
        )
        store_kv_ref(prefix_keys, prefix_values, k_cache, v_cache, slots_of(block_tables, seq, prefix, block_size))
        new_slots.append(slots_of(block_tables, seq, torch.arange(cached, length, device=DEVICE), block_size))
    slot_mapping = torch.cat(new_slots)
    # A skipped token (slot -1), as for padding of a captured batch.
    slot_mapping = torch.cat([slot_mapping, torch.full((1,), -1, dtype=torch.long, device=DEVICE)])
    total_new = int(slot_mapping.numel())
    new_keys = torch.randn((total_new, CHECK_KV_HEADS, head_dim), generator=generator, device=DEVICE).to(DTYPE)
    new_values = torch.randn((total_new, CHECK_KV_HEADS, head_dim), generator=generator, device=DEVICE).to(DTYPE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(new_keys, new_values, expected_k, expected_v, slot_mapping)
    store_kv_triton(new_keys, new_values, k_cache, v_cache, slot_mapping)
    stored, expected_stored = torch.stack([k_cache, v_cache]), torch.stack([expected_k, expected_v])
    results.append(compare(f"store_kv {label}", stored, expected_stored, exact=True))

    q = torch.randn((sum(new_lens), num_heads, head_dim), generator=generator, device=DEVICE).to(DTYPE)
    cu_seqlens_q = torch.tensor([0] + new_lens, device=DEVICE).cumsum(0).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    arguments = (q, expected_k, expected_v, cu_seqlens_q, lens, block_tables, scale)
    results.append(
        compare(
            f"prefill {label}",
            paged_prefill_attention_triton(*arguments),
            paged_prefill_attention_ref(*arguments),
        )
    )

    # Decode: one entry, a partial block, exactly full blocks, a long context, and an empty padding slot.
    context_lens = [1, 17, 3 * block_size, 1500, 0]
    k_cache, v_cache, block_tables = random_paged_cache(context_lens, block_size, CHECK_KV_HEADS, head_dim, generator)
    q = torch.randn((len(context_lens), num_heads, head_dim), generator=generator, device=DEVICE).to(DTYPE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    arguments = (q, k_cache, v_cache, lens, block_tables, scale)
    expected = paged_decode_attention_ref(*arguments)
    for partition_size, name in ((None, "auto split"), (64, "64-token partitions")):
        actual = paged_decode_attention_triton(*arguments, partition_size=partition_size)
        results.append(compare(f"decode {name} {label}", actual, expected))
    return results


def run_checks(seed: int) -> list[dict]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    configurations = [(g, d, b) for g in (1, 3, 8) for d in (64, 128) for b in (16, 64, 256)]
    configurations.append((3, 80, 16))
    results = []
    for group, head_dim, block_size in configurations:
        results += check_configuration(group, head_dim, block_size, generator)
    failures = [result for result in results if not result["passed"]]
    worst = max(results, key=lambda result: result["max_abs_error"])
    log(f"checks: {len(results) - len(failures)}/{len(results)} passed (bfloat16, atol=rtol={ATOL}); "
        f"largest error {worst['max_abs_error']:.2e} in '{worst['case']}'")
    for failure in failures:
        log(f"  FAILED {failure['case']}: max abs error {failure['max_abs_error']:.3e}")
    return results


def time_microseconds(function) -> float:
    # do_bench clears the L2 cache before every run, so small batches cannot read their KV from cache.
    return triton.testing.do_bench(function, warmup=25, rep=200, return_mode="median") * 1e3


def time_with_cuda_graph_microseconds(function) -> float | None:
    """Time replaying a captured graph, as the engine's decode does; None if capture fails."""
    try:
        return triton.testing.do_bench_cudagraph(function, rep=50, return_mode="median") * 1e3
    except RuntimeError as error:
        log(f"  CUDA graph capture failed: {error}")
        return None


def time_decode(seed: int) -> list[dict]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    streaming_multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    shapes = [(batch, 2048) for batch in (1, 32, 128, 256)] + [(1, 32768), (8, 32768)]
    log()
    log(f"decode, {TIMED_HEADS} q heads / {TIMED_KV_HEADS} kv heads / head_dim {TIMED_HEAD_DIM}, bfloat16; "
        "GB/s = K+V bytes read / time (L2 flushed)")
    header = (f"{'block':>5} {'batch':>5} {'context':>7} {'parts':>5} {'KV MB':>8} {'us':>8} {'GB/s':>7} "
              f"{'graph us':>8} {'1-part us':>9}")
    log(header)
    for block_size in (16, 256):
        for batch, context_len in shapes:
            k_cache, v_cache, block_tables = random_paged_cache(
                [context_len] * batch, block_size, TIMED_KV_HEADS, TIMED_HEAD_DIM, generator
            )
            q = torch.randn((batch, TIMED_HEADS, TIMED_HEAD_DIM), generator=generator, device=DEVICE).to(DTYPE)
            lens = torch.full((batch,), context_len, dtype=torch.int32, device=DEVICE)
            capacity = block_tables.shape[1] * block_size
            partition = decode_partition_size(batch, TIMED_KV_HEADS, capacity, streaming_multiprocessors)
            arguments = (q, k_cache, v_cache, lens, block_tables, TIMED_HEAD_DIM**-0.5)
            microseconds = time_microseconds(lambda: paged_decode_attention_triton(*arguments))
            graph_microseconds = time_with_cuda_graph_microseconds(lambda: paged_decode_attention_triton(*arguments))
            one_partition = triton.cdiv(capacity, 64) * 64
            one_partition_microseconds = time_microseconds(
                lambda: paged_decode_attention_triton(*arguments, partition_size=one_partition)
            )
            kv_bytes = 2 * batch * context_len * TIMED_KV_HEADS * TIMED_HEAD_DIM * DTYPE.itemsize
            row = {
                "block_size": block_size,
                "batch": batch,
                "context": context_len,
                "partitions": triton.cdiv(capacity, partition),
                "kv_megabytes": kv_bytes / 1e6,
                "microseconds": microseconds,
                "gigabytes_per_second": kv_bytes / microseconds / 1e3,
                "graph_microseconds": graph_microseconds,
                "one_partition_microseconds": one_partition_microseconds,
            }
            rows.append(row)
            graph = f"{graph_microseconds:8.1f}" if graph_microseconds is not None else f"{'n/a':>8}"
            log(f"{block_size:>5} {batch:>5} {context_len:>7} {row['partitions']:>5} {row['kv_megabytes']:>8.1f} "
                f"{microseconds:>8.1f} {row['gigabytes_per_second']:>7.0f} {graph} {one_partition_microseconds:>9.1f}")
            del k_cache, v_cache
    return rows


def time_prefill(seed: int) -> dict:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    batch, prompt_len, block_size = 4, 2048, 256
    k_cache, v_cache, block_tables = random_paged_cache(
        [prompt_len] * batch, block_size, TIMED_KV_HEADS, TIMED_HEAD_DIM, generator
    )
    q = torch.randn((batch * prompt_len, TIMED_HEADS, TIMED_HEAD_DIM), generator=generator, device=DEVICE).to(DTYPE)
    cu_seqlens_q = torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * prompt_len
    lens = torch.full((batch,), prompt_len, dtype=torch.int32, device=DEVICE)
    scale = TIMED_HEAD_DIM**-0.5
    paged = time_microseconds(
        lambda: paged_prefill_attention_triton(q, k_cache, v_cache, cu_seqlens_q, lens, block_tables, scale)
    )
    dense_q = q.view(batch, prompt_len, TIMED_HEADS, TIMED_HEAD_DIM).transpose(1, 2)
    # KV repeated per query head, so any torch version's flash backend takes it.
    dense_kv = torch.randn((batch, TIMED_HEADS, prompt_len, TIMED_HEAD_DIM), generator=generator, device=DEVICE)
    dense_kv = dense_kv.to(DTYPE)
    dense = time_microseconds(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            dense_q, dense_kv, dense_kv, is_causal=True, scale=scale
        )
    )
    # Causal: half of the query x key pairs, two matrix products of 2 * head_dim flops each.
    flops = 2 * 2 * batch * TIMED_HEADS * TIMED_HEAD_DIM * prompt_len * prompt_len / 2
    log()
    log(f"prefill, {batch} x {prompt_len}-token prompts, block {block_size}: paged Triton {paged / 1e3:.2f} ms "
        f"({flops / paged / 1e6:.0f} TFLOP/s); dense torch SDPA {dense / 1e3:.2f} ms "
        f"({flops / dense / 1e6:.0f} TFLOP/s)")
    return {"paged_microseconds": paged, "dense_sdpa_microseconds": dense, "flops": flops}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_attention_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    log(f"{datetime.datetime.now().isoformat(timespec='seconds')} {torch.cuda.get_device_name(0)}, "
        f"torch {torch.__version__}, triton {triton.__version__}")
    checks = run_checks(arguments.seed)
    decode_rows = time_decode(arguments.seed)
    prefill = time_prefill(arguments.seed)
    output_dir = os.environ.get("OUT")
    if output_dir:
        with open(os.path.join(output_dir, "check_attention_gpu.json"), "w") as json_file:
            json.dump({"checks": checks, "decode": decode_rows, "prefill": prefill}, json_file, indent=1)
    return 0 if all(result["passed"] for result in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
