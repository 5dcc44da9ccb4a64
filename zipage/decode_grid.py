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


# How a step's rows are split (the kernel's `_DECODE_SPLIT`). "batch": every row into the grid's
# partitions, sized from the batch alone, so one long row beside many short ones is one program
# walking all its entries while the others finish (TensorRT-LLM's row 2: a 20k-entry row beside 95
# of 2k took 2.5x the step without it, docs/BENCHMARKS.md 'One long row beside many short ones').
# "balanced": each row into as many partitions as its share of the step's entries asks (its entries
# over the even share a program would get), up to a grid widened for long rows; the kernel sums the
# step's lengths on the device, so a CUDA graph replays it for any lengths.
DECODE_SPLITS = ("batch", "balanced")
# A balanced grid holds this many waves of programs at a batch (most of them empty, exiting at once):
# the most a long row can be split is this many times its batch share.
SPLIT_WAVES = 8


def decode_grid_partitions(batch: int, num_kv_heads: int, streaming_multiprocessors: int, *,
                           programs_per_sm: int = PROGRAMS_PER_SM, round_up: bool = False,
                           split: str = "batch") -> int:
    """The decode grid's partitions per sequence: `decode_num_partitions`'s, widened by a balanced
    split to `SPLIT_WAVES` waves of programs (never more than one row alone would take)."""
    partitions = decode_num_partitions(batch, num_kv_heads, streaming_multiprocessors,
                                       programs_per_sm=programs_per_sm, round_up=round_up)
    if split == "balanced":
        target_programs = programs_per_sm * streaming_multiprocessors
        widened = -(-SPLIT_WAVES * target_programs // (batch * num_kv_heads))
        partitions = max(partitions, min(widened, max(1, target_programs // num_kv_heads), MAX_PARTITIONS))
    return partitions


def balanced_row_partitions(context: int, total_context: int, num_kv_heads: int,
                            streaming_multiprocessors: int, grid_partitions: int, *,
                            programs_per_sm: int = PROGRAMS_PER_SM, min_entries: int = 128) -> int:
    """The partitions a balanced split gives a row of `context` entries in a step whose rows hold
    `total_context` (the kernel's `_decode_row_partitions`): its entries over the even share of a
    program (never under `min_entries`), at least 1, at most the grid's."""
    row_programs = max(1, programs_per_sm * streaming_multiprocessors // num_kv_heads)
    share = max(-(-total_context // row_programs), min_entries)
    return max(1, min(context // share, grid_partitions))


def takes_balanced_split(batch: int, total_context: int, longest: int, num_kv_heads: int,
                         streaming_multiprocessors: int, *,
                         programs_per_sm: int = PROGRAMS_PER_SM) -> bool:
    """Whether a decode step of `batch` rows (the grid's: a graph's padded size), holding
    `total_context` entries of which the longest row `longest`, runs the balanced split: when it
    gives that row more partitions than the batch split does. Otherwise the batch split, whose
    grid has no empty programs to launch: on an H200 the widened grid cost a uniform batch of 128
    rows of 600 entries 26 % of its attention time and the 8B headline 5.5 % of its makespan, and
    saved 59-69 % where a 20k-entry row sat beside 95 of 2k (docs/BENCHMARKS.md, 'One long row
    beside many short ones')."""
    plain = decode_num_partitions(batch, num_kv_heads, streaming_multiprocessors,
                                  programs_per_sm=programs_per_sm)
    wide = decode_grid_partitions(batch, num_kv_heads, streaming_multiprocessors,
                                  programs_per_sm=programs_per_sm, split="balanced")
    return wide > plain and balanced_row_partitions(
        longest, total_context, num_kv_heads, streaming_multiprocessors, wide,
        programs_per_sm=programs_per_sm) > plain
