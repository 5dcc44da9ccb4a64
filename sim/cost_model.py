"""Step durations for the simulator: how long a step and a compression batch take.

The simulator asks a `CostModel` (docs/architecture.md, 'Simulator') for `step_time(plan)` — a
step of any kind: its sync compressions, then one forward over its decode requests and prompt
chunks (a prefill, decode or mixed step) — for `compress_time(batch)` of an async batch, and for
`decode_contention(overlap_fraction)`. A forward is costed from its `StepWork` (the counts of what
it computes), so one formula covers every kind of step. Two implementations answer.
`AnalyticCostModel` is a roofline over the model's shape and a `GPUSpec`: every operation costs
max-ish(bytes / achievable bandwidth, FLOPs / achievable compute) plus launch and host
overheads, with the compression pipeline (docs/architecture.md, 'Compression pipeline') costed
kernel by kernel.
`CalibratedCostModel` is a least-squares fit of simple linear models to a profile measured on a
real GPU (format in docs/cost_model.md). `load_cost_model` picks one from a command-line spec.
Every formula, constant and assumption is written out in docs/cost_model.md.
"""

from __future__ import annotations

import gzip
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from zipage.config import REDUNDANCY_MODES, ZipageConfig
from zipage.core.memory import DTYPE_BYTES, heads_per_gpu, kv_entry_bytes
from zipage.core.step import causal_pairs
from zipage.decode_grid import decode_num_partitions
from zipage.errors import ConfigError
from zipage.hardware import GPUSpec, get_hardware
from zipage.prefill_buckets import padded_rows
from zipage.presets import ModelShape, model_identity
from zipage.sim.prefill_fit import PrefillFit, fit_host_or_device, fit_prefill

if TYPE_CHECKING:
    from zipage.core.step import CompressionBatch, CompressionJob, StepPlan

PROFILES_DIR = Path(__file__).parent / "profiles"
# Version 2 added the "mixed" section; version 3 fits prefill steps as host- or device-bound with
# a per-sequence term, every coefficient >= 0 (sim/prefill_fit.py). Older profiles still load and
# predict what they did.
PROFILE_VERSION = 3
READABLE_PROFILE_VERSIONS = (1, 2, 3)
PROFILE_SECTIONS = ("decode", "prefill", "mixed", "compress")
FLOAT32_BYTES = 4

# Real kernels do not switch abruptly from memory- to compute-bound at the ridge point: measured
# on the H200, Qwen3-8B's decode GEMMs at batch 176 (where both limits are ~4.0 ms) took 5.0 ms.
# A cube-norm of the two times fits that (5.0 ms) and equals the max away from the ridge.
ROOFLINE_SHARPNESS = 3.0
# Shares of the GPU's achievable rates (a copy, a large square GEMM) that each kernel class reaches,
# measured on the H200 with Qwen3-8B's shapes under CUDA graphs: the decode GEMV chain streamed
# weights at 3.79 TB/s (0.89 of the 4.27 a copy gets); the projection GEMMs at 512..8192 rows ran
# at 667..680 TFLOP/s (0.85 of 791); torch's flash SDPA streamed a batch-176 decode KV cache at
# 4.19 TB/s (a copy's rate, so no factor) and ran causal prefill at 0.70 (8k tokens) and 0.51 (2k)
# of 791 TFLOP/s.
LINEAR_BANDWIDTH_EFFICIENCY = 0.89
LINEAR_COMPUTE_EFFICIENCY = 0.85
ATTENTION_COMPUTE_EFFICIENCY = 0.70
# The similarity kernels of the redundancy score work on small tiles (16x64) with fp32 norms and a
# per-column threshold scan, so they run far below dense-matmul throughput; the paper's kernel
# profile shows (flash) redundancy 1-2 orders of magnitude slower than the other operations.
REDUNDANCY_EFFICIENCY = 0.25
# A forward is a chain of kernels, about 12 per layer (norms, projections, rope, cache store,
# attention, activation), and each adds a fixed latency to its roofline time (ramp-up, tail, the
# gap to the next one), even inside a CUDA graph. 4.0 us is what our engine's decode steps
# measured on the H200 (fitted with DECODE_PROGRAM_BANDWIDTH below on ~18k decode steps of twelve
# runs, Qwen3-8B and 0.6B, three traces, Zipage and Full KV: relative RMS 10.4 %; the floor
# it replaces, max(roofline, 3 us per kernel), left those steps 28-69 % short;
# docs/cost_model.md, 'Decode step'). Part of it is host time of the
# step loop that grows with the layer count: a forward replayed alone sits closer to the roofline.
KERNELS_PER_LAYER = 12
KERNEL_LATENCY_S = 4.0e-6
# The split-K decode kernel gives each sequence a fixed number of partitions from the batch size
# alone (zipage/decode_grid.py): one per sequence once the batch fills the GPU. One program
# streams its partition's K and V at this rate, so a step holding one long sequence beside many
# short ones lasts as long as that sequence's program (LongBench: a 6k-token prompt not yet
# compressed doubles a Qwen3-8B decode step). Fitted with KERNEL_LATENCY_S above.
DECODE_PROGRAM_BANDWIDTH = 15.8e9
# Host work that grows with the batch: building block tables, positions and slot mappings, and
# appending each sampled token, in Python.
PER_SEQUENCE_OVERHEAD_S = 5e-6
# Compression runs eagerly (no CUDA graph: shapes change every batch). One launch costs about the
# 9.4 us measured for an eager op on the H200 host; torch.topk keeping 2048 of 2304 scores took
# 0.42 ms per call there (64 rows), once per launch group.
KERNEL_LAUNCH_S = 10e-6
TOPK_CALL_S = 0.4e-3
# Per batch: gathering block tables, slots and flags into device tensors, and the event that
# reports completion.
COMPRESS_BATCH_OVERHEAD_S = 0.5e-3
# Fp32 passes over the (padded) attention logits w x q_heads x N*b: the score kernel writes them,
# softmax reads and writes them, the max over each group's query heads reads them.
SCORE_LOGIT_PASSES = 4
# Fp32 passes over the per-kv-head scores N*b: mean over the window, pooling, window fill,
# redundancy normalisation and softmax, the lambda combination, top-k input and keep-mask output.
SCORE_ELEMENT_PASSES = 10
# Tensor parallelism: ring all-reduce over NVLink at this share of the link rate, plus a fixed
# latency per all-reduce (NCCL inside a CUDA graph). 25 us is what two H200s measured: with it,
# Qwen3-8B TP=2 decode steps (batch 32/128/256, 2k contexts) sit 1.10/1.05/1.11x above this
# model, as TP=1 steps do (1.18/1.05/0.99x); the first guess, 10 us, left TP=2 1.37/1.18/1.19x
# above (docs/BENCHMARKS.md, 'Tensor parallelism').
INTERCONNECT_EFFICIENCY = 0.80
ALLREDUCE_LATENCY_S = 25e-6
# A decode step overlapping an async compression batch shares the SMs and HBM bandwidth with it.
# These are the multipliers for a fully overlapped step. The engine launches a batch behind its
# step's forward, so it runs in the gap before the next step and beside it: in H200 runs of the
# headline trace the steps of a batch cost 0.15 (Qwen3-8B), 0.20 (0.6B) and 0.17 (Qwen3-32B,
# TP=2) times this model's duration of the batch more than the decode plane (docs/cost_model.md,
# 'Async compression on the GPU'); launched before the forward, the same batches cost
# 1.28-1.36 times it, which is why the engine launches behind. Flash (not measured) keeps the
# paper's extra 0.2 for its compute-heavy similarity kernels; off runs the lightning pipeline
# minus its redundancy launches, so it takes lightning's factor.
DEFAULT_CONTENTION = {"off": 1.15, "lightning": 1.15, "flash": 1.35}

ANALYTIC = "analytic"
# What a cost model is built for: the knobs that change a step's duration (declared with
# `cost=True` on ZipageConfig), the element size, the sharding and the contention factor.
COST_KNOBS = tuple(ZipageConfig().cost_knobs())
KNOBS = ("dtype_bytes", *COST_KNOBS, "tensor_parallel", "contention_factor")


@dataclass(slots=True)  # not frozen: a frozen dataclass takes twice as long to build
class StepWork:
    """What one step's forward computes, in the counts the cost models read.

    A decode step has only decode requests, a prefill step only prompt chunks (whole prompts or
    parts of them), a mixed step (chunked prefill) both; an idle step nothing.
    """

    num_decode: int = 0  # requests decoding one token each
    decode_context_tokens: int = 0  # KV entries they attend to in all, their new tokens included
    num_prefill: int = 0  # prompt chunks
    num_sampled_prefill: int = 0  # chunks that reach their prompt's end: each samples a token
    prefill_tokens: int = 0  # tokens the chunks compute
    cached_tokens: int = 0  # KV entries before the chunks: prefix-cache hits, earlier chunks
    attention_pairs: int = 0  # (query, key) pairs of the chunks' causal attention
    # The most KV entries one decode request attends to (0: not known, priced as if balanced).
    decode_max_context: int = 0

    @classmethod
    def of(cls, plan: StepPlan) -> "StepWork":
        if not plan.prefill:  # the common case, kept cheap: the simulator asks ~100k times a run
            return cls(len(plan.decode), plan.decode_context_tokens,
                       decode_max_context=plan.decode_max_context)
        return cls(len(plan.decode), plan.decode_context_tokens, len(plan.prefill),
                   sum(1 for item in plan.prefill if item.samples),
                   sum(item.num_new_tokens for item in plan.prefill),
                   sum(item.num_cached_tokens for item in plan.prefill),
                   sum(item.attention_pairs for item in plan.prefill),
                   plan.decode_max_context)

    @classmethod
    def from_counts(cls, num_decode: int = 0, decode_context_tokens: int = 0,
                    prefill: Sequence[tuple[int, int]] = ()) -> "StepWork":
        """`prefill`: (new_tokens, cached_tokens) of each chunk; every chunk ends its prompt."""
        return cls(num_decode, decode_context_tokens, len(prefill), len(prefill),
                   sum(new for new, _ in prefill), sum(cached for _, cached in prefill),
                   sum(causal_pairs(new, cached) for new, cached in prefill))


class CostModel(ABC):
    """Durations in seconds of the steps a `StepPlan` describes.

    Subclasses cost a forward from its `StepWork` and a compression batch from its source blocks;
    the plan-level methods here extract those counts, so the engine's calibration tool and tests
    can ask without building plans.
    """

    # Multiplier of a step fully overlapped by an async compression batch.
    contention_factor: float
    # Which engine steps replayed CUDA graphs when the costs were measured ({"decode": bool,
    # "prefill": bool}), where a profile says so; None for the analytic model.
    measured_graphs: dict[str, bool] | None = None

    def step_time(self, plan: StepPlan) -> float:
        """A step of any kind: its sync compressions run first, then one forward over its decode
        requests and prompt chunks. An idle step computes nothing (0)."""
        duration = self.forward_time_for(StepWork.of(plan))
        if plan.compress_sync:
            duration += self.compress_time(plan.compress_sync)
        return duration

    def compress_time(self, jobs: Iterable[CompressionJob] | CompressionBatch) -> float:
        """Duration of one compression batch (the jobs of a plan, or a `CompressionBatch`), each
        job priced by its own size: the blocks it reads and the blocks it keeps (a request's own
        budget, or its elastic cap)."""
        jobs = getattr(jobs, "jobs", jobs)
        blocks = [job.num_source_blocks for job in jobs]
        if not blocks:
            return 0.0
        return self.compress_time_for(blocks, [len(job.target_blocks) for job in jobs])

    def decode_contention(self, overlap_fraction: float) -> float:
        """Multiplier of a step whose `overlap_fraction` (0..1) ran beside a compression."""
        overlap = min(1.0, max(0.0, overlap_fraction))
        return 1.0 + (self.contention_factor - 1.0) * overlap

    def decode_time_for(self, batch: int, context_tokens: int, max_context: int = 0) -> float:
        """A decode step of `batch` requests attending to `context_tokens` KV entries in total,
        the longest `max_context` of them (0: not known)."""
        return self.forward_time_for(StepWork(batch, context_tokens,
                                              decode_max_context=max_context))

    def prefill_time_for(self, requests: Sequence[tuple[int, int]]) -> float:
        """A prefill step over (new_tokens, cached_tokens) per request."""
        return self.forward_time_for(StepWork.from_counts(prefill=requests))

    @abstractmethod
    def forward_time_for(self, work: StepWork) -> float:
        """One forward over `work`: a decode, prefill or mixed step without its compressions."""

    @abstractmethod
    def compress_time_for(self, blocks: Sequence[int],
                          kept_blocks: Sequence[int] | None = None) -> float:
        """A compression batch of requests holding `blocks[i]` source blocks each and keeping
        `kept_blocks[i]` (None: the configured budget, N_max - 1 blocks, each)."""


def _roofline(memory_s: float, compute_s: float) -> float:
    power = ROOFLINE_SHARPNESS
    return (memory_s**power + compute_s**power) ** (1.0 / power)


def launch_groups(num_layers: int, layer_stride: int) -> int:
    """Launch groups of cross-layer compression: `layer_stride` layers per group."""
    if layer_stride <= 0 or layer_stride >= num_layers:
        return 1
    return math.ceil(num_layers / layer_stride)


def compression_launches_per_group(redundancy: str, global_score: bool) -> int:
    """Kernel launches (besides top-k) that one launch group of the section-7 pipeline issues."""
    # score kernel, softmax, group max, window mean, pooling, window fill, keep mask, K/V compaction
    launches = 8
    if global_score:
        launches += 2  # global-score update, F compaction
    if redundancy != "off":
        launches += 4  # similarity kernel, row-sum normalisation, softmax, lambda combination
    if redundancy == "flash":
        launches += 1  # reduction of the N x N x b accumulator R'
    return launches


class AnalyticCostModel(CostModel):
    """Roofline durations from a model shape and a GPU spec (formulas: docs/cost_model.md)."""

    def __init__(self, shape: ModelShape, gpu: GPUSpec, *, dtype_bytes: int = 2,
                 block_size: int = 256, window: int = 16, kv_budget: int = 2048,
                 redundancy: str = "lightning", layer_stride: int = 8, global_score: bool = True,
                 tensor_parallel: int = 1, contention_factor: float | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        _check_knobs(shape, dtype_bytes, block_size, window, kv_budget, redundancy, layer_stride,
                     tensor_parallel, contention_factor)
        self.shape, self.gpu = shape, gpu
        self.dtype_bytes, self.block_size, self.window = dtype_bytes, block_size, window
        self.kv_budget, self.redundancy, self.layer_stride = kv_budget, redundancy, layer_stride
        self.global_score, self.tensor_parallel = global_score, tensor_parallel
        # K (or V) bytes of one entry and KV head: an fp8 cache reads one byte per value plus
        # its scale, so attention and compression read about half the bytes of bfloat16.
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_entry_bytes = kv_entry_bytes(shape.head_dim, kv_cache_dtype, dtype_bytes)
        self.contention_factor = (DEFAULT_CONTENTION[redundancy] if contention_factor is None
                                  else contention_factor)

        layers, head_dim = shape.num_layers, shape.head_dim
        self.q_heads = heads_per_gpu(shape.num_heads, tensor_parallel)
        self.kv_heads = heads_per_gpu(shape.num_kv_heads, tensor_parallel)
        lm_head_params = shape.vocab_size * shape.hidden_size
        # The input embedding is a gather of a few rows; every other weight streams each step (a
        # tied embedding streams once, as the LM head).
        streamed_params = shape.num_params - (0 if shape.tie_embeddings else lm_head_params)
        body_params = (streamed_params - lm_head_params) / tensor_parallel
        lm_head_params /= tensor_parallel
        self.weight_bytes = (body_params + lm_head_params) * dtype_bytes
        self.kv_bytes_per_token = 2 * layers * self.kv_heads * self.kv_entry_bytes

        linear_bandwidth = gpu.achievable_bandwidth * LINEAR_BANDWIDTH_EFFICIENCY
        linear_flops = gpu.achievable_flops * LINEAR_COMPUTE_EFFICIENCY
        self._weight_s = self.weight_bytes / linear_bandwidth
        self._decode_token_flop_s = 2 * (body_params + lm_head_params) / linear_flops
        # A prompt chunk computes logits for its last token only, and only if it samples.
        self._prefill_token_flop_s = 2 * body_params / linear_flops
        self._sampled_chunk_flop_s = 2 * lm_head_params / linear_flops
        self._kv_token_s = self.kv_bytes_per_token / gpu.achievable_bandwidth
        # One query-key pair costs a multiply-add in QK^T and one in PV, per query head and layer.
        self._attention_pair_s = (4 * layers * self.q_heads * head_dim
                                  / (gpu.achievable_flops * ATTENTION_COMPUTE_EFFICIENCY))
        self._kernel_chain_s = layers * KERNELS_PER_LAYER * KERNEL_LATENCY_S
        # One program's time per KV entry of its partition, over all layers.
        self._program_entry_s = layers * 2 * self.kv_entry_bytes / DECODE_PROGRAM_BANDWIDTH
        self._step_overhead_s = gpu.step_overhead_s
        self._allreduce_token_s, self._allreduce_fixed_s = 0.0, 0.0
        if tensor_parallel > 1:
            # Two all-reduces of the hidden state per layer plus the logits gather; a ring moves
            # 2 (tp - 1) / tp of the message over each link.
            link = gpu.interconnect_bytes_per_s * INTERCONNECT_EFFICIENCY
            ring = 2 * (tensor_parallel - 1) / tensor_parallel
            self._allreduce_token_s = 2 * layers * shape.hidden_size * dtype_bytes * ring / link
            self._allreduce_fixed_s = (2 * layers + 1) * ALLREDUCE_LATENCY_S

        self.num_launch_groups = launch_groups(layers, layer_stride)
        self.compress_fixed_s = COMPRESS_BATCH_OVERHEAD_S + self.num_launch_groups * (
            compression_launches_per_group(redundancy, global_score) * KERNEL_LAUNCH_S
            + TOPK_CALL_S
        )

    def forward_time_for(self, work: StepWork) -> float:
        batch, tokens = work.num_decode, work.prefill_tokens
        if not batch and not work.num_prefill:
            return 0.0
        # Weights stream once for every row of the step; each decode row and each chunk that
        # samples goes through the LM head (a chunk computes logits for its last token only).
        linear = _roofline(self._weight_s, batch * self._decode_token_flop_s
                           + tokens * self._prefill_token_flop_s
                           + work.num_sampled_prefill * self._sampled_chunk_flop_s)
        # Decode rows and chunks attend in two kernels (split-K decode, varlen prefill), so two
        # rooflines: each decode row reads its own KV entries; a chunk reads the entries before
        # it, writes its new ones and reads them back.
        attention = 0.0
        if batch:
            context = work.decode_context_tokens
            attention = _roofline(context * self._kv_token_s, context * self._attention_pair_s)
            if work.decode_max_context:
                partitions = decode_num_partitions(batch, self.kv_heads,
                                                   self.gpu.streaming_multiprocessors)
                longest = -(-work.decode_max_context // partitions) * self._program_entry_s
                if longest > attention:
                    attention = longest
        if work.num_prefill:
            attention += _roofline((work.cached_tokens + 2 * tokens) * self._kv_token_s,
                                   work.attention_pairs * self._attention_pair_s)
        gpu = (linear + attention + self._allreduce_fixed_s
               + (batch + tokens) * self._allreduce_token_s)
        return (gpu + self._kernel_chain_s + self._step_overhead_s
                + (batch + work.num_prefill) * PER_SEQUENCE_OVERHEAD_S)

    def compress_time_for(self, blocks: Sequence[int],
                          kept_blocks: Sequence[int] | None = None) -> float:
        block_size = self.block_size
        tokens = sum(blocks) * block_size
        # Torch ops between the kernels run on the batch padded to its longest request.
        padded_tokens = len(blocks) * max(blocks) * block_size
        if kept_blocks is None:
            kept_tokens = sum(min(self.kv_budget, count * block_size) for count in blocks)
        else:
            kept_tokens = sum(kept_blocks) * block_size
        return (self.compress_fixed_s
                + self._attention_score_s(tokens, padded_tokens, len(blocks))
                + self._score_elementwise_s(tokens, padded_tokens)
                + self._redundancy_s(blocks)
                + self._compaction_s(tokens, kept_tokens))

    def _attention_score_s(self, tokens: int, padded_tokens: int, requests: int) -> float:
        """Step 1: w window queries per query head against every cached key, all layers."""
        shape, size = self.shape, self.dtype_bytes
        group_queries = self.window * self.q_heads
        read_keys = tokens * self.kv_heads * self.kv_entry_bytes
        read_queries = requests * group_queries * shape.head_dim * size
        logits = SCORE_LOGIT_PASSES * padded_tokens * group_queries * FLOAT32_BYTES
        memory = shape.num_layers * (read_keys + read_queries + logits)
        flops = shape.num_layers * 2 * group_queries * tokens * shape.head_dim
        return _roofline(memory / self.gpu.achievable_bandwidth, flops / self.gpu.achievable_flops)

    def _score_elementwise_s(self, tokens: int, padded_tokens: int) -> float:
        """Steps 2-6 outside the kernels: global score, pooling, window, softmaxes, top-k input."""
        per_layer = SCORE_ELEMENT_PASSES * padded_tokens * self.kv_heads * FLOAT32_BYTES
        if self.global_score:
            per_layer += 2 * tokens * self.kv_heads * self.dtype_bytes  # read and write F
        return self.shape.num_layers * per_layer / self.gpu.achievable_bandwidth

    def _redundancy_s(self, blocks: Sequence[int]) -> float:
        """Step 4: cosine similarity of keys, within each block (lightning) or all pairs (flash)."""
        if self.redundancy == "off":
            return 0.0
        shape, block_size = self.shape, self.block_size
        key_bytes = block_size * self.kv_entry_bytes
        if self.redundancy == "lightning":
            block_pairs = sum(blocks)  # each block against itself
            # Keys read once; one fp32 row sum per key written.
            per_head = sum(blocks) * (key_bytes + block_size * FLOAT32_BYTES)
        else:
            block_pairs = sum(count * count for count in blocks)
            # The program of block m streams every block i and writes R'[i, m] (b fp32 sums),
            # which the reduction then reads back.
            per_head = block_pairs * (key_bytes + 2 * block_size * FLOAT32_BYTES)
        layers_heads = shape.num_layers * self.kv_heads
        flops = layers_heads * block_pairs * 2 * block_size * block_size * shape.head_dim
        return _roofline(layers_heads * per_head / self.gpu.achievable_bandwidth,
                         flops / (self.gpu.achievable_flops * REDUNDANCY_EFFICIENCY))

    def _compaction_s(self, tokens: int, kept_tokens: int) -> float:
        """Step 7: two-pointer move of the kept K, V (and F) entries into the target blocks."""
        shape, size = self.shape, self.dtype_bytes
        per_entry = 2 * 2 * self.kv_entry_bytes  # K and V (and their scales), read and written
        if self.global_score:
            per_entry += 2 * size
        per_layer = self.kv_heads * (kept_tokens * per_entry + tokens)  # + the one-byte keep mask
        return shape.num_layers * per_layer / self.gpu.achievable_bandwidth


def _check_knobs(shape: ModelShape, dtype_bytes: int, block_size: int, window: int,
                 kv_budget: int, redundancy: str, layer_stride: int, tensor_parallel: int,
                 contention_factor: float | None) -> None:
    if dtype_bytes not in DTYPE_BYTES.values():
        raise ConfigError(f"dtype_bytes: got {dtype_bytes!r}, expected one of "
                          f"{sorted(set(DTYPE_BYTES.values()))}")
    # block_size, window, kv_budget and redundancy arrive validated by ZipageConfig (the one
    # place those rules live); the window is only meaningful when compressing.
    if not isinstance(layer_stride, int):
        raise ConfigError(f"layer_stride: got {layer_stride!r}, expected an integer "
                          "(<= 0 or >= layers: all layers in one launch group)")
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ConfigError(f"tensor_parallel: got {tensor_parallel!r}, expected an integer >= 1")
    if shape.num_heads % tensor_parallel or (shape.num_kv_heads % tensor_parallel
                                             and tensor_parallel % shape.num_kv_heads):
        raise ConfigError(
            f"tensor_parallel: {tensor_parallel} GPUs cannot split {shape.name}'s "
            f"{shape.num_heads} query / {shape.num_kv_heads} kv heads evenly; pick a divisor "
            f"of {shape.num_heads}"
        )
    if contention_factor is not None and not contention_factor >= 1.0:
        raise ConfigError(f"contention_factor: got {contention_factor!r}, expected a number >= 1")


@dataclass(frozen=True)
class LinearFit:
    """time_s = sum(coefficients[i] * feature_i), feature 0 being the constant 1."""

    feature_names: tuple[str, ...]
    coefficients: tuple[float, ...]
    relative_rms_error: float  # over the profile points it was fitted to
    num_points: int
    floor_s: float  # fastest measured time: a prediction below it is clamped to it

    def predict(self, *features: float) -> float:
        value = self.coefficients[0] + sum(c * f for c, f in zip(self.coefficients[1:], features))
        return max(value, self.floor_s)

    def describe(self) -> str:
        return " + ".join([f"{self.coefficients[0]:.3g}"] + [
            f"{c:.3g} * {name}" for c, name in zip(self.coefficients[1:], self.feature_names[1:])])


@dataclass(frozen=True)
class MixedFit(LinearFit):
    """A mixed step's model: `coefficients` is its device line (m and the pure fits' slopes,
    clamped at `floor_s` as a LinearFit is), and the step costs
    per_sequence_s * requests + max(host_s, that line).

    `host_s` is the mixed points' own host bound h_m (version 3, when they determine it:
    `host_fitted`), else the prefill's h; `per_sequence_s` is the prefill's s either way."""

    host_s: float = 0.0
    per_sequence_s: float = 0.0
    host_fitted: bool = False

    def step_time(self, batch: float, context_tokens: float, new_tokens: float,
                  attention_pairs: float, requests: float, longest_decode: float = 0.0) -> float:
        features = (batch, context_tokens, new_tokens, attention_pairs)
        if len(self.coefficients) > 5:  # padded steps: the longest decode row's serial walk
            features += (longest_decode,)
        device = self.predict(*features)
        return self.per_sequence_s * requests + max(self.host_s, device)

    def describe(self) -> str:
        line = super().describe()
        if not self.host_s and not self.per_sequence_s:
            return line
        return f"{self.per_sequence_s:.3g} * requests + max({self.host_s:.3g}, {line})"


class CalibratedCostModel(CostModel):
    """Linear models fitted to a measured profile (format and fits: docs/cost_model.md).

    decode:   a + b * batch + c * context_tokens [+ d * longest_excess, when the points carry
              max_context: the longest request's entries beyond the mean, max - sum / batch]
    prefill:  s * requests + max(h, a + b * new_tokens + c * attention_pairs)   (version 3;
              before it s = h = 0; pairs: sum of T*C + T(T+1)/2)
    mixed:    s * requests + max(h_m, m + decode's b, c terms + prefill's b, c terms)
              (m and, version 3, h_m fitted to the mixed points; h_m = h when they cannot
              determine it)
    A profile with `prefill_buckets` measured an engine that pads prefill and mixed steps of
    up to its largest bucket to the next bucket (its prefill graphs): there new_tokens is the
    padded row count less the decode rows, in the fits and in the predictions alike.
    compress: a + b * blocks [+ c * blocks_squared with the flash redundancy score]
    """

    def __init__(self, decode: LinearFit, prefill: PrefillFit, mixed: MixedFit,
                 compress: LinearFit | None, contention_factor: float, header: dict[str, Any],
                 source: str) -> None:
        self.decode_fit, self.prefill_fit, self.mixed_fit = decode, prefill, mixed
        self.compress_fit = compress
        self.contention_factor = contention_factor
        self.header, self.source = header, source
        self.measured_graphs = header.get("graphs")
        self.prefill_buckets = tuple(header.get("prefill_buckets") or ())
        self._decode_a, self._decode_b, self._decode_c = decode.coefficients[:3]
        # Per KV entry the longest request holds beyond the mean (0 when not fitted).
        self._decode_excess = decode.coefficients[3] if len(decode.coefficients) > 3 else 0.0
        self._decode_floor = decode.floor_s

    @classmethod
    def from_profile(cls, profile: str | Path | dict, *, shape: ModelShape | None = None,
                     gpu: GPUSpec | None = None, **knobs: Any) -> "CalibratedCostModel":
        """Fit a profile (a path or an already-parsed dict); check it matches the run if given."""
        source, data = _read_profile(profile)
        header = _check_header(source, data, shape, gpu, knobs)
        redundancy = header.get("redundancy", "lightning")
        decode_rows = _points(source, data, "decode", ("batch", "context_tokens"),
                              {"max_context": None})
        decode = _decode_fit(source, decode_rows)
        prefill_rows = _points(source, data, "prefill", ("new_tokens",), PREFILL_DEFAULTS)
        buckets = tuple(header.get("prefill_buckets") or ())
        prefill = _prefill_fit(source, data["version"], prefill_rows, buckets)
        mixed_rows = []
        if "mixed" in data:
            mixed_rows = _points(source, data, "mixed", ("batch", "context_tokens", "new_tokens"),
                                 PREFILL_DEFAULTS)
        mixed = _mixed_fit(source, data["version"], decode, prefill, mixed_rows, buckets)
        compress = None
        if "compress" in data:
            compress_rows = _points(source, data, "compress", ("requests", "blocks"),
                                    {"blocks_squared": None})
            times = [row["time_s"] for row in compress_rows]
            if redundancy == "flash":
                compress = _fit(source, "compress", ("blocks", "blocks_squared"),
                                [[row["blocks"], _blocks_squared(row)] for row in compress_rows],
                                times, proportional_if_uniform=True)
            else:
                compress = _fit(source, "compress", ("blocks",),
                                [[row["blocks"]] for row in compress_rows], times,
                                proportional_if_uniform=True)
        contention = knobs.get("contention_factor")
        if contention is None:
            contention = data.get("contention_factor", DEFAULT_CONTENTION[redundancy])
        if isinstance(contention, bool) or not isinstance(contention, (int, float)) \
                or not contention >= 1.0:
            raise ConfigError(f"{source}: contention_factor: got {contention!r}, "
                              "expected a number >= 1")
        return cls(decode, prefill, mixed, compress, float(contention), header, source)

    def forward_time_for(self, work: StepWork) -> float:
        batch = work.num_decode
        if not work.num_prefill:
            if not batch:
                return 0.0
            context = work.decode_context_tokens
            value = self._decode_a + self._decode_b * batch + self._decode_c * context
            if self._decode_excess and work.decode_max_context:
                value += self._decode_excess * longest_excess(work.decode_max_context, context,
                                                              batch)
            return value if value > self._decode_floor else self._decode_floor
        tokens = work.prefill_tokens
        if self.prefill_buckets:
            tokens = padded_tokens(tokens, batch, self.prefill_buckets)
        if not batch:
            return self.prefill_fit.predict(tokens, work.attention_pairs, work.num_prefill)
        # A mixed step runs the prefill path: a host bound (its own, or the prefill's) and the
        # prefill's per-chunk cost.
        return self.mixed_fit.step_time(batch, work.decode_context_tokens, tokens,
                                        work.attention_pairs, work.num_prefill,
                                        work.decode_max_context or work.decode_context_tokens / batch)

    def compress_time_for(self, blocks: Sequence[int],
                          kept_blocks: Sequence[int] | None = None) -> float:
        # The fit prices the blocks read (what a profile measures); what is kept is not a
        # feature of it, so `kept_blocks` does not change the estimate.
        if self.compress_fit is None:
            raise ConfigError(f"{self.source}: the profile has no \"compress\" section, so it "
                              "cannot time compressions; measure one, or run with compression off "
                              "or the analytic cost model")
        return self.compress_fit.predict(sum(blocks), sum(count * count for count in blocks))


# Optional fields of a prefill or mixed point: the prompt chunks of the step.
PREFILL_DEFAULTS = {"cached_tokens": 0, "requests": 1, "attention_pairs": None}
PREFILL_FEATURES = ("new_tokens", "attention_pairs")
# The mixed fit's own coefficients (version 3): its host bound h_m and its constant m. Like every
# section it needs a point more than those; and each is taken as determined only when that many
# points fall in its regime: one point alone would set it to that point's time, noise included.
MIXED_UNKNOWNS = 2
MIN_REGIME_POINTS = 2


def padded_tokens(new_tokens: int, decodes: int, buckets: tuple[int, ...]) -> int:
    """The prompt rows a padded step computes: its bucket's rows less its decode rows (a padding
    row costs what a prompt row does in the GEMMs; it adds no attention pairs)."""
    return padded_rows(new_tokens + decodes, buckets) - decodes


def _prefill_fit(source: str, version: int, rows: list[dict[str, Any]],
                 buckets: tuple[int, ...] = ()) -> PrefillFit:
    """Version 3: host- or device-bound with a per-sequence term, non-negative
    (sim/prefill_fit.py). Before it: one unconstrained line in tokens and pairs, exactly as those
    profiles were always read (their predictions must not change). With `buckets`, each point's
    tokens are its padded rows."""
    tokens = [padded_tokens(row["requests"] * row["new_tokens"], 0, buckets) if buckets
              else row["requests"] * row["new_tokens"] for row in rows]
    pairs = [_prefill_pairs(row) for row in rows]
    times = [row["time_s"] for row in rows]
    if version < 3:
        line = _fit(source, "prefill", PREFILL_FEATURES, list(map(list, zip(tokens, pairs))),
                    times)
        return PrefillFit(line.coefficients, 0.0, 0.0, line.relative_rms_error,
                          line.num_points, line.floor_s)
    requests = [row["requests"] for row in rows]
    unknowns = 5 if len(set(requests)) > 1 else 4
    if len(rows) < unknowns + 1:
        raise ConfigError(f"{source}: prefill: {len(rows)} point(s) cannot fit "
                          f"{unknowns} coefficients; measure at least {unknowns + 1}")
    return fit_prefill(tokens, pairs, requests, times)


def longest_excess(max_context: float, context_tokens: float, batch: float) -> float:
    """KV entries the longest decode request holds beyond the batch's mean: what makes a decode
    step cost more than its batch and summed context say, when the kernel gives each request one
    partition (the analytic model's DECODE_PROGRAM_BANDWIDTH)."""
    excess = max_context - context_tokens / batch
    return excess if excess > 0.0 else 0.0


# A longest-request term is fitted only if some decode points hold one request this far (KV
# entries) beyond the mean: balanced steps cannot separate it from the context slope.
MIN_LONGEST_EXCESS = 1024


def _decode_fit(source: str, rows: list[dict[str, Any]]) -> LinearFit:
    """a + b * batch + c * context_tokens, plus d * longest_excess when every point says its
    longest request (`max_context`: profiles fitted from runs whose steps.csv records it), some
    are unbalanced and the fit finds d > 0; otherwise the three-term fit, as always."""
    names = ("batch", "context_tokens")
    features = [[row["batch"], row["context_tokens"]] for row in rows]
    times = [row["time_s"] for row in rows]
    if rows and all(row["max_context"] is not None for row in rows):
        excess = [longest_excess(row["max_context"], row["context_tokens"], row["batch"])
                  for row in rows]
        if max(excess) >= MIN_LONGEST_EXCESS:
            fit = _fit(source, "decode", names + ("longest_excess",),
                       [point + [value] for point, value in zip(features, excess)], times)
            if fit.coefficients[3] > 0:
                return fit
    return _fit(source, "decode", names, features, times)


def _mixed_fit(source: str, version: int, decode: LinearFit, prefill: PrefillFit,
               rows: list[dict[str, Any]], buckets: tuple[int, ...] = ()) -> MixedFit:
    """A mixed step costs the decode fit's per-request and per-context-token terms plus the
    prefill fit's per-token and per-pair terms, and one constant m: a single forward reads the
    weights and pays the host's step overhead once, not once per part. It runs the prefill
    path, so it is host-bound or device-bound like a prefill step, and pays the
    prefill's per-chunk cost s. Version 3 fits its host bound h_m and m to the mixed points
    (host-or-device, non-negative, relative error: sim/prefill_fit.py), falling back to the
    prefill's h with m fitted alone when the points do not determine h_m; before version 3, and
    in that fallback, m is fitted as one constant through every point (in relative error, like
    every fit), as it always was. A profile without mixed points (version 1) gets the larger of
    the two constants, the one-forward assumption, and the prefill's h (docs/cost_model.md).
    With `buckets` (a padded engine) the tokens are padded rows and the longest decode's walk is
    fitted too (below)."""
    # The decode's batch and context slopes; not its longest-request term: in an eager mixed
    # step the prompt chunk, not one long decode, sets its length (host-bound or prefill-bound).
    names = decode.feature_names[1:3] + PREFILL_FEATURES
    slopes = decode.coefficients[1:3] + prefill.device_coefficients[1:]
    bounds = {"host_s": prefill.host_s, "per_sequence_s": prefill.per_sequence_s}
    one_forward = max(decode.coefficients[0], prefill.device_coefficients[0])
    if not rows:
        return MixedFit(("constant",) + names, (one_forward,) + slopes,
                        relative_rms_error=float("nan"), num_points=0,
                        floor_s=max(decode.floor_s, prefill.floor_s), **bounds)
    features = np.array([[row["batch"], row["context_tokens"],
                          padded_tokens(row["requests"] * row["new_tokens"], row["batch"], buckets)
                          if buckets else row["requests"] * row["new_tokens"],
                          _prefill_pairs(row)]
                         for row in rows], dtype=float)
    # A padded step's decode rows are one-token sequences of the prefill launch, each walked by
    # one program per KV head (no split-K): the longest one is a serial walk the chunk's tiles
    # may not hide (Full KV, one decode of 8k entries beside a 128-token chunk: 15.1 against
    # 8.1 ms at 513 entries, Qwen3-8B on an H200). Fitted as one more device term.
    longest = np.array([row.get("max_context") or row["context_tokens"] / row["batch"]
                        for row in rows], dtype=float)
    # Only where the points vary it: otherwise the constant already holds it.
    extra = ("longest_decode",) if buckets and np.ptp(longest) > 0 else ()
    time = np.array([row["time_s"] for row in rows], dtype=float)
    chunks = np.array([row["requests"] for row in rows], dtype=float)
    slope_part = features @ np.asarray(slopes)  # v: what the pure fits' slopes charge
    offsets = slope_part
    if prefill.per_sequence_s:
        offsets = offsets + prefill.per_sequence_s * chunks
    if version >= 3 and len(rows) >= MIXED_UNKNOWNS + 1:
        # Known: v inside the max, s * chunks outside it; fitted: h_m and m. A point's device
        # time grows with v, so the regimes split the points by v.
        inner = np.column_stack([np.ones(len(rows))] + ([longest] if extra else []))
        fit = fit_host_or_device(time, inner=inner,
                                 outer=np.empty((len(rows), 0)), sizes=slope_part,
                                 inner_offset=slope_part,
                                 outer_offset=prefill.per_sequence_s * chunks)
        host_points = int((~fit.device).sum())
        if host_points >= MIN_REGIME_POINTS:
            constant = fit.inner[0]
            if len(rows) - host_points < MIN_REGIME_POINTS:
                # (Nearly) every point is host-bound: they bound m from above only. Take the
                # one-forward assumption, as without mixed points.
                constant = one_forward
            # The fitted host bound is the floor: the device line may fall below it (the
            # decode's slopes are not constrained), never the step.
            mixed = MixedFit(("constant",) + names + extra,
                             (constant,) + slopes + tuple(fit.inner[1:]), 0.0, len(rows),
                             fit.host_s, host_s=fit.host_s,
                             per_sequence_s=prefill.per_sequence_s, host_fitted=True)
            return replace(mixed, relative_rms_error=_mixed_error(mixed, features, chunks,
                                                                  time, longest))
    constant = _fit(source, "mixed", extra, [[value] for value in longest] if extra
                    else [[] for _ in rows], time.tolist(), offsets=offsets)
    mixed = MixedFit(("constant",) + names + extra,
                     constant.coefficients[:1] + slopes + constant.coefficients[1:],
                     constant.relative_rms_error, constant.num_points, constant.floor_s,
                     **bounds)
    if version < 3:
        return mixed
    # Points that leave h_m open are device-bound (or too few), so the fastest of them says
    # nothing about a small mixed step, which the prefill's h bounds: the device line is only
    # kept above the fastest decode step measured. The error is the model's as it predicts,
    # with the host bound, which the constant was fitted without.
    mixed = replace(mixed, floor_s=decode.floor_s)
    return replace(mixed, relative_rms_error=_mixed_error(mixed, features, chunks, time, longest))


def _mixed_error(fit: MixedFit, features: np.ndarray, chunks: np.ndarray,
                 time: np.ndarray, longest: np.ndarray) -> float:
    predicted = np.array([fit.step_time(*point, count, length)
                          for point, count, length in zip(features, chunks, longest)])
    return float(np.sqrt(np.mean((predicted / time - 1.0) ** 2)))


def _prefill_pairs(row: dict) -> float:
    # A point measured on one request shape gives (new, cached, requests); a point taken from a
    # run's step (mixed prompt lengths) gives its attention pairs directly.
    if row["attention_pairs"] is not None:
        return row["attention_pairs"]
    return row["requests"] * causal_pairs(row["new_tokens"], row["cached_tokens"])


def _blocks_squared(row: dict) -> float:
    # Without the per-request split, assume the batch's blocks were spread evenly.
    if row["blocks_squared"] is not None:
        return row["blocks_squared"]
    return row["blocks"] ** 2 / row["requests"]


def _read_profile(profile: str | Path | dict) -> tuple[str, dict]:
    if isinstance(profile, dict):
        return "profile", profile
    path = Path(profile)
    source = f"profile {path}"
    try:
        # A profile fitted from long runs holds thousands of points: it may be kept gzipped.
        text = (gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz"
                else path.read_text())
        data = json.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{source}: not a readable JSON file ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    return source, data


def _check_header(source: str, data: dict, shape: ModelShape | None, gpu: GPUSpec | None,
                  knobs: dict[str, Any]) -> dict[str, Any]:
    """Validate the profile's metadata and refuse a profile measured for a different setup."""
    _check_knob_names(knobs)
    version = data.get("version")
    if isinstance(version, bool) or version not in READABLE_PROFILE_VERSIONS:
        raise ConfigError(f"{source}: version: got {version!r}, expected one of "
                          f"{', '.join(map(str, READABLE_PROFILE_VERSIONS))}")
    if version < 2 and "mixed" in data:
        raise ConfigError(f"{source}: mixed: a version-2 section; set \"version\" to 2")
    for name in ("model", "gpu"):
        if not isinstance(data.get(name), str):
            raise ConfigError(f"{source}: {name}: expected a string naming the "
                              f"{'model preset' if name == 'model' else 'GPU'} it was measured on")
    header = {key: value for key, value in data.items()
              if key not in PROFILE_SECTIONS}
    if header.get("redundancy", "lightning") not in REDUNDANCY_MODES:
        raise ConfigError(f"{source}: redundancy: got {header['redundancy']!r}, expected one of "
                          f"{', '.join(REDUNDANCY_MODES)}")
    if "dtype" in header and header["dtype"] not in DTYPE_BYTES:
        raise ConfigError(f"{source}: dtype: got {header['dtype']!r}, expected one of "
                          f"{', '.join(DTYPE_BYTES)}")
    buckets = header.get("prefill_buckets")
    if buckets is not None and not (
            isinstance(buckets, list) and buckets
            and all(isinstance(size, int) and not isinstance(size, bool) and size > 0
                    for size in buckets)
            and all(a < b for a, b in zip(buckets, buckets[1:]))):
        raise ConfigError(f"{source}: prefill_buckets: got {buckets!r}, expected increasing "
                          "positive token counts: the buckets the measured engine padded prefill "
                          "and mixed steps to (or leave the field out: steps were not padded)")
    graphs = header.get("graphs")
    if graphs is not None and not (isinstance(graphs, dict) and set(graphs) == {"decode", "prefill"}
                                   and all(isinstance(value, bool) for value in graphs.values())):
        raise ConfigError(f"{source}: graphs: got {graphs!r}, expected {{\"decode\": true|false, "
                          "\"prefill\": true|false}: which engine steps replayed CUDA graphs "
                          "when it was measured")
    fix = "measure a profile for this setup, or use --cost-model analytic"
    if shape is not None and model_identity(data["model"]) != model_identity(shape.name):
        raise ConfigError(f"{source}: model: measured on {data['model']!r}, but this run uses "
                          f"{shape.name!r}; {fix}")
    if gpu is not None and _gpu_name(data["gpu"]) != gpu.name:
        raise ConfigError(f"{source}: gpu: measured on {data['gpu']!r}, but this run uses "
                          f"{gpu.name!r}; {fix}")
    if "dtype_bytes" in knobs and "dtype" in header \
            and DTYPE_BYTES[header["dtype"]] != knobs["dtype_bytes"]:
        raise ConfigError(f"{source}: dtype: measured in {header['dtype']}, but this run uses "
                          f"{knobs['dtype_bytes']}-byte values; {fix}")
    for name in (*COST_KNOBS, "tensor_parallel"):
        if name in knobs and name in header and knobs[name] != header[name]:
            raise ConfigError(f"{source}: {name}: measured with {header[name]!r}, but this run "
                              f"uses {knobs[name]!r}; {fix}")
    return header


def _check_knob_names(knobs: dict[str, Any]) -> None:
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise ConfigError(f"cost model: unknown knob(s) {', '.join(unknown)}; known: "
                          f"{', '.join(KNOBS)}")


def _plain(name: str) -> str:
    return name.strip().lower().replace("_", "-").split("/")[-1].removeprefix("random:")


def _gpu_name(name: str) -> str:
    try:
        return get_hardware(name).name
    except ConfigError:
        return _plain(name)


def _points(source: str, data: dict, section: str, required: tuple[str, ...],
            optional: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one profile section, every field checked to be a non-negative number."""
    rows = data.get(section)
    if not isinstance(rows, list):
        raise ConfigError(f"{source}: {section}: expected a list of measured points "
                          f"({', '.join(required + ('time_s',))}), got {type(rows).__name__}")
    points = []
    for index, row in enumerate(rows):
        where = f"{source}: {section}[{index}]"
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected an object, got {row!r}")
        point = {}
        for name in required + ("time_s",) + tuple(optional):
            if name not in row:
                if name in optional:
                    point[name] = optional[name]
                    continue
                raise ConfigError(f"{where}.{name}: missing")
            value = row[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}.{name}: expected a non-negative number, got {value!r}")
            point[name] = value
        if not point["time_s"] > 0:
            raise ConfigError(f"{where}.time_s: expected a positive duration, got "
                              f"{point['time_s']!r}")
        if "requests" in point and not point["requests"] >= 1:
            raise ConfigError(f"{where}.requests: expected at least 1, got {point['requests']!r}")
        points.append(point)
    return points


def _fit(source: str, section: str, names: tuple[str, ...], features: list[list[float]],
         times: list[float], offsets: np.ndarray | None = None,
         proportional_if_uniform: bool = False) -> LinearFit:
    """Least squares in relative error, so short steps are fitted as well as long ones.

    time = offset + constant + sum(coefficient * feature): `offsets` are the parts of each
    point's time that other fits already explain (default none). With
    `proportional_if_uniform`, points that all have the same features (every compression batch
    of a run the same size) cannot separate the constant from the slope: the time is then taken
    as proportional to the first feature, which is what a compression's cost mostly is."""
    unknowns = len(names) + 1
    time = np.asarray(times, dtype=float)
    offset = np.zeros(len(times)) if offsets is None else np.asarray(offsets, dtype=float)
    rows = np.asarray(features, dtype=float)
    if proportional_if_uniform and len(times) >= 1 and rows.size and (rows == rows[0]).all() \
            and rows[0][0] > 0:
        slope = float(np.median(time - offset)) / rows[0][0]
        predicted = offset + slope * rows[:, 0]
        return LinearFit(
            feature_names=("constant",) + names,
            coefficients=(0.0, slope) + (0.0,) * (len(names) - 1),
            relative_rms_error=float(np.sqrt(np.mean((predicted / time - 1.0) ** 2))),
            num_points=len(times), floor_s=float(time.min()))
    if len(times) < unknowns + 1:
        raise ConfigError(f"{source}: {section}: {len(times)} point(s) cannot fit "
                          f"{' + '.join(('constant',) + names)}; measure at least {unknowns + 1}")
    design = np.column_stack([np.ones(len(times)), rows])
    # Columns span orders of magnitude (tokens vs 1): scale them before judging the rank.
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    weighted = design / scale / time[:, None]
    if np.linalg.matrix_rank(weighted) < unknowns:
        raise ConfigError(f"{source}: {section}: the points do not vary "
                          f"{' and '.join(names)} independently, so their effects cannot be "
                          "separated; measure more varied points")
    solution, *_ = np.linalg.lstsq(weighted, 1.0 - offset / time, rcond=None)
    coefficients = solution / scale
    relative = (offset + design @ coefficients) / time - 1.0
    return LinearFit(
        feature_names=("constant",) + names,
        coefficients=tuple(float(value) for value in coefficients),
        relative_rms_error=float(np.sqrt(np.mean(relative**2))),
        num_points=len(times),
        floor_s=float(time.min()),
    )


def load_cost_model(spec: str, shape: ModelShape, gpu: GPUSpec, **knobs: Any) -> CostModel:
    """"analytic", a profile JSON path, or the name of a profile shipped in sim/profiles/."""
    if spec == ANALYTIC:
        _check_knob_names(knobs)
        return AnalyticCostModel(shape, gpu, **knobs)
    path = Path(spec)
    if not path.exists() and (PROFILES_DIR / f"{spec}.json").exists():
        path = PROFILES_DIR / f"{spec}.json"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ConfigError(f"cost model: {spec!r} is neither \"analytic\" nor a profile file; "
                          f"shipped profiles: {shipped or 'none'}")
    return CalibratedCostModel.from_profile(path, shape=shape, gpu=gpu, **knobs)


def synthesize_profile(model: AnalyticCostModel, *, noise: float = 0.03,
                       seed: int = 0) -> dict[str, Any]:
    """A profile in the measured format, timed by `model` with multiplicative Gaussian noise.

    It exercises the calibrated path without a GPU; real profiles come from the engine.
    """
    rng = np.random.default_rng(seed)

    def jitter(seconds: float) -> float:
        return round(seconds * (1.0 + noise * rng.standard_normal()), 9)

    decode = [{"batch": batch, "context_tokens": batch * context,
               "time_s": jitter(model.decode_time_for(batch, batch * context))}
              for batch in (1, 8, 32, 64, 128, 176, 256) for context in (512, 2048, 4096)]
    prefill = [{"new_tokens": new, "cached_tokens": cached, "requests": 1,
                "time_s": jitter(model.prefill_time_for([(new, cached)]))}
               for new in (128, 512, 2048, 8192) for cached in (0, 2048)]
    compress = [{"requests": requests, "blocks": requests * each,
                 "time_s": jitter(model.compress_time_for([each] * requests))}
                for requests in (1, 2, 4, 8) for each in (9, 12, 16)]
    # Drawn last, so the sections above are what they were before mixed points existed.
    mixed = [{"batch": batch, "context_tokens": batch * context, "new_tokens": new,
              "cached_tokens": 0, "requests": 1, "time_s": jitter(model.forward_time_for(
                  StepWork.from_counts(batch, batch * context, [(new, 0)])))}
             for batch in (1, 32, 128) for context in (512, 4096) for new in (128, 512, 2048)]
    return {
        "version": PROFILE_VERSION,
        "note": (f"SYNTHETIC: generated by sim.cost_model.synthesize_profile from the analytic "
                 f"model with {noise:.0%} Gaussian noise (seed {seed}); not a measurement"),
        "source": "synthetic",
        "model": model.shape.name,
        "gpu": model.gpu.name,
        "dtype": "bfloat16" if model.dtype_bytes == 2 else "float32",
        **{name: getattr(model, name) for name in COST_KNOBS},
        "tensor_parallel": model.tensor_parallel,
        "contention_factor": model.contention_factor,
        "decode": decode,
        "prefill": prefill,
        "mixed": mixed,
        "compress": compress,
    }
