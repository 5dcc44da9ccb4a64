"""The decode step's shape on the GPU, without torch: the split-K kernel's grid rule (the Triton
kernel launches by it and the analytic cost model prices a decode step's longest sequence by it: a
sequence's K/V is cut into this many partitions, one program each, so the longest one bounds the
kernel when the batch fills the GPU with one partition per sequence), and the batch sizes the
engine captures decode CUDA graphs at (a step replays the smallest that holds its batch, padded:
the calibrated cost model prices it at that size)."""

from __future__ import annotations

from bisect import bisect_left

# The decode graphs' batch sizes, up to --max-num-seqs (zipage/engine/runner.py captures them):
# dense where batches are small and a padded row costs the most, coarser above.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def graph_batch(batch: int, sizes: tuple[int, ...] | list[int]) -> int:
    """The rows a decode step of `batch` requests computes: the smallest captured graph size
    that holds it (increasing `sizes`), or the batch itself above the largest (run eagerly)."""
    index = bisect_left(sizes, batch)
    return sizes[index] if index < len(sizes) else batch

# Decode aims for at most this many programs per streaming multiprocessor: as many as fit on an SM
# at once, so that a batch of equal-length sequences runs in one wave with no short last wave.
PROGRAMS_PER_SM = 4
# The FP8 launch holds 5 (2 warps of 196 registers a thread, 38 KB of shared memory on an H200,
# kernels/attention_triton.py `_DECODE_FP8_*`, where bfloat16's 4 warps hold 4): a grid aimed
# at another count leaves a last wave part empty (docs/BENCHMARKS.md 'FP8 KV cache').
FP8_PROGRAMS_PER_SM = 5
# Upper bound on decode partitions per sequence (a single sequence on many SMs).
MAX_PARTITIONS = 256


def programs_per_sm(kv_cache_dtype: str) -> int:
    """The decode programs an SM holds with this KV cache dtype ("auto" or "fp8")."""
    return FP8_PROGRAMS_PER_SM if kv_cache_dtype == "fp8" else PROGRAMS_PER_SM


def decode_num_partitions(batch: int, num_kv_heads: int, streaming_multiprocessors: int, *,
                          programs_per_sm: int = PROGRAMS_PER_SM, round_up: bool = False) -> int:
    """Partitions per sequence (the decode grid's third dimension), from the batch size alone: as
    many as keep batch x kv-heads x partitions within `programs_per_sm` programs per SM. A large
    batch gets one partition (no merge pass); a single sequence gets many."""
    target_programs = programs_per_sm * streaming_multiprocessors
    per_sequence = batch * num_kv_heads
    num_partitions = (-(-target_programs // per_sequence) if round_up
                      else target_programs // per_sequence)
    return max(1, min(num_partitions, MAX_PARTITIONS))
