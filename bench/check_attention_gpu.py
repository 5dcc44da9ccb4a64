"""Check the Triton paged-attention kernels against the torch reference in bfloat16 on a GPU, then time them.

Part 1 compares ``store_kv``, ``store_queries``, ``paged_prefill_attention`` (with prefix-cached prompts) and
``paged_decode_attention`` (automatic split, automatic split with a wide padded block table as a CUDA graph uses,
and a forced many-partition split) with the references of ``zipage.kernels.attention_ref`` over random cases: GQA
ratios 1/3/8, head_dim 64/128 (and 80, which is padded inside the kernels), block sizes 16/64/256, ragged context
lengths.
Part 2 times decode for a Qwen3-8B-shaped layer (32 query heads, 8 KV heads, head_dim 128) at batch 1/32/128/256 x
2k contexts and at 32k contexts, and reports the bandwidth achieved on the KV bytes read against the measured
device-to-device copy bandwidth, with tight and wide (``max_model_len`` = 40960) block tables; part 3 times one
prefill against torch's dense scaled_dot_product_attention for scale. ``--sweep`` also times a few decode and
prefill launch configurations (tile, warps, pipeline stages, programs per SM), for tuning.

Usage: ``python bench/check_attention_gpu.py [--sweep]`` (needs a CUDA GPU). Prints a short table; with ``$OUT``
set, also writes ``$OUT/check_attention_gpu.log`` and ``$OUT/check_attention_gpu.json``. Exits 1 if any check
fails or a section crashes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import triton
import triton.testing

from zipage.kernels import attention_triton
from zipage.kernels.attention_ref import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
    store_queries_ref,
)
from zipage.kernels.attention_triton import (
    decode_num_partitions,
    paged_decode_attention_triton,
    paged_prefill_attention_triton,
    store_kv_triton,
    store_queries_triton,
)

DEVICE = "cuda"
DTYPE = torch.bfloat16
# bfloat16 keeps 8 bits of mantissa; the kernels round the softmax weights to it before the second product.
ATOL = RTOL = 2e-2
CHECK_KV_HEADS = 2
TIMED_HEADS, TIMED_KV_HEADS, TIMED_HEAD_DIM = 32, 8, 128
# The runner's CUDA graphs use block tables of ceil(max_model_len / block_size) columns (Qwen3-8B: 40960).
GRAPH_MAX_MODEL_LEN = 40960
CHECK_CONFIGURATIONS = [(g, d, b) for g in (1, 3, 8) for d in (64, 128) for b in (16, 64, 256)] + [(3, 80, 16)]
DECODE_SHAPES = [(batch, 2048) for batch in (1, 32, 128, 256)] + [(1, 32768), (8, 32768)]
DECODE_BLOCK_SIZES = (16, 256)
PREFILL_SHAPE = (4, 2048)  # prompts x tokens


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
    # Window queries (what a compression scores with): a cache [slots, window, heads, head_dim], every other
    # token stored, each to a row of its own, the others skipped (-1).
    query_cache = torch.randn((4, 16, num_heads, head_dim), generator=generator, device=DEVICE).to(DTYPE)
    tokens = 2 * query_cache.shape[0] * query_cache.shape[1]
    query_rows = torch.full((tokens,), -1, dtype=torch.long, device=DEVICE)
    query_rows[0::2] = torch.randperm(tokens // 2, generator=generator, device=DEVICE)
    expected_queries = query_cache.clone()
    store_queries_ref(q[:tokens], expected_queries, query_rows)
    store_queries_triton(q[:tokens], query_cache, query_rows)
    results.append(compare(f"store_queries {label}", query_cache, expected_queries, exact=True))
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
    wide_arguments = (q, k_cache, v_cache, lens, widen(block_tables, block_size), scale)
    results.append(compare(f"decode wide table {label}", paged_decode_attention_triton(*wide_arguments), expected))
    return results


def widen(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block table padded with -1 to the width a CUDA graph of the runner uses."""
    width = max(triton.cdiv(GRAPH_MAX_MODEL_LEN, block_size), block_tables.shape[1])
    wide = torch.full((block_tables.shape[0], width), -1, dtype=block_tables.dtype, device=block_tables.device)
    wide[:, : block_tables.shape[1]] = block_tables
    return wide


def run_checks(seed: int) -> list[dict]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    results = []
    for group, head_dim, block_size in CHECK_CONFIGURATIONS:
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
    """Time replaying a captured graph, as the engine's decode does (L2 not flushed); None if capture fails."""
    try:
        return triton.testing.do_bench_cudagraph(function, rep=50, return_mode="median") * 1e3
    except RuntimeError as error:
        log(f"  CUDA graph capture failed: {error}")
        return None


def copy_bandwidth_gigabytes_per_second() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read and written: the ceiling decode is compared with."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    destination = torch.empty_like(source)
    microseconds = time_microseconds(lambda: destination.copy_(source))
    del source, destination
    return 2 * (1 << 30) / microseconds / 1e3


def legacy_partition_size(batch: int, capacity: int, streaming_multiprocessors: int) -> int:
    """The first version's split (partition length from the block table's capacity), kept here to show what a
    wide table cost it."""
    wanted_partitions = triton.cdiv(4 * streaming_multiprocessors, batch * TIMED_KV_HEADS)
    tile = attention_triton._DECODE_KV_TILE
    return max(triton.cdiv(triton.cdiv(capacity, wanted_partitions), tile), 2) * tile


def decode_case(batch: int, context_len: int, block_size: int, generator: torch.Generator) -> tuple:
    k_cache, v_cache, block_tables = random_paged_cache(
        [context_len] * batch, block_size, TIMED_KV_HEADS, TIMED_HEAD_DIM, generator
    )
    q = torch.randn((batch, TIMED_HEADS, TIMED_HEAD_DIM), generator=generator, device=DEVICE).to(DTYPE)
    lens = torch.full((batch,), context_len, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, lens, block_tables, TIMED_HEAD_DIM**-0.5


def kv_bytes(batch: int, context_len: int) -> int:
    return 2 * batch * context_len * TIMED_KV_HEADS * TIMED_HEAD_DIM * DTYPE.itemsize


def time_decode(seed: int, copy_gigabytes_per_second: float) -> list[dict]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    streaming_multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    log()
    log(f"decode, {TIMED_HEADS} q heads / {TIMED_KV_HEADS} kv heads / head_dim {TIMED_HEAD_DIM}, bfloat16; "
        f"GB/s = K+V bytes read / time (L2 flushed); copy = {copy_gigabytes_per_second:.0f} GB/s; graph = CUDA "
        f"graph replay (L2 not flushed); wide = block table of ceil({GRAPH_MAX_MODEL_LEN}/block) columns; "
        "old = the first version's capacity-based split; 1-part = no split")
    header = (f"{'block':>5} {'batch':>5} {'context':>7} {'parts':>5} {'KV MB':>8} {'us':>8} {'GB/s':>7} "
              f"{'%copy':>5} {'graph us':>8} {'wide us':>8} {'wide gr':>8} {'old wide':>8} {'1-part us':>9}")
    log(header)
    for block_size in DECODE_BLOCK_SIZES:
        for batch, context_len in DECODE_SHAPES:
            arguments = decode_case(batch, context_len, block_size, generator)
            q, k_cache, v_cache, lens, block_tables, scale = arguments
            wide_arguments = (q, k_cache, v_cache, lens, widen(block_tables, block_size), scale)
            wide_capacity = wide_arguments[4].shape[1] * block_size
            tile = attention_triton._DECODE_KV_TILE
            microseconds = time_microseconds(lambda: paged_decode_attention_triton(*arguments))
            graph_microseconds = time_with_cuda_graph_microseconds(lambda: paged_decode_attention_triton(*arguments))
            wide_microseconds = time_microseconds(lambda: paged_decode_attention_triton(*wide_arguments))
            wide_graph_microseconds = time_with_cuda_graph_microseconds(
                lambda: paged_decode_attention_triton(*wide_arguments)
            )
            old_partition = legacy_partition_size(batch, wide_capacity, streaming_multiprocessors)
            old_wide_microseconds = time_microseconds(
                lambda: paged_decode_attention_triton(*wide_arguments, partition_size=old_partition)
            )
            one_partition = triton.cdiv(block_tables.shape[1] * block_size, tile) * tile
            one_partition_microseconds = time_microseconds(
                lambda: paged_decode_attention_triton(*arguments, partition_size=one_partition)
            )
            gigabytes_per_second = kv_bytes(batch, context_len) / microseconds / 1e3
            row = {
                "block_size": block_size,
                "batch": batch,
                "context": context_len,
                "partitions": decode_num_partitions(batch, TIMED_KV_HEADS, streaming_multiprocessors),
                "kv_megabytes": kv_bytes(batch, context_len) / 1e6,
                "microseconds": microseconds,
                "gigabytes_per_second": gigabytes_per_second,
                "percent_of_copy": 100 * gigabytes_per_second / copy_gigabytes_per_second,
                "graph_microseconds": graph_microseconds,
                "wide_microseconds": wide_microseconds,
                "wide_graph_microseconds": wide_graph_microseconds,
                "old_split_wide_microseconds": old_wide_microseconds,
                "one_partition_microseconds": one_partition_microseconds,
            }
            rows.append(row)

            def optional(value: float | None) -> str:
                return f"{value:8.1f}" if value is not None else f"{'n/a':>8}"

            log(f"{block_size:>5} {batch:>5} {context_len:>7} {row['partitions']:>5} {row['kv_megabytes']:>8.1f} "
                f"{microseconds:>8.1f} {gigabytes_per_second:>7.0f} {row['percent_of_copy']:>5.0f} "
                f"{optional(graph_microseconds)} {wide_microseconds:>8.1f} {optional(wide_graph_microseconds)} "
                f"{old_wide_microseconds:>8.1f} {one_partition_microseconds:>9.1f}")
            del arguments, wide_arguments, q, k_cache, v_cache
    return rows


DECODE_DEFAULTS = (
    "_DECODE_KV_TILE", "_DECODE_NUM_WARPS", "_DECODE_NUM_STAGES", "_PROGRAMS_PER_SM", "_ROUND_PARTITIONS_UP"
)
# (tile, warps, stages, programs per SM, round the partition count up); the first is the first version's choice.
DECODE_SWEEP = [
    (64, 4, 3, 4, True), (64, 4, 3, 4, False), (64, 4, 3, 2, False), (64, 4, 3, 3, False), (64, 4, 3, 5, False),
    (64, 4, 3, 6, False), (64, 4, 3, 8, False), (64, 4, 2, 4, False), (64, 4, 4, 4, False), (64, 8, 3, 4, False),
    (128, 4, 2, 3, False), (128, 4, 3, 3, False), (128, 8, 3, 3, False), (32, 4, 4, 6, False),
]
SWEEP_DECODE_SHAPES = [(1, 2048), (32, 2048), (64, 2048), (128, 2048), (256, 2048), (4, 8192), (16, 8192), (1, 32768),
                       (8, 32768)]
PREFILL_DEFAULTS = ("_PREFILL_ROWS", "_KV_TILE", "_PREFILL_NUM_WARPS", "_PREFILL_NUM_STAGES")
PREFILL_SWEEP = [
    (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)
]


def with_settings(names: tuple, values: tuple, function):
    saved = [getattr(attention_triton, name) for name in names]
    try:
        for name, value in zip(names, values):
            setattr(attention_triton, name, value)
        return function()
    finally:
        for name, value in zip(names, saved):
            setattr(attention_triton, name, value)


def compiled_kernel_report() -> list[str]:
    """Registers, spills and shared memory of every compiled decode-partition kernel, and how many programs of
    it fit on one SM (65536 registers, 227 KiB of shared memory, 64 warps)."""
    lines: list[str] = []
    try:
        for device_cache in attention_triton._decode_partition_kernel.device_caches.values():
            for compiled in device_cache[0].values():
                compiled._init_handles()
                warps = compiled.metadata.num_warps
                shared = compiled.metadata.shared
                by_registers = 65536 // max(1, compiled.n_regs * 32 * warps)
                by_shared = 232448 // max(1, shared)
                resident = min(by_registers, by_shared, 64 // warps)
                lines.append(f"  decode kernel, warps={warps} stages={compiled.metadata.num_stages}: "
                             f"{compiled.n_regs} regs, {compiled.n_spills} spills, {shared} B shared -> "
                             f"{resident} programs/SM")
    except Exception as error:  # noqa: BLE001 - internals differ between Triton versions
        lines.append(f"  (no kernel report: {error!r})")
    # Every variant compiled so far (the checks' shapes too), each distinct line once with its count.
    return [f"{line} (x{lines.count(line)})" for line in dict.fromkeys(lines)]


def sweep(seed: int, copy_gigabytes_per_second: float) -> dict:
    """Decode (block 256, CUDA graph replay, so no launch overhead) and prefill (L2 flushed) timings over launch
    configurations; each output is compared with the default configuration's."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    shapes = SWEEP_DECODE_SHAPES
    log()
    log(f"sweep, decode block 256, CUDA graph replay: GB/s (us) per (tile, warps, stages, programs/SM, round up); "
        f"copy = {copy_gigabytes_per_second:.0f} GB/s; ! = output differs from the default's by > {ATOL}")
    log(f"{'config':>22} " + " ".join(f"{f'{b}x{c}':>14}" for b, c in shapes))
    decode_results = []
    for config in DECODE_SWEEP:
        decode_results.append({"config": config, "microseconds": [], "max_abs_difference": 0.0})
    cells = [[] for _ in DECODE_SWEEP]
    for batch, context_len in shapes:
        arguments = decode_case(batch, context_len, 256, generator)
        reference = paged_decode_attention_triton(*arguments)
        for entry, row_cells in zip(decode_results, cells):
            config = entry["config"]
            try:
                actual = with_settings(DECODE_DEFAULTS, config, lambda: paged_decode_attention_triton(*arguments))
                difference = (actual.float() - reference.float()).abs().max().item()
                entry["max_abs_difference"] = max(entry["max_abs_difference"], difference)
                microseconds = with_settings(
                    DECODE_DEFAULTS,
                    config,
                    lambda: time_with_cuda_graph_microseconds(lambda: paged_decode_attention_triton(*arguments)),
                )
                entry["microseconds"].append(microseconds)
                bad = "!" if difference > ATOL else ""
                row_cells.append(f"{kv_bytes(batch, context_len) / microseconds / 1e3:6.0f}({microseconds:6.1f}){bad}")
            except Exception as error:  # noqa: BLE001 - a configuration that does not compile is a result
                entry["microseconds"].append(None)
                entry["error"] = repr(error)[:200]
                row_cells.append(f"{'error':>14}")
        del arguments, reference
    for entry, row_cells in zip(decode_results, cells):
        log(f"{str(entry['config']):>22} " + " ".join(row_cells))
    for line in compiled_kernel_report():
        log(line)

    batch, prompt_len = PREFILL_SHAPE
    prefill_arguments = prefill_case(batch, prompt_len, generator)
    reference = paged_prefill_attention_triton(*prefill_arguments)
    log(f"sweep, prefill {batch} x {prompt_len} block 256, ms per (rows, tile, warps, stages)")
    prefill_results = []
    for config in PREFILL_SWEEP:
        entry = {"config": config}
        try:
            actual = with_settings(PREFILL_DEFAULTS, config, lambda: paged_prefill_attention_triton(*prefill_arguments))
            entry["max_abs_difference"] = (actual.float() - reference.float()).abs().max().item()
            entry["microseconds"] = with_settings(
                PREFILL_DEFAULTS,
                config,
                lambda: time_microseconds(lambda: paged_prefill_attention_triton(*prefill_arguments)),
            )
            log(f"{str(config):>16} {entry['microseconds'] / 1e3:8.3f} ms  "
                f"(max diff {entry['max_abs_difference']:.1e})")
        except Exception as error:  # noqa: BLE001
            entry["error"] = repr(error)[:200]
            log(f"{str(config):>16} error {entry['error']}")
        prefill_results.append(entry)
    return {"decode": decode_results, "prefill": prefill_results}


def prefill_case(batch: int, prompt_len: int, generator: torch.Generator) -> tuple:
    block_size = 256
    k_cache, v_cache, block_tables = random_paged_cache(
        [prompt_len] * batch, block_size, TIMED_KV_HEADS, TIMED_HEAD_DIM, generator
    )
    q = torch.randn((batch * prompt_len, TIMED_HEADS, TIMED_HEAD_DIM), generator=generator, device=DEVICE).to(DTYPE)
    cu_seqlens_q = torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * prompt_len
    lens = torch.full((batch,), prompt_len, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, cu_seqlens_q, lens, block_tables, TIMED_HEAD_DIM**-0.5


def time_prefill(seed: int) -> dict:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    (batch, prompt_len), block_size = PREFILL_SHAPE, 256
    arguments = prefill_case(batch, prompt_len, generator)
    q, scale = arguments[0], arguments[-1]
    paged = time_microseconds(lambda: paged_prefill_attention_triton(*arguments))
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


def section(name: str, function, failures: list[str]):
    """Run one part of the check; a crash is logged with its traceback and counted as a failure, and the
    remaining parts still run."""
    try:
        return function()
    except Exception:  # noqa: BLE001
        failures.append(name)
        log(f"{name} CRASHED:")
        for line in traceback.format_exc().splitlines():
            log("  " + line)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="also time several launch configurations")
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_attention_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    properties = torch.cuda.get_device_properties(0)
    log(f"{datetime.datetime.now().isoformat(timespec='seconds')} {torch.cuda.get_device_name(0)} "
        f"({properties.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}")
    crashed: list[str] = []
    copy = section("copy bandwidth", copy_bandwidth_gigabytes_per_second, crashed) or float("nan")
    log(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
    checks = section("checks", lambda: run_checks(arguments.seed), crashed) or []
    decode_rows = section("decode timing", lambda: time_decode(arguments.seed, copy), crashed)
    prefill = section("prefill timing", lambda: time_prefill(arguments.seed), crashed)
    tuning = section("sweep", lambda: sweep(arguments.seed, copy), crashed) if arguments.sweep else None
    output_dir = os.environ.get("OUT")
    if output_dir:
        with open(os.path.join(output_dir, "check_attention_gpu.json"), "w") as json_file:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(0),
                    "copy_gigabytes_per_second": copy,
                    "checks": checks,
                    "decode": decode_rows,
                    "prefill": prefill,
                    "sweep": tuning,
                    "crashed": crashed,
                },
                json_file,
                indent=1,
            )
    passed = bool(checks) and all(result["passed"] for result in checks) and not crashed
    log(f"RESULT: {'PASS' if passed else 'FAIL'}" + (f" (crashed: {', '.join(crashed)})" if crashed else ""))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
