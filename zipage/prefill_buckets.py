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

# A graphed mixed step's decode section. The prefill launch can take a mixed step's decode rows
# as sequences of one new token, but then one program a row and KV head walks the row's whole
# context after the chunks' tiles: with a few rows of long context most SMs sit idle. A step of
# at most DECODE_SECTION_ROWS decode rows, the longest of at least DECODE_SECTION_MIN_CONTEXT
# entries, replays its bucket's second graph instead, whose section of that many slots runs the
# rows through the split-K decode kernel (empty slots have no entries). Llama-3.1-8B on an H200,
# 16 rows beside a 2,032-token chunk, folded against the section: 20k entries 73.1 / 58.7 ms,
# 8k 58.4 / 52.8, 2k 51.1 / 51.0, 1k 50.4 / 50.8 (below 2k the chunks' tiles hide the tail and
# the section's own launches cost more); 32 rows of 8k 58.8 / 56.4. More rows fill the GPU in
# the prefill launch (64 rows of 8k: folded 62.0 ms, eager 61.9). bench/decode_section_gpu.sh,
# 2026-12-02; docs/cost_model.md, 'Decode rows in graphed mixed steps'.
DECODE_SECTION_ROWS = 32
DECODE_SECTION_MIN_CONTEXT = 2048
# The section's split is sized as for a decode step of this many rows (a graph's grid cannot
# follow how many slots a step fills): a few long rows still get several partitions each, a full
# section of 32 runs a few waves of programs.
DECODE_SECTION_GRID_BATCH = 8


def decode_section_rows(bucket: int) -> int:
    """The decode section's slots in a padded step of `bucket` rows (at least one row is a chunk's)."""
    return min(DECODE_SECTION_ROWS, bucket - 1)


def takes_decode_section(bucket: int, num_decode: int, longest_context: int) -> bool:
    """Whether a padded step of `bucket` rows runs its `num_decode` decode rows (the longest of
    `longest_context` entries) through the decode section rather than the prefill launch."""
    return 0 < num_decode <= decode_section_rows(bucket) and longest_context >= DECODE_SECTION_MIN_CONTEXT


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
