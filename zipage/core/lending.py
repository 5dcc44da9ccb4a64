"""Hybrid scheduling's lending rule: the blocks a request admitted without a query slot may take
(docs/architecture.md, 'Scheduling', hybrid scheduling).

Hybrid admits requests beyond the M slot holders into blocks the holders have reserved but not yet
claimed: a bet that the borrower finishes before a holder grows into them. A bet lost costs a
preemption, and a borrower re-admitted on the same terms loses it again (issue #47: on amc23, 4,314
preemptions of 1,058 requests, up to 20 each, 1.8 M tokens recomputed, -3 % throughput). So a
request borrows once: admitted again after a preemption, it takes only blocks that no running
request will claim (`fits_unreserved`). First admissions still borrow, which is what hybrid earns
where borrowers are short (2x on a chat trace at 4 GB; docs/BENCHMARKS.md, 'Hybrid scheduling').

Blocks are counted once however many requests hold them, so a session's shared prompt is not
reserved once per turn (a rule that summed every request's peak made hybrid as slow as
constrained scheduling on agent sessions under the "output" scope).
"""

from __future__ import annotations

from collections.abc import Iterable

from zipage.core.admission import Admission
from zipage.core.block_manager import BlockManager
from zipage.core.sequence import Sequence


def reservation(seq: Sequence, admission: Admission) -> int:
    """The most blocks `seq` holds at once from here on: its slot's `slot_blocks`, or without a
    slot its peak before it needs one (`Admission.peak_blocks` at its own N_max)."""
    if seq.query_slot is not None:
        return seq.slot_blocks
    return admission.peak_blocks(seq.prompt_len, seq.max_output_tokens, seq.n_max)


def keeps_shared(seq: Sequence, blocks: int, block_size: int) -> int:
    """How many of the first `blocks` leading blocks of `seq`'s table stay in it for good even
    when shared: all of them if it never compresses (all its KV fits its N_max), else those of
    its pinned prompt (the "output" scope). A compression replaces any other shared block with a
    fresh one (`BlockManager.plan_compression`), so those count as blocks it will still take."""
    whole = -(-(seq.prompt_len + seq.max_output_tokens - 1) // block_size)
    return blocks if whole <= seq.n_max else min(seq.pinned, blocks)


def future_blocks(seq: Sequence, refcount: list[int], admission: Admission) -> int:
    """Blocks `seq` may still take from the free pool before it leaves: its reservation less the
    blocks it holds that stay its own."""
    table = seq.block_table
    kept = keeps_shared(seq, len(table), admission.block_size)
    for block in table[kept:]:
        if refcount[block] == 1:
            kept += 1
    grow = reservation(seq, admission) - kept
    return grow if grow > 0 else 0


def fits_unreserved(seq: Sequence, cached: list[int], running: Iterable[Sequence],
                    manager: BlockManager, admission: Admission) -> bool:
    """`seq` (waiting, `cached` its prefix blocks in the index) fits in the blocks that neither a
    running request holds nor one will take: the blocks in use plus every running request's
    `future_blocks` plus `seq`'s own need stay within the pool. O(blocks held): asked only for
    requests that were preempted, a few a run."""
    refcount = manager.refcount
    committed = manager.num_used_blocks
    for other in running:
        committed += future_blocks(other, refcount, admission)
    # Blocks another request holds that `seq` will map and keep are in use already.
    keep = keeps_shared(seq, len(cached), manager.block_size)
    need = reservation(seq, admission) - sum(1 for block in cached[:keep] if refcount[block] > 0)
    return committed + need <= manager.num_blocks
