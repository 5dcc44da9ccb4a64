"""The scheduler: constrained and hybrid scheduling over Compressed PagedAttention.

One step at a time: `schedule()` returns a `StepPlan` (a prefill step or a decode step, with the
compressions and preemptions it needs; with chunked prefill, decodes and prompt chunks mixed in
one step), the driver executes it, `finish(result)` applies it. The rules are
docs/architecture.md, 'Rules', 'Scheduling' and 'Chunked prefill'; they live here and in the
parts the scheduler owns and asks, each with one job:

- zipage/core/admission.py: who can ever be served here, and each request's N_max;
- zipage/core/prefill.py: which prompts a step computes, admitted from the head of `waiting`;
- zipage/core/slots.py: the query slots, and which KV entries need one;
- zipage/core/victims.py: whom to preempt when blocks run out;
- zipage/core/compressions.py: what a compression keeps, its jobs, the async batch in flight;
- zipage/core/steady.py: the requests decoding every step with nothing to decide.

The scheduler itself keeps the queues, the step protocol, the decode decisions and every change
of the running set: admission, preemption, finish, abort.

Queues: `waiting` (its order is the waiting policy's, zipage/core/waiting.py: FCFS, preempted
requests back at its front; or priority classes with aging) and `running` (admission order).
Query slots: M of them; a request needs one to write the window queries a compression reads.
Full KV (`compress` off) is plain PagedAttention with vLLM-style preemption of the last running
request.

Speed: a request with nothing to decide ("steady") is decoded every decode step without being
touched (zipage/core/steady.py keeps, per future decode tick, who then needs a decision or
finishes); a step costs O(requests with an event), not O(running requests).
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter

from zipage.config import ZipageConfig
from zipage.core.admission import Admission
from zipage.core.block_manager import BlockManager
from zipage.core.compressions import Compressions
from zipage.core.prefill import PrefillPlanner
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.slots import QuerySlots
from zipage.core.steady import SteadyDecoding
from zipage.core.step import DECODE, IDLE, MIXED, PREFILL, CompressionJob, PrefillItem, StepPlan, StepResult
from zipage.core.victims import Victims
from zipage.core.waiting import waiting_queue
from zipage.errors import ConfigError


def check_pool(config: ZipageConfig, num_blocks: int, num_query_slots: int) -> None:
    """Refuse blocks and query slots a scheduler cannot run with: every slot holder must be
    backable by N_max blocks (docs/architecture.md, 'Memory planning')."""
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


_RUNNING_RANK = attrgetter("running_rank")  # a sort key without a Python call per request
# Bound once: an Enum class's attribute is read through EnumType.__getattr__ (4x a plain read).
RUNNING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.FINISHED
WAITING = SequenceStatus.WAITING


class SchedulerStuck(RuntimeError):
    """No request can make progress and nothing is in flight: a deadlock, i.e. a bug."""

    @classmethod
    def report(cls, step_id: int, free_blocks: int, free_slots: int,
               running: Iterable[Sequence], waiting: Iterable[Sequence]) -> SchedulerStuck:
        """The error, with the state the scheduler is stuck in: what is free, every running
        request, the head of `waiting`."""
        lines = [f"scheduler stuck at step {step_id}: {free_blocks} free blocks, "
                 f"{free_slots} free slots"]
        lines += [f"  running {seq!r} compressions={seq.num_compressions}" for seq in running]
        lines += [f"  waiting {seq!r}" for seq in list(waiting)[:5]]
        return cls("\n".join(lines))


class Scheduler:
    def __init__(self, config: ZipageConfig, num_blocks: int, num_query_slots: int,
                 num_host_blocks: int = 0) -> None:
        check_pool(config, num_blocks, num_query_slots)
        self.config = config
        self.block_size = config.block_size
        self.n_max = config.n_max  # of the default budget; a request's own is `seq.n_max`
        self.compress = config.compress
        # What can ever be served here, and each request's N_max (pure: docs/architecture.md,
        # 'Scheduling'); `step_tokens` is resolved there once, read here every step.
        self.admission = Admission(config, num_blocks)
        self.step_tokens = self.admission.step_tokens
        # docs/architecture.md, 'Per-request and elastic budgets'.
        self.elastic = config.compress and config.budget_policy == "elastic"
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_cache,
                                          num_host_blocks)
        self.slots = QuerySlots(config, num_blocks, num_query_slots)

        self.by_priority = config.scheduling_policy == "priority"
        self.waiting = waiting_queue(config.scheduling_policy, config.priority_aging_s)
        self.running: dict[Sequence, None] = {}  # insertion-ordered: admission order
        # Chunked prefill: running requests whose prompt (or recomputation) is only partly
        # computed, in admission order; each continues with its next chunk before new admissions.
        self.prefilling: dict[Sequence, None] = {}
        self.finished: list[Sequence] = []
        self.rejected: list[Sequence] = []
        self.aborted: list[Sequence] = []
        # Who is preempted when blocks run out, and what compressions keep, plan and complete.
        self.victims = Victims(config, self.block_manager, self.running)
        self.compressions = Compressions(config, self.block_manager, self.running, self.prefilling)
        # Which prompts a step computes, admitted from the head of `waiting` into `running`.
        self.prefill = PrefillPlanner(config, self.step_tokens, self.block_manager,
                                      self.admission, self.slots,
                                      self.waiting, self.running, self.prefilling, self._admit)
        # Aborted while their async compression batch runs: released when the batch completes.
        self._abort_after_batch: set[Sequence] = set()
        self.admission_order: list[str] = []  # first admissions, for the FCFS invariant

        # The requests decoding every step with nothing to decide, and the decode clock.
        self.steady = SteadyDecoding()
        self._pending: list[Sequence] = []  # need a decision at the next decode step
        self._blocked: dict[Sequence, int] = {}  # request -> resource version when it blocked
        self._starved: set[Sequence] = set()  # requests blocked because no block was free
        self._admission_failed_at: tuple[Sequence, int] | None = None
        self._resource_version = 0  # bumps whenever blocks, slots or the running set change

        # Whether a plan lists its decode requests (`StepPlan.decode`, O(batch) a step); a driver
        # that reads only how many there are (`StepPlan.num_decode`: the simulator without a
        # decision log or checker) turns it off.
        self.decode_lists = True

        self._plan: StepPlan | None = None  # scheduled, not advanced yet
        # Advanced, its result not settled yet (async scheduling: the next plan is made while
        # this one runs), and the requests whose first-token or finish time that result gives.
        self._unsettled: StepPlan | None = None
        self._untimed: list[Sequence] = []
        # Stopped (EOS) inside a compression job (a sync one of the step running, or the async
        # batch): finished when it completes, at the time of the stop.
        self._stop_after_batch: dict[Sequence, float] = {}
        self._step_id = 0
        self._next_rank = 0

    # ------------------------------------------------------------------ requests in and out

    def add(self, seq: Sequence) -> bool:
        """Queue a request; a request that can never be served is rejected alone (False)."""
        reason = self.admission.rejection_reason(seq)
        if reason is not None:
            self.refuse(seq, reason)
            return False
        self.admission.prepare(seq)
        self.waiting.append(seq)
        return True

    def refuse(self, seq: Sequence, reason: str) -> None:
        """Fail a request that is never queued (it cannot be served; a session turn whose
        predecessor failed), alone, with its reason."""
        seq.status = SequenceStatus.REJECTED
        seq.error = reason
        self.rejected.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step protocol

    def schedule(self) -> StepPlan | None:
        """Plan the next step; None when there is no request at all."""
        assert self._plan is None, "finish() the previous plan before scheduling again"
        if not (self.waiting or self.running):  # (`has_unfinished`, inline: once a step)
            return None
        self.victims.begin_step()
        slots = self.slots
        if slots.free and slots.num_slotless:  # rare: no call otherwise
            for seq in slots.hand_out(self.running):
                self._resource_version += 1
                if seq in slots.waiters:
                    slots.waiters.discard(seq)
                    self._pending.append(seq)
        # Positional, its lists given (prefill, decode, num_decode, compress_sync,
        # compress_launch, preempted, forks, grown): a plan is made every step, and the
        # dataclass's defaults make the call 2.4x as long.
        plan = StepPlan(self._step_id, PREFILL, [], [], 0, [], None, [], [], [])
        if self.config.chunked_prefill:
            self._schedule_chunked(plan)
        else:  # prefill steps have priority; a step prefills or decodes
            if self.waiting:
                self._schedule_prefill(plan)
            if not plan.prefill:
                self._schedule_decode(plan)
        if plan.prefill:
            plan.kind = MIXED if plan.num_decode else PREFILL
        elif plan.num_decode:
            plan.kind = DECODE
        else:
            # With a step unsettled, its result may free what nothing else can: an idle plan
            # waits for it (the driver settles that step, then schedules again).
            if (plan.compress_launch is None and self.compressions.in_flight is None
                    and self._unsettled is None):
                raise SchedulerStuck.report(self._step_id, self.block_manager.num_free_blocks,
                                            len(slots.free), self.running, self.waiting)
            plan.kind = IDLE
        plan.num_running = len(self.running)
        plan.num_waiting = len(self.waiting)
        manager = self.block_manager
        if manager.kv_saves or manager.kv_loads:
            plan.kv_saves, plan.kv_loads = manager.take_copies()
        plan.blocks_used = manager.num_blocks - manager.num_free_blocks  # (`num_used_blocks`)
        plan.shared_kv_tokens = manager.extra_holders * self.block_size
        plan.slots_used = slots.num_query_slots - len(slots.free)
        self._plan = plan
        self._step_id += 1
        return plan

    def finish(self, result: StepResult) -> None:
        """The plan ran: `advance` and `settle` at once (the synchronous protocol)."""
        self.advance(result)
        self.settle(result)

    def advance(self, result: StepResult | None = None) -> None:
        """Apply what the scheduled plan does whatever its tokens are: prompt counters, one
        decode tick, finishes by length, sync compressions done. Async scheduling calls it
        before the plan's result exists (`result` None), schedules the next step, then
        `settle`s this one with its result (docs/architecture.md, 'Async scheduling'); the
        synchronous `finish` passes the result, so a prompt's stop applies in prompt order."""
        plan, self._plan = self._plan, None
        assert plan is not None, "advance() needs a scheduled plan"
        assert self._unsettled is None, "settle() the previous step before advancing another"
        self._unsettled = plan
        if plan.prefill:
            for item in plan.prefill:
                self._finish_prefill(item, result)
            for fork in plan.forks:
                self._first_token(fork.seq, fork.seq.prompt_len, result)
            self._resource_version += 1  # a finished prefill may unblock the waiting head
        if plan.kind in (DECODE, MIXED):
            if plan.compress_sync:
                self._resource_version += self.compressions.complete_sync()
                if self._stop_after_batch:
                    for job in plan.compress_sync:
                        self._finish_if_stopped(job.seq)
            t_end = None if result is None else result.t_end
            for seq in self.steady.tick():
                self._finish_sequence(seq, t_end)

    def settle(self, result: StepResult) -> None:
        """Apply the advanced plan's result: its end time, the requests that stopped at an
        end-of-sequence token, the async compression batches done by then. Under async
        scheduling the next plan is made already: a request stopped here decoded in it too
        (the driver drops that token), and leaves now."""
        plan, self._unsettled = self._unsettled, None
        assert plan is not None and plan.step_id == result.step_id, "result of another plan"
        t_end = result.t_end
        if self._untimed:
            for seq in self._untimed:
                if seq.first_token_time is None:
                    seq.first_token_time = t_end
                if seq.status is FINISHED and seq.finish_time is None:
                    seq.finish_time = t_end
            self._untimed = []
        if result.stopped:
            assert self.decode_lists or not plan.num_decode, \
                "a request stopped early, but the plan lists no decodes"
            # A prompt's stop applied in `advance` where the result came with it (the request
            # is finished already); decodes' stops apply here, in plan order.
            for seq in self.sampled_requests(plan):
                if seq.seq_id in result.stopped:
                    if seq.status is RUNNING:
                        self._stop(seq, t_end)
                    elif seq.status is WAITING:  # preempted by the next plan: no recompute
                        self._finish_sequence(seq, t_end)
        for batch_id in result.completed_batches:
            self._complete_batch(batch_id)

    @staticmethod
    def sampled_requests(plan: StepPlan) -> list[Sequence]:
        """The requests that got a token in `plan`, in `StepPlan.sampled` order."""
        if not plan.prefill:
            return plan.decode
        return ([item.seq for item in plan.prefill if item.samples] + plan.decode
                + [fork.seq for fork in plan.forks])

    def _stop(self, seq: Sequence, time: float) -> None:
        """`seq` stopped at an end-of-sequence token; inside a compression job (only async
        scheduling plans one for a request whose stop is not known yet), it leaves when the job
        completes, since the job still writes its blocks."""
        if seq.compressing:
            self.steady.leave(seq)
            self._forget_blocked(seq)
            self._stop_after_batch[seq] = time
            return
        self._finish_sequence(seq, time)

    def _finish_if_stopped(self, seq: Sequence) -> None:
        """`seq`'s compression job completed: it finishes now if it stopped inside the job."""
        time = self._stop_after_batch.pop(seq, None)
        if time is not None:
            self._finish_sequence(seq, time)

    # ------------------------------------------------------------------ prefill

    def _schedule_prefill(self, plan: StepPlan, budget: int | None = None) -> None:
        """Admit waiting requests (`PrefillPlanner.admit_waiting`), unless nothing that admission
        depends on changed since the head last failed."""
        if self._admission_failed_at == (self.waiting[0], self._resource_version):
            return
        failed = self.prefill.admit_waiting(plan, budget)
        if failed is not None:
            self._admission_failed_at = (failed, self._resource_version)

    def _schedule_chunked(self, plan: StepPlan) -> None:
        """Chunked prefill (docs/architecture.md, 'Chunked prefill'): the running requests decode
        first; prompt chunks fill the rest of `max_num_batched_tokens`, the requests already
        part-way through their prompt before new admissions. A step that preempted admits
        nobody (the victim would come straight back)."""
        self._schedule_decode(plan)
        budget = self.step_tokens - plan.num_decode
        for seq in list(self.prefilling):
            if budget <= 0:
                return
            start = seq.settled_kv_len  # part-way through its prompt: settled
            end = min(seq.prompt_len + seq.settled_output_tokens, start + budget)
            self.prefill.plan_chunk(plan, seq, end)
            budget -= end - start
        if self.waiting and budget > 0 and not plan.preempted:
            self._schedule_prefill(plan, budget)

    def _admit(self, seq: Sequence, takes_slot: bool) -> None:
        """`seq`, its block table allocated, enters `running`, with a query slot or without."""
        self.compressions.note_table(seq)
        self.slots.seat(seq, takes_slot)
        seq.status = RUNNING
        seq.running_rank = self._next_rank
        self._next_rank += 1
        self.running[seq] = None
        if seq.first_admitted_step is None:
            seq.first_admitted_step = self._step_id
            self.admission_order.append(seq.seq_id)
        self._resource_version += 1

    def _finish_prefill(self, item: PrefillItem, result: StepResult | None) -> None:
        seq = item.seq
        if seq.status is not RUNNING:  # aborted while the step ran (async scheduling)
            return
        if not item.samples:  # a partial chunk: the prompt continues next step
            seq.set_counters(item.num_tokens, seq.settled_output_tokens)
            return
        self._first_token(seq, item.num_tokens, result)

    def _first_token(self, seq: Sequence, num_tokens: int, result: StepResult | None) -> None:
        """`seq` computed its `num_tokens` and sampled a token (a prefill's, or a fork's);
        `result` None: not known yet (async scheduling), its time and stop come in `settle`."""
        if seq.status is not RUNNING:  # aborted while the step ran (async scheduling)
            return
        seq.set_counters(num_tokens, seq.settled_output_tokens + 1)
        if result is None:
            if seq.first_token_time is None:
                self._untimed.append(seq)
            stopped = False
        else:
            if seq.first_token_time is None:
                seq.first_token_time = result.t_end
            stopped = seq.seq_id in result.stopped
        if seq.settled_output_tokens >= seq.max_output_tokens or stopped:
            self._finish_sequence(seq, None if result is None else result.t_end)
        else:
            self._pending.append(seq)

    # ------------------------------------------------------------------ decode

    def _schedule_decode(self, plan: StepPlan) -> None:
        self._pending.extend(self.steady.due_decisions())
        candidates = self._pending
        self._pending = []
        if self._blocked:
            for seq, version in list(self._blocked.items()):
                if version != self._resource_version:
                    del self._blocked[seq]
                    candidates.append(seq)
        if len(candidates) > 1:
            candidates.sort(key=_RUNNING_RANK)

        jobs: list[CompressionJob] = []
        for seq in candidates:
            if (seq.status is RUNNING and seq.steady_since is None
                    and not seq.compressing):
                self._decide(seq, plan, jobs)

        if jobs:
            self.compressions.launch(plan, jobs)
        steady = self.steady.offsets
        plan.num_decode = len(steady)
        if not steady:
            return
        if self.decode_lists:
            plan.decode = list(steady)
        plan.decode_context_tokens, plan.decode_max_context = self.steady.context_tokens()

    def _decide(self, seq: Sequence, plan: StepPlan, jobs: list[CompressionJob]) -> None:
        """Settle what a request that is not steady does this step, then let it decode."""
        table = seq.block_table
        self._starved.discard(seq)  # retried now; blocked again below if still no block is free
        kv_len = seq.settled_kv_len  # not steady: settled
        if kv_len == len(table) * self.block_size:  # the next token needs a new place
            if self.compress and len(table) >= seq.n_max:
                target = self.compressions.target(seq, self._memory_demand)
                if target is not None:
                    self._compress(seq, plan, jobs, target)
                    return
                # Elastic, and the pool is slack: the request keeps all its KV, one block more.
            if not self._make_free_blocks(seq, plan, lambda: 1):
                return
            table.append(self.block_manager.allocate())
            self.compressions.note_table(seq)
            if len(table) > seq.n_max and self.compress:
                plan.grown.append(seq)
            self._resource_version += 1
            if seq.num_compressions:
                seq.max_blocks_after_first_compression = max(
                    seq.max_blocks_after_first_compression, len(table))
        elif seq.query_slot is None and self.slots.needs_slot(kv_len, seq.n_max):
            self.slots.waiters.add(seq)
            return
        self._join_steady(seq)

    def _join_steady(self, seq: Sequence) -> None:
        """Decode `seq` every step from now on until its next event: its last block is full,
        or it reaches the window of a block that may compress while it holds no slot."""
        kv_len = seq.settled_kv_len  # not steady yet: settled
        steps_to_decision = len(seq.block_table) * self.block_size - kv_len
        if self.compress and seq.query_slot is None:
            steps_to_decision = min(steps_to_decision,
                                    self.slots.first_slot_token(kv_len, seq.n_max) - kv_len)
        self.steady.join(seq, steps_to_decision)

    def _memory_demand(self) -> bool:
        """Somebody wants blocks: a running request blocked because no block was free, or the
        head of `waiting`, which admission would take now but for blocks."""
        return bool(self._starved) or self.prefill.head_short_of_blocks()

    # ------------------------------------------------------------------ compression

    def _compress(self, seq: Sequence, plan: StepPlan, jobs: list[CompressionJob],
                  n_max: int) -> None:
        """Compress `seq` into n_max - 1 target blocks plus one for new tokens (rules 3, 5)."""
        assert seq.query_slot is not None, f"{seq.seq_id} must compress but holds no query slot"
        compressions = self.compressions
        if compressions.must_wait(seq, jobs):
            self._block(seq)  # waits for the compression stream
            return
        if not self._make_free_blocks(seq, plan,
                                      lambda: compressions.fresh_for_compression(seq, n_max)):
            return
        job = compressions.plan_job(seq, n_max)
        self._resource_version += 1
        jobs.append(job)
        if not self.config.async_compress:
            # Sync: the compression runs before this step's decode, so the request decodes now
            # with its new table; the old blocks stay held by the job until the step is done.
            compressions.swap_to_compressed_table(job)
            self._join_steady(seq)

    def _complete_batch(self, batch_id: int) -> None:
        for job in self.compressions.take_batch(batch_id).jobs:
            self.compressions.complete(job, swap_table=True)
            self._resource_version += 1
            if job.seq in self._abort_after_batch:
                self._abort_after_batch.discard(job.seq)
                self._release(job.seq, SequenceStatus.ABORTED, self.aborted)
            elif job.seq in self._stop_after_batch:
                self._finish_if_stopped(job.seq)
            else:
                self._pending.append(job.seq)

    # ------------------------------------------------------------------ preemption

    def _make_free_blocks(self, seq: Sequence, plan: StepPlan, blocks_needed) -> bool:
        """Preempt until `blocks_needed()` blocks are free; False if `seq` blocked or went.

        Elastic: while another request holds blocks above its N_max that it will give back at
        its next full block, `seq` waits for them instead of anyone being preempted."""
        while self.block_manager.num_free_blocks < blocks_needed():
            victim = None
            if not (self.elastic and self.compressions.reclaimable_borrower(seq)):
                victim = self.victims.pick(seq)
            if victim is None:
                self._block(seq)
                self._starved.add(seq)
                return False
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free every block of `seq` and send it back to `waiting` (recompute later): to its front,
        or under the priority policy to its own place."""
        self._leave_running(seq)
        seq.set_counters(0, seq.num_output_tokens)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _block(self, seq: Sequence) -> None:
        self._blocked[seq] = self._resource_version

    def _forget_blocked(self, seq: Sequence) -> None:
        self._blocked.pop(seq, None)
        self.slots.waiters.discard(seq)
        self._starved.discard(seq)

    # ------------------------------------------------------------------ leaving

    def _finish_sequence(self, seq: Sequence, time: float | None) -> None:
        """`seq` is done; `time` None: its step's end is not known yet (async scheduling). A
        waiting one stopped in the step settled now, and the plan made since preempted it
        (async scheduling): it is done, not recomputed."""
        if seq.status is WAITING:
            self._leave_waiting(seq, FINISHED, self.finished)
        else:
            self._release(seq, FINISHED, self.finished)
        seq.finish_time = time
        if time is None and seq.first_token_time is not None:
            self._untimed.append(seq)  # (with no first token yet it is listed already)
        seq.kept_budget = self.compressions.kept_budget(seq)

    def _leave_waiting(self, seq: Sequence, status: SequenceStatus, into: list[Sequence]) -> None:
        """A waiting request leaves for good (aborted, or finished: `_finish_sequence`)."""
        self.waiting.remove(seq)
        self._forget_blocked(seq)
        seq.status = status
        into.append(seq)
        self._resource_version += 1

    def _release(self, seq: Sequence, status: SequenceStatus, into: list[Sequence]) -> None:
        """A running request leaves for good (finished or aborted): blocks and slot are freed."""
        self._leave_running(seq)
        seq.status = status
        into.append(seq)

    def _leave_running(self, seq: Sequence) -> None:
        """`seq` leaves `running` (preempted, finished or aborted): it stops decoding and waiting
        for anything, and its blocks and slot are freed."""
        self.steady.leave(seq)
        self._forget_blocked(seq)
        self.block_manager.release_table(seq.block_table)
        seq.block_table = []
        self.compressions.borrowers.pop(seq, None)
        del self.running[seq]
        self.prefilling.pop(seq, None)
        self.slots.release(seq)
        self._resource_version += 1

    # ------------------------------------------------------------------ abort

    def abort(self, seq_id: str) -> bool:
        """Drop a waiting or running request (its client went away); False if none is queued.

        Call it between steps; under async scheduling a step is always running then, and
        its `advance` passes over the requests that left. Its blocks and query slot are freed
        at once (a later step's writes to them queue behind the running one on the device),
        except for a request inside the in-flight async compression batch: that batch still
        reads its slot and writes its target blocks, so the request is released when the batch
        completes and meanwhile only waits, out of decoding.
        """
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self._leave_waiting(seq, SequenceStatus.ABORTED, self.aborted)
                return True
        for seq in self.running:
            if seq.seq_id == seq_id:
                if seq in self._abort_after_batch:
                    return True
                if seq in self._stop_after_batch:  # stopped already: it finishes, not aborts
                    return True
                if seq.compressing:  # only an async batch holds it between steps
                    self._abort_after_batch.add(seq)
                else:
                    self._release(seq, SequenceStatus.ABORTED, self.aborted)
                return True
        return False
