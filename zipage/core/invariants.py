"""Checks of the core's invariants (docs/architecture.md, 'Invariants'), run by drivers under test.

`InvariantChecker` watches a scheduler step by step: `before_schedule()` right before
`Scheduler.schedule` (a snapshot of the queues the plan is judged against), `after_schedule(plan)`
before the driver executes the plan, `record_computed(seq, start, end)` for every KV range a
driver computes, and `after_finish()` once the step is applied; `at_end()` when the run is over.
A violation raises `InvariantViolation` with the step and the request. The checks read the
scheduler's state and keep their own copies; they never change the scheduler, so a run with
checks on makes exactly the decisions of a run without them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from zipage.core.budget_invariants import BudgetInvariants, pinned_blocks, slot_blocks
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.step import StepPlan


class InvariantViolation(AssertionError):
    pass


@dataclass
class QueueSnapshot:
    """The queues right before `Scheduler.schedule`: what a step's preemptions, admissions and
    slot hand-outs are judged against (copies, so the checks never touch the scheduler)."""

    running: list[Sequence]  # running order (admission order)
    waiting: list[Sequence]
    # Whether each running request holds a query slot once the step's hand-out is done: freed
    # slots go to the foremost running requests without one (docs/architecture.md, 'Scheduling').
    holds_slot: dict[Sequence, bool]
    # Running requests neither compressed nor being compressed before the step: the only ones
    # the prefix-cache rule may preempt.
    uncompressed: set[Sequence]
    # Whether some block was held by two requests before the step (forks share their leader's
    # prompt blocks even without the prefix cache): the uncompressed-victim rule then applies.
    shared: bool

    @classmethod
    def take(cls, scheduler: Scheduler) -> "QueueSnapshot":
        running = list(scheduler.running)
        holds_slot = {seq: seq.query_slot is not None for seq in running}
        free = len(scheduler.slots.free)
        # A slot also reserves its holder's N_max blocks; the hand-out stops at the foremost
        # request the pool cannot back (docs/architecture.md, 'Per-request and elastic budgets').
        pool = scheduler.block_manager.num_blocks
        config = scheduler.config
        reserved = sum(slot_blocks(seq, config) for seq in running if holds_slot[seq])
        for seq in running:
            if free and not holds_slot[seq]:
                if reserved + slot_blocks(seq, config) > pool:
                    break
                reserved += slot_blocks(seq, config)
                holds_slot[seq] = True
                free -= 1
        return cls(
            running=running, waiting=list(scheduler.waiting), holds_slot=holds_slot,
            uncompressed={seq for seq in running
                          if seq.num_compressions == 0 and not seq.compressing},
            shared=any(count > 1 for count in scheduler.block_manager.refcount))


def victim_rule(scheduler: Scheduler) -> tuple[str, Callable[[Sequence, QueueSnapshot], bool]]:
    """Who the scheduler may preempt when blocks run out (docs/architecture.md, 'Scheduling'):
    the rule's name, and whether a running request of the snapshot may be the victim."""
    config = scheduler.config
    if not config.compress:
        return "Full KV: the last running request", lambda seq, before: True
    # A request whose recomputation would exceed the pool is never a victim (it could never be
    # admitted again); the rule reads the request's length, not the scheduler's own check.
    pool_tokens = scheduler.block_manager.num_blocks * scheduler.block_size

    def recomputable(seq: Sequence) -> bool:
        return seq.num_tokens <= pool_tokens

    uncompressed = ("the last running request neither compressed nor being compressed whose "
                    "recomputation fits the pool")
    if config.prefix_cache:
        return (f"prefix cache: {uncompressed}",
                lambda seq, before: seq in before.uncompressed and recomputable(seq))

    def shared_or(otherwise: Callable[[Sequence, QueueSnapshot], bool]):
        # Forks share blocks without the prefix cache; while any block was shared at the step's
        # start, the uncompressed rule holds instead of the mode's own.
        return lambda seq, before: (seq in before.uncompressed if before.shared
                                    else otherwise(seq, before)) and recomputable(seq)

    if config.hybrid:
        return (f"hybrid: the last running request without a query slot whose recomputation "
                f"fits the pool (blocks shared at the step's start: {uncompressed})",
                shared_or(lambda seq, before: not before.holds_slot[seq]))
    return (f"constrained: nobody is preempted (blocks shared at the step's start: "
            f"{uncompressed})", shared_or(lambda seq, before: False))


class InvariantChecker:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.step_id = -1
        # Window queries written into each request's slot since its last compression:
        # window index -> KV entry whose query it holds.
        self.window_queries: dict[Sequence, dict[int, int]] = {}
        # Accepted requests by id, in the order they arrived, and their places in that order.
        self.accepted: dict[str, Sequence] = {}
        self.accepted_rank: dict[str, int] = {}
        self.before: QueueSnapshot | None = None  # taken by before_schedule, used once
        # Block -> hash of the full prompt block it holds (None: anything else), from the writes
        # the driver computed and the compressions planned; the prefix index must agree.
        self.block_content: dict[int, int | None] = {}
        # KV entries each request computed itself since it was last admitted.
        self.computed: dict[Sequence, int] = {}
        # (hash, block) entries of the prefix index when the current step was planned: their KV
        # is computed. (A block id may come back with other content, hence the pairs.)
        self.indexed_before: set[tuple[int, int]] = set()
        # Host slot -> hash of the prompt block the host tier's copies put there.
        self.host_content: dict[int, int] = {}
        # Per-request and elastic budgets (`before_schedule` runs right before each schedule).
        self.budgets = BudgetInvariants(scheduler, self.fail)

    def fail(self, message: str) -> None:
        raise InvariantViolation(f"step {self.step_id}: {message}")

    # ---- hooks ----

    def before_schedule(self) -> None:
        self.before = QueueSnapshot.take(self.scheduler)
        self.budgets.before_schedule()

    def after_schedule(self, plan: StepPlan) -> None:
        self.step_id = plan.step_id
        if self.before is None:
            raise RuntimeError("InvariantChecker.before_schedule() must run before each schedule()")
        before, self.before = self.before, None
        for seq in plan.preempted:
            if seq.num_compressions or seq.compressing:
                self.fail(f"{seq.seq_id} was preempted although compressed or compressing")
            self.window_queries.pop(seq, None)
            self.computed.pop(seq, None)
        self._check_victims(plan, before)
        self._check_waiting(plan, before)
        self._check_slot_handout(plan, before)
        self._check_host_copies(plan)
        for job in plan.compressions:
            self._check_compression(job)
            for block in job.target_blocks + [job.new_block]:
                self.block_content[block] = None  # about to be overwritten
        self._check_chunks(plan)
        self._check_forks(plan)
        self._check_decode_context(plan)
        self._check_writes(plan)
        self._check_blocks()
        self._check_shared_kv(plan)
        self._check_slots()
        self.budgets.after_schedule(plan)

    def record_plan_writes(self, plan: StepPlan) -> None:
        """Record the KV ranges (and so the window queries) a driver computes for `plan`."""
        b = self.scheduler.block_size
        for item in plan.prefill:
            self.record_computed(item.seq, item.num_cached_tokens, item.num_tokens)
            hashes = item.seq.prompt_block_hashes
            for index in range(item.num_cached_tokens // b, -(-item.num_tokens // b)):
                # A block holds prompt block `index` once a prefill has written it to its end.
                whole = index < len(hashes) and (index + 1) * b <= item.num_tokens
                self.block_content[item.seq.block_table[index]] = hashes[index] if whole else None
            self.computed[item.seq] = item.num_tokens
        for seq in plan.decode:
            self.record_computed(seq, seq.kv_len, seq.kv_len + 1)
            self.block_content[seq.block_table[seq.kv_len // b]] = None
        for fork in plan.forks:  # its KV is the leader's prompt: shared blocks and a copy
            if fork.copy is not None:
                self.block_content[fork.copy[1]] = None
            self.computed[fork.seq] = fork.seq.prompt_len

    def record_computed(self, seq: Sequence, start: int, end: int) -> None:
        """A driver computed KV entries [start, end) of `seq` (and wrote their window queries)."""
        first, last = self.scheduler.slots.window_query_range(seq, start, end)
        layout = self.scheduler.slots.windows
        written = self.window_queries.setdefault(seq, {})
        for entry in range(first, last):
            written[layout.index(entry)] = entry

    def after_advance(self) -> None:
        """Async scheduling: the advanced step runs before the next plan's on the device, so the
        prefix blocks it computes count as computed for that plan."""
        self.indexed_before = set(self.scheduler.block_manager.hash_to_block.items())

    def after_finish(self) -> None:
        self._check_blocks()
        self._check_slots()
        self._check_prefix_index()
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
            n_max = self.n_max(seq)
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
        if len(scheduler.slots.free) != scheduler.slots.num_query_slots:
            self.fail("leak: query slots still held")
        for seq in scheduler.finished:
            if seq.seq_id not in stopped_early and seq.num_output_tokens != seq.max_output_tokens:
                self.fail(f"{seq.seq_id} finished with {seq.num_output_tokens} tokens, "
                          f"expected {seq.max_output_tokens}")
        if scheduler.by_priority:
            self._check_starvation_bound()
            return
        arrival_rank = self.accepted_rank
        ranks = [arrival_rank[seq_id] for seq_id in scheduler.admission_order]
        if ranks != sorted(ranks):
            self.fail(f"first admissions out of arrival order: {scheduler.admission_order}")

    def note_added(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.REJECTED:
            self.accepted_rank[seq.seq_id] = len(self.accepted)
            self.accepted[seq.seq_id] = seq

    def queue_order(self, seq: Sequence) -> tuple[float, int]:
        """A request's place under the priority policy, from its own fields: priority x aging
        + arrival, then arrival order (docs/architecture.md, 'Waiting-queue policies')."""
        aging = self.scheduler.config.priority_aging_s
        return seq.priority * aging + seq.arrival_s, self.accepted_rank[seq.seq_id]

    # ---- the checks ----

    def n_max(self, seq: Sequence) -> int:
        """The request's N_max from its budget, its scope and the config, not from the
        scheduler's copy."""
        return seq.kv_budget // self.scheduler.config.block_size + 1 + self.pinned(seq)

    def pinned(self, seq: Sequence) -> int:
        return pinned_blocks(seq, self.scheduler.config)

    def _check_compression(self, job) -> None:
        scheduler = self.scheduler
        manager = scheduler.block_manager
        seq = job.seq
        if seq.query_slot is None or job.query_slot != seq.query_slot:
            self.fail(f"{seq.seq_id} is compressed without its query slot")
        # Rule 3 with the request's own N_max (elastic compressions: BudgetInvariants), past
        # the blocks its scope keeps in place: its prompt's, left where they are, untouched.
        pinned = self.pinned(seq)
        expected = self.n_max(seq) - 1 - pinned
        if len(job.target_blocks) != expected and not scheduler.elastic:
            self.fail(f"{seq.seq_id} is compressed into {len(job.target_blocks)} target blocks, "
                      f"expected N_max - 1 - pinned = {expected} (rule 3)")
        if len(job.kept_blocks) != pinned or seq.block_table[:pinned] != job.kept_blocks:
            self.fail(f"{seq.seq_id}: a compression keeps {job.kept_blocks} in place, expected "
                      f"its first {pinned} blocks {seq.block_table[:pinned]} (its scope)")
        if set(job.kept_blocks) & (set(job.source_table) | set(job.target_blocks)
                                   | {job.new_block}):
            self.fail(f"{seq.seq_id}: a compression reads or writes a block its scope keeps")
        for block in job.target_blocks + [job.new_block]:
            holders = self._holders()[block]
            if manager.refcount[block] != 1 or holders != 1:
                self.fail(f"compression target {block} of {seq.seq_id} is shared "
                          f"(refcount {manager.refcount[block]})")
        # Rule 7: all w window queries of the final (full) block were written since it filled.
        b, w = scheduler.block_size, scheduler.config.window
        final_start = (len(job.kept_blocks) + len(job.source_table) - 1) * b
        written = self.window_queries.get(seq, {})
        for index in range(w):
            expected = final_start + b - w + index
            if written.get(index) != expected:
                self.fail(f"{seq.seq_id}: window query {index} of its final block is missing "
                          f"(holds entry {written.get(index)}, expected {expected})")
        self.window_queries.pop(seq, None)

    def _check_victims(self, plan: StepPlan, before: QueueSnapshot) -> None:
        """Each victim is the last running request the mode's rule allows (under the priority
        policy: the last in queue order, the last admitted of equals), re-chosen after every
        preemption of the step. Within a decode step the allowed set does not change before a
        victim is chosen (a request compressed earlier in the step sits before the requester,
        which is itself allowed), so the victims are exactly the last allowed requests of the
        snapshot, last first."""
        if not plan.preempted:
            return
        rule, allowed = victim_rule(self.scheduler)
        candidates = [seq for seq in before.running if allowed(seq, before)]
        if self.scheduler.by_priority:
            self._check_priority_victims(plan, candidates)
            return
        expected = candidates[::-1][:len(plan.preempted)]
        if plan.preempted != expected:
            self.fail(f"preempted {_ids(plan.preempted)}, but the victim rule ({rule}, re-chosen "
                      f"after each preemption) picks {_ids(expected)}")

    def _check_priority_victims(self, plan: StepPlan, candidates: list[Sequence]) -> None:
        """Priority policy: each victim is the last allowed request in priority order but for
        the one that needs the blocks (which the checker cannot name): at most one allowed
        request still running comes after it. A request this step compresses may have left the
        allowed set before a victim was chosen (in running order that cannot matter, in
        priority order it can), so it does not count."""
        def order(seq: Sequence) -> tuple:
            return self.queue_order(seq)[0], seq.running_rank

        compressed = {job.seq for job in plan.compressions}
        remaining = set(candidates) - compressed
        for victim in plan.preempted:
            if victim not in remaining:
                self.fail(f"preempted {victim.seq_id}, which the victim rule does not allow")
            later = [seq.seq_id for seq in remaining if order(seq) > order(victim)]
            if len(later) > 1:
                self.fail(f"preempted {victim.seq_id}, but {later} come after it in priority "
                          "order (the victim is the last, the requester aside)")
            remaining.discard(victim)

    def _check_waiting(self, plan: StepPlan, before: QueueSnapshot) -> None:
        """FCFS admission from the head of `waiting`; preempted requests go to its front. Under
        the priority policy: admission from the head of the queue in priority order, preempted
        requests back in their places."""
        preempted = set(plan.preempted)
        was_running = set(before.running)
        admitted = sorted([item.seq for item in plan.prefill
                           if item.seq not in was_running or item.seq in preempted]
                          + [fork.seq for fork in plan.forks], key=lambda seq: seq.running_rank)
        if self.scheduler.by_priority:
            self._check_priority_waiting(plan, before, admitted)
            return
        # Each victim is put at the front as it is preempted: the last one heads the queue.
        queue = plan.preempted[::-1] + before.waiting
        if admitted and admitted not in (before.waiting[:len(admitted)], queue[:len(admitted)]):
            self.fail(f"admitted {_ids(admitted)}, not the head of waiting {_ids(queue)}")
        if admitted and plan.preempted:
            # The victim heads waiting and could come straight back (chunked prefill's rule;
            # without chunking a step that admits never decodes, so it never preempts).
            self.fail(f"admitted {_ids(admitted)} in a step that preempted "
                      f"{_ids(plan.preempted)}")
        taken = set(admitted)
        expected = [seq for seq in queue if seq not in taken]
        if list(self.scheduler.waiting) != expected:
            self.fail(f"waiting is {_ids(self.scheduler.waiting)}, expected {_ids(expected)}: "
                      "preempted requests go to the front of waiting, the last preempted first")

    def _check_priority_waiting(self, plan: StepPlan, before: QueueSnapshot,
                                admitted: list[Sequence]) -> None:
        queue = sorted(before.waiting + plan.preempted, key=self.queue_order)
        if admitted != queue[:len(admitted)]:
            self.fail(f"admitted {_ids(admitted)}, not the head of waiting in priority order "
                      f"{_ids(queue)}")
        if admitted and plan.preempted:
            self.fail(f"admitted {_ids(admitted)} in a step that preempted "
                      f"{_ids(plan.preempted)}")
        expected = queue[len(admitted):]
        if list(self.scheduler.waiting) != expected:
            self.fail(f"waiting is {_ids(self.scheduler.waiting)}, expected {_ids(expected)}: "
                      "the priority order (priority x aging + arrival, then arrival order)")

    def _check_starvation_bound(self) -> None:
        """Priority policy: no request is first admitted before one that arrived no later and
        comes before it in priority order. With the order's aging this is the starvation bound:
        a request is never passed by one arriving more than (its priority - the other's) x
        aging seconds after it. O(n log n): requests by arrival, a prefix maximum (a Fenwick
        tree) over their places in priority order of the admission positions seen so far."""
        position = {seq_id: index for index, seq_id in enumerate(self.scheduler.admission_order)}
        admitted = [self.accepted[seq_id] for seq_id in position]
        by_order = sorted(admitted, key=self.queue_order)
        place = {seq.seq_id: index + 1 for index, seq in enumerate(by_order)}
        tree = [-1] * (len(admitted) + 1)
        by_arrival = sorted(admitted, key=lambda seq: (seq.arrival_s, self.accepted_rank[seq.seq_id]))
        start = 0
        while start < len(by_arrival):
            end = start
            while end < len(by_arrival) and by_arrival[end].arrival_s == by_arrival[start].arrival_s:
                end += 1
            group = sorted(by_arrival[start:end], key=self.queue_order)
            group_latest = -1  # of the group's requests before this one in priority order
            for seq in group:  # against those that arrived earlier, then its own arrival group
                index, latest = place[seq.seq_id] - 1, group_latest
                while index > 0:
                    latest = max(latest, tree[index])
                    index -= index & -index
                group_latest = max(group_latest, position[seq.seq_id])
                if position[seq.seq_id] < latest:
                    self.fail(f"{seq.seq_id} (priority {seq.priority}, arrived "
                              f"{seq.arrival_s:g}) was first admitted before a request that "
                              "arrived no later and comes before it in priority order")
            for seq in group:
                index = place[seq.seq_id]
                while index < len(tree):
                    tree[index] = max(tree[index], position[seq.seq_id])
                    index += index & -index
            start = end

    def _check_slot_handout(self, plan: StepPlan, before: QueueSnapshot) -> None:
        """Slots move only at the step start, to the foremost running requests without one."""
        preempted = set(plan.preempted)
        for seq in before.running:
            if seq in preempted:
                continue
            if (seq.query_slot is not None) != before.holds_slot[seq]:
                self.fail(f"{seq.seq_id} {'holds' if seq.query_slot is not None else 'lacks'} a "
                          "query slot, but freed slots go to the foremost running requests "
                          "without one")

    def _check_prefix_index(self) -> None:
        """Every block in the prefix index holds the prompt block its hash names: computed by a
        prefill and not overwritten since (a compression target leaves the index at once)."""
        content = self.block_content
        manager = self.scheduler.block_manager
        for block_hash, block in manager.hash_to_block.items():
            if content.get(block) != block_hash:
                self.fail(f"block {block} is in the prefix index but does not hold the prompt "
                          "block of its hash (overwritten, or never computed)")
            if manager.block_hash[block] != block_hash:
                self.fail(f"block {block} is in the prefix index under a hash it does not have")
        hashed = sum(1 for block_hash in manager.block_hash if block_hash is not None)
        if hashed != len(manager.hash_to_block):
            self.fail(f"{hashed} blocks have a hash but the prefix index maps "
                      f"{len(manager.hash_to_block)}: a block's hash left without its entry")

    def _check_host_copies(self, plan: StepPlan) -> None:
        """The host tier (docs/architecture.md, 'Host tier'): a save copies a block that holds
        a computed prompt block (before this step overwrites it), into a slot no other save of
        the step writes; a load fills a block an admission of this step maps below its cached
        tokens, from a slot holding that very prompt block; and every hash of the host's index
        names what its slot holds once the step's saves are done."""
        manager = self.scheduler.block_manager
        host = manager.host
        if host is None:
            if plan.kv_saves or plan.kv_loads:
                self.fail("a plan copies to or from a host tier the deployment does not have")
            return
        content = self.block_content
        saved = set()
        for block, slot in plan.kv_saves:
            if content.get(block) is None:
                self.fail(f"block {block} is saved to host slot {slot} but holds no computed "
                          "prompt block")
            if slot in saved:
                self.fail(f"host slot {slot} is written by two saves in one step")
            saved.add(slot)
            self.host_content[slot] = content[block]
        b = self.scheduler.block_size
        mapped = {}  # block -> the prompt block an admission of this step maps it as
        for item in plan.prefill:
            table, hashes = item.seq.block_table, item.seq.prompt_block_hashes
            for index in range(self.computed.get(item.seq, 0) // b, item.num_cached_tokens // b):
                mapped[table[index]] = hashes[index]
        for slot, block in plan.kv_loads:
            if block not in mapped:
                self.fail(f"host slot {slot} is loaded into block {block}, which no admission of "
                          "this step maps from the prefix cache")
            if self.host_content.get(slot) != mapped[block]:
                self.fail(f"block {block} is loaded from host slot {slot}, which does not hold "
                          "the prompt block the request maps there")
            content[block] = mapped[block]
        for block_hash, slot in host.slot_of.items():
            if self.host_content.get(slot) != block_hash:
                self.fail(f"host slot {slot} is in the host tier's index under a prompt block it "
                          "does not hold")

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
            if seq.prompt_logits and item.num_cached_tokens != self.computed.get(seq, 0):
                self.fail(f"{seq.seq_id} needs its prompt's logits but took "
                          f"{item.num_cached_tokens - self.computed.get(seq, 0)} tokens from "
                          "the prefix cache")
            if item.prompt_logits != (seq.prompt_logits and seq.num_output_tokens == 0):
                self.fail(f"{seq.seq_id}: prompt_logits={item.prompt_logits} on a range of a "
                          f"request with prompt_logits={seq.prompt_logits} and "
                          f"{seq.num_output_tokens} outputs")
        tokens = sum(item.num_new_tokens for item in plan.prefill)
        if config.chunked_prefill:
            if plan.prefill and tokens + len(plan.decode) > config.step_tokens:
                self.fail(f"{tokens} prompt + {len(plan.decode)} decode tokens exceed "
                          f"max_num_batched_tokens {config.step_tokens}")
        else:
            if plan.prefill and plan.decode:
                self.fail("a step both prefills and decodes without chunked prefill")
            if len(plan.prefill) > 1 and tokens > config.step_tokens:
                self.fail(f"{tokens} prompt tokens exceed max_num_batched_tokens")
            if any(not item.samples for item in plan.prefill):
                self.fail("a partial prompt chunk without chunked prefill")

    def _check_forks(self, plan: StepPlan) -> None:
        """A fork (docs/architecture.md, 'Samples of one prompt') maps exactly its leader's full
        prompt blocks plus a fresh copy of its last partial one, in the step that computes the
        leader's last prompt token for the first time; both prompts are equal; and the prompt
        wrote no window queries (they would be in the leader's query slot alone: rule 7)."""
        if not plan.forks:
            return
        scheduler = self.scheduler
        manager = scheduler.block_manager
        b = scheduler.block_size
        sampling = {item.seq: item for item in plan.prefill if item.samples}
        for fork in plan.forks:
            seq, leader = fork.seq, fork.leader
            prompt_len = leader.prompt_len
            item = sampling.get(leader)
            if item is None or item.num_tokens != prompt_len or leader.num_output_tokens:
                self.fail(f"{seq.seq_id} is forked from {leader.seq_id}, which does not compute "
                          "its last prompt token for its first sample in this step")
            if (seq.prompt_len != prompt_len or seq.num_output_tokens
                    or seq.prompt_block_hashes != leader.prompt_block_hashes
                    or (seq.prompt_token_ids is not None and leader.prompt_token_ids is not None
                        and list(seq.prompt_token_ids) != list(leader.prompt_token_ids))):
                self.fail(f"{seq.seq_id} is forked from {leader.seq_id} with another prompt")
            full = prompt_len // b
            expected = leader.block_table[:full]
            if prompt_len % b:
                if fork.copy is None or fork.copy[0] != leader.block_table[full]:
                    self.fail(f"{seq.seq_id}: the fork does not copy {leader.seq_id}'s last, "
                              "partial prompt block")
                expected = expected + [fork.copy[1]]
                if manager.refcount[fork.copy[1]] != 1:
                    self.fail(f"{seq.seq_id}: the fork's copy block {fork.copy[1]} is shared")
            elif fork.copy is not None:
                self.fail(f"{seq.seq_id}: a fork of a prompt of whole blocks copies a block")
            if seq.block_table != expected:
                self.fail(f"{seq.seq_id}: forked with blocks {seq.block_table}, expected "
                          f"{expected} (the leader's prompt blocks)")
            if scheduler.compress and any(scheduler.slots.needs_slot(t, leader.n_max)
                                          for t in range(prompt_len)):
                self.fail(f"{seq.seq_id} is forked from a prompt that wrote window queries")

    def _check_decode_context(self, plan: StepPlan) -> None:
        # The scheduler keeps both counts incrementally (O(events) a step); here from scratch.
        contexts = [seq.kv_len + 1 for seq in plan.decode]
        if plan.decode_context_tokens != sum(contexts) \
                or plan.decode_max_context != max(contexts, default=0):
            self.fail(f"decode context: planned sum {plan.decode_context_tokens} / max "
                      f"{plan.decode_max_context}, requests give {sum(contexts)} / "
                      f"{max(contexts, default=0)}")

    def _check_writes(self, plan: StepPlan) -> None:
        """No prefill or decode writes KV into a block another holder can see.

        One exception: prefix sharing within a step. A prompt block enters the prefix index when
        the step that computes it is planned, so a request admitted later in that step may map
        it. Such a block is written exactly once, by the request computing it, and every other
        holder took it from the index in this very step (the driver stores the step's KV before
        any attention reads it), or is a sample forked in this step from one that did (it reads
        the prompt's KV from the next step on). And no request maps a block from the index that
        no request computed before or in this step.

        A block is indexed in this step when its (hash, block) pair is new, or when the prefill
        writing it indexes it under the hash of the position it computes: a freed block keeps its
        hash until it is handed out again, so a prefill that recomputes the same prompt block
        into that very block (its lookup stopped at an earlier block that was gone) drops the
        pair and indexes it again within the step, with the same content.
        """
        manager = self.scheduler.block_manager
        b = self.scheduler.block_size
        writes = []
        indexed_by_writer = set()
        for item in plan.prefill:
            table, hashes = item.seq.block_table, item.seq.prompt_block_hashes
            for index in range(item.num_cached_tokens // b, -(-item.num_tokens // b)):
                writes.append((item.seq, table[index]))
                if index < len(hashes) and manager.hash_to_block.get(hashes[index]) == table[index]:
                    indexed_by_writer.add(table[index])
        for seq in plan.decode:
            if seq.kv_len >= len(seq.block_table) * b:
                self.fail(f"{seq.seq_id} decodes KV entry {seq.kv_len} beyond its "
                          f"{len(seq.block_table)} blocks")
            writes.append((seq, seq.block_table[seq.kv_len // b]))
        for fork in plan.forks:
            if fork.copy is not None:
                writes.append((fork.seq, fork.copy[1]))
        loaded = {block for _, block in plan.kv_loads}  # (checked: `_check_host_copies`)
        forks_of: dict = {}
        for fork in plan.forks:
            forks_of.setdefault(fork.leader, set()).add(fork.seq)
        writers = Counter(block for _, block in writes)
        hits_now: dict[int, set] = {}  # block -> requests that map it from the index this step
        for item in plan.prefill:
            table = item.seq.block_table
            hashes = item.seq.prompt_block_hashes
            for index in range(self.computed.get(item.seq, 0) // b, item.num_cached_tokens // b):
                block = table[index]
                if ((hashes[index], block) not in self.indexed_before and writers[block] == 0
                        and block not in loaded):
                    self.fail(f"{item.seq.seq_id} maps block {block} from the prefix cache "
                              "before any request computed it")
                hits_now.setdefault(block, set()).add(item.seq)
        for fork in plan.forks:  # a sample holds what its leader took from the index now
            for readers in hits_now.values():
                if fork.leader in readers:
                    readers.add(fork.seq)
        indexed_now = indexed_by_writer | {block for entry, block in manager.hash_to_block.items()
                                           if (entry, block) not in self.indexed_before}
        for seq, block in writes:
            if writers[block] > 1:
                self.fail(f"block {block} is written by {writers[block]} requests in one step")
            if manager.refcount[block] == 1:
                continue
            holders = {other for other in self.scheduler.running
                       if block in other.block_table and other is not seq}
            holders -= forks_of.get(seq, set())  # its forks read the KV it computes now
            if not holders:
                continue
            if block not in indexed_now or not holders <= hits_now.get(block, set()):
                self.fail(f"{seq.seq_id} writes KV into block {block} with refcount "
                          f"{manager.refcount[block]} (shared blocks are never written, but "
                          "within the step that computes and indexes them)")

    def _holders(self) -> Counter:
        holders: Counter = Counter()
        for seq in self.scheduler.running:
            holders.update(seq.block_table)
        for job in self.scheduler.compressions.in_flight_jobs():
            in_table = set(job.seq.block_table)
            involved = set(job.source_table) | set(job.target_blocks) | {job.new_block}
            holders.update(involved - in_table)
        return holders

    def _check_blocks(self) -> None:
        manager = self.scheduler.block_manager
        holders = self._holders()
        free_list = manager.free_blocks()
        free = set(free_list)
        if len(free) != len(free_list) or len(free_list) != manager.num_free_blocks:
            self.fail(f"the free list holds {len(free_list)} entries of {len(free)} blocks, "
                      f"but {manager.num_free_blocks} blocks are counted free")
        for block in range(manager.num_blocks):
            if manager.refcount[block] != holders[block]:
                self.fail(f"block {block}: refcount {manager.refcount[block]} but "
                          f"{holders[block]} holders")
            if (manager.refcount[block] == 0) != (block in free):
                self.fail(f"block {block}: refcount {manager.refcount[block]} disagrees with "
                          "the free list")
        if manager.num_free_blocks + manager.num_used_blocks != manager.num_blocks:
            self.fail("free + used != total")

    def _check_shared_kv(self, plan: StepPlan) -> None:
        """The plan's shared entries are every holder beyond a block's first, times the block
        size: a cost feature, so both twins must count it alike from the holders."""
        manager = self.scheduler.block_manager
        extra = sum(count - 1 for count in manager.refcount if count > 1)
        if manager.extra_holders != extra or plan.shared_kv_tokens != extra * manager.block_size:
            self.fail(f"shared KV: {manager.extra_holders} extra holders counted, "
                      f"{plan.shared_kv_tokens} entries planned; the refcounts give {extra} "
                      f"extra holders")

    def _check_slots(self) -> None:
        scheduler = self.scheduler
        slots = [seq.query_slot for seq in scheduler.running if seq.query_slot is not None]
        if len(slots) != len(set(slots)) or len(slots) > scheduler.slots.num_query_slots:
            self.fail(f"query slots double-booked or over M: {slots}")
        if len(slots) + len(scheduler.slots.free) != scheduler.slots.num_query_slots:
            self.fail("query slots leaked")
        if scheduler.compress and scheduler.config.hybrid:
            for position, seq in enumerate(scheduler.running):
                if seq.query_slot is not None and position >= scheduler.slots.num_query_slots:
                    self.fail(f"{seq.seq_id} holds a slot at running position {position} >= M")
        elif scheduler.compress:
            if any(seq.query_slot is None for seq in scheduler.running):
                self.fail("constrained scheduling ran a request without a query slot")


def _ids(seqs, limit: int = 8) -> str:
    ids = [str(seq.seq_id) for seq in seqs]
    return "[" + ",".join(ids[:limit]) + (",..." if len(ids) > limit else "") + "]"
