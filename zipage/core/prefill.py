"""Prefill planning: which prompts a step computes, and who is admitted from `waiting` for them.

Admission tries the head of `waiting` only (a head that cannot start blocks the queue, so the
queue's order is the whole waiting policy: zipage/core/waiting.py). A request is admitted when
`running` has room under `max_num_seqs`, it can take a query slot or (hybrid scheduling) need
none yet, and its prompt's blocks can be allocated (docs/architecture.md, 'Scheduling'). Without
chunked prefill each computes its whole prompt; with it, what is left of the step's token budget
(docs/architecture.md, 'Chunked prefill'). The samples of one prompt queued behind their leader
are admitted as forks of it (docs/architecture.md, 'Samples of one prompt').

`PrefillPlanner` works on the scheduler's queues and writes the step's `PrefillItem`s and
`Fork`s into its plan; putting an admitted request into `running` is the scheduler's (`admit`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from zipage.config import ZipageConfig
from zipage.core import lending
from zipage.core.admission import Admission
from zipage.core.block_manager import BlockManager
from zipage.core.sequence import Sequence
from zipage.core.slots import QuerySlots
from zipage.core.step import Fork, PrefillItem, StepPlan
from zipage.core.waiting import PriorityWaiting


class PrefillPlanner:
    def __init__(self, config: ZipageConfig, step_tokens: int, block_manager: BlockManager,
                 admission: Admission, slots: QuerySlots, waiting: deque[Sequence] | PriorityWaiting,
                 running: dict[Sequence, None], prefilling: dict[Sequence, None],
                 admit: Callable[[Sequence, bool], None]) -> None:
        self.config = config
        self.block_size = config.block_size
        self.compress = config.compress
        self.step_tokens = step_tokens
        self.block_manager = block_manager
        self.admission = admission  # its peak rule prices what a borrower reserves (lending)
        self.slots = slots
        # The scheduler's queues (`waiting` in the policy's order, `running` in admission
        # order, `prefilling` its part-way prompts), and how it puts a request, its block table
        # allocated, into `running` (with a query slot or without).
        self.waiting = waiting
        self.running = running
        self.prefilling = prefilling
        self.admit = admit

    def admit_waiting(self, plan: StepPlan, budget: int | None = None) -> Sequence | None:
        """Admit waiting requests, FCFS (only the head is tried). Without a `budget` each computes
        its whole prompt, up to `max_num_batched_tokens` in all (the first always fits); with one
        (chunked prefill) each computes what is left of the budget and continues next step.
        Returns the head that failed for want of a resource (room, a slot, blocks), if one did."""
        config = self.config
        batched_tokens = 0
        while self.waiting and (budget is None or budget > 0):
            seq = self.waiting[0]
            # A preempted request recomputes its outputs too (`num_tokens`; waiting: settled).
            num_tokens = seq.prompt_len + seq.settled_output_tokens
            cached = self.block_manager.cached_prefix_blocks(seq, num_tokens)
            hosted = self.block_manager.host_prefix_slots(seq, num_tokens, len(cached))
            start = (len(cached) + len(hosted)) * self.block_size
            if budget is None and plan.prefill and (
                    batched_tokens + num_tokens - start > self.step_tokens):
                return None  # the tokens of this step, not a resource: the next step may admit it
            if len(self.running) >= config.max_num_seqs:
                return seq
            takes_slot = self.compress and self.slots.can_take(seq)
            if self.compress and not takes_slot:
                # Hybrid scheduling admits a request without a slot only if it will not write
                # window queries before a slot can reach it (and, after a preemption, only into
                # blocks nobody reserved: `may_borrow`).
                if (not config.hybrid or self.slots.needs_slot_to_start(seq, num_tokens)
                        or not self.may_borrow(seq, cached)):
                    return seq
            if not self.block_manager.can_allocate_prefill(cached, num_tokens):
                return seq
            self.waiting.popleft()
            if hosted:
                hosted = self.block_manager.reserve_host_prefix(seq, len(cached), len(hosted))
            seq.block_table = self.block_manager.allocate_prefill(cached, num_tokens)
            if hosted:
                self.block_manager.load_prefix(seq, len(cached), hosted)
                plan.host_hit_tokens += len(hosted) * self.block_size
            self.admit(seq, takes_slot)
            seq.set_counters(start, seq.settled_output_tokens)
            plan.prefix_hit_tokens += start
            if not seq.num_preemptions:
                plan.first_hit_tokens += start
            end = num_tokens
            if budget is not None and start + budget < num_tokens:
                end = start + budget  # a chunk
            self.plan_chunk(plan, seq, end)
            batched_tokens += end - start
            if budget is not None:
                budget -= end - start
        return None

    def head_short_of_blocks(self) -> bool:
        """The head of `waiting` passes every admission check but the one for KV blocks (room
        under max_num_seqs, a query slot or no need of one), and fails that one."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        head = self.waiting[0]
        tokens = head.num_tokens
        manager = self.block_manager
        cached = manager.cached_prefix_blocks(head, tokens)
        if self.compress and not self.slots.can_take(head) and (
                not self.config.hybrid or self.slots.needs_slot_to_start(head, tokens)
                or not self.may_borrow(head, cached)):
            return False
        return not manager.can_allocate_prefill(cached, tokens)

    def may_borrow(self, seq: Sequence, cached: list[int]) -> bool:
        """Hybrid admission without a slot: a first admission may take blocks the slot holders
        reserved; a request preempted before only blocks nobody reserved (zipage/core/lending.py:
        re-admitted on the same terms it is preempted again, up to 20 times on amc23)."""
        return not seq.num_preemptions or lending.fits_unreserved(
            seq, cached, self.running, self.block_manager, self.admission)

    def plan_chunk(self, plan: StepPlan, seq: Sequence, end: int) -> None:
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
        slots = self.slots
        if self.compress and prompt_len > slots.first_slot_token(0, leader.n_max):
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
            takes_slot = self.compress and slots.can_take(seq)
            if self.compress and not takes_slot and (
                    not self.config.hybrid or slots.needs_slot_to_start(seq, prompt_len)
                    or not self.may_borrow(seq, leader.block_table[:full])):
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
            self.admit(seq, takes_slot)
            plan.forks.append(Fork(seq, leader, copy))
        self._release_forks(leader)

    def _release_forks(self, leader: Sequence) -> None:
        """The leader sampled: its samples still waiting prefill as any request from now on."""
        for seq in self.waiting:  # they are queued together, right behind it
            if seq.fork_of is not leader:
                break
            seq.fork_of = None
