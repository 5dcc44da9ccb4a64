"""The analytic cost model: a roofline over the model's shape and a `GPUSpec`.

Every operation costs max-ish(bytes / achievable bandwidth, FLOPs / achievable compute) plus
launch and host overheads, with the compression pipeline (docs/architecture.md, 'Compression
pipeline') costed kernel by kernel. It needs no GPU and covers any model, GPU and knob setting;
its constants are assumptions, each written out with where it comes from in docs/cost_model.md.
`synthesize_profile` times a profile with it, to exercise the calibrated model without a GPU.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from zipage.core.memory import heads_per_gpu, kv_entry_bytes
from zipage.decode_grid import balanced_row_partitions, decode_grid_partitions, decode_num_partitions, programs_per_sm
from zipage.dtypes import DTYPE_BYTES
from zipage.errors import ConfigError
from zipage.hardware import GPUSpec
from zipage.prefill_buckets import DECODE_SECTION_GRID_BATCH, PREFILL_GRAPH_TOKENS, bucket_of, takes_decode_section
from zipage.profile import COST_KNOBS, PROFILE_VERSION
from zipage.scoring import DEFAULT_SCORING, ScoringCost, scoring_spec
from zipage.shape import ModelShape
from zipage.sim.cost_model import CostModel, StepWork

FLOAT32_BYTES = 4

# Real kernels do not switch abruptly from memory- to compute-bound at the ridge point: measured
# on the H200, Qwen3-8B's decode GEMMs at batch 176 (where both limits are ~4.0 ms) took 5.0 ms.
# A cube-norm of the two times fits that (5.0 ms) and equals the max away from the ridge.
ROOFLINE_SHARPNESS = 3.0
# Shares of the GPU's achievable rates (a copy, a large square GEMM) that each kernel class reaches,
# measured on the H200 with Qwen3-8B's shapes under CUDA graphs: the decode GEMV chain streamed
# weights at 3.79 TB/s (0.89 of the 4.27 a copy gets); the projection GEMMs at 512..8192 rows ran
# at 667..680 TFLOP/s (0.85 of 791); torch's flash SDPA streamed a batch-176 decode KV cache at
# 4.19 TB/s (a copy's rate, so no factor). Attention's query-key pairs run at the engine's own
# paged prefill kernel's rate, not torch's flash SDPA's (0.70 of 791 TFLOP/s at 8k tokens, the
# value until 2026-12-02, which priced long-context prefill 20 % short): the shipped bfloat16
# launch, Qwen3-8B and 0.6B, 512-4,096 new tokens over 0-16k cached entries, median 0.47 of
# 791 over 24 kernel points (bench/prefill_attention_gpu.py, 2026-12-02); a whole graphed
# 2,048-token Llama-3.1-8B step over 8-16k cached entries, 0.46-0.48 (bench/prefill_gpu.py).
LINEAR_BANDWIDTH_EFFICIENCY = 0.89
LINEAR_COMPUTE_EFFICIENCY = 0.85
ATTENTION_COMPUTE_EFFICIENCY = 0.47
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
# A mixed step of at most the largest prefill graph's rows runs in a CUDA graph. Unless it takes
# the decode section (zipage/prefill_buckets.py: at most 32 decode rows, the longest of 2k entries
# or more), its one prefill launch also covers its decode rows, each a sequence of one new token
# (zipage/engine/runner.py, 'Prefill graphs'): one program a row and KV head walks that row's
# whole context, with no split-K. A program's time a layer and entry grows with the query heads
# it carries (its KV group): 11.4 ns a head, from whole graphed steps on an H200 with 16 decode
# rows at 1k-20k entries beside a 496- or 2,032-token chunk, eager steps subtracted
# (Llama-3.1-8B, group 4: 43.8 ns; Qwen3-0.6B, group 2: 23.7 ns; bench/prefill_gpu.py,
# 2026-12-02, before the section; docs/cost_model.md, 'Decode rows in graphed mixed steps').
FOLDED_DECODE_HEAD_ENTRY_S = 11.4e-9
# Those rows are the last items of the launch's work list, so their programs run as a tail after
# the chunks' tiles; the tail grows the step by its longest program less this share of the
# chunks' attention time (the same steps beside a 2,032-token chunk over 0 / 8k / 16k cached
# entries: +28.8 / +21.8 / +16.0 ms over 3.7 / 27.5 / 49.1 ms of chunk attention).
FOLDED_DECODE_OVERLAP = 0.26
# The fp8 decode kernel reads its (halved) bytes at this fraction of the rate the bfloat16 one
# reads its own: it widens every value and key and is bound by the programs an SM holds, not by
# bytes. One layer of Llama-3.1-8B's decode attention on an H200 in a CUDA graph, the shipped
# launches, batch 128-512 at 576 and 2,000 entries: 2.48-2.72 TB/s against 4.01-4.31, ratios
# 0.62-0.64 (bench/decode_kernel_info_gpu.py, 2026-12-01; docs/cost_model.md, 'FP8 KV cache').
FP8_DECODE_BANDWIDTH_EFFICIENCY = 0.63
# One fp8 decode program walks its partition at this many times a bfloat16 program's time an entry
# (DECODE_PROGRAM_BANDWIDTH over bfloat16's bytes), not at half of it: it reads half the bytes but
# widens each, on 2 warps. One layer of Llama-3.1-8B's decode attention on an H200: a 20k-entry row
# walked by one program beside 95 of 2k, 830 / 657 us (1.26; the same on two hosts); a 20k row cut
# into 10 / 8 partitions beside 7 of 2k, 47 / 37 ns an entry (1.27) (bench/decode_long_row_gpu.py,
# 2026-12-02; docs/cost_model.md, 'The balanced decode split').
FP8_DECODE_PROGRAM_ENTRY_RATIO = 1.26
# The fp8 prefill kernel computes its query-key pairs at this fraction of the bfloat16 one's rate: it
# widens every key and value in registers, outside the tiles' asynchronous copy pipeline, and scales
# each logit and weight by its entry's scale on an ALU-bound softmax, so reading half the bytes buys
# nothing. One layer of Qwen3-8B's and Qwen3-0.6B's prefill attention on an H200, the shipped launches
# (bfloat16 64/64/4/3, fp8 64/128/4/2), 512-4,096 new tokens over 0-16k cached entries: median 0.52
# (0.49-1.54) over 24 points (bench/prefill_attention_gpu.py, 2026-12-02; docs/cost_model.md, 'FP8 KV cache').
FP8_PREFILL_COMPUTE_EFFICIENCY = 0.52
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
# Fp32 passes over the per-kv-head scores N*b and launches per group are the scoring policy's
# (`ScoringCost`, zipage/scoring.py; the pipeline's: 10 passes — mean over the window, pooling,
# window fill, redundancy normalisation and softmax, the lambda combination, top-k input and
# keep-mask output — and 8 launches, `compression_launches_per_group`).
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


def _roofline(memory_s: float, compute_s: float) -> float:
    power = ROOFLINE_SHARPNESS
    return (memory_s**power + compute_s**power) ** (1.0 / power)


def launch_groups(num_layers: int, layer_stride: int) -> int:
    """Launch groups of cross-layer compression: `layer_stride` layers per group."""
    if layer_stride <= 0 or layer_stride >= num_layers:
        return 1
    return math.ceil(num_layers / layer_stride)


def compression_launches_per_group(redundancy: str, global_score: bool,
                                   cost: ScoringCost | None = None) -> int:
    """Kernel launches (besides top-k) that one launch group of a compression issues: the scoring
    policy's own (the pipeline's: score kernel, softmax, group max, window mean, pooling, window
    fill, keep mask, K/V compaction), then the global score's and the redundancy's."""
    launches = (cost or scoring_spec(DEFAULT_SCORING).cost).launches
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
                 kv_cache_dtype: str = "auto", scoring: str = DEFAULT_SCORING,
                 async_scheduling: bool = False) -> None:
        _check_knobs(shape, dtype_bytes, block_size, window, kv_budget, redundancy, layer_stride,
                     tensor_parallel, contention_factor)
        # The same deployment with another scoring policy prices a request that asks for that
        # one (`compress_time_for`'s `scoring`): built on first use, by name.
        self._knobs = dict(dtype_bytes=dtype_bytes, block_size=block_size, window=window,
                           kv_budget=kv_budget, redundancy=redundancy, layer_stride=layer_stride,
                           global_score=global_score, tensor_parallel=tensor_parallel,
                           contention_factor=contention_factor, kv_cache_dtype=kv_cache_dtype,
                           async_scheduling=async_scheduling)
        self._with_scoring: dict[str, AnalyticCostModel] = {scoring: self}
        self.shape, self.gpu = shape, gpu
        self.dtype_bytes, self.block_size, self.window = dtype_bytes, block_size, window
        self.kv_budget, self.redundancy, self.layer_stride = kv_budget, redundancy, layer_stride
        self.global_score, self.tensor_parallel = global_score, tensor_parallel
        # Async scheduling: the host's part of a step (its fixed and per-request overheads)
        # runs while the device computes the step before, so a step lasts the longer of the
        # two, not their sum.
        self.async_scheduling = async_scheduling
        # The scoring policy's kernels (zipage/scoring.py): the knobs above as the default
        # pipeline runs them, or the policy's own fixed modes.
        self.scoring = scoring
        policy = scoring_spec(scoring)
        self.scoring_cost = cost = policy.cost
        self.redundancy_mode = redundancy if cost.redundancy is None else cost.redundancy
        self.keeps_global_scores = global_score and policy.global_scores
        # K (or V) bytes of one entry and KV head: an fp8 cache reads one byte per value plus
        # its scale, so attention and compression read about half the bytes of bfloat16.
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_entry_bytes = kv_entry_bytes(shape.head_dim, kv_cache_dtype, dtype_bytes)
        self.contention_factor = (DEFAULT_CONTENTION[self.redundancy_mode]
                                  if contention_factor is None else contention_factor)

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
        self._decode_kv_token_s = self._kv_token_s / (
            FP8_DECODE_BANDWIDTH_EFFICIENCY if kv_cache_dtype == "fp8" else 1.0)
        self.decode_programs_per_sm = programs_per_sm(kv_cache_dtype)  # the engine's grid for it
        # A graphed mixed step's decode section splits its rows as for this fixed batch.
        self._section_partitions = decode_num_partitions(
            DECODE_SECTION_GRID_BATCH, self.kv_heads, gpu.streaming_multiprocessors,
            programs_per_sm=self.decode_programs_per_sm)
        # One query-key pair costs a multiply-add in QK^T and one in PV, per query head and layer.
        self._attention_pair_s = (4 * layers * self.q_heads * head_dim
                                  / (gpu.achievable_flops * ATTENTION_COMPUTE_EFFICIENCY))
        self._prefill_pair_s = self._attention_pair_s / (
            FP8_PREFILL_COMPUTE_EFFICIENCY if kv_cache_dtype == "fp8" else 1.0)
        self._kernel_chain_s = layers * KERNELS_PER_LAYER * KERNEL_LATENCY_S
        # One program's time per KV entry of its partition, over all layers.
        self._program_entry_s = (layers * 2 * kv_entry_bytes(shape.head_dim, "auto", dtype_bytes)
                                 / DECODE_PROGRAM_BANDWIDTH
                                 * (FP8_DECODE_PROGRAM_ENTRY_RATIO if kv_cache_dtype == "fp8" else 1.0))
        self._folded_entry_s = layers * self.q_heads / self.kv_heads * FOLDED_DECODE_HEAD_ENTRY_S
        self._step_overhead_s = gpu.step_overhead_s
        self._allreduce_token_s, self._allreduce_fixed_s = 0.0, 0.0
        if tensor_parallel > 1:
            # Two all-reduces of the hidden state per layer plus the logits gather; a ring moves
            # 2 (tp - 1) / tp of the message over each link.
            link = gpu.interconnect_bytes_per_s * INTERCONNECT_EFFICIENCY
            ring = 2 * (tensor_parallel - 1) / tensor_parallel
            self._allreduce_token_s = 2 * layers * shape.hidden_size * dtype_bytes * ring / link
            self._allreduce_fixed_s = (2 * layers + 1) * ALLREDUCE_LATENCY_S

        # What a decode step's price reads of its batch size alone (its weight-streaming roofline
        # and its decode partitions), worked out once per batch size: the simulator prices
        # millions of decode steps over a few hundred batch sizes.
        self._decode_batch_terms: dict[int, tuple[float, int, int]] = {}

        self.num_launch_groups = launch_groups(layers, layer_stride)
        self.compress_fixed_s = COMPRESS_BATCH_OVERHEAD_S + self.num_launch_groups * (
            compression_launches_per_group(self.redundancy_mode, self.keeps_global_scores, cost)
            * KERNEL_LAUNCH_S
            + TOPK_CALL_S
        )

    def forward_time_for(self, work: StepWork) -> float:
        return self.forward_time(work.num_decode, work.decode_context_tokens, work.num_prefill,
                                 work.num_sampled_prefill, work.prefill_tokens,
                                 work.cached_tokens, work.attention_pairs,
                                 work.decode_max_context, work.shared_kv_tokens)

    def forward_time(self, num_decode: int, decode_context_tokens: int, num_prefill: int,
                     num_sampled_prefill: int, prefill_tokens: int, cached_tokens: int,
                     attention_pairs: int, decode_max_context: int,
                     shared_kv_tokens: int) -> float:
        # The formula, over the counts (the simulator prices its decode steps here directly).
        batch, tokens, sampled = num_decode, prefill_tokens, num_sampled_prefill
        if not batch and not num_prefill:
            return 0.0
        linear = self._linear_s(batch, tokens, sampled) if tokens or sampled else None
        # Decode rows and chunks attend in two kernels (split-K decode, varlen prefill), so two
        # rooflines: each decode row reads its own KV entries; a chunk reads the entries before
        # it, writes its new ones and reads them back.
        attention = folded = 0.0
        if batch:
            terms = self._decode_batch_terms.get(batch)
            if terms is None:
                grid = (batch, self.kv_heads, self.gpu.streaming_multiprocessors)
                terms = self._decode_batch_terms[batch] = (
                    self._linear_s(batch, 0, 0),
                    decode_num_partitions(*grid, programs_per_sm=self.decode_programs_per_sm),
                    decode_grid_partitions(*grid, programs_per_sm=self.decode_programs_per_sm,
                                           split="balanced"))
            if linear is None:  # a decode step: its linear layers are its batch's
                linear = terms[0]
            context = decode_context_tokens
            attention = _roofline(context * self._decode_kv_token_s, context * self._attention_pair_s)
            if decode_max_context:
                partitions = terms[1]
                bucket = bucket_of(batch + tokens, PREFILL_GRAPH_TOKENS) if num_prefill else None
                if bucket is not None:  # a graphed mixed step
                    if takes_decode_section(bucket, batch, decode_max_context):
                        partitions = self._section_partitions
                    else:
                        partitions = 0  # folded: no split-K in the graph
                elif not num_prefill and terms[2] > partitions:
                    # A decode step's longest row takes the balanced split where that gives it
                    # more partitions (zipage/decode_grid.py `takes_balanced_split`).
                    partitions = max(partitions, balanced_row_partitions(
                        decode_max_context, context, self.kv_heads, self.gpu.streaming_multiprocessors,
                        terms[2], programs_per_sm=self.decode_programs_per_sm))
                if partitions == 0:
                    folded = decode_max_context * self._folded_entry_s
                else:
                    longest = -(-decode_max_context // partitions) * self._program_entry_s
                    if longest > attention:
                        attention = longest
        if num_prefill:
            chunks = _roofline((cached_tokens + 2 * tokens) * self._kv_token_s,
                               attention_pairs * self._prefill_pair_s)
            # The folded rows are the work list's last items: their longest program is a tail
            # after the chunks' tiles, which hides part of it.
            attention = max(attention, folded - FOLDED_DECODE_OVERLAP * chunks) + chunks
        gpu = (linear + attention + self._allreduce_fixed_s
               + (batch + tokens) * self._allreduce_token_s)
        host = self._step_overhead_s + (batch + num_prefill) * PER_SEQUENCE_OVERHEAD_S
        if self.async_scheduling:
            return max(gpu + self._kernel_chain_s, host)
        return gpu + self._kernel_chain_s + host

    def _linear_s(self, batch: int, tokens: int, sampled_chunks: int) -> float:
        """The step's linear layers: weights stream once for every row of the step; each decode
        row and each chunk that samples goes through the LM head (a chunk computes logits for
        its last token only)."""
        return _roofline(self._weight_s, batch * self._decode_token_flop_s
                         + tokens * self._prefill_token_flop_s
                         + sampled_chunks * self._sampled_chunk_flop_s)

    def compress_time_for(self, blocks: Sequence[int], kept_blocks: Sequence[int] | None = None,
                          scoring: str | None = None) -> float:
        if scoring is not None and scoring != self.scoring:
            return self.with_scoring(scoring).compress_time_for(blocks, kept_blocks)
        block_size = self.block_size
        tokens = sum(blocks) * block_size
        # Torch ops between the kernels run on the batch padded to its longest request.
        padded_tokens = len(blocks) * max(blocks) * block_size
        if kept_blocks is None:
            kept_tokens = sum(min(self.kv_budget, count * block_size) for count in blocks)
        else:
            kept_tokens = sum(kept_blocks) * block_size
        attention = (self._attention_score_s(tokens, padded_tokens, len(blocks))
                     if self.scoring_cost.attention else 0.0)
        return (self.compress_fixed_s + attention
                + self._score_elementwise_s(tokens, padded_tokens)
                + self._redundancy_s(blocks)
                + self._compaction_s(tokens, kept_tokens))

    def with_scoring(self, scoring: str) -> "AnalyticCostModel":
        """This deployment's model with the scoring policy `scoring`, asked only for the cost of
        that policy's compressions (a decode step's contention stays this deployment's)."""
        model = self._with_scoring.get(scoring)
        if model is None:
            model = self._with_scoring[scoring] = AnalyticCostModel(
                self.shape, self.gpu, **self._knobs, scoring=scoring)
        return model

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
        """Steps 2-6 outside the kernels: global score, pooling, window, softmaxes, top-k input,
        and the passes of a policy that reads the keys or values themselves."""
        cost = self.scoring_cost
        per_layer = cost.score_passes * padded_tokens * self.kv_heads * FLOAT32_BYTES
        per_layer += ((cost.key_passes + cost.value_passes)
                      * tokens * self.kv_heads * self.kv_entry_bytes)
        if self.keeps_global_scores:
            per_layer += 2 * tokens * self.kv_heads * self.dtype_bytes  # read and write F
        return self.shape.num_layers * per_layer / self.gpu.achievable_bandwidth

    def _redundancy_s(self, blocks: Sequence[int]) -> float:
        """Step 4: cosine similarity of keys, within each block (lightning) or all pairs (flash)."""
        if self.redundancy_mode == "off":
            return 0.0
        shape, block_size = self.shape, self.block_size
        key_bytes = block_size * self.kv_entry_bytes
        if self.redundancy_mode == "lightning":
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
        if self.keeps_global_scores:
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
        "note": (f"SYNTHETIC: generated by sim.analytic.synthesize_profile from the analytic "
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
