"""Invariants of per-request and elastic budgets (docs/architecture.md, 'Per-request and elastic
budgets' and 'Invariants'), checked step by step for `InvariantChecker`.

`before_schedule()` takes what the checks need from the queues right before `Scheduler.schedule`;
`after_schedule(plan)` judges the plan against it; `after_finish()` checks the state a step left.
Like every check, they read the scheduler and never change it.
"""

from __future__ import annotations

from zipage.config import ZipageConfig
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.step import StepPlan


def slot_blocks(seq: Sequence, config: ZipageConfig) -> int:
    """Blocks a query slot reserves for its holder: its N_max (from its budget and its scope),
    or all it can ever hold if fewer."""
    block_size = config.block_size
    whole = -(-(seq.prompt_len + seq.max_output_tokens - 1) // block_size)
    return min(seq.kv_budget // block_size + 1 + pinned_blocks(seq, config), whole)


def pinned_blocks(seq: Sequence, config: ZipageConfig) -> int:
    """The leading blocks no compression of `seq` may touch: its prompt's, under the "output"
    scope (docs/architecture.md, 'Compression scope'); worked out here, not read from the
    scheduler's copy."""
    scope = config.compress_scope if seq.compress_scope is None else seq.compress_scope
    if scope != "output" or not config.compress:
        return 0
    return -(-seq.prompt_len // config.block_size)


class BudgetInvariants:
    def __init__(self, scheduler: Scheduler, fail) -> None:
        self.scheduler = scheduler
        self.fail = fail
        self.demand_before = False
        self.blocks_before: dict[Sequence, int] = {}
        self.reclaimable_before: set[Sequence] = set()

    def before_schedule(self) -> None:
        scheduler = self.scheduler
        if not scheduler.elastic:
            return
        running = list(scheduler.running)
        # Within a step that preempts nobody, the head's shortage can only persist.
        self.demand_before = scheduler.prefill.head_short_of_blocks()
        self.blocks_before = {seq: len(seq.block_table) for seq in running}
        # Borrowers that can give their extra blocks back at their next full block without a
        # free one (elastic waits for them before preempting anybody).
        self.reclaimable_before = {
            seq for seq in running
            if len(seq.block_table) > seq.n_max and seq.query_slot is not None
            and not seq.compressing and seq not in scheduler.prefilling
            and scheduler.compressions.fresh_for_compression(seq, seq.n_max) == 0}

    def after_schedule(self, plan: StepPlan) -> None:
        scheduler = self.scheduler
        for job in plan.compressions:  # (fixed: rule 3 in InvariantChecker._check_compression)
            seq, kept = job.seq, len(job.target_blocks)
            floor = seq.n_max - 1 - len(job.kept_blocks)  # (the blocks its scope keeps aside)
            if scheduler.elastic and not floor <= kept <= len(job.source_table) - 1:
                self.fail(f"{seq.seq_id}: an elastic compression of {len(job.source_table)} "
                          f"blocks keeps {kept}, outside [N_max - 1 - pinned = {floor}, "
                          "source - 1] (never below the budget, never more than it held)")
        if not scheduler.elastic:
            return
        admitted = {item.seq for item in plan.prefill}
        for seq, before in self.blocks_before.items():
            held = len(seq.block_table)
            if (seq.status is SequenceStatus.RUNNING and seq not in admitted
                    and held > before and held > seq.n_max and self.demand_before
                    and not plan.preempted):
                self.fail(f"{seq.seq_id} grew to {held} blocks, beyond its N_max {seq.n_max}, "
                          "while a request waited for memory")
        if plan.preempted:
            compressed = {job.seq for job in plan.compressions}
            for seq in self.reclaimable_before:
                if seq.status is SequenceStatus.RUNNING and seq not in compressed:
                    self.fail(f"preempted {[str(victim.seq_id) for victim in plan.preempted]} "
                              f"while {seq.seq_id} held {len(seq.block_table)} blocks above "
                              f"its N_max {seq.n_max} that it could give back")

    def after_finish(self) -> None:
        scheduler = self.scheduler
        b = scheduler.block_size
        backed = 0
        for seq in scheduler.running:
            if len(seq.block_table) > -(-seq.num_tokens // b):
                self.fail(f"{seq.seq_id} holds {len(seq.block_table)} blocks for "
                          f"{seq.num_tokens} tokens (a block beyond its KV and next token)")
            if seq.query_slot is not None:
                backed += slot_blocks(seq, scheduler.config)
        # Deadlock freedom with any mix of budgets: the pool backs every slot holder up to its
        # own N_max (or all it can ever hold), i.e. N_total >= the sum of the holders' N_max.
        if backed > scheduler.block_manager.num_blocks:
            self.fail(f"slot holders need {backed} blocks up to their N_max but only "
                      f"{scheduler.block_manager.num_blocks} exist")
