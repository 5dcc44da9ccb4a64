"""Compression bookkeeping: what a compression keeps, the jobs, the async batch in flight.

The scheduler decides when a request compresses (its last block is full at N_max blocks: rule 3)
and frees the blocks a job needs (preempting if it must); `Compressions` answers how many blocks
the request keeps (its N_max, or under the elastic policy more while the pool is slack:
docs/architecture.md, 'Per-request and elastic budgets'), how many free blocks the job takes
(rule 5), plans the job, launches a step's jobs (one async batch on the compression stream, or
sync before the step's decode), and applies a job when it completes. It also keeps the borrowers:
running requests holding more blocks than their N_max, which their next compression gives back.
"""

from __future__ import annotations

from collections.abc import Callable

from zipage.config import ZipageConfig
from zipage.core.block_manager import BlockManager
from zipage.core.sequence import Sequence
from zipage.core.step import CompressionBatch, CompressionJob, StepPlan


class Compressions:
    def __init__(self, config: ZipageConfig, block_manager: BlockManager,
                 running: dict[Sequence, None], prefilling: dict[Sequence, None]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = config.block_size
        # docs/architecture.md, 'Per-request and elastic budgets'.
        self.elastic = config.compress and config.budget_policy == "elastic"
        self.running = running  # the scheduler's (admission order) and its part-way prompts
        self.prefilling = prefilling
        self.in_flight: CompressionBatch | None = None  # async batch on the compression stream
        self.sync: list[CompressionJob] = []  # this step's sync jobs, until the step is done
        self._next_batch_id = 0
        # Running requests holding more blocks than their N_max (elastic borrowers, and prompts
        # longer than N_max blocks).
        self.borrowers: dict[Sequence, None] = {}

    # ------------------------------------------------------------------ budgets

    def target(self, seq: Sequence, memory_demand: Callable[[], bool]) -> int | None:
        """The blocks `seq` holds after the compression its full last block triggers, or None
        when it takes one more block instead (docs/architecture.md, 'Per-request and elastic
        budgets'). Fixed: its N_max. Elastic: more while the pool is slack (grow), the blocks it
        holds while nobody waits for memory (hold), its N_max as soon as somebody does."""
        floor = seq.n_max
        if not self.elastic or memory_demand():
            return floor
        manager = self.block_manager
        if manager.num_free_blocks - 1 >= len(self.running):
            return None
        held = len(seq.block_table)
        if held > floor and self.fresh_for_compression(seq, held) == 0:
            return held
        return floor

    def fresh_for_compression(self, seq: Sequence, n_max: int) -> int:
        """Free blocks compressing `seq` to `n_max` blocks takes (rule 5), past its pinned
        blocks."""
        pinned = seq.pinned
        if not pinned:
            return self.block_manager.fresh_blocks_for_compression(seq.block_table, n_max)
        return self.block_manager.fresh_blocks_for_compression(seq.block_table[pinned:],
                                                               n_max - pinned)

    def note_table(self, seq: Sequence) -> None:
        """Keep `borrowers` up to date after `seq`'s block table changed."""
        if len(seq.block_table) > seq.n_max:
            self.borrowers[seq] = None
        else:
            self.borrowers.pop(seq, None)

    def reclaimable_borrower(self, requester: Sequence) -> bool:
        """Some other running request holds more blocks than its N_max and will give them back
        at its next full block without needing a free one: it decodes (not prefilling, not
        compressing), holds its query slot, and compressing it needs no fresh target block.
        Elastic scheduling waits for it rather than preempting anyone."""
        for seq in self.borrowers:
            if (seq is not requester and seq.query_slot is not None and not seq.compressing
                    and seq not in self.prefilling
                    and self.fresh_for_compression(seq, seq.n_max) == 0):
                return True
        return False

    # ------------------------------------------------------------------ jobs

    def must_wait(self, seq: Sequence, jobs: list[CompressionJob]) -> bool:
        """Async: `seq` waits for the compression stream, busy with a batch or whose next batch
        (this step's `jobs`) would grow past `max_compress_batch_blocks`."""
        if not self.config.async_compress:
            return False
        batch_blocks = sum(job.num_source_blocks for job in jobs)
        over_cap = jobs and batch_blocks + len(seq.block_table) > \
            self.config.max_compress_batch_blocks
        return self.in_flight is not None or bool(over_cap)

    def plan_job(self, seq: Sequence, n_max: int) -> CompressionJob:
        """Compress `seq` into n_max - 1 target blocks plus one for new tokens (rules 3, 5), its
        fresh blocks free already."""
        manager = self.block_manager
        # Keep reusable prefix blocks while free memory exceeds one block per running request
        # (what their next tokens may need); see BlockManager.plan_compression. Pinned blocks
        # (the prompt, under the "output" scope) are neither read nor written: the job covers
        # the blocks after them.
        pinned = seq.pinned
        table = seq.block_table
        source = table[pinned:] if pinned else list(table)
        targets = manager.plan_compression(source, n_max - pinned, reserve=len(self.running))
        assert targets is not None
        job = CompressionJob(
            seq=seq, source_table=source, target_blocks=targets.target_blocks,
            new_block=targets.new_block, released=targets.released, query_slot=seq.query_slot,
            is_first=seq.num_compressions == 0, kept_blocks=table[:pinned])
        seq.compressing = True
        return job

    def launch(self, plan: StepPlan, jobs: list[CompressionJob]) -> None:
        """A step's jobs: one async batch on the compression stream, or sync, run before the
        step's decode."""
        if self.config.async_compress:
            plan.compress_launch = CompressionBatch(self._next_batch_id, jobs)
            self.in_flight = plan.compress_launch
            self._next_batch_id += 1
        else:
            plan.compress_sync = self.sync = jobs

    def swap_to_compressed_table(self, job: CompressionJob) -> None:
        seq = job.seq
        seq.block_table = job.kept_blocks + job.target_blocks + [job.new_block]
        seq.set_counters((len(job.kept_blocks) + len(job.target_blocks)) * self.block_size,
                         seq.num_output_tokens)
        self.note_table(seq)
        seq.max_blocks_after_first_compression = max(
            seq.max_blocks_after_first_compression, len(seq.block_table))

    def complete(self, job: CompressionJob, swap_table: bool) -> None:
        if swap_table:
            self.swap_to_compressed_table(job)
        self.block_manager.release_all(job.released)
        job.seq.compressing = False
        job.seq.num_compressions += 1
        job.seq.kept_tokens += len(job.target_blocks) * self.block_size

    def complete_sync(self) -> int:
        """The step is done: its sync jobs complete (their tables were swapped when planned);
        how many."""
        jobs, self.sync = self.sync, []
        for job in jobs:
            self.complete(job, swap_table=False)
        return len(jobs)

    def take_batch(self, batch_id: int) -> CompressionBatch:
        """The async batch `batch_id` completed: it leaves the compression stream."""
        batch = self.in_flight
        assert batch is not None and batch.batch_id == batch_id, f"no batch {batch_id} in flight"
        self.in_flight = None
        return batch

    def in_flight_jobs(self) -> list[CompressionJob]:
        """Compression jobs holding blocks right now (the current sync ones or the async batch)."""
        jobs = list(self.sync)
        if self.in_flight is not None:
            jobs += self.in_flight.jobs
        return jobs

    def kept_budget(self, seq: Sequence) -> float | None:
        """The KV budget a finished request actually kept: the mean number of entries its
        compressions kept; all its KV if it was never compressed although it outgrew what its
        budget lets a request hold uncompressed (max(prompt blocks, N_max) blocks); None if its
        budget never bound it."""
        if seq.num_compressions:
            return seq.kept_tokens / seq.num_compressions
        entries = seq.prompt_len + seq.settled_output_tokens - 1  # released: settled
        b = self.block_size
        held = -(-seq.prompt_len // b)  # max(prompt blocks, N_max), written out (once a request)
        if entries > (held if held > seq.n_max else seq.n_max) * b:
            return float(entries)
        return None
