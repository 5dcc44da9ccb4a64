"""Named minimal witness traces, one per preemption rule (docs/architecture.md, 'Scheduling').

Each trace is the smallest one we know on which the rule decides the outcome: break the rule and
the trace fails, through the invariant checker (every step is checked) and through the test's own
assertions on the decisions. `python tests/mutation_check.py` runs them against deliberate
breaks of the rules. Blocks are 16 tokens; P is a shared prompt prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from zipage.config import ZipageConfig
from zipage.core.block_manager import BlockManager
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.step import StepPlan
from zipage.sim.instant import InstantDriver

B = 16
P = list(range(1_000, 1_000 + 8 * B))  # a shared prompt prefix


def own(name: str, length: int) -> list[int]:
    """A prompt of `length` tokens no other request (with another one-letter name) shares."""
    return [1_000_000 * ord(name) + i for i in range(length)]


@dataclass
class Step:
    plan: StepPlan
    waiting: list[str]  # ids in the waiting queue right after the plan was made
    running: list[str]  # ids of the running requests then
    slot_holders: list[str]  # ... of those holding a query slot

    @property
    def preempted(self) -> list[str]:
        return [seq.seq_id for seq in self.plan.preempted]


@dataclass
class Trace:
    steps: list[Step]
    seqs: dict[str, Sequence]
    scheduler: Scheduler

    def preemptions(self) -> list[tuple[int, list[str]]]:
        return [(step.plan.step_id, step.preempted) for step in self.steps if step.preempted]

    def admissions(self) -> list[str]:
        """Every admission (first or after a preemption), in order."""
        return [item.seq.seq_id for step in self.steps for item in step.plan.prefill]


def run_trace(requests, *, budget: int, num_blocks: int, num_slots: int, compress=True,
              hybrid=False, prefix_cache=False, async_compress=False) -> Trace:
    """Run (id, prompt tokens, output_len, arrival) requests with every invariant checked."""
    config = ZipageConfig(block_size=B, window=4, kv_budget=budget, compress=compress,
                          hybrid=hybrid, prefix_cache=prefix_cache,
                          async_compress=async_compress, chunked_prefill=False)
    scheduler = Scheduler(config, num_blocks, num_slots)
    driver = InstantDriver(scheduler, compress_delay=1, check=True)
    steps: list[Step] = []
    schedule = driver.recorder.schedule

    def recorded_schedule():
        plan = schedule()
        if plan is not None:
            steps.append(Step(plan, [seq.seq_id for seq in scheduler.waiting],
                              [seq.seq_id for seq in scheduler.running],
                              [seq.seq_id for seq in scheduler.running
                               if seq.query_slot is not None]))
        return plan

    driver.recorder.schedule = recorded_schedule
    seqs = [Sequence(seq_id, tokens, output, arrival_s=arrival)
            for seq_id, tokens, output, arrival in requests]
    run = driver.run(seqs)
    assert run.summary["completed"] == len(seqs)
    return Trace(steps, {seq.seq_id: seq for seq in seqs}, scheduler)


# ---------------------------------------------------------------- Full KV: the last running


def test_full_kv_preempts_the_last_running_request_again_after_each_preemption():
    """Three one-block prompts on three blocks all need a second block at the first decode: a
    gets it by preempting c (the last running), then b, now the last itself, is preempted. Both
    go to the front of waiting, the last preempted first (so they keep their running order)."""
    trace = run_trace([("a", own("a", B), 8, 0), ("b", own("b", B), 8, 0),
                       ("c", own("c", B), 8, 0), ("d", own("d", B), 4, 0)],
                      budget=B, num_blocks=3, num_slots=0, compress=False, prefix_cache=False)
    step, preempted = trace.preemptions()[0]
    assert preempted == ["c", "b"]
    assert trace.steps[step].waiting[:3] == ["b", "c", "d"]
    readmitted = trace.admissions()[3:]
    assert readmitted.index("b") < readmitted.index("c") < readmitted.index("d")


# ---------------------------------------------------------------- constrained / hybrid: blocked


@pytest.mark.parametrize("hybrid", [False, True], ids=["constrained", "hybrid"])
def test_slot_holders_block_instead_of_being_preempted(hybrid):
    """a holds three blocks, one above the cap, until its first compression (step 16); b needs
    its second block at step 14, when none is free. Both hold query slots, so neither scheduler
    preempts anybody: b waits (steps 14-16) until a's compression releases a block."""
    trace = run_trace([("a", own("a", 2 * B + 1), 40, 0), ("b", own("b", 3), 40, 0)],
                      budget=B, num_blocks=4, num_slots=2, hybrid=hybrid)
    assert trace.preemptions() == []
    waited = [step.plan.step_id for step in trace.steps if step.plan.kind == "decode"
              and "b" in step.running and trace.seqs["b"] not in step.plan.decode]
    assert waited == [14, 15, 16]


# ---------------------------------------------------------------- hybrid: the last without a slot


def test_hybrid_preempts_the_last_request_without_a_slot_to_the_front_of_waiting():
    """One slot: a holds it, b and c run without one; the pool is full. In lockstep all three
    need their third block: for a, c (the last running request without a slot) is preempted,
    not a or b, and goes back ahead of d, which waited before it; b takes the other freed block."""
    trace = run_trace([("a", own("a", B + 1), 40, 0), ("b", own("b", B + 1), 20, 0),
                       ("c", own("c", B + 1), 20, 0), ("d", own("d", B + 1), 8, 1)],
                      budget=2 * B, num_blocks=6, num_slots=1, hybrid=True)
    step, preempted = trace.preemptions()[0]
    assert preempted == ["c"]
    assert trace.steps[step].waiting == ["c", "d"]
    assert trace.admissions()[-2:] == ["c", "d"]


def test_a_freed_slot_goes_to_the_foremost_request_without_one():
    """One slot: a holds it and finishes after two tokens; b and c run without one. The freed
    slot goes to b, the foremost; c gets it only when b is done."""
    trace = run_trace([("a", own("a", B), 2, 0), ("b", own("b", B), 40, 0),
                       ("c", own("c", B), 40, 0)],
                      budget=2 * B, num_blocks=9, num_slots=1, hybrid=True)
    holders = []  # who held the slot, in the order they got it
    for step in trace.steps:
        if step.slot_holders and step.slot_holders != (holders[-1] if holders else None):
            holders.append(step.slot_holders)
    assert holders == [["a"], ["b"], ["c"]]
    assert trace.preemptions() == []


def test_hybrid_lends_a_request_reserved_blocks_once():
    """One slot: a holds it (N_max 5 blocks: the whole pool) and grows; b and c borrow the blocks
    a has not claimed yet. At step 13 a needs one: c, the last without a slot, is preempted. When
    b finishes (step 20) its blocks are still a's reservation, so c, preempted once, is not
    re-admitted into them (it would be preempted again at step 26): it waits until blocks nobody
    reserved are free, when a is done (docs/architecture.md, 'Scheduling': a request borrows
    once, zipage/core/lending.py)."""
    trace = run_trace([("a", own("a", 8), 60, 0), ("b", own("b", 4), 20, 0),
                       ("c", own("c", 20), 20, 0)],
                      budget=4 * B, num_blocks=5, num_slots=1, hybrid=True)
    assert trace.preemptions() == [(13, ["c"])]
    readmitted = [step for step in trace.steps
                  if any(item.seq.seq_id == "c" for item in step.plan.prefill)][1]
    assert readmitted.plan.step_id > 20 and "a" not in readmitted.running


# ---------------------------------------------------------------- prefix cache


@pytest.mark.parametrize("hybrid", [False, True], ids=["constrained", "hybrid"])
def test_prefix_cache_preemption_avoids_the_shared_prefix_deadlock(hybrid):
    """a and b share two prompt blocks and fill the pool. In lockstep both must compress, and
    each needs a fresh target block for the shared prefix (rule 5); none is free. Without the
    prefix-cache preemption both block forever; with it, b (the last uncompressed request,
    although it holds a slot) is preempted, a's prefix is no longer shared and it compresses."""
    trace = run_trace([("a", P[:2 * B + 1], 20, 0), ("b", P[:2 * B + 1], 20, 1)],
                      budget=B, num_blocks=4, num_slots=2, hybrid=hybrid, prefix_cache=True)
    step, preempted = trace.preemptions()[0]
    assert preempted == ["b"]
    assert [job.seq.seq_id for job in trace.steps[step].plan.compressions] == ["a"]


@pytest.mark.parametrize("async_compress", [False, True], ids=["sync", "async"])
def test_prefix_cache_preemption_skips_a_compressed_last_request(async_compress):
    """a and b share a prompt block; c, admitted last, compresses at its first decode. When a
    and b must compress in the same step each needs a fresh block for the shared one: a takes
    the only free block, and for b the victim is b itself: c, the last running request, is
    compressed and may not be preempted (its compression would be lost)."""
    trace = run_trace([("a", P[:B + 1], 40, 0), ("b", P[:B + 1], 40, 1),
                       ("c", own("c", 2 * B), 40, 2)],
                      budget=B, num_blocks=6, num_slots=3, prefix_cache=True,
                      async_compress=async_compress)
    step, preempted = trace.preemptions()[0]
    assert preempted == ["b"]
    running = [seq.seq_id for seq in trace.scheduler.running]  # at the end: nobody
    assert running == [] and trace.seqs["c"].num_preemptions == 0


def test_rule5_shortfall_takes_fresh_targets_for_a_shared_block_mid_table():
    """Rule 5's "if it owns too few" branch, on the block manager directly: a table [own, shared,
    own] at N_max = 3 owns two blocks; the targets are those two, in order, plus one fresh block,
    and the shared block is kept. Through the scheduler only a hole in the prefix index (a freed
    prompt's first block reused while a later one is still indexed) leads there, since prompt
    blocks are indexed when their step is planned (before, two requests prefilled in the same
    step each computed their own copy of a common prefix); random traces did not reach it."""
    manager = BlockManager(num_blocks=8, block_size=B, prefix_cache=True)
    table = [manager.allocate() for _ in range(3)]
    manager.refcount[table[1]] += 1  # another request maps the middle block
    targets = manager.plan_compression(table, n_max=3)
    new_table = targets.target_blocks + [targets.new_block]
    assert new_table[:2] == [table[0], table[2]]  # own blocks reused, in order
    assert new_table[2] not in table and targets.fresh_blocks == [new_table[2]]
    assert targets.released == [table[1]]  # the shared block: only this request's reference


# ------------------------------------------- a victim whose recomputation cannot fit the pool


def test_a_preempted_request_with_a_pool_sized_prompt_is_readmitted():
    """b's 64-token prompt maps a's two blocks and fills the 4-block pool. a's compression needs
    a fresh block for the shared prefix. b (64 tokens cached, one sampled) would recompute 65
    tokens, 5 blocks, more than exist: it is not a victim (it once was, and the run stuck); a, the
    other sharer, is preempted instead and runs again once b is done."""
    run_trace([("a", P[:2 * B], 32, 0), ("b", P[:4 * B], 32, 1)],
              budget=B, num_blocks=4, num_slots=2, prefix_cache=True)
