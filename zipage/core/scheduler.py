"""The scheduler: constrained and hybrid scheduling over Compressed PagedAttention.

One step at a time: `schedule()` returns a `StepPlan` (a prefill step or a decode step, with the
compressions and preemptions it needs; with chunked prefill, decodes and prompt chunks mixed in
one step), the driver executes it, `finish(result)` applies it. The rules are
docs/architecture.md, 'Rules', 'Scheduling' and 'Chunked prefill'; this module is the only place
they live.

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

import heapq
from operator import attrgetter

from zipage.config import ZipageConfig
from zipage.core.admission import Admission
from zipage.core.block_manager import BlockManager, prompt_block_hashes
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.steady import SteadyDecoding
from zipage.core.step import (
    DECODE,
    IDLE,
    MIXED,
    PREFILL,
    CompressionBatch,
    CompressionJob,
    Fork,
    PrefillItem,
    StepPlan,
    StepResult,
)
from zipage.core.waiting import priority_key, waiting_queue
from zipage.core.window import WindowLayout
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


class SchedulerStuck(RuntimeError):
    """No request can make progress and nothing is in flight: a deadlock, i.e. a bug."""


class Scheduler:
    def __init__(self, config: ZipageConfig, num_blocks: int, num_query_slots: int) -> None:
        check_pool(config, num_blocks, num_query_slots)
        self.config = config
        self.block_size = config.block_size
        self.window = config.window
        self.windows = WindowLayout(config.block_size, config.window)
        self.n_max = config.n_max  # of the default budget; a request's own is `seq.n_max`
        self.compress = config.compress
        # What can ever be served here, and each request's N_max (pure: docs/architecture.md,
        # 'Scheduling'); `step_tokens` is resolved there once, read here every step.
        self.admission = Admission(config, num_blocks)
        self.step_tokens = self.admission.step_tokens
        # docs/architecture.md, 'Per-request and elastic budgets'.
        self.elastic = config.compress and config.budget_policy == "elastic"
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_cache)
        self.num_query_slots = num_query_slots if config.compress else 0
        self.free_slots = list(range(self.num_query_slots))  # a min-heap: lowest slot first

        self.by_priority = config.scheduling_policy == "priority"
        self.waiting = waiting_queue(config.scheduling_policy, config.priority_aging_s)
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

        # The requests decoding every step with nothing to decide, and the decode clock.
        self.steady = SteadyDecoding()
        self._pending: list[Sequence] = []  # need a decision at the next decode step
        self._blocked: dict[Sequence, int] = {}  # request -> resource version when it blocked
        # Requests waiting for a query slot (hybrid): only a slot hand-out can release them, so
        # they are not rescanned each step.
        self._waiting_for_slot: set[Sequence] = set()
        self._admission_failed_at: tuple[Sequence, int] | None = None
        self._resource_version = 0  # bumps whenever blocks, slots or the running set change
        self._num_slotless_running = 0
        # Blocks reserved for the slot holders: the sum of their `slot_blocks`, never above
        # num_blocks (with one budget, the planner's N_total >= M N_max makes this automatic).
        self._slot_reserved = 0
        # Running requests holding more blocks than their N_max (elastic borrowers, and prompts
        # longer than N_max blocks), and requests blocked because no block was free.
        self._borrowers: dict[Sequence, None] = {}
        self._starved: set[Sequence] = set()

        # Whether a plan lists its decode requests (`StepPlan.decode`, O(batch) a step); a driver
        # that reads only how many there are (`StepPlan.num_decode`: the simulator without a
        # decision log or checker) turns it off.
        self.decode_lists = True

        self.in_flight: CompressionBatch | None = None  # async batch on the compression stream
        self._sync_jobs: list[CompressionJob] = []
        self._plan: StepPlan | None = None
        self._step_id = 0
        self._next_rank = 0
        self._next_batch_id = 0

    # ------------------------------------------------------------------ requests in and out

    def add(self, seq: Sequence) -> bool:
        """Queue a request; a request that can never be served is rejected alone (False)."""
        reason = self.admission.rejection_reason(seq)
        if reason is not None:
            self.refuse(seq, reason)
            return False
        # A driver may give the blocks' hashes itself (the simulator's keys); a prompt shorter
        # than a block has none to give.
        if (self.config.prefix_cache and not seq.prompt_block_hashes
                and seq.prompt_len >= self.block_size):
            if seq.prompt_token_ids is None:
                raise ValueError(f"request {seq.seq_id}: prefix caching needs prompt_token_ids")
            seq.prompt_block_hashes = prompt_block_hashes(seq.prompt_token_ids, self.block_size)
        if seq.kv_budget is None:
            seq.kv_budget = self.config.kv_budget
        seq.n_max = self.admission.n_max_of(seq)
        seq.pinned = self.admission.pinned_of(seq) if self.compress else 0
        # Blocks a query slot reserves for its holder: its N_max, or all it can ever hold if
        # fewer. The holders' reservations never exceed the pool, which is what keeps any mix
        # of budgets deadlock-free (docs/architecture.md, 'Deadlock freedom'). Fixed from here
        # on, so worked out once (slots are taken and given back several times a request).
        whole = -(-(seq.prompt_len + seq.max_output_tokens - 1) // self.block_size)
        seq.slot_blocks = seq.n_max if seq.n_max < whole else whole  # (min, written out)
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
        if self.free_slots and self._num_slotless_running:  # rare: no call otherwise
            self._hand_out_slots()
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
            if plan.compress_launch is None and self.in_flight is None:
                raise SchedulerStuck(self._stuck_report())
            plan.kind = IDLE
        plan.num_running = len(self.running)
        plan.num_waiting = len(self.waiting)
        manager = self.block_manager
        plan.blocks_used = manager.num_blocks - manager.num_free_blocks  # (`num_used_blocks`)
        plan.shared_kv_tokens = manager.extra_holders * self.block_size
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
            for fork in plan.forks:
                self._first_token(fork.seq, fork.seq.prompt_len, result)
            self._resource_version += 1  # a finished prefill may unblock the waiting head
        if plan.kind in (DECODE, MIXED):
            for job in plan.compress_sync:
                self._complete_compression(job, swap_table=False)
            for seq in self.steady.tick():
                self._finish_sequence(seq, result.t_end)
            if result.stopped:
                assert self.decode_lists, "a request stopped early, but the plan lists no decodes"
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
            # A preempted request recomputes its outputs too (`num_tokens`; waiting: settled).
            num_tokens = seq.prompt_len + seq.settled_output_tokens
            cached = self.block_manager.cached_prefix_blocks(seq, num_tokens)
            start = len(cached) * self.block_size
            if budget is None and plan.prefill and (
                    batched_tokens + num_tokens - start > self.step_tokens):
                break  # the tokens of this step, not a resource: the next step may admit it
            self._admission_failed_at = (seq, self._resource_version)
            if len(self.running) >= config.max_num_seqs:
                break
            takes_slot = self.compress and self._can_take_slot(seq)
            if self.compress and not takes_slot:
                # Hybrid scheduling admits a request without a slot only if it will not write
                # window queries before a slot can reach it.
                if not config.hybrid or self._needs_slot_to_start(seq, num_tokens):
                    break
            if not self.block_manager.can_allocate_prefill(cached, num_tokens):
                break
            self.waiting.popleft()
            seq.block_table = self.block_manager.allocate_prefill(cached, num_tokens)
            self._note_table(seq)
            slot = self._take_slot(seq) if takes_slot else None
            self._admit(seq, slot)
            seq.set_counters(start, seq.settled_output_tokens)
            plan.prefix_hit_tokens += start
            end = num_tokens
            if budget is not None and start + budget < num_tokens:
                end = start + budget  # a chunk
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
        budget = self.step_tokens - plan.num_decode
        for seq in list(self.prefilling):
            if budget <= 0:
                return
            start = seq.settled_kv_len  # part-way through its prompt: settled
            end = min(seq.prompt_len + seq.settled_output_tokens, start + budget)
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
        start = seq.settled_kv_len  # its prompt is being computed: settled
        self.block_manager.register_prompt_blocks(seq, start // self.block_size,
                                                  end // self.block_size)
        samples = end == seq.prompt_len + seq.settled_output_tokens  # (`num_tokens`)
        first = seq.settled_output_tokens == 0
        plan.prefill.append(PrefillItem(seq, start, end, samples, seq.prompt_logits and first))
        if samples:
            self.prefilling.pop(seq, None)
            if first and self.waiting and self.waiting[0].fork_of is seq and not plan.preempted:
                self._fork(plan, seq)
        else:
            self.prefilling.setdefault(seq, None)  # keeps its place in admission order

    def _fork(self, plan: StepPlan, leader: Sequence) -> None:
        """Admit the samples of `leader`'s prompt queued right behind it as forks: they map its
        full prompt blocks, get a copy of its last partial one, and sample their first token
        from its logits (docs/architecture.md, 'Samples of one prompt'). Each is admitted as a
        prefill would be (FCFS from the head of waiting, max_num_seqs, a query slot under the
        same rule); one that cannot be stays waiting, and later prefills as any request (its
        prompt blocks from the prefix cache). Only a prompt that wrote no window queries is
        forked: those would be in the leader's query slot alone (rule 7)."""
        b = self.block_size
        prompt_len = leader.prompt_len
        if self.compress and prompt_len > self._first_slot_token(0, leader.n_max):
            self._release_forks(leader)
            return
        full = prompt_len // b
        manager = self.block_manager
        while self.waiting and self.waiting[0].fork_of is leader:
            seq = self.waiting[0]
            if (seq.num_output_tokens or seq.prompt_len != prompt_len
                    or seq.kv_budget != leader.kv_budget
                    or seq.prompt_block_hashes != leader.prompt_block_hashes):
                break
            if len(self.running) >= self.config.max_num_seqs:
                break
            takes_slot = self.compress and self._can_take_slot(seq)
            if self.compress and not takes_slot and (
                    not self.config.hybrid or self._needs_slot_to_start(seq, prompt_len)):
                break
            partial = prompt_len % b != 0
            if partial and manager.num_free_blocks < 1:
                break
            self.waiting.popleft()
            table = leader.block_table[:full]
            manager.share(table)
            copy = None
            if partial:
                fresh = manager.allocate()
                copy = (leader.block_table[full], fresh)
                table = table + [fresh]
            seq.block_table = table
            seq.fork_of = None
            self._note_table(seq)
            self._admit(seq, self._take_slot(seq) if takes_slot else None)
            plan.forks.append(Fork(seq, leader, copy))
        self._release_forks(leader)

    def _release_forks(self, leader: Sequence) -> None:
        """The leader sampled: its samples still waiting prefill as any request from now on."""
        for seq in self.waiting:  # they are queued together, right behind it
            if seq.fork_of is not leader:
                break
            seq.fork_of = None

    def _admit(self, seq: Sequence, slot: int | None) -> None:
        seq.status = RUNNING
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
            seq.set_counters(item.num_tokens, seq.settled_output_tokens)
            return
        self._first_token(seq, item.num_tokens, result)

    def _first_token(self, seq: Sequence, num_tokens: int, result: StepResult) -> None:
        """`seq` computed its `num_tokens` and sampled a token (a prefill's, or a fork's)."""
        seq.set_counters(num_tokens, seq.settled_output_tokens + 1)
        if seq.first_token_time is None:
            seq.first_token_time = result.t_end
        if seq.settled_output_tokens >= seq.max_output_tokens or seq.seq_id in result.stopped:
            self._finish_sequence(seq, result.t_end)
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
            if self.config.async_compress:
                plan.compress_launch = CompressionBatch(self._next_batch_id, jobs)
                self.in_flight = plan.compress_launch
                self._next_batch_id += 1
            else:
                plan.compress_sync = jobs
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
                target = self._compression_target(seq)
                if target is not None:
                    self._compress(seq, plan, jobs, target)
                    return
                # Elastic, and the pool is slack: the request keeps all its KV, one block more.
            if not self._make_free_blocks(seq, plan, lambda: 1):
                return
            table.append(self.block_manager.allocate())
            self._note_table(seq)
            if len(table) > seq.n_max and self.compress:
                plan.grown.append(seq)
            self._resource_version += 1
            if seq.num_compressions:
                seq.max_blocks_after_first_compression = max(
                    seq.max_blocks_after_first_compression, len(table))
        elif seq.query_slot is None and self.needs_slot(kv_len, seq.n_max):
            self._waiting_for_slot.add(seq)
            return
        self._join_steady(seq)

    # ------------------------------------------------------------------ budgets

    def _compression_target(self, seq: Sequence) -> int | None:
        """The blocks `seq` holds after the compression its full last block triggers, or None
        when it takes one more block instead (docs/architecture.md, 'Per-request and elastic
        budgets'). Fixed: its N_max. Elastic: more while the pool is slack (grow), the blocks it
        holds while nobody waits for memory (hold), its N_max as soon as somebody does."""
        floor = seq.n_max
        if not self.elastic or self._memory_demand():
            return floor
        manager = self.block_manager
        if manager.num_free_blocks - 1 >= len(self.running):
            return None
        held = len(seq.block_table)
        if held > floor and self.fresh_for_compression(seq, held) == 0:
            return held
        return floor

    def _memory_demand(self) -> bool:
        """Somebody wants blocks: a running request blocked because no block was free, or the
        head of `waiting`, which admission would take now but for blocks."""
        return bool(self._starved) or self.head_short_of_blocks()

    def head_short_of_blocks(self) -> bool:
        """The head of `waiting` passes every admission check but the one for KV blocks (room
        under max_num_seqs, a query slot or no need of one), and fails that one."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        head = self.waiting[0]
        tokens = head.num_tokens
        if self.compress and not self._can_take_slot(head) and (
                not self.config.hybrid or self._needs_slot_to_start(head, tokens)):
            return False
        manager = self.block_manager
        return not manager.can_allocate_prefill(manager.cached_prefix_blocks(head, tokens), tokens)

    def _reclaimable_borrower(self, requester: Sequence) -> bool:
        """Some other running request holds more blocks than its N_max and will give them back
        at its next full block without needing a free one: it decodes (not prefilling, not
        compressing), holds its query slot, and compressing it needs no fresh target block.
        Elastic scheduling waits for it rather than preempting anyone."""
        for seq in self._borrowers:
            if (seq is not requester and seq.query_slot is not None and not seq.compressing
                    and seq not in self.prefilling
                    and self.fresh_for_compression(seq, seq.n_max) == 0):
                return True
        return False

    def _note_table(self, seq: Sequence) -> None:
        """Keep `_borrowers` up to date after `seq`'s block table changed."""
        if len(seq.block_table) > seq.n_max:
            self._borrowers[seq] = None
        else:
            self._borrowers.pop(seq, None)

    def _can_take_slot(self, seq: Sequence) -> bool:
        """A slot is free, no running request waits for one before `seq`, and the pool can back
        `seq`'s reservation too."""
        return (bool(self.free_slots) and not self._num_slotless_running
                and self._slot_reserved + seq.slot_blocks <= self.block_manager.num_blocks)

    def _take_slot(self, seq: Sequence) -> int:
        self._slot_reserved += seq.slot_blocks
        return heapq.heappop(self.free_slots)

    # ------------------------------------------------------------------ compression

    def _compress(self, seq: Sequence, plan: StepPlan, jobs: list[CompressionJob],
                  n_max: int) -> None:
        """Compress `seq` into n_max - 1 target blocks plus one for new tokens (rules 3, 5)."""
        assert seq.query_slot is not None, f"{seq.seq_id} must compress but holds no query slot"
        if self.config.async_compress:
            batch_blocks = sum(job.num_source_blocks for job in jobs)
            over_cap = jobs and batch_blocks + len(seq.block_table) > \
                self.config.max_compress_batch_blocks
            if self.in_flight is not None or over_cap:
                self._block(seq)  # waits for the compression stream
                return
        manager = self.block_manager
        if not self._make_free_blocks(seq, plan, lambda: self.fresh_for_compression(seq, n_max)):
            return
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
        self._resource_version += 1
        jobs.append(job)
        if not self.config.async_compress:
            # Sync: the compression runs before this step's decode, so the request decodes now
            # with its new table; the old blocks stay held by the job until the step is done.
            self._swap_to_compressed_table(job)
            self._join_steady(seq)

    def fresh_for_compression(self, seq: Sequence, n_max: int) -> int:
        """Free blocks compressing `seq` to `n_max` blocks takes (rule 5), past its pinned
        blocks."""
        pinned = seq.pinned
        if not pinned:
            return self.block_manager.fresh_blocks_for_compression(seq.block_table, n_max)
        return self.block_manager.fresh_blocks_for_compression(seq.block_table[pinned:],
                                                               n_max - pinned)

    def _make_free_blocks(self, seq: Sequence, plan: StepPlan, blocks_needed) -> bool:
        """Preempt until `blocks_needed()` blocks are free; False if `seq` blocked or went.

        Elastic: while another request holds blocks above its N_max that it will give back at
        its next full block, `seq` waits for them instead of anyone being preempted."""
        while self.block_manager.num_free_blocks < blocks_needed():
            victim = None
            if not (self.elastic and self._reclaimable_borrower(seq)):
                victim = self._pick_victim(seq)
            if victim is None:
                self._block(seq)
                self._starved.add(seq)
                return False
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _pick_victim(self, requester: Sequence) -> Sequence | None:
        """The request to preempt when blocks run out (docs/architecture.md, 'Scheduling'), or
        None: of the requests the mode allows, the last admitted. Under the priority policy the
        one the waiting queue would serve last (the latest admitted of equals), the requester
        only when no other is allowed: a slot holder of a low class preempting itself could
        leave a step with nothing to run while the requests it blocked wait for its slot
        (docs/architecture.md, 'Waiting-queue policies')."""
        candidates = self._victim_candidates()
        if self.by_priority:
            aging = self.config.priority_aging_s
            allowed = list(candidates)
            others = [seq for seq in allowed if seq is not requester]
            if not others:
                return allowed[0] if allowed else None  # the requester, or nobody
            return max(others, key=lambda seq: (priority_key(seq, aging), seq.running_rank))
        return next(candidates, None)

    def _victim_candidates(self):
        """The running requests the mode may preempt, last admitted first."""
        if not self.compress:
            return reversed(self.running)
        if self.config.prefix_cache:
            # Compression may need fresh target blocks, so only preempting uncompressed requests
            # (slot or not) keeps prefix sharing deadlock-free.
            return (seq for seq in reversed(self.running)
                    if seq.num_compressions == 0 and not seq.compressing
                    and self.can_recompute(seq))
        if self.config.hybrid:
            return (seq for seq in reversed(self.running)
                    if seq.query_slot is None and self.can_recompute(seq))
        return iter(())

    def can_recompute(self, seq: Sequence) -> bool:
        """A preempted request recomputes its prompt and outputs: one block more than it held
        when it stopped on a block boundary. One whose recomputation would not fit the pool is
        never a victim (it could never run again). Such a request holds every block, so the
        requests sharing its prefix blocks are uncompressed and remain victims: the deadlock
        argument is unchanged (docs/architecture.md, 'Deadlock freedom')."""
        return -(-seq.num_tokens // self.block_size) <= self.block_manager.num_blocks

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free every block of `seq` and send it back to `waiting` (recompute later): to its front,
        or under the priority policy to its own place."""
        self.steady.leave(seq)
        self._forget_blocked(seq)
        self.block_manager.release_table(seq.block_table)
        seq.block_table = []
        self._borrowers.pop(seq, None)
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
        self._starved.discard(seq)

    # ------------------------------------------------------------------ steady decoding

    def _join_steady(self, seq: Sequence) -> None:
        """Decode `seq` every step from now on until its next event: its last block is full,
        or it reaches the window of a block that may compress while it holds no slot."""
        kv_len = seq.settled_kv_len  # not steady yet: settled
        steps_to_decision = len(seq.block_table) * self.block_size - kv_len
        if self.compress and seq.query_slot is None:
            steps_to_decision = min(steps_to_decision,
                                    self._first_slot_token(kv_len, seq.n_max) - kv_len)
        self.steady.join(seq, steps_to_decision)

    # ------------------------------------------------------------------ query slots

    def needs_slot(self, token_index: int, n_max: int | None = None) -> bool:
        """Computing KV entry `token_index` writes a window query a compression will read.

        True for the last w in-block offsets of every block from index N_max - 1 on (the
        request's N_max; the default's when not given): those blocks are the final block when a
        compression triggers (docs/architecture.md, 'Rules', rule 7), at N_max blocks or, for an
        elastic request, at any number above.
        """
        b = self.block_size
        n_max = self.n_max if n_max is None else n_max
        return (self.compress and token_index // b >= n_max - 1
                and token_index % b >= b - self.window)

    def _first_slot_token(self, kv_len: int, n_max: int) -> int:
        b = self.block_size
        block = max(kv_len // b, n_max - 1)
        return max(kv_len, block * b + b - self.window)

    def _needs_slot_to_start(self, seq: Sequence, num_tokens: int) -> bool:
        """Prefill of num_tokens, or the first decode after it, writes window queries."""
        return (self.needs_slot(num_tokens - 1, seq.n_max)
                or self.needs_slot(num_tokens, seq.n_max))

    def window_query_range(self, seq: Sequence, start: int, end: int) -> tuple[int, int]:
        """KV entries in [start, end) whose queries a driver stores (`WindowLayout.query_range`)."""
        return self.windows.query_range(seq.query_slot, start, end)

    def _hand_out_slots(self) -> None:
        """Freed slots go to the foremost running requests that lack one (hybrid)."""
        if not (self.free_slots and self._num_slotless_running):
            return
        for seq in self.running:
            if seq.query_slot is None:
                if self._slot_reserved + seq.slot_blocks > self.block_manager.num_blocks:
                    return  # the foremost waits until enough holders finish; nobody overtakes
                seq.query_slot = self._take_slot(seq)
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
            self._slot_reserved -= seq.slot_blocks
            seq.query_slot = None
        elif self.compress:
            self._num_slotless_running -= 1

    # ------------------------------------------------------------------ completion

    def _swap_to_compressed_table(self, job: CompressionJob) -> None:
        seq = job.seq
        seq.block_table = job.kept_blocks + job.target_blocks + [job.new_block]
        seq.set_counters((len(job.kept_blocks) + len(job.target_blocks)) * self.block_size,
                         seq.num_output_tokens)
        self._note_table(seq)
        seq.max_blocks_after_first_compression = max(
            seq.max_blocks_after_first_compression, len(seq.block_table))

    def _complete_compression(self, job: CompressionJob, swap_table: bool) -> None:
        if swap_table:
            self._swap_to_compressed_table(job)
        self.block_manager.release_all(job.released)
        job.seq.compressing = False
        job.seq.num_compressions += 1
        job.seq.kept_tokens += len(job.target_blocks) * self.block_size
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
        self._release(seq, FINISHED, self.finished)
        seq.finish_time = time
        seq.kept_budget = self._kept_budget(seq)

    def _kept_budget(self, seq: Sequence) -> float | None:
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

    def _release(self, seq: Sequence, status: SequenceStatus, into: list[Sequence]) -> None:
        """A running request leaves for good (finished or aborted): blocks and slot are freed."""
        self.steady.leave(seq)
        self._forget_blocked(seq)
        self.block_manager.release_table(seq.block_table)
        seq.block_table = []
        self._borrowers.pop(seq, None)
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
