"""Token buckets of padded prefill and mixed steps, without torch: the engine's runner pads a step
of up to the largest bucket to the next bucket and replays that bucket's CUDA graph, and a
calibrated cost model that measured such an engine prices the step at its padded row count (a
padding row goes through every GEMM like a real one)."""

from __future__ import annotations

from bisect import bisect_left

# Each bucket at most 1.5x the one before (x2 up to 256, where a step is launch-bound anyway): a
# step pays for at most half as many padding rows again as it has, where doubling buckets made a
# 513-row step cost a 1,024-row one (H200, Qwen3-8B: 22 ms against 13 ms at 512; docs/BENCHMARKS.md,
# 'Prefill'). Larger steps run eagerly: their kernels dwarf the launches' host time.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def buckets_up_to(limit: int) -> tuple[int, ...]:
    """The buckets a step of at most `limit` rows (max_num_batched_tokens) can need."""
    return tuple(size for size in PREFILL_GRAPH_TOKENS if size <= limit)


def bucket_of(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `rows` rows, or None when the step is larger than all
    (it then runs eagerly, unpadded)."""
    index = bisect_left(buckets, rows)
    return buckets[index] if index < len(buckets) else None


def padded_rows(rows: int, buckets: tuple[int, ...]) -> int:
    """The rows a step of `rows` rows computes: its bucket's size, or `rows` past the largest."""
    bucket = bucket_of(rows, buckets)
    return rows if bucket is None else bucket
