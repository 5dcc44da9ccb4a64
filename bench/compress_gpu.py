"""GPU check and timing of the compression kernels (run on a GPU; results go to docs/compression.md).

Part A — correctness in bfloat16: the Triton pipeline (`zipage.kernels.compress_triton`) against the torch
reference (`compress_ref`, run on the GPU in float32 from the same bfloat16 inputs) on random batches shaped like
Qwen3-8B (32 query / 8 KV heads, head_dim 128: GQA 8), SmolLM2 (9 / 3, head_dim 64: GQA 3) and an MHA model
(8 / 8, head_dim 128), 3 layers in the group, block sizes 256 and 16, N_max = 9: three requests with ragged block
counts, a shared prefix block, targets that are fresh blocks, the request's own blocks in place, and own blocks
moved up (the staged compaction); redundancy lightning / flash / off with pooling and the global score on and off.
Checked per case: final and global scores (tolerance), kept sets (equal, or differing only at ties with the
k-th score), and the K / V / score caches bit for bit against the reference compaction of Triton's kept sets
(and against the reference pipeline outright when all kept sets agree).

Part B — timing, Qwen3-8B (random weights) built by the engine in bfloat16, block 256, budget 2048 (N_max 9):
the engine's `Compressor.run` on batches of 1 x 9 blocks, 8 x 9 blocks and 1 x 33 blocks, for layer stride
1 / 4 / 8 / 36 (all) and redundancy lightning / flash / off, next to one decode step of 128 requests x 2k context
(CUDA graph); and the time of each stage at layer stride 8 (the paper's kernel timing figure).

Part C — asynchronous vs synchronous compression: the engine's step loop syncs every step (sampling), so a step is
"enqueue, run, wait". Decode steps of the same 128 x 2k batch alone; with a compression run first on the main
stream (sync); and while the compression batch runs on the compressor's side stream (async, `Compressor.launch`),
stepping until `Compressor.completed()` reports it: the inflation of those steps and how much of the compression
time the overlap hides.

    python bench/compress_gpu.py [--parts A,B,C] [--smoke]

`--smoke` runs part A on tiny shapes in float16 on any device (on the CPU under TRITON_INTERPRET=1) to check the
script.
Prints the tables last; writes compress_gpu.json (and compress_gpu.log) under $OUT, or
runs/compress_gpu/ of the repository.
Exits 1 if a check fails or a part crashes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from zipage.kernels import compress_triton
from zipage.kernels.compress import CompressionInputs
from zipage.kernels.compress_ref import CompressionParams, compress_ref, final_scores, kept_entries, write_kept_entries

# $OUT when set (the GPU harness collects it), else the ignored runs/ of the repository.
OUT = Path(os.environ.get("OUT")
           or Path(__file__).resolve().parents[1] / "runs" / "compress_gpu")
LOG_LINES: list[str] = []
N_MAX = 9
WINDOW = 16  # capped at half a block (the kernels' rule) for block 16
# Final and global scores: float32 on both sides from the same bfloat16 inputs; the kernels' dots sum in another
# order, exp2 replaces exp, the cosine divides after the dot. Scores are ~1 / length, so 1e-6 absolute is tight.
SCORE_ATOL, SCORE_RTOL = 1e-6, 1e-4
CHECK_SHAPES = [("qwen3-8b", 32, 8, 128), ("smollm2", 9, 3, 64), ("mha", 8, 8, 128)]
CHECK_MODES = [
    # (redundancy, pooling, global score)
    ("lightning", "first", True),
    ("flash", "always", True),
    ("off", "off", False),
    ("lightning", "always", False),
]
CONTEXT = 2048
DECODE_BATCH = 128
TIMED_BATCHES = [(1, 9), (8, 9), (1, 33)]  # requests x source blocks
TIMED_STRIDES = [1, 4, 8, 36]
REDUNDANCY_MODES = ["lightning", "flash", "off"]
# Part C: (requests, source blocks), redundancy, layer stride.
ASYNC_CONFIGURATIONS = [((8, 9), "lightning", 8), ((8, 9), "flash", 8), ((1, 9), "lightning", 8),
                        ((8, 9), "lightning", 1), ((1, 33), "lightning", 8)]


def log(line: str = "") -> None:
    print(line, flush=True)
    LOG_LINES.append(line)
    (OUT / "compress_gpu.log").write_text("\n".join(LOG_LINES) + "\n")


# ---------------------------------------------------------------- part A: correctness


Batch = CompressionInputs  # the pipeline's inputs, as the engine's compressor builds them


def random_batch(layers: int, query_heads: int, kv_heads: int, head_dim: int, block_size: int, counts: list[int],
                 dtype: torch.dtype, device: str, seed: int) -> Batch:
    """Three requests over a cache of random values. Request 0 and 2 share their first block (a prefix; targets:
    a fresh block, then their own blocks at the same index, compacted in place); request 1's second block is
    request 2's last (a shared block in the middle), so its targets are its own blocks moved up an index (the
    staged compaction). A quarter of the keys copy another key of the same block (a few of another block) plus
    noise, so the redundancy's threshold rule has work to do; random pairs sit near similarity 0."""
    generator = torch.Generator().manual_seed(seed)
    targets_per_request = N_MAX - 1
    num_blocks = sum(counts) + 4
    shape = (layers, num_blocks, block_size, kv_heads, head_dim)
    keys = torch.randn(shape, generator=generator)
    copies = num_blocks * block_size // 4
    blocks = torch.randint(0, num_blocks, (copies, 2), generator=generator)
    entries = torch.randint(0, block_size, (copies, 2), generator=generator)
    layer_of_copy = torch.randint(0, layers, (copies,), generator=generator)
    same_block = torch.rand(copies, generator=generator) < 0.875
    copied_blocks = torch.where(same_block, blocks[:, 0], blocks[:, 1])
    keys[layer_of_copy, blocks[:, 0], entries[:, 0]] = keys[layer_of_copy, copied_blocks, entries[:, 1]] + 0.2 * (
        torch.randn((copies, kv_heads, head_dim), generator=generator))
    order = iter(torch.randperm(num_blocks, generator=generator).tolist())
    prefix, middle = next(order), next(order)
    first = [prefix] + [next(order) for _ in range(counts[0] - 1)]
    second = [next(order), middle] + [next(order) for _ in range(counts[1] - 2)]
    third = [prefix] + [next(order) for _ in range(counts[2] - 2)] + [middle]
    targets = [
        [next(order)] + first[1:targets_per_request],
        [block for block in second if block != middle][:targets_per_request],
        [next(order)] + third[1:targets_per_request],
    ]
    source_tables = torch.full((3, max(counts)), -1, dtype=torch.int32)
    for row, table in enumerate((first, second, third)):
        source_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
    window = min(WINDOW, block_size // 2)
    query_cache = torch.randn((layers, 4, window, query_heads, head_dim), generator=generator)
    # Earlier global scores of the size of this compression's attention scores, so the decayed max picks both.
    score_cache = torch.rand(shape[:4], generator=generator) * 2 / (max(counts) * block_size)
    return Batch(
        k_cache=keys.to(dtype).to(device),
        v_cache=torch.randn(shape, generator=generator).to(dtype).to(device),
        score_cache=score_cache.to(dtype).to(device),
        query_cache=query_cache.to(dtype).to(device),
        source_tables=source_tables.to(device),
        num_source_blocks=torch.tensor(counts, dtype=torch.int32, device=device),
        target_tables=torch.tensor(targets, dtype=torch.int32, device=device),
        query_slots=torch.tensor([2, 0, 3], dtype=torch.int64, device=device),
        is_compressed=torch.tensor([False, True, True], device=device),
    )


def check_case(batch: Batch, params: CompressionParams, scale: float) -> dict:
    """Triton against the reference on one batch; returns the measured errors and PASS/FAIL."""
    keep = batch.target_tables.shape[1] * params.block_size
    final, scores = compress_triton.compression_scores_triton(
        batch.k_cache, batch.score_cache, batch.query_cache, batch.source_tables, batch.num_source_blocks,
        batch.query_slots, batch.is_compressed, params, scale)
    kept = kept_entries(final, keep)
    result = batch.clone()
    compress_triton.compress_triton(*result.arguments(params, scale))
    from_kept = batch.clone()
    score_error = stored_error = 0.0
    scores_ok = True
    differing = tied = 0
    for request, count in enumerate(batch.num_source_blocks.tolist()):
        source = batch.source_tables[request, :count].long()
        length = count * params.block_size
        for layer in range(batch.k_cache.shape[0]):
            keys = batch.k_cache[layer, source].flatten(0, 1)
            previous = batch.score_cache[layer, source].flatten(0, 1).transpose(0, 1)
            expected, stored = final_scores(keys, batch.query_cache[layer, batch.query_slots[request]], previous,
                                            bool(batch.is_compressed[request]), params, scale)
            got = final[layer, request, :, :length]
            finite = torch.isfinite(expected)
            scores_ok &= bool(torch.equal(torch.isinf(got), torch.isinf(expected)))
            scores_ok &= bool(torch.all(final[layer, request, :, length:] == float("-inf")))
            scores_ok &= torch.allclose(got[finite], expected[finite], atol=SCORE_ATOL, rtol=SCORE_RTOL)
            score_error = max(score_error, (got[finite] - expected[finite]).abs().max().item())
            if stored is not None:
                got_stored = scores[layer, request, :, :length]
                scores_ok &= torch.allclose(got_stored, stored, atol=SCORE_ATOL, rtol=SCORE_RTOL)
                stored_error = max(stored_error, (got_stored - stored).abs().max().item())
            expected_kept = kept_entries(expected, keep)
            for head in range(expected.shape[0]):
                different = set(kept[layer, request, head].tolist()) ^ set(expected_kept[head].tolist())
                if different:
                    differing += len(different)
                    cut = expected[head].topk(keep).values[-1]
                    distance = (expected[head, sorted(different)] - cut).abs()
                    tied += int((distance <= SCORE_ATOL + SCORE_RTOL * cut.abs()).sum())
            write_kept_entries(from_kept.k_cache[layer], from_kept.v_cache[layer],
                               from_kept.score_cache[layer] if params.global_score else None, source,
                               batch.target_tables[request].long(), kept[layer, request],
                               scores[layer, request, :, :length])
    caches_ok = all(torch.equal(got, expected) for got, expected in (
        (result.k_cache, from_kept.k_cache), (result.v_cache, from_kept.v_cache),
        (result.score_cache, from_kept.score_cache)))
    reference_ok = None
    if differing == 0:
        reference = batch.clone()
        compress_ref(*reference.arguments(params, scale))
        reference_ok = (torch.equal(result.k_cache, reference.k_cache)
                        and torch.equal(result.v_cache, reference.v_cache)
                        # Stored in bfloat16: a score a rounding step apart may round to the neighbouring value.
                        and torch.allclose(result.score_cache.float(), reference.score_cache.float(), atol=1e-7,
                                           rtol=1e-2))
    passed = scores_ok and caches_ok and tied == differing and reference_ok is not False
    return dict(score_error=score_error, stored_error=stored_error, kept_differing=differing,
                kept_differing_at_ties=tied, caches_match_reference_compaction=caches_ok,
                caches_match_reference_pipeline=reference_ok, passed=passed)


def part_a(smoke: bool, device: str) -> list[dict]:
    rows = []
    # The Triton interpreter mis-computes bfloat16 dots: the smoke run uses float16.
    dtype = torch.float16 if smoke else torch.bfloat16
    shapes = [("tiny", 6, 2, 64)] if smoke else CHECK_SHAPES
    block_sizes = [16] if smoke else [256, 16]
    layers = 2 if smoke else 3
    for name, query_heads, kv_heads, head_dim in shapes:
        for block_size in block_sizes:
            # 20 blocks: the score kernel merges its softmax statistics over two chunks of 16 blocks.
            counts = [N_MAX + 1, N_MAX, N_MAX + 11] if not smoke else [N_MAX + 1, N_MAX, N_MAX]
            batch = random_batch(layers, query_heads, kv_heads, head_dim, block_size, counts, dtype, device,
                                 seed=block_size + head_dim)
            for redundancy, pooling, global_score in CHECK_MODES:
                params = CompressionParams(block_size=block_size, window=min(WINDOW, block_size // 2),
                                           redundancy=redundancy,
                                           pooling=pooling, global_score=global_score)
                row = dict(shape=name, dtype=str(dtype), group=query_heads // kv_heads, head_dim=head_dim,
                           block_size=block_size, redundancy=redundancy, pooling=pooling, global_score=global_score)
                try:
                    row |= check_case(batch, params, head_dim**-0.5)
                except Exception:
                    row |= dict(passed=False, error=traceback.format_exc())
                    log(row["error"])
                rows.append(row)
                log(f"A {name:<9} G{row['group']} b{block_size:<4} {redundancy:<9} {pooling:<6} "
                    f"global={int(global_score)}: {'PASS' if row['passed'] else 'FAIL'} "
                    f"score err {row.get('score_error', float('nan')):.2e} "
                    f"kept differing {row.get('kept_differing', '-')}")
    return rows


# ---------------------------------------------------------------- parts B and C: the engine


def build_qwen3_engine():
    from zipage.config import ZipageConfig
    from zipage.core.deployment import ReplaySettings
    from zipage.engine.builder import build_engine

    # 128 x 8 decode blocks + 33 compression blocks (and their query slots), with room to spare.
    settings = ReplaySettings(model="random:qwen3-8b", dtype="bfloat16", kv_memory_gb=46,
                              config=ZipageConfig(compress=True, max_num_seqs=DECODE_BATCH,
                                                  max_model_len=CONTEXT + 256))
    return build_engine(settings, "cuda", cuda_graphs=True)


def decode_batch(engine):
    """128 requests that each decode the token at KV index 2047 (2048 entries, 8 full blocks)."""
    from zipage.core.sequence import Sequence

    manager = engine.new_scheduler().block_manager
    sequences, tokens = [], {}
    for index in range(DECODE_BATCH):
        seq = Sequence(f"d{index}", None, 16, prompt_len=CONTEXT - 1)
        seq.block_table = [manager.allocate() for _ in range(CONTEXT // engine.config.block_size)]
        seq.set_counters(CONTEXT - 1, 1)
        sequences.append(seq)
        tokens[seq.seq_id] = [index]
    return manager, sequences, tokens


def compression_jobs(engine, manager, requests: int, blocks: int) -> list:
    """Jobs as the core hands them out for requests at their trigger: `blocks` full blocks of random K/V and
    window queries, targets = their own first N_max - 1 blocks (in place). A 9-block request was compressed
    before (the steady state); a longer one is at its first compression (a long prompt)."""
    from zipage.core.sequence import Sequence
    from zipage.core.step import CompressionJob

    runner = engine.runner
    jobs = []
    for request in range(requests):
        table = [manager.allocate() for _ in range(blocks)]
        index = torch.tensor(table, device=runner.device)
        for cache in (runner.kv_cache[0], runner.kv_cache[1]):
            cache[:, index] = torch.randn_like(cache[:, index])
        if runner.score_cache is not None:
            runner.score_cache[:, index] = torch.rand_like(runner.score_cache[:, index]) / (
                blocks * engine.config.block_size)
        runner.query_cache[:, request] = torch.randn_like(runner.query_cache[:, request])
        seq = Sequence(f"c{request}", None, 16, prompt_len=blocks * engine.config.block_size)
        jobs.append(CompressionJob(seq=seq, source_table=table, target_blocks=table[:N_MAX - 1],
                                   new_block=table[N_MAX - 1], released=table[N_MAX:], query_slot=request,
                                   is_first=blocks > N_MAX))
    return jobs


def cuda_time(function, repeats: int) -> float:
    """Seconds per call of `function`, from events around `repeats` back-to-back calls (GPU time, unless the host
    launches slower than the GPU runs)."""
    function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def wall_time(function, repeats: int) -> float:
    """Median seconds from calling `function` to the GPU finishing its work (host overhead included)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        function()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def set_compression(compressor, stride: int, redundancy: str) -> None:
    compressor.layer_stride = stride
    compressor.params = dataclasses.replace(compressor.params, redundancy=redundancy)


class Steps:
    """Whole engine steps (`ModelRunner.execute`: compressions of the plan, decode, sampling, tokens back on the
    host) of the 128-request decode batch."""

    def __init__(self, engine, sequences, tokens) -> None:
        from zipage.core.sampling import SamplingParams

        self.runner = engine.runner
        self.sequences = sequences
        self.tokens = tokens
        for seq in sequences:
            seq.sampling = SamplingParams(temperature=0.0)
        self.step_id = 0

    def run(self, compress_sync=(), compress_launch=None) -> float:
        """One step; wall seconds until its tokens are on the host."""
        from zipage.core.step import DECODE, StepPlan

        self.step_id += 1
        plan = StepPlan(step_id=self.step_id, kind=DECODE, decode=self.sequences,
                        compress_sync=list(compress_sync), compress_launch=compress_launch)
        started = time.perf_counter()
        self.runner.execute(plan, self.tokens)
        return time.perf_counter() - started


def part_b(engine, steps: Steps, jobs_by_batch) -> dict:
    compressor = engine.runner.compressor
    for _ in range(3):
        steps.run()
    decode_s = statistics.median(steps.run() for _ in range(20))
    log(f"B decode step, {DECODE_BATCH} x {CONTEXT}: {decode_s * 1e3:.2f} ms")
    rows = []
    for (requests, blocks), jobs in jobs_by_batch.items():
        for redundancy in REDUNDANCY_MODES:
            for stride in TIMED_STRIDES:
                set_compression(compressor, stride, redundancy)
                run = lambda: compressor.run(jobs)  # noqa: E731
                run()
                seconds = wall_time(run, 3 if redundancy == "flash" and blocks > N_MAX else 10)
                torch.cuda.synchronize()
                started = time.perf_counter()
                run()
                launch = time.perf_counter() - started
                torch.cuda.synchronize()
                rows.append(dict(requests=requests, blocks=blocks, redundancy=redundancy, layer_stride=stride,
                                 compress_s=seconds, launch_s=launch, vs_decode=seconds / decode_s))
                log(f"B {requests} x {blocks} blocks, {redundancy:<9} stride {stride:>2}: {seconds * 1e3:8.2f} ms "
                    f"(host launch {launch * 1e3:.2f} ms) = {seconds / decode_s:.2f} decode steps")
    stages = []
    for (requests, blocks), jobs in jobs_by_batch.items():
        for redundancy in REDUNDANCY_MODES[:2]:
            stages.append(dict(requests=requests, blocks=blocks, redundancy=redundancy)
                          | stage_times(engine, jobs, redundancy, 8))
            log(f"B stages {requests} x {blocks} {redundancy}: " + ", ".join(
                f"{name} {value * 1e3:.3f} ms" for name, value in stages[-1].items() if name.endswith("_s")))
    set_compression(compressor, engine.config.layer_stride, engine.config.redundancy)
    return dict(decode_s=decode_s, rows=rows, stages=stages)


def engine_arguments(compressor, jobs, stride: int) -> tuple[tuple, dict]:
    """The arguments the engine's compressor passes to `compress` for its first group of `stride` layers."""
    captured = []
    saved = compressor.compress_fn, compressor.layer_stride
    compressor.compress_fn = lambda *arguments, **keywords: captured.append((arguments, keywords))
    compressor.layer_stride = stride
    try:
        compressor.run(jobs)
    finally:
        compressor.compress_fn, compressor.layer_stride = saved
    return captured[0]


def stage_times(engine, jobs, redundancy: str, stride: int) -> dict:
    """Seconds of each stage over all layers: one group of `stride` layers, times the number of groups."""
    compressor = engine.runner.compressor
    (k_cache, v_cache, score_cache, query_cache), keywords = engine_arguments(compressor, jobs, stride)
    params = dataclasses.replace(keywords["params"], redundancy=redundancy)
    scale = keywords["scale"]
    source, counts = keywords["source_tables"], keywords["num_source_blocks"]
    targets, slots, compressed = keywords["target_tables"], keywords["query_slots"], keywords["is_compressed"]
    keep = targets.shape[1] * params.block_size
    scores = compress_triton.attention_scores_triton(k_cache, score_cache, query_cache, source, counts, slots,
                                                     compressed, params, scale)
    redundancy_sums = compress_triton.redundancy_triton(k_cache, source, counts, params)
    final = compress_triton.final_scores_triton(scores, redundancy_sums.clone(), counts, compressed, params)
    kept = kept_entries(final, keep)
    # The final-score kernel writes over its input: each timed run gets the previous run's output, which costs
    # the same (the work does not depend on the values).
    scratch = redundancy_sums.clone()
    stages = {
        "attention_and_global_s": lambda: compress_triton.attention_scores_triton(
            k_cache, score_cache, query_cache, source, counts, slots, compressed, params, scale),
        "redundancy_s": lambda: compress_triton.redundancy_triton(k_cache, source, counts, params),
        "pooling_and_final_s": lambda: compress_triton.final_scores_triton(scores, scratch, counts, compressed,
                                                                           params),
        "top_k_s": lambda: kept_entries(final, keep),
        "compaction_s": lambda: compress_triton.compact_triton(
            k_cache, v_cache, score_cache, source, counts, targets, kept, scores, params.global_score),
    }
    groups = -(-engine.runner.shape.num_layers // stride)
    return {name: cuda_time(function, 10) * groups for name, function in stages.items()}


def part_c(engine, steps: Steps, jobs_by_batch, sm_limits=(None,)) -> list[dict]:
    rows = []
    compressor = engine.runner.compressor
    for num_sms in sm_limits:
        try:
            compressor.completed(wait=True)  # a failed row may have left a batch in flight
            compressor.limit_sms(num_sms)
            rows += part_c_rows(engine, steps, jobs_by_batch, num_sms)
        except Exception:
            log(f"C with the compressor on {num_sms} SMs failed:\n{traceback.format_exc()}")
    compressor.completed(wait=True)
    compressor.limit_sms(None)
    return rows


def part_c_rows(engine, steps: Steps, jobs_by_batch, num_sms) -> list[dict]:
    from zipage.core.step import CompressionBatch

    compressor = engine.runner.compressor
    rows = []
    for batch_index, ((requests, blocks), redundancy, stride) in enumerate(ASYNC_CONFIGURATIONS):
        jobs = jobs_by_batch[requests, blocks]
        set_compression(compressor, stride, redundancy)
        steps.run(compress_sync=jobs)
        alone = statistics.median(steps.run() for _ in range(20))
        synchronous = statistics.median(steps.run(compress_sync=jobs) for _ in range(5))
        overlapped_runs = []
        for repeat in range(3):
            torch.cuda.synchronize()
            batch = CompressionBatch(batch_id=batch_index * 10 + repeat, jobs=jobs)
            overlapped = [steps.run(compress_launch=batch)]
            while not compressor.completed():
                overlapped.append(steps.run())
            overlapped_runs.append(overlapped)
        overlapped = min(overlapped_runs, key=sum)
        extra_async = sum(overlapped) - len(overlapped) * alone
        extra_sync = synchronous - alone
        row = dict(requests=requests, blocks=blocks, redundancy=redundancy, layer_stride=stride,
                   compressor_sms=num_sms or "all",
                   decode_alone_s=alone, sync_step_s=synchronous, async_steps=len(overlapped),
                   async_step_s=sum(overlapped) / len(overlapped), async_first_step_s=overlapped[0],
                   inflation=sum(overlapped) / len(overlapped) / alone - 1, async_extra_s=extra_async,
                   sync_extra_s=extra_sync, hidden=1 - extra_async / extra_sync if extra_sync > 0 else None)
        rows.append(row)
        log(f"C {requests} x {blocks} {redundancy} stride {stride} on {num_sms or 'all'} SMs: "
            f"alone {alone * 1e3:.2f} ms, sync step "
            f"{synchronous * 1e3:.2f} ms, async {len(overlapped)} steps of {row['async_step_s'] * 1e3:.2f} ms "
            f"(+{100 * row['inflation']:.1f}%), hidden {row['hidden']}")
    set_compression(compressor, engine.config.layer_stride, engine.config.redundancy)
    return rows


def print_tables(report: dict) -> None:
    log("")
    checks = report.get("checks", [])
    if checks:
        log(f"A. Triton vs reference, {checks[0]['dtype']} (final/global score tolerance {SCORE_ATOL:g} + "
            f"{SCORE_RTOL:g} x |score|; caches bit for bit)")
        log(f"{'shape':<9} {'G':>2} {'b':>4} {'redundancy':<10} {'pooling':<7} {'global':<6} {'score err':>9} "
            f"{'global err':>10} {'kept diff':>9} {'caches':<6} {'result':<6}")
    for row in checks:
        log(f"{row['shape']:<9} {row['group']:>2} {row['block_size']:>4} {row['redundancy']:<10} "
            f"{row['pooling']:<7} {str(row['global_score']):<6} {row.get('score_error', float('nan')):>9.1e} "
            f"{row.get('stored_error', float('nan')):>10.1e} {row.get('kept_differing', '-'):>9} "
            f"{str(row.get('caches_match_reference_compaction', '-')):<6} {'PASS' if row['passed'] else 'FAIL'}")
    timing = report.get("timing")
    if timing:
        decode = timing["decode_s"]
        log("")
        log(f"B. Compression time per batch, Qwen3-8B bfloat16, block 256, N_max 9 (ms; x = decode steps of "
            f"{DECODE_BATCH} x {CONTEXT} = {decode * 1e3:.2f} ms)")
        for (requests, blocks) in TIMED_BATCHES:
            log(f"  {requests} x {blocks} blocks   " + "".join(f"{'stride ' + str(s):>18}" for s in TIMED_STRIDES))
            for redundancy in REDUNDANCY_MODES:
                cells = []
                for stride in TIMED_STRIDES:
                    row = next(row for row in timing["rows"] if (row["requests"], row["blocks"], row["redundancy"],
                                                                 row["layer_stride"]) == (requests, blocks,
                                                                                          redundancy, stride))
                    cells.append(f"{row['compress_s'] * 1e3:9.2f} ({row['vs_decode']:4.2f}x)")
                log(f"  {redundancy:<16}" + "".join(f"{cell:>18}" for cell in cells))
        log("")
        log("B. Stages at layer stride 8, all 36 layers (GPU ms)")
        names = ["attention_and_global_s", "redundancy_s", "pooling_and_final_s", "top_k_s", "compaction_s"]
        log(f"  {'batch':<14} {'redundancy':<10} " + " ".join(f"{name[:-2]:>22}" for name in names))
        for row in timing["stages"]:
            log(f"  {str(row['requests']) + ' x ' + str(row['blocks']):<14} {row['redundancy']:<10} "
                + " ".join(f"{row[name] * 1e3:>22.3f}" for name in names))
    if report.get("async"):
        log("")
        log(f"C. Engine steps ({DECODE_BATCH} x {CONTEXT} decode) with a compression batch: sync (in the step, "
            "before the decode) vs async (side stream)")
        log(f"  {'batch':<10} {'redundancy':<10} {'stride':>6} {'SMs':>4} {'alone ms':>9} "
            f"{'sync ms':>8} {'async steps':>11} "
            f"{'async ms/step':>13} {'inflation':>9} {'hidden':>7}")
        for row in report["async"]:
            hidden = f"{100 * row['hidden']:.0f}%" if row["hidden"] is not None else "-"
            log(f"  {str(row['requests']) + ' x ' + str(row['blocks']):<10} {row['redundancy']:<10} "
                f"{row['layer_stride']:>6} {str(row.get('compressor_sms', 'all')):>4} "
                f"{row['decode_alone_s'] * 1e3:>9.2f} {row['sync_step_s'] * 1e3:>8.2f} "
                f"{row['async_steps']:>11} {row['async_step_s'] * 1e3:>13.2f} {100 * row['inflation']:>8.1f}% "
                f"{hidden:>7}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="A,B,C")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--compressor-sms", default="all",
                        help="part C: comma-separated SM limits for async batches ('all' = none)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    log(f"device {report['device']}, torch {torch.__version__}")
    failed = False
    parts = args.parts.split(",") if not args.smoke else ["A"]
    if "A" in parts:
        report["checks"] = part_a(args.smoke, device)
        failed |= not all(row["passed"] for row in report["checks"])
        if device == "cuda":
            torch.cuda.empty_cache()
    if {"B", "C"} & set(parts):
        try:
            engine = build_qwen3_engine()
            manager, sequences, tokens = decode_batch(engine)
            steps = Steps(engine, sequences, tokens)
            torch.manual_seed(0)
            jobs_by_batch = {batch: compression_jobs(engine, manager, *batch) for batch in TIMED_BATCHES}
            if "B" in parts:
                report["timing"] = part_b(engine, steps, jobs_by_batch)
            (OUT / "compress_gpu.json").write_text(json.dumps(report, indent=2))
            if "C" in parts:
                limits = [None if n == "all" else int(n) for n in args.compressor_sms.split(",")]
                report["async"] = part_c(engine, steps, jobs_by_batch, limits)
        except Exception:
            failed = True
            report["error"] = traceback.format_exc()
            log(report["error"])
    (OUT / "compress_gpu.json").write_text(json.dumps(report, indent=2))
    print_tables(report)
    log(f"RESULT: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
