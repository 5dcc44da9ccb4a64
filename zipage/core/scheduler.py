"""The scheduler: constrained and hybrid scheduling over Compressed PagedAttention.

One step at a time: `schedule()` returns a `StepPlan` (a prefill step or a decode step, with the
compressions and preemptions it needs; with chunked prefill, decodes and prompt chunks mixed in
one step), the driver executes it, `finish(result)` applies it. The rules are
docs/architecture.md, 'Rules', 'Scheduling' and 'Chunked prefill'; this module is the only place
they live.

Queues: `waiting` (FCFS; preempted requests go back to its front) and `running` (admission
order). Query slots: M of them; a request needs one to write the window queries a compression
reads. Full KV (`compress` off) is plain PagedAttention with vLLM-style preemption of the last
running request.

Speed: a request with nothing to decide ("steady") is decoded every decode step without being
touched; the scheduler keeps, per future decode tick, the requests that will then need a decision
(their last block is full, they reach the window of a block that may compress and hold no slot) or
will finish. A step costs O(requests with an event), not O(running requests).
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque

from zipage.core.block_manager import BlockManager, prompt_block_hashes
from zipage.core.config import ZipageConfig
from zipage.core.step import (
    DECODE, IDLE, MIXED, PREFILL, CompressionBatch, CompressionJob, PrefillItem, StepPlan,
    StepResult,
)
from zipage.core.sequence import DecodeClock, Sequence, SequenceStatus
from zipage.core.window import WindowLayout
from zipage.errors import ConfigError


class SchedulerStuck(RuntimeError):
    """No request can make progress and nothing is in flight: a deadlock, i.e. a bug."""


class Scheduler:
    def __init__(self, config: ZipageConfig, num_blocks: int, num_query_slots: int) -> None:
        if num_blocks < 1:
            raise ConfigError(f"num_blocks: got {num_blocks}, expected at least 1")
        if config.compress:
            if num_query_slots < 1:
                raise ConfigError(
                    f"num_query_slots: got {num_query_slots}, compression needs at least 1")
            if num_blocks < num_query_slots * config.n_max:
                raise ConfigError(
                    f"num_blocks: {num_blocks} blocks cannot back {num_query_slots} query slots "
                    f"of N_max = {config.n_max} blocks each; use the memory planner, fewer slots "
                    "or more blocks")
        self.config = config
        self.block_size = config.block_size
        self.window = config.window
        self.windows = WindowLayout(config.block_size, config.window)
        self.n_max = config.n_max
        self.compress = config.compress
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_cache)
        self.num_query_slots = num_query_slots if config.compress else 0
        self.free_slots = list(range(self.num_query_slots))  # a min-heap: lowest slot first

        self.waiting: deque[Sequence] = deque()
        self.running: dict[Sequence, None] = {}  # insertion-ordered: admission order
        # Chunked prefill: running requests whose prompt (or recomputation) is only partly
        # computed, in admission order; each continues with its next chunk before new admissions.
        self.prefilling: dict[Sequence, None] = {}
        self.finished: list[Sequence] = []
        self.rejected: list[Sequence] = []
        self.aborted: list[Sequence] = []
        # Aborted while their async compression batch runs: released when the batch completes.
        self._abort_after_batch: set[Sequence] = set()
        self.admission_order: list[str] = []  # first admissions, for the FCFS invariant

        self.clock = DecodeClock()
        self._steady: dict[Sequence, None] = {}
        self._steady_kv_offset_sum = 0  # sum over steady requests of kv_len - clock.ticks
        self._decision_due: defaultdict[int, list] = defaultdict(list)
        self._finish_due: defaultdict[int, list] = defaultdict(list)
        self._pending: list[Sequence] = []  # need a decision at the next decode step
        self._blocked: dict[Sequence, int] = {}  # request -> resource version when it blocked
        # Requests waiting for a query slot (hybrid): only a slot hand-out can release them, so
        # they are not rescanned each step.
        self._waiting_for_slot: set[Sequence] = set()
        self._admission_failed_at: tuple[Sequence, int] | None = None
        self._resource_version = 0  # bumps whenever blocks, slots or the running set change
        self._num_slotless_running = 0

        self.in_flight: CompressionBatch | None = None  # async batch on the compression stream
        self._sync_jobs: list[CompressionJob] = []
        self._plan: StepPlan | None = None
        self._step_id = 0
        self._next_rank = 0
        self._next_batch_id = 0

    # ------------------------------------------------------------------ requests in and out

    def add(self, seq: Sequence) -> bool:
        """Queue a request; a request that can never be served is rejected alone (False)."""
        reason = self.rejection_reason(seq)
        if reason is not None:
            seq.status = SequenceStatus.REJECTED
            seq.error = reason
            self.rejected.append(seq)
            return False
        if self.config.prefix_cache and not seq.prompt_block_hashes:
            if seq.prompt_token_ids is None:
                raise ValueError(f"request {seq.seq_id}: prefix caching needs prompt_token_ids")
            seq.prompt_block_hashes = prompt_block_hashes(seq.prompt_token_ids, self.block_size)
        self.waiting.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def rejection_reason(self, seq: Sequence) -> str | None:
        """Why `seq` can never be served here, or None. O(1) from its lengths alone, so a driver
        can ask before building a prompt it would throw away (a 10^9-token one)."""
        prompt, output = seq.prompt_len, seq.max_output_tokens
        where = f"request {seq.seq_id}"
        if prompt < 1 or output < 1:
            return f"{where}: prompt_len and output_len must be >= 1 (got {prompt}, {output})"
        limit = self.config.max_model_len
        if limit is not None and prompt + output > limit:
            return (f"{where}: prompt_len + output_len = {prompt + output} exceeds max_model_len "
                    f"{limit}; shorten the request or raise --max-model-len")
        if not self.config.chunked_prefill and prompt > self.config.max_num_batched_tokens:
            return (f"{where}: prompt_len {prompt} exceeds max_num_batched_tokens "
                    f"{self.config.max_num_batched_tokens}; raise --max-num-batched-tokens")
        peak = self.peak_blocks(prompt, output)
        if peak > self.block_manager.num_blocks:
            return (f"{where}: needs {peak} KV blocks at its peak but only "
                    f"{self.block_manager.num_blocks} exist; give more KV memory"
                    + (" or enable compression" if not self.compress else ""))
        return None

    def peak_blocks(self, prompt_len: int, output_len: int) -> int:
        """Most blocks a request must hold at once when it runs alone.

        All its KV (prompt + output - 1 entries: the last token is never cached) under Full KV;
        with compression it stops growing at max(prompt blocks, N_max).
        """
        whole = -(-(prompt_len + output_len - 1) // self.block_size)
        if not self.compress:
            return whole
        return min(whole, max(-(-prompt_len // self.block_size), self.n_max))

    # ------------------------------------------------------------------ the step protocol

    def schedule(self) -> StepPlan | None:
        """Plan the next step; None when there is no request at all."""
        assert self._plan is None, "finish() the previous plan before scheduling again"
        if not self.has_unfinished():
            return None
        self._hand_out_slots()
        plan = StepPlan(step_id=self._step_id, kind=PREFILL)
        if self.config.chunked_prefill:
            self._schedule_chunked(plan)
        else:  # prefill steps have priority; a step prefills or decodes
            if self.waiting:
                self._schedule_prefill(plan)
            if not plan.prefill:
                self._schedule_decode(plan)
        if plan.prefill:
            plan.kind = MIXED if plan.decode else PREFILL
        elif plan.decode:
            plan.kind = DECODE
        else:
            if plan.compress_launch is None and self.in_flight is None:
                raise SchedulerStuck(self._stuck_report())
            plan.kind = IDLE
        plan.num_running = len(self.running)
        plan.num_waiting = len(self.waiting)
        plan.blocks_used = self.block_manager.num_used_blocks
        plan.slots_used = self.num_query_slots - len(self.free_slots)
        self._plan = plan
        self._step_id += 1
        return plan

    def finish(self, result: StepResult) -> None:
        plan, self._plan = self._plan, None
        assert plan is not None and plan.step_id == result.step_id, "result of another plan"
        if plan.prefill:
            for item in plan.prefill:
                self._finish_prefill(item, result)
            self._resource_version += 1  # a finished prefill may unblock the waiting head
        if plan.kind in (DECODE, MIXED):
            for job in plan.compress_sync:
                self._complete_compression(job, swap_table=False)
            self.clock.ticks += 1
            for seq, epoch in self._finish_due.pop(self.clock.ticks, ()):
                if seq.steady_epoch == epoch and seq.is_steady:
                    self._finish_sequence(seq, result.t_end)
            if result.stopped:
                for seq in plan.decode:
                    if seq.seq_id in result.stopped and seq.status is SequenceStatus.RUNNING:
                        self._finish_sequence(seq, result.t_end)
        for batch_id in result.completed_batches:
            self._complete_batch(batch_id)

    # ------------------------------------------------------------------ prefill

    def _schedule_prefill(self, plan: StepPlan, budget: int | None = None) -> None:
        """Admit waiting requests, FCFS (only the head is tried). Without a `budget` each computes
        its whole prompt, up to `max_num_batched_tokens` in all (the first always fits); with one
        (chunked prefill) each computes what is left of the budget and continues next step."""
        config = self.config
        batched_tokens = 0
        if self._admission_failed_at == (self.waiting[0], self._resource_version):
            return  # nothing that admission depends on changed since the head last failed
        while self.waiting and (budget is None or budget > 0):
            seq = self.waiting[0]
            num_tokens = seq.num_tokens  # a preempted request recomputes its outputs too
            cached = self.block_manager.cached_prefix_blocks(seq, num_tokens)
            start = len(cached) * self.block_size
            if budget is None and plan.prefill and (
                    batched_tokens + num_tokens - start > config.max_num_batched_tokens):
                break  # the tokens of this step, not a resource: the next step may admit it
            self._admission_failed_at = (seq, self._resource_version)
            if len(self.running) >= config.max_num_seqs:
                break
            if self.compress and not self.free_slots:
                # Hybrid scheduling admits a request without a slot only if it will not write
                # window queries before a slot can reach it.
                if not config.hybrid or self._needs_slot_to_start(num_tokens):
                    break
            if not self.block_manager.can_allocate_prefill(cached, num_tokens):
                break
            self.waiting.popleft()
            seq.block_table = self.block_manager.allocate_prefill(cached, num_tokens)
            slot = heapq.heappop(self.free_slots) if self.compress and self.free_slots else None
            self._admit(seq, slot)
            seq.set_counters(start, seq.num_output_tokens)
            plan.prefix_hit_tokens += start
            end = num_tokens if budget is None else min(num_tokens, start + budget)
            self._plan_chunk(plan, seq, end)
            batched_tokens += end - start
            if budget is not None:
                budget -= end - start

    def _schedule_chunked(self, plan: StepPlan) -> None:
        """Chunked prefill (docs/architecture.md, 'Chunked prefill'): the running requests decode
        first; prompt chunks fill the rest of `max_num_batched_tokens`, the requests already
        part-way through their prompt before new admissions. A step that preempted admits
        nobody (the victim would come straight back)."""
        self._schedule_decode(plan)
        budget = self.config.max_num_batched_tokens - len(plan.decode)
        for seq in list(self.prefilling):
            if budget <= 0:
                return
            start = seq.kv_len
            end = min(seq.num_tokens, start + budget)
            self._plan_chunk(plan, seq, end)
            budget -= end - start
        if self.waiting and budget > 0 and not plan.preempted:
            self._schedule_prefill(plan, budget)

    def _plan_chunk(self, plan: StepPlan, seq: Sequence, end: int) -> None:
        """Compute entries [seq.kv_len, end) of `seq` in this step.

        The full prompt blocks the range completes enter the prefix index now, not when the step
        is done: a request admitted later in this step maps them and the driver computes them
        once (it stores a step's KV before any attention reads it). Only blocks this step
        computes are indexed, so a hit is always on KV that exists by the time it is read.
        """
        start = seq.kv_len
        self.block_manager.register_prompt_blocks(seq, start // self.block_size,
                                                  end // self.block_size)
        samples = end == seq.num_tokens
        plan.prefill.append(PrefillItem(seq, start, end, samples))
        if samples:
            self.prefilling.pop(seq, None)
        else:
            self.prefilling.setdefault(seq, None)  # keeps its place in admission order

    def _admit(self, seq: Sequence, slot: int | None) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.query_slot = slot
        seq.running_rank = self._next_rank
        self._next_rank += 1
        self.running[seq] = None
        if self.compress and slot is None:
            self._num_slotless_running += 1
        if seq.first_admitted_step is None:
            seq.first_admitted_step = self._step_id
            self.admission_order.append(seq.seq_id)
        self._resource_version += 1

    def _finish_prefill(self, item: PrefillItem, result: StepResult) -> None:
        seq = item.seq
        if not item.samples:  # a partial chunk: the prompt continues next step
            seq.set_counters(item.num_tokens, seq.num_output_tokens)
            return
        seq.set_counters(item.num_tokens, seq.num_output_tokens + 1)
        if seq.first_token_time is None:
            seq.first_token_time = result.t_end
        if seq.remaining_output_tokens <= 0 or seq.seq_id in result.stopped:
            self._finish_sequence(seq, result.t_end)
        else:
            self._pending.append(seq)

    # ------------------------------------------------------------------ decode

    def _schedule_decode(self, plan: StepPlan) -> None:
        for seq, epoch in self._decision_due.pop(self.clock.ticks, ()):
            if seq.steady_epoch == epoch and seq.is_steady:
                self._leave_steady(seq)
                self._pending.append(seq)
        candidates = self._pending
        self._pending = []
        if self._blocked:
            for seq, version in list(self._blocked.items()):
                if version != self._resource_version:
                    del self._blocked[seq]
                    candidates.append(seq)
        candidates.sort(key=lambda seq: seq.running_rank)

        jobs: list[CompressionJob] = []
        for seq in candidates:
            if seq.status is SequenceStatus.RUNNING and not seq.is_steady and not seq.compressing:
                self._decide(seq, plan, jobs)

        if jobs:
            if self.config.async_compress:
                plan.compress_launch = CompressionBatch(self._next_batch_id, jobs)
                self.in_flight = plan.compress_launch
                self._next_batch_id += 1
            else:
                plan.compress_sync = jobs
        plan.decode = list(self._steady)
        # Each decode request attends its cached entries plus the token it decodes now.
        plan.decode_context_tokens = (
            self._steady_kv_offset_sum + len(self._steady) * (self.clock.ticks + 1))

    def _decide(self, seq: Sequence, plan: StepPlan, jobs: list[CompressionJob]) -> None:
        """Settle what a request that is not steady does this step, then let it decode."""
        table = seq.block_table
        if seq.kv_len == len(table) * self.block_size:  # the next token needs a new place
            if self.compress and len(table) >= self.n_max:
                self._compress(seq, plan, jobs)
                return
            if not self._make_free_blocks(seq, plan, lambda: 1):
                return
            table.append(self.block_manager.allocate())
            self._resource_version += 1
            if seq.num_compressions:
                seq.max_blocks_after_first_compression = max(
                    seq.max_blocks_after_first_compression, len(table))
        elif seq.query_slot is None and self.needs_slot(seq.kv_len):
            self._waiting_for_slot.add(seq)
            return
        self._join_steady(seq)

    def _compress(self, seq: Sequence, plan: StepPlan, jobs: list[CompressionJob]) -> None:
        assert seq.query_slot is not None, f"{seq.seq_id} must compress but holds no query slot"
        if self.config.async_compress:
            batch_blocks = sum(job.num_source_blocks for job in jobs)
            over_cap = jobs and batch_blocks + len(seq.block_table) > \
                self.config.max_compress_batch_blocks
            if self.in_flight is not None or over_cap:
                self._block(seq)  # waits for the compression stream
                return
        manager = self.block_manager
        if not self._make_free_blocks(
                seq, plan, lambda: manager.fresh_blocks_for_compression(seq.block_table, self.n_max)):
            return
        # Keep reusable prefix blocks while free memory exceeds one block per running request
        # (what their next tokens may need); see BlockManager.plan_compression.
        targets = manager.plan_compression(seq.block_table, self.n_max,
                                           reserve=len(self.running))
        assert targets is not None
        job = CompressionJob(
            seq=seq, source_table=list(seq.block_table), target_blocks=targets.target_blocks,
            new_block=targets.new_block, released=targets.released, query_slot=seq.query_slot,
            is_first=seq.num_compressions == 0)
        seq.compressing = True
        self._resource_version += 1
        jobs.append(job)
        if not self.config.async_compress:
            # Sync: the compression runs before this step's decode, so the request decodes now
            # with its new table; the old blocks stay held by the job until the step is done.
            self._swap_to_compressed_table(job)
            self._join_steady(seq)

    def _make_free_blocks(self, seq: Sequence, plan: StepPlan, blocks_needed) -> bool:
        """Preempt until `blocks_needed()` blocks are free; False if `seq` blocked or went."""
        while self.block_manager.num_free_blocks < blocks_needed():
            victim = self._pick_victim()
            if victim is None:
                self._block(seq)
                return False
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _pick_victim(self) -> Sequence | None:
        """The request to preempt when blocks run out (docs/architecture.md, 'Scheduling'), or None."""
        if not self.compress:
            return next(reversed(self.running), None)
        if self.config.prefix_cache:
            # Compression may need fresh target blocks, so only preempting uncompressed requests
            # (slot or not) keeps prefix sharing deadlock-free.
            for seq in reversed(self.running):
                if seq.num_compressions == 0 and not seq.compressing and self.can_recompute(seq):
                    return seq
            return None
        if self.config.hybrid:
            for seq in reversed(self.running):
                if seq.query_slot is None and self.can_recompute(seq):
                    return seq
        return None

    def can_recompute(self, seq: Sequence) -> bool:
        """A preempted request recomputes its prompt and outputs: one block more than it held
        when it stopped on a block boundary. One whose recomputation would not fit the pool is
        never a victim (it could never run again). Such a request holds every block, so the
        requests sharing its prefix blocks are uncompressed and remain victims: the deadlock
        argument is unchanged (docs/architecture.md, 'Deadlock freedom')."""
        return -(-seq.num_tokens // self.block_size) <= self.block_manager.num_blocks

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free every block of `seq` and send it to the front of `waiting` (recompute later)."""
        self._leave_steady(seq)
        self._forget_blocked(seq)
        self.block_manager.release_table(seq.block_table)
        seq.block_table = []
        seq.set_counters(0, seq.num_output_tokens)
        self._remove_from_running(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _block(self, seq: Sequence) -> None:
        self._blocked[seq] = self._resource_version

    def _forget_blocked(self, seq: Sequence) -> None:
        self._blocked.pop(seq, None)
        self._waiting_for_slot.discard(seq)

    # ------------------------------------------------------------------ steady decoding

    def _join_steady(self, seq: Sequence) -> None:
        """Decode `seq` every step from now on until its next event."""
        ticks = self.clock.ticks
        kv_len = seq.kv_len
        seq.join_steady(self.clock)
        self._steady[seq] = None
        self._steady_kv_offset_sum += kv_len - ticks
        steps_to_decision = len(seq.block_table) * self.block_size - kv_len
        if self.compress and seq.query_slot is None:
            steps_to_decision = min(steps_to_decision, self._first_slot_token(kv_len) - kv_len)
        remaining = seq.remaining_output_tokens
        if remaining <= steps_to_decision:
            self._finish_due[ticks + remaining].append((seq, seq.steady_epoch))
        else:
            self._decision_due[ticks + steps_to_decision].append((seq, seq.steady_epoch))

    def _leave_steady(self, seq: Sequence) -> None:
        if seq.is_steady:
            self._steady_kv_offset_sum -= seq.kv_len - self.clock.ticks
            del self._steady[seq]
            seq.settle()

    # ------------------------------------------------------------------ query slots

    def needs_slot(self, token_index: int) -> bool:
        """Computing KV entry `token_index` writes a window query a compression will read.

        True for the last w in-block offsets of every block from index N_max - 1 on: those blocks
        are the final block when a compression triggers (docs/architecture.md, 'Rules', rule 7).
        """
        b = self.block_size
        return (self.compress and token_index // b >= self.n_max - 1
                and token_index % b >= b - self.window)

    def _first_slot_token(self, kv_len: int) -> int:
        b = self.block_size
        block = max(kv_len // b, self.n_max - 1)
        return max(kv_len, block * b + b - self.window)

    def _needs_slot_to_start(self, num_tokens: int) -> bool:
        """Prefill of num_tokens, or the first decode after it, writes window queries."""
        return self.needs_slot(num_tokens - 1) or self.needs_slot(num_tokens)

    def window_query_range(self, seq: Sequence, start: int, end: int) -> tuple[int, int]:
        """KV entries in [start, end) whose queries a driver stores (`WindowLayout.query_range`)."""
        return self.windows.query_range(seq.query_slot, start, end)

    def _hand_out_slots(self) -> None:
        """Freed slots go to the foremost running requests that lack one (hybrid)."""
        if not (self.free_slots and self._num_slotless_running):
            return
        for seq in self.running:
            if seq.query_slot is None:
                seq.query_slot = heapq.heappop(self.free_slots)
                self._num_slotless_running -= 1
                self._resource_version += 1
                if seq in self._waiting_for_slot:
                    self._waiting_for_slot.discard(seq)
                    self._pending.append(seq)
                if not (self.free_slots and self._num_slotless_running):
                    return

    def _release_slot(self, seq: Sequence) -> None:
        if seq.query_slot is not None:
            heapq.heappush(self.free_slots, seq.query_slot)
            seq.query_slot = None
        elif self.compress:
            self._num_slotless_running -= 1

    # ------------------------------------------------------------------ completion

    def _swap_to_compressed_table(self, job: CompressionJob) -> None:
        seq = job.seq
        seq.block_table = job.target_blocks + [job.new_block]
        seq.set_counters((self.n_max - 1) * self.block_size, seq.num_output_tokens)
        seq.max_blocks_after_first_compression = max(
            seq.max_blocks_after_first_compression, len(seq.block_table))

    def _complete_compression(self, job: CompressionJob, swap_table: bool) -> None:
        if swap_table:
            self._swap_to_compressed_table(job)
        self.block_manager.release_all(job.released)
        job.seq.compressing = False
        job.seq.num_compressions += 1
        self._resource_version += 1

    def _complete_batch(self, batch_id: int) -> None:
        batch = self.in_flight
        assert batch is not None and batch.batch_id == batch_id, f"no batch {batch_id} in flight"
        self.in_flight = None
        for job in batch.jobs:
            self._complete_compression(job, swap_table=True)
            if job.seq in self._abort_after_batch:
                self._abort_after_batch.discard(job.seq)
                self._release(job.seq, SequenceStatus.ABORTED, self.aborted)
            else:
                self._pending.append(job.seq)

    def _finish_sequence(self, seq: Sequence, time: float) -> None:
        self._release(seq, SequenceStatus.FINISHED, self.finished)
        seq.finish_time = time

    def _release(self, seq: Sequence, status: SequenceStatus, into: list[Sequence]) -> None:
        """A running request leaves for good (finished or aborted): blocks and slot are freed."""
        self._leave_steady(seq)
        self._forget_blocked(seq)
        self.block_manager.release_table(seq.block_table)
        seq.block_table = []
        self._remove_from_running(seq)
        seq.status = status
        into.append(seq)

    def _remove_from_running(self, seq: Sequence) -> None:
        del self.running[seq]
        self.prefilling.pop(seq, None)
        self._release_slot(seq)
        self._resource_version += 1

    # ------------------------------------------------------------------ abort

    def abort(self, seq_id: str) -> bool:
        """Drop a waiting or running request (its client went away); False if none is queued.

        Call it between steps (after `finish`, before the next `schedule`). Its blocks and query
        slot are freed at once, except for a request inside the in-flight async compression
        batch: that batch still reads its slot and writes its target blocks, so the request is
        released when the batch completes and meanwhile only waits, out of decoding.
        """
        assert self._plan is None, "abort between steps, not while a plan is being executed"
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                self._forget_blocked(seq)
                seq.status = SequenceStatus.ABORTED
                self.aborted.append(seq)
                self._resource_version += 1
                return True
        for seq in self.running:
            if seq.seq_id == seq_id:
                if seq in self._abort_after_batch:
                    return True
                if seq.compressing:  # only an async batch holds it between steps
                    self._abort_after_batch.add(seq)
                else:
                    self._release(seq, SequenceStatus.ABORTED, self.aborted)
                return True
        return False

    # ------------------------------------------------------------------ introspection

    def in_flight_jobs(self) -> list[CompressionJob]:
        """Compression jobs holding blocks right now (the current sync ones or the async batch)."""
        jobs = list(self._plan.compress_sync) if self._plan is not None else []
        if self.in_flight is not None:
            jobs += self.in_flight.jobs
        return jobs

    def _stuck_report(self) -> str:
        lines = [f"scheduler stuck at step {self._step_id}: "
                 f"{self.block_manager.num_free_blocks} free blocks, "
                 f"{len(self.free_slots)} free slots"]
        lines += [f"  running {seq!r} compressions={seq.num_compressions}" for seq in self.running]
        lines += [f"  waiting {seq!r}" for seq in list(self.waiting)[:5]]
        return "\n".join(lines)
