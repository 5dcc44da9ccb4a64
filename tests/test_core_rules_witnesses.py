"""Named minimal witness traces for the rules of chunked prefill, per-request and elastic budgets
and aborts (docs/architecture.md, 'Chunked prefill', 'Per-request and elastic budgets',
`Scheduler.abort`); tests/test_preemption_witnesses.py does the same for the preemption rules.

Each trace is a small one on which the rule decides the outcome: break the rule and the test
fails, through the invariant checker (every step is checked) or through the test's own
assertions on the decisions. `python tests/mutation_check.py` runs them against deliberate breaks
of the rules. Blocks are 16 tokens, windows 4; the default budget is 32 tokens (N_max = 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from zipage.config import ZipageConfig
from zipage.core.recorder import StepRecorder
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.step import StepPlan, StepResult
from zipage.sim.instant import InstantDriver

B = 16
P = list(range(1_000, 1_000 + 2 * B))  # a shared two-block prompt prefix


def own(name: str, length: int) -> list[int]:
    """A prompt of `length` tokens no other request (with another name) shares."""
    return [1_000_000 * sum(map(ord, name)) + i for i in range(length)]


def config(**knobs) -> ZipageConfig:
    # The witnesses are written step by step for whole-prompt prefill (chunked ones say so).
    return ZipageConfig(**{**dict(block_size=B, window=4, kv_budget=2 * B, async_compress=False,
                                  chunked_prefill=False),
                           **knobs})


@dataclass
class Step:
    plan: StepPlan
    slot_holders: list[str]  # ids of the running requests holding a query slot after the plan
    tables: dict[str, int]  # id -> blocks held after the plan, for every running request

    @property
    def prefilled(self) -> list[tuple[str, int, int, bool]]:
        return [(item.seq.seq_id, item.num_cached_tokens, item.num_tokens, item.samples)
                for item in self.plan.prefill]

    @property
    def decoded(self) -> list[str]:
        return [seq.seq_id for seq in self.plan.decode]

    @property
    def preempted(self) -> list[str]:
        return [seq.seq_id for seq in self.plan.preempted]


def run_trace(requests, *, num_blocks: int, num_slots: int, aborts=None, **knobs):
    """Run (id, prompt tokens, output_len, arrival[, kv_budget]) requests through the instant
    driver with every invariant checked; the steps as planned, and the requests by id."""
    scheduler = Scheduler(config(**knobs), num_blocks, num_slots)
    driver = InstantDriver(scheduler, compress_delay=1, check=True)
    steps: list[Step] = []
    schedule = driver.recorder.schedule

    def recorded_schedule():
        plan = schedule()
        if plan is not None:
            running = list(scheduler.running)
            steps.append(Step(plan, [seq.seq_id for seq in running if seq.query_slot is not None],
                              {seq.seq_id: len(seq.block_table) for seq in running}))
        return plan

    driver.recorder.schedule = recorded_schedule
    seqs = [Sequence(seq_id, tokens, output, arrival_s=arrival,
                     kv_budget=budget[0] if budget else None)
            for seq_id, tokens, output, arrival, *budget in requests]
    run = driver.run(seqs, aborts=aborts)
    assert run.summary["completed"] + run.summary["aborted"] == len(seqs)
    return steps, {seq.seq_id: seq for seq in seqs}


class Stepper:
    """Step a scheduler by hand (to abort between given steps), every invariant checked."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.recorder = StepRecorder(scheduler, check=True)

    def step(self, completed=()) -> StepPlan:
        plan = self.recorder.schedule()
        self.recorder.finish(plan, StepResult(plan.step_id, t_start=plan.step_id,
                                              t_end=plan.step_id + 1,
                                              completed_batches=list(completed)))
        return plan

    def run_out(self) -> None:
        """Step to the end (async batches complete the step after their launch)."""
        in_flight = None
        while self.scheduler.has_unfinished():
            plan = self.step([in_flight] if in_flight is not None else ())
            in_flight = plan.compress_launch.batch_id if plan.compress_launch else None
        self.recorder.result()  # the end-of-run checks: nothing leaked, FCFS


# ---------------------------------------------------------------- chunked prefill


def test_a_chunked_step_that_preempted_admits_nobody():
    """a and r share a two-block prefix; r's own third block makes it N_max = 3 blocks, so its
    first decode compresses it, which needs two fresh targets for the shared blocks (rule 5).
    One block is free: the victim is r itself (the last uncompressed request). Its blocks are
    now enough to readmit it at once (the shared ones and its own indexed one are prefix hits),
    but a step that preempted admits nobody: r comes back the step after."""
    steps, _ = run_trace([("a", P + own("a", B + 1), 20, 0), ("r", P + own("r", B), 4, 0)],
                         num_blocks=6, num_slots=2, prefix_cache=True, chunked_prefill=True,
                         max_num_batched_tokens=256)
    assert steps[1].preempted == ["r"] and steps[1].prefilled == []
    assert steps[2].prefilled == [("r", 3 * B, 3 * B + 1, True)]
    assert not any(step.preempted and step.prefilled for step in steps)


def test_chunks_take_the_budget_left_by_the_decodes():
    """Decode first: s decodes in every step, so the 70-token prompt of l gets 19 of the 20
    tokens of each step; chunks planned before the decodes, or a budget not reduced by them,
    give it the whole 20 (21 tokens in a 20-token step)."""
    steps, _ = run_trace([("s", own("s", 5), 8, 0), ("l", own("l", 70), 2, 1)],
                         num_blocks=64, num_slots=4, chunked_prefill=True,
                         max_num_batched_tokens=20)
    assert [step.prefilled for step in steps[1:5]] == [
        [("l", 0, 19, False)], [("l", 19, 38, False)], [("l", 38, 57, False)],
        [("l", 57, 70, True)]]
    assert all(step.decoded == ["s"] for step in steps[1:5])


def test_running_prompts_continue_before_new_admissions():
    """f's 40-token prompt takes 16 tokens a step; g, waiting behind it, is admitted only with
    what f's last chunk leaves."""
    steps, _ = run_trace([("f", own("f", 40), 1, 0), ("g", own("g", 40), 1, 0)],
                         num_blocks=64, num_slots=4, compress=False, chunked_prefill=True,
                         max_num_batched_tokens=16)
    assert [step.prefilled for step in steps[:3]] == [
        [("f", 0, 16, False)], [("f", 16, 32, False)], [("f", 32, 40, True), ("g", 0, 8, False)]]


def test_only_the_chunk_that_reaches_the_last_token_samples():
    """A 33-token prompt in 16-token chunks: the chunk ending at token 32, one short of the
    last, samples nothing; the first token comes with the one-token chunk after it."""
    steps, seqs = run_trace([("a", own("a", 2 * B + 1), 3, 0)], num_blocks=64, num_slots=4,
                            chunked_prefill=True, max_num_batched_tokens=16)
    assert [step.prefilled for step in steps[:3]] == [
        [("a", 0, 16, False)], [("a", 16, 32, False)], [("a", 32, 33, True)]]
    assert seqs["a"].first_token_time == pytest.approx(3)  # the end of step 2


def test_a_chunk_indexes_only_the_prompt_blocks_it_completes():
    """a's first chunk computes 24 tokens: block 0 whole, block 1 half. Only block 0 enters the
    prefix index; b, with the same prompt, arriving after it, maps block 0 and computes the rest
    (the checker also fails a block indexed before its prompt block was computed)."""
    prompt = own("p", 4 * B + 1)
    scheduler = Scheduler(config(compress=False, prefix_cache=True, chunked_prefill=True,
                                 max_num_batched_tokens=24), 64, 4)
    stepper = Stepper(scheduler)
    a = Sequence("a", prompt, 2)
    stepper.recorder.add(a)
    plan = stepper.step()
    assert [(item.num_cached_tokens, item.num_tokens) for item in plan.prefill] == [(0, 24)]
    assert set(scheduler.block_manager.hash_to_block.values()) == {a.block_table[0]}
    stepper.run_out()


def test_a_request_decodes_only_once_its_prompt_is_whole():
    """While l's prompt is computed in chunks, l is not decoded (nor compressed); its first
    decode comes in the step after its last chunk."""
    steps, _ = run_trace([("l", own("l", 3 * B + 8), 4, 0)], num_blocks=64, num_slots=4,
                         chunked_prefill=True, max_num_batched_tokens=B)
    assert [step.decoded for step in steps[:5]] == [[], [], [], [], ["l"]]
    assert [len(step.prefilled) for step in steps[:5]] == [1, 1, 1, 1, 0]


def test_a_prompt_longer_than_the_step_budget_is_served_in_chunks():
    """Without chunking a prompt above max_num_batched_tokens is rejected alone; with it, it
    is served."""
    steps, seqs = run_trace([("l", own("l", 100), 3, 0)], num_blocks=64, num_slots=4,
                            chunked_prefill=True, max_num_batched_tokens=32)
    assert seqs["l"].status is SequenceStatus.FINISHED
    assert [step.prefilled[0][1:3] for step in steps[:4]] == [(0, 32), (32, 64), (64, 96),
                                                              (96, 100)]


def test_an_aborted_partial_prefill_leaves_the_running_prompts():
    """a is aborted after its first chunk: it is no longer among the prompts that continue, and
    the next step computes b's prompt, not a's."""
    scheduler = Scheduler(config(chunked_prefill=True, max_num_batched_tokens=16), 64, 4)
    stepper = Stepper(scheduler)
    a, b = Sequence("a", own("a", 40), 2), Sequence("b", own("b", 8), 2)
    stepper.recorder.add(a)
    stepper.step()
    stepper.recorder.add(b)
    assert list(scheduler.prefilling) == [a]
    assert scheduler.abort("a")
    assert list(scheduler.prefilling) == []
    plan = stepper.step()
    assert [(item.seq.seq_id, item.num_cached_tokens) for item in plan.prefill] == [("b", 0)]
    stepper.run_out()


def test_a_preempted_partial_prefill_leaves_the_running_prompts():
    """Full KV, three blocks: g decodes into its second block while l's 48-token prompt is
    being computed in chunks; g needs a third block, none is free, and l, the last running, is
    preempted part-way: it continues from the front of waiting, not as a running prompt."""
    steps, seqs = run_trace([("g", own("g", 15), 20, 0), ("l", own("l", 2 * B + 1), 1, 1)],
                            num_blocks=4, num_slots=0, compress=False, chunked_prefill=True,
                            max_num_batched_tokens=9)
    victim = next(step for step in steps if step.preempted)
    assert victim.preempted == ["l"] and seqs["l"].num_preemptions == 1
    after = steps[steps.index(victim) + 1:]
    first = next(step for step in after if step.prefilled)
    assert first.prefilled[0][:2] == ("l", 0)


# ---------------------------------------------------------------- per-request budgets


def test_a_request_compresses_to_its_own_budget():
    """a brings a budget of one block (N_max = 2) under a default of two: it compresses into one
    target block, the default's request into two."""
    steps, seqs = run_trace([("a", own("a", 2 * B), 20, 0, B), ("d", own("d", 3 * B), 20, 0)],
                            num_blocks=12, num_slots=2)
    assert seqs["a"].n_max == 2 and seqs["d"].n_max == 3
    kept = {(job.seq.seq_id, len(job.target_blocks)) for step in steps
            for job in step.plan.compressions}
    assert kept == {("a", 1), ("d", 2)}


def test_a_slot_reserves_its_holders_own_n_max():
    """Two requests with a budget of four blocks (N_max = 5) each reserve five blocks of a
    six-block pool with their slot: the second waits for the first to finish although a slot
    and blocks are free (the default's N_max = 3 would let both in)."""
    steps, seqs = run_trace([("a", own("a", 40), 30, 0, 4 * B), ("b", own("b", 40), 30, 0, 4 * B)],
                            num_blocks=6, num_slots=2, hybrid=False)
    admitted_b = next(i for i, step in enumerate(steps) if "b" in step.tables)
    assert all("a" not in step.tables for step in steps[admitted_b:])
    assert seqs["a"].finish_time <= admitted_b


def test_a_freed_slot_waits_for_the_foremost_the_pool_can_back():
    """Hybrid, six blocks, two slots: h1 (N_max 4) and h2 hold them. When h2 finishes, the
    foremost request without a slot, x (N_max 3), does not fit (4 + 3 > 6), so the slot stays
    free: y behind it (N_max 2, it would fit) does not overtake."""
    steps, _ = run_trace([("h1", own("h1", 10), 60, 0, 3 * B), ("h2", own("h2", 3), 5, 0, B),
                          ("x", own("x", 3), 60, 0), ("y", own("y", 3), 30, 0, B)],
                         num_blocks=6, num_slots=2, hybrid=True)
    assert steps[0].slot_holders == ["h1", "h2"]
    after_h2 = [step for step in steps[5:] if {"h1", "x", "y"} <= step.tables.keys()]
    assert after_h2 and all(step.slot_holders == ["h1"] for step in after_h2)


# ---------------------------------------------------------------- the elastic policy


def test_elastic_grows_only_while_a_free_block_per_running_request_remains():
    """Alone on six blocks, h grows past its N_max while a block stays free after it takes one
    (4, then 5 blocks), then holds its 5 (compresses into 4 targets): it never takes the last
    free block."""
    steps, _ = run_trace([("h", own("h", 3 * B), 60, 0)], num_blocks=6, num_slots=1,
                         budget_policy="elastic")
    assert max(step.tables.get("h", 0) for step in steps) == 5
    grown = [step.plan.step_id for step in steps if step.plan.grown]
    assert grown == [1, 17]
    kept = {len(job.target_blocks) for step in steps for job in step.plan.compressions}
    assert kept == {4}


def test_elastic_borrower_shrinks_to_its_floor_when_the_head_waits_for_blocks():
    """h grew to five blocks on a slack pool. z arrives needing two blocks, one is free: the head
    of waiting is short of blocks alone, which is demand, so at its next full block h compresses
    to its floor (N_max - 1 = 2 targets), not holding five, and z is admitted the step after."""
    steps, _ = run_trace([("h", own("h", 3 * B), 40, 0), ("z", own("z", 20), 4, 20)],
                         num_blocks=6, num_slots=2, budget_policy="elastic")
    jobs = [(step.plan.step_id, len(job.target_blocks), len(job.source_table))
            for step in steps for job in step.plan.compressions]
    assert jobs[0] == (33, 2, 5)
    assert steps[34].prefilled == [("z", 0, 20, True)]


def test_elastic_waits_for_a_borrower_instead_of_preempting():
    """Prefix cache on (preemption allowed): h grew to five blocks, y took the last free one.
    When y needs a second block, h holds more than its N_max and gives it back at its next full
    block without needing a free one: y waits for it (steps 30-34); nobody is preempted."""
    steps, _ = run_trace([("h", own("h", 3 * B), 40, 0), ("y", own("y", 5), 20, 18)],
                         num_blocks=6, num_slots=2, budget_policy="elastic", prefix_cache=True)
    assert not any(step.preempted for step in steps)
    waited = [step.plan.step_id for step in steps
              if "y" in step.tables and "y" not in step.decoded and not step.prefilled]
    assert waited == [30, 31, 32, 33, 34]


def test_elastic_holds_only_when_holding_needs_no_fresh_block():
    """Prefix cache on: a's first two blocks are shared with b. At a's full block with the pool
    not slack, holding its blocks would need fresh targets for the shared ones; a shrinks to its
    floor instead (2 targets)."""
    steps, _ = run_trace([("a", P + own("a", 2 * B), 40, 0), ("b", P + own("b", 1), 40, 1)],
                         num_blocks=7, num_slots=2, budget_policy="elastic", prefix_cache=True)
    jobs = [(job.seq.seq_id, len(job.target_blocks), len(job.source_table))
            for step in steps for job in step.plan.compressions]
    assert jobs and all(kept == 2 for _, kept, _ in jobs)


# ---------------------------------------------------------------- aborts


def _two_running(async_compress: bool = False):
    scheduler = Scheduler(config(async_compress=async_compress, hybrid=False), num_blocks=10,
                          num_query_slots=2)
    stepper = Stepper(scheduler)
    a, b = Sequence("a", own("a", 40), 60), Sequence("b", own("b", 20), 30)
    stepper.recorder.add(a)
    stepper.recorder.add(b)
    return scheduler, stepper, a, b


def test_abort_of_a_running_request_frees_its_blocks_and_slot_at_once():
    scheduler, stepper, a, b = _two_running()
    for _ in range(3):
        stepper.step()
    free, held, slot = scheduler.block_manager.num_free_blocks, len(a.block_table), a.query_slot
    assert held == 3 and slot is not None
    assert scheduler.abort("a")
    assert a.status is SequenceStatus.ABORTED and a.block_table == []
    assert scheduler.block_manager.num_free_blocks == free + held
    assert slot in scheduler.slots.free
    stepper.run_out()
    assert b.num_output_tokens == 30


def test_abort_inside_the_in_flight_batch_waits_for_the_batch():
    """a's compression is in flight (async) when its client goes away: the batch still reads
    a's slot and writes its targets, so a keeps them (out of decoding) until the batch is done,
    and is released then, not resumed."""
    scheduler, stepper, a, b = _two_running(async_compress=True)
    plan = stepper.step()
    while plan.compress_launch is None or a not in {job.seq for job in plan.compress_launch.jobs}:
        plan = stepper.step()
    held = len(a.block_table)
    assert scheduler.abort("a")
    assert a.status is SequenceStatus.RUNNING and len(a.block_table) == held
    assert a.query_slot is not None and a.query_slot not in scheduler.slots.free
    plan = stepper.step([plan.compress_launch.batch_id])
    assert a not in plan.decode
    assert a.status is SequenceStatus.ABORTED and a.block_table == []
    assert a in scheduler.aborted and a not in scheduler.running
    stepper.run_out()
    assert a.num_output_tokens < 60 and b.num_output_tokens == 30


def test_an_aborted_waiting_request_is_never_admitted():
    """c waits behind a and b (both slots taken) and is aborted: it leaves waiting at once and no
    later step computes it."""
    scheduler, stepper, a, b = _two_running()
    c = Sequence("c", own("c", 8), 4)
    stepper.recorder.add(c)
    stepper.step()
    assert list(scheduler.waiting) == [c]
    assert scheduler.abort("c")
    assert list(scheduler.waiting) == [] and c.status is SequenceStatus.ABORTED
    admitted = []
    while scheduler.has_unfinished():
        admitted += [item.seq.seq_id for item in stepper.step().prefill]
    assert "c" not in admitted and c.status is SequenceStatus.ABORTED
