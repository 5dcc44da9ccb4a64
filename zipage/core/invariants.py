"""Checks of the core's invariants (docs/architecture.md, 'Invariants'), run by drivers under test.

`InvariantChecker` watches a scheduler step by step: `after_schedule(plan)` before the driver
executes the plan, `record_computed(seq, start, end)` for every KV range a driver computes, and
`after_finish()` once the step is applied; `at_end()` when the run is over. A violation raises
`InvariantViolation` with the step and the request. The checks read the scheduler's state; they
never change it, so a run with checks on makes exactly the decisions of a run without them.
"""

from __future__ import annotations

from collections import Counter

from zipage.core.budget_invariants import BudgetInvariants
from zipage.core.step import StepPlan
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence, SequenceStatus


class InvariantViolation(AssertionError):
    pass


class InvariantChecker:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.step_id = -1
        # Window queries written into each request's slot since its last compression:
        # window index -> KV entry whose query it holds.
        self.window_queries: dict[Sequence, dict[int, int]] = {}
        self.accepted_order: list = []  # ids of accepted requests, in the order they arrived
        # KV entries each request computed itself since it was last admitted.
        self.computed: dict[Sequence, int] = {}
        # (hash, block) entries of the prefix index when the current step was planned: their KV
        # is computed. (A block id may come back with other content, hence the pairs.)
        self.indexed_before: set[tuple[int, int]] = set()
        # Per-request and elastic budgets (`before_schedule` runs right before each schedule).
        self.budgets = BudgetInvariants(scheduler, self.fail)

    def fail(self, message: str) -> None:
        raise InvariantViolation(f"step {self.step_id}: {message}")

    # ---- hooks ----

    def after_schedule(self, plan: StepPlan) -> None:
        self.step_id = plan.step_id
        scheduler = self.scheduler
        for seq in plan.preempted:
            if seq.num_compressions or seq.compressing:
                self.fail(f"{seq.seq_id} was preempted although compressed or compressing")
            self.window_queries.pop(seq, None)
            self.computed.pop(seq, None)
        for job in plan.compressions:
            self._check_compression(job)
        self._check_chunks(plan)
        self._check_writes(plan)
        self._check_blocks()
        self._check_slots()
        self.budgets.after_schedule(plan)

    def record_plan_writes(self, plan: StepPlan) -> None:
        """Record the KV ranges (and so the window queries) a driver computes for `plan`."""
        for item in plan.prefill:
            self.record_computed(item.seq, item.num_cached_tokens, item.num_tokens)
            self.computed[item.seq] = item.num_tokens
        for seq in plan.decode:
            self.record_computed(seq, seq.kv_len, seq.kv_len + 1)

    def record_computed(self, seq: Sequence, start: int, end: int) -> None:
        """A driver computed KV entries [start, end) of `seq` (and wrote their window queries)."""
        first, last = self.scheduler.window_query_range(seq, start, end)
        layout = self.scheduler.windows
        written = self.window_queries.setdefault(seq, {})
        for entry in range(first, last):
            written[layout.index(entry)] = entry

    def after_finish(self) -> None:
        self._check_blocks()
        self._check_slots()
        scheduler = self.scheduler
        self.indexed_before = set(scheduler.block_manager.hash_to_block.items())
        if scheduler.prefilling and not scheduler.config.chunked_prefill:
            self.fail("a prompt is left part-computed without chunked prefill")
        for seq in scheduler.prefilling:
            if seq not in scheduler.running or seq.kv_len >= seq.num_tokens:
                self.fail(f"{seq.seq_id} is listed as prefilling but is not running or is done "
                          f"({seq!r})")
        self.budgets.after_finish()
        for seq in self.scheduler.running:
            # Rule 6 with the request's own N_max; an elastic request may hold more (its cap).
            n_max = seq.n_max
            if seq.num_compressions and len(seq.block_table) > n_max and not scheduler.elastic:
                self.fail(f"{seq.seq_id} holds {len(seq.block_table)} > N_max = {n_max} blocks "
                          "after its first compression")
        for seq in self.scheduler.finished:
            if seq.num_output_tokens > seq.max_output_tokens:
                self.fail(f"{seq.seq_id} produced {seq.num_output_tokens} tokens, more than "
                          f"its {seq.max_output_tokens}")

    def at_end(self, stopped_early: set = frozenset()) -> None:
        scheduler = self.scheduler
        if scheduler.has_unfinished():
            self.fail("run ended with unfinished requests")
        manager = scheduler.block_manager
        if manager.num_free_blocks != manager.num_blocks or any(manager.refcount):
            self.fail(f"leak: {manager.num_blocks - manager.num_free_blocks} blocks still held")
        if len(scheduler.free_slots) != scheduler.num_query_slots:
            self.fail("leak: query slots still held")
        for seq in scheduler.finished:
            if seq.seq_id not in stopped_early and seq.num_output_tokens != seq.max_output_tokens:
                self.fail(f"{seq.seq_id} finished with {seq.num_output_tokens} tokens, "
                          f"expected {seq.max_output_tokens}")
        arrival_rank = {seq_id: rank for rank, seq_id in enumerate(self.accepted_order)}
        ranks = [arrival_rank[seq_id] for seq_id in scheduler.admission_order]
        if ranks != sorted(ranks):
            self.fail(f"first admissions out of arrival order: {scheduler.admission_order}")

    def note_added(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.REJECTED:
            self.accepted_order.append(seq.seq_id)

    # ---- the checks ----

    def _check_compression(self, job) -> None:
        scheduler = self.scheduler
        manager = scheduler.block_manager
        seq = job.seq
        if seq.query_slot is None or job.query_slot != seq.query_slot:
            self.fail(f"{seq.seq_id} is compressed without its query slot")
        for block in job.target_blocks + [job.new_block]:
            holders = self._holders()[block]
            if manager.refcount[block] != 1 or holders != 1:
                self.fail(f"compression target {block} of {seq.seq_id} is shared "
                          f"(refcount {manager.refcount[block]})")
        # Rule 7: all w window queries of the final (full) block were written since it filled.
        b, w = scheduler.block_size, scheduler.window
        final_start = (len(job.source_table) - 1) * b
        written = self.window_queries.get(seq, {})
        for index in range(w):
            expected = final_start + b - w + index
            if written.get(index) != expected:
                self.fail(f"{seq.seq_id}: window query {index} of its final block is missing "
                          f"(holds entry {written.get(index)}, expected {expected})")
        self.window_queries.pop(seq, None)

    def _check_chunks(self, plan: StepPlan) -> None:
        """Prompt ranges continue where their request stopped; a range samples exactly when it
        reaches the request's last token; the step's tokens respect the budget."""
        scheduler = self.scheduler
        config = scheduler.config
        decoding = set(plan.decode)
        for item in plan.prefill:
            seq = item.seq
            if item.num_cached_tokens != seq.kv_len or not (
                    seq.kv_len < item.num_tokens <= seq.num_tokens):
                self.fail(f"{seq.seq_id} computes [{item.num_cached_tokens}, {item.num_tokens}) "
                          f"but holds {seq.kv_len} of its {seq.num_tokens} tokens")
            if item.samples != (item.num_tokens == seq.num_tokens):
                self.fail(f"{seq.seq_id}: a range that ends at {item.num_tokens} of "
                          f"{seq.num_tokens} tokens has samples={item.samples}")
            if seq in decoding or seq.compressing or seq.num_compressions:
                self.fail(f"{seq.seq_id} prefills while decoding or compressed")
        tokens = sum(item.num_new_tokens for item in plan.prefill)
        if config.chunked_prefill:
            if plan.prefill and tokens + len(plan.decode) > config.max_num_batched_tokens:
                self.fail(f"{tokens} prompt + {len(plan.decode)} decode tokens exceed "
                          f"max_num_batched_tokens {config.max_num_batched_tokens}")
        else:
            if plan.prefill and plan.decode:
                self.fail("a step both prefills and decodes without chunked prefill")
            if len(plan.prefill) > 1 and tokens > config.max_num_batched_tokens:
                self.fail(f"{tokens} prompt tokens exceed max_num_batched_tokens")
            if any(not item.samples for item in plan.prefill):
                self.fail("a partial prompt chunk without chunked prefill")

    def _check_writes(self, plan: StepPlan) -> None:
        """No prefill or decode writes KV into a block another holder can see.

        One exception: prefix sharing within a step. A prompt block enters the prefix index when
        the step that computes it is planned, so a request admitted later in that step may map
        it. Such a block is written exactly once, by the request computing it, and every other
        holder took it from the index in this very step (the driver stores the step's KV before
        any attention reads it). And no request maps a block from the index that no request
        computed before or in this step.
        """
        manager = self.scheduler.block_manager
        b = self.scheduler.block_size
        writes = []
        for item in plan.prefill:
            table = item.seq.block_table
            for index in range(item.num_cached_tokens // b, -(-item.num_tokens // b)):
                writes.append((item.seq, table[index]))
        for seq in plan.decode:
            writes.append((seq, seq.block_table[seq.kv_len // b]))
        writers = Counter(block for _, block in writes)
        hits_now: dict[int, set] = {}  # block -> requests that map it from the index this step
        for item in plan.prefill:
            table = item.seq.block_table
            hashes = item.seq.prompt_block_hashes
            for index in range(self.computed.get(item.seq, 0) // b, item.num_cached_tokens // b):
                block = table[index]
                if (hashes[index], block) not in self.indexed_before and writers[block] == 0:
                    self.fail(f"{item.seq.seq_id} maps block {block} from the prefix cache "
                              "before any request computed it")
                hits_now.setdefault(block, set()).add(item.seq)
        indexed_now = {block for entry, block in manager.hash_to_block.items()
                       if (entry, block) not in self.indexed_before}
        for seq, block in writes:
            if writers[block] > 1:
                self.fail(f"block {block} is written by {writers[block]} requests in one step")
            if manager.refcount[block] == 1:
                continue
            holders = {other for other in self.scheduler.running
                       if block in other.block_table and other is not seq}
            if block not in indexed_now or not holders <= hits_now.get(block, set()):
                self.fail(f"{seq.seq_id} writes KV into block {block} with refcount "
                          f"{manager.refcount[block]} (shared blocks are never written, but "
                          "within the step that computes and indexes them)")

    def _holders(self) -> Counter:
        holders: Counter = Counter()
        for seq in self.scheduler.running:
            holders.update(seq.block_table)
        for job in self.scheduler.in_flight_jobs():
            in_table = set(job.seq.block_table)
            involved = set(job.source_table) | set(job.target_blocks) | {job.new_block}
            holders.update(involved - in_table)
        return holders

    def _check_blocks(self) -> None:
        manager = self.scheduler.block_manager
        holders = self._holders()
        for block in range(manager.num_blocks):
            if manager.refcount[block] != holders[block]:
                self.fail(f"block {block}: refcount {manager.refcount[block]} but "
                          f"{holders[block]} holders")
            if (manager.refcount[block] == 0) != (block in manager.free_blocks):
                self.fail(f"block {block}: refcount {manager.refcount[block]} disagrees with "
                          "the free list")
        if manager.num_free_blocks + manager.num_used_blocks != manager.num_blocks:
            self.fail("free + used != total")

    def _check_slots(self) -> None:
        scheduler = self.scheduler
        slots = [seq.query_slot for seq in scheduler.running if seq.query_slot is not None]
        if len(slots) != len(set(slots)) or len(slots) > scheduler.num_query_slots:
            self.fail(f"query slots double-booked or over M: {slots}")
        if len(slots) + len(scheduler.free_slots) != scheduler.num_query_slots:
            self.fail("query slots leaked")
        if scheduler.compress and scheduler.config.hybrid:
            for position, seq in enumerate(scheduler.running):
                if seq.query_slot is not None and position >= scheduler.num_query_slots:
                    self.fail(f"{seq.seq_id} holds a slot at running position {position} >= M")
        elif scheduler.compress:
            if any(seq.query_slot is None for seq in scheduler.running):
                self.fail("constrained scheduling ran a request without a query slot")
