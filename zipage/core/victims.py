"""Victims: whom the scheduler preempts when a request needs blocks and none is free.

The mode decides who may be preempted (docs/architecture.md, 'Scheduling', the table of who is
preempted when blocks run out): under Full KV any running request (vLLM's rule); constrained
scheduling nobody; hybrid scheduling the requests without a query slot; where blocks may be shared
(the prefix cache, or forks holding their leader's prompt blocks) the uncompressed ones. Of those,
the last admitted, or under the priority policy the one the waiting queue would serve last. A
request whose recomputation would not fit the pool is never one. The scheduler asks and does the
preempting; this module only chooses.
"""

from __future__ import annotations

from zipage.config import ZipageConfig
from zipage.core.block_manager import BlockManager
from zipage.core.sequence import Sequence
from zipage.core.waiting import priority_key


class Victims:
    def __init__(self, config: ZipageConfig, block_manager: BlockManager,
                 running: dict[Sequence, None]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = config.block_size
        self.compress = config.compress
        self.by_priority = config.scheduling_policy == "priority"
        self.running = running  # the scheduler's, in admission order
        # Whether some block was held twice when the step began (`begin_step`): without the
        # prefix cache only forks share blocks, and while they do, hybrid's rule is not enough.
        self.shared = False

    def begin_step(self) -> None:
        """Read, once a step before anything is planned, whether blocks are shared: the rule
        holds for a whole step, so the invariant checker can re-derive it from its snapshot."""
        self.shared = self.block_manager.extra_holders > 0

    def pick(self, requester: Sequence) -> Sequence | None:
        """The request to preempt when blocks run out (docs/architecture.md, 'Scheduling'), or
        None: of the requests the mode allows, the last admitted. Under the priority policy the
        one the waiting queue would serve last (the latest admitted of equals), the requester
        only when no other is allowed: a slot holder of a low class preempting itself could
        leave a step with nothing to run while the requests it blocked wait for its slot
        (docs/architecture.md, 'Waiting-queue policies')."""
        candidates = self.candidates()
        if self.by_priority:
            aging = self.config.priority_aging_s
            allowed = list(candidates)
            others = [seq for seq in allowed if seq is not requester]
            if not others:
                return allowed[0] if allowed else None  # the requester, or nobody
            return max(others, key=lambda seq: (priority_key(seq, aging), seq.running_rank))
        return next(candidates, None)

    def candidates(self):
        """The running requests the mode may preempt, last admitted first."""
        if not self.compress:
            return reversed(self.running)
        if self.config.prefix_cache or self.shared:
            # Compressing a shared block needs a fresh target block, so only preempting
            # uncompressed requests (slot or not) keeps sharing deadlock-free: two slot holders
            # sharing a fork's prompt could otherwise each wait for a target the other holds
            # (docs/architecture.md, 'Deadlock freedom').
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
