"""Runs the core's compression jobs on the engine's caches, synchronously or asynchronously.

Sync jobs run on the main stream before the step's forward. An async batch runs on its own CUDA
stream, overlapping the decode steps of the other requests: the runner launches it once the step's
forward is queued, it waits for everything the main stream has queued (the KV entries it reads,
and that forward), and it records an event the step loop polls; the core keeps the compressed
requests out of decode until the batch is reported done. Blocks the batch
reads or writes are held by the core until then, so no other request can touch them. On the CPU
an async batch simply runs at launch and is done at the next poll.

Layers are compressed `layer_stride` at a time (the paper's cross-layer parallel compression):
fewer, larger launches. Each request is scored by its own policy (`Sequence.scoring`, or the
deployment's `--scoring`): a batch runs as one batch per policy, so each policy's fast path stays
batched (docs/compression.md, 'Scoring policies').
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from zipage.config import ZipageConfig
from zipage.core.step import CompressionBatch, CompressionJob
from zipage.engine.caches import KVCaches
from zipage.errors import ConfigError
from zipage.kernels.compress import CompressionInputs, CompressionParams, compress
from zipage.scoring import jobs_by_scoring, scoring_spec


class Compressor:
    def __init__(self, caches: KVCaches, config: ZipageConfig, head_dim: int,
                 device: torch.device) -> None:
        self.caches = caches
        self.device = device
        # The pipeline, scoring with the policy `params.scoring` names (kernels/scoring): called
        # once per policy of a batch. Analysis swaps in a dispatcher of the same signature that
        # scores each request with variants the registry does not hold.
        self.compress_fn = compress
        # Tensor parallelism with replicated KV heads sets this (`engine/parallel.py`): the max
        # over a KV head's query heads, reduced across the ranks that hold some of them.
        self.reduce_group_max = None
        self.params = CompressionParams.from_config(config)
        self.scale = head_dim ** -0.5
        self.layer_stride = config.layer_stride
        self.on_gpu = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.on_gpu else None
        self.green_context = None
        self.in_flight: tuple[int, torch.cuda.Event | None] | None = None

    def limit_sms(self, num_sms: int | None) -> None:
        """Run async batches on `num_sms` SMs only (a CUDA green context), or on all (None).

        Stream priority alone does not stop a compression batch from filling every SM between two
        decode kernels; a partition leaves the rest of the GPU to the decode. Measured, it does
        not pay (docs/results/compression-kernels.md), so nothing in the engine calls it: it is
        an API for measurements (`bench/compress_gpu.py`), not a setting.
        """
        if not self.on_gpu:
            return
        # Swapping streams would drop the context an in-flight batch still runs in.
        assert self.in_flight is None, "limit_sms with a compression batch in flight"
        self.stream.synchronize()
        if num_sms is None:
            self.stream, self.green_context = torch.cuda.Stream(self.device), None
            return
        device = self.device
        device_id = device.index if device.index is not None else torch.cuda.current_device()
        available = torch.cuda.get_device_properties(device_id).multi_processor_count
        if not 1 <= num_sms < available:
            raise ConfigError(f"limit_sms: got {num_sms}, expected 1 to "
                              f"{available - 1} (this GPU has {available} SMs)")
        from torch.cuda.green_contexts import GreenContext

        try:
            self.green_context = GreenContext.create(num_sms=num_sms, device_id=device_id)
        except (RuntimeError, AttributeError) as error:
            raise ConfigError(f"limit_sms: this CUDA build or driver cannot make a "
                              f"green context ({error})") from error
        self.stream = self.green_context.Stream()

    def run(self, jobs: list[CompressionJob]) -> None:
        """Compress `jobs` now, on the current stream: the jobs of each scoring policy together,
        as one batch (requests write disjoint blocks, so the batches' order is free)."""
        for scoring, group in jobs_by_scoring(jobs, self.params.scoring).items():
            self.run_policy(group, self.params_of(scoring))

    def params_of(self, scoring: str) -> CompressionParams:
        """The deployment's parameters with `scoring`'s policy (which fixes its own constants in
        `compress`); the pipeline's knobs are the deployment's."""
        if scoring == self.params.scoring:
            return self.params
        params = dataclasses.replace(self.params, scoring=scoring)
        # Admission refuses a policy that needs a score cache the deployment did not allocate
        # (`Admission.scoring_reason`); scoring without it would crash inside a kernel.
        assert self.caches.score is not None or not (
            params.global_score and scoring_spec(scoring).global_scores), \
            f"scoring {scoring!r} needs the global score cache this deployment lacks"
        return params

    def run_policy(self, jobs: list[CompressionJob], params: CompressionParams) -> None:
        """Compress `jobs`, all scored by the policy of `params`, as one batch."""
        caches = self.caches
        tables = self.tables(jobs)
        # Tensor parallelism with replicated KV heads: the GQA max spans ranks.
        extra = {} if self.reduce_group_max is None else {"reduce_group_max": self.reduce_group_max}
        layers = caches.num_layers
        seeds = tables.pop("seeds")
        for first in range(0, layers, self.layer_stride):
            group = slice(first, min(first + self.layer_stride, layers))
            inputs = CompressionInputs(
                caches.kv[0, group], caches.kv[1, group],
                caches.score[group] if caches.score is not None else None,
                caches.query[group], **tables, **caches.layer_scales(group),
                # Each group's layers draw apart from the other groups' (the random policy).
                seeds=seeds * 131 + first)
            # By keyword, the contract of a compress_fn; the fp8 scales only for an fp8 cache
            # (`CompressionInputs.keywords`), so a policy that knows none still runs on others.
            arguments = {name: value for name, value in vars(inputs).items()
                         if name not in ("num_target_blocks", "k_scale", "v_scale", "seeds")}
            self.compress_fn(**arguments, **inputs.keywords(), params=params,
                             scale=self.scale, **extra)

    def tables(self, jobs: list[CompressionJob]) -> dict[str, torch.Tensor]:
        """The batch's per-request tables on the device, uploaded without blocking the host.

        A blocking upload waits for the stream it runs on, and an async batch's stream waits for
        the step's forward (`launch`): one blocking copy would hold the host until the forward
        is done. So the tables go up from pinned memory, in three copies."""
        # Both tables are padded with -1: requests read different numbers of source blocks and,
        # with budgets of their own or the elastic policy, keep different numbers of blocks.
        source = _padded([job.source_table for job in jobs])
        target = _padded([job.target_blocks for job in jobs])
        counts = torch.tensor([[len(job.source_table) for job in jobs],
                               [job.query_slot for job in jobs],
                               [not job.is_first for job in jobs],
                               [len(job.target_blocks) for job in jobs]], dtype=torch.int32)
        seeds = torch.tensor([job_seed(job) for job in jobs], dtype=torch.int64)
        if self.on_gpu:
            source, target, counts, seeds = (
                tensor.pin_memory().to(self.device, non_blocking=True)
                for tensor in (source, target, counts, seeds))
        return dict(source_tables=source, num_source_blocks=counts[0],
                    target_tables=target, query_slots=counts[1].long(),
                    is_compressed=counts[2].bool(), num_target_blocks=counts[3], seeds=seeds)

    def launch(self, batch: CompressionBatch) -> None:
        assert self.in_flight is None, "the core allows one compression batch in flight"
        if not self.on_gpu:
            self.run(batch.jobs)
            self.in_flight = (batch.batch_id, None)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.run(batch.jobs)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.in_flight = (batch.batch_id, done)

    def completed(self, wait: bool = False) -> list[int]:
        """Ids of async batches finished by now (blocking until then when `wait`)."""
        if self.in_flight is None:
            return []
        batch_id, done = self.in_flight
        if done is not None:
            if wait:
                done.synchronize()
            elif not done.query():
                return []
            # Later main-stream work (decoding the compressed requests) must see the writes.
            torch.cuda.current_stream().wait_event(done)
        self.in_flight = None
        return [batch_id]


def job_seed(job: CompressionJob) -> int:
    """A compression's own seed: a checksum of what it reads and writes (its blocks and slot),
    so the same request and step draw the same on every run and every tensor-parallel rank
    (whose jobs carry no more of their request than its policy), and two requests of one step
    differ."""
    numbers = [*job.source_table, -1, *job.target_blocks, -1, job.query_slot]
    return zlib.crc32(torch.tensor(numbers, dtype=torch.int64).numpy().tobytes())


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """int32 [len(rows), longest row], each row padded with -1."""
    table = torch.full((len(rows), max(len(row) for row in rows)), -1, dtype=torch.int32)
    for index, row in enumerate(rows):
        table[index, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return table
