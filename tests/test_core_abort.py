"""`Scheduler.abort`: a client that goes away frees its request's blocks and slot at once, whether
the request waits, runs, or sits inside an in-flight async compression batch (then when the batch
completes); every invariant holds on every step and every other request finishes untouched.

Property tests: random traces with random abort times through the instant driver, all invariants
checked each step (zipage/core/invariants.py), for every scheduling mode."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import MODES, cases, mode_seed

from zipage.config import ZipageConfig
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.core.step import StepResult
from zipage.sim.instant import InstantDriver


@st.composite
def cases_with_aborts(draw, mode: str):
    case = draw(cases(mode))
    aborts = {}
    for seq_id, _, _, arrival in case.requests:
        if draw(st.booleans()):  # a client goes away after it arrived
            aborts[seq_id] = arrival + draw(st.integers(0, 120))
    return case, aborts


@pytest.mark.parametrize("mode", list(MODES))
def test_random_aborts_keep_every_invariant(mode):
    @mode_seed(mode)
    @given(drawn=cases_with_aborts(mode))
    def check(drawn):
        case, aborts = drawn
        scheduler = case.new_scheduler()
        driver = InstantDriver(scheduler, compress_delay=case.delay, seed=7, check=True)
        sequences = case.sequences()
        run = driver.run(sequences, aborts=aborts)  # the checker also fails any leak at the end
        for seq in sequences:
            if seq.status is SequenceStatus.ABORTED:
                assert seq.seq_id in aborts
                assert seq.finish_time is None
            elif seq.status is SequenceStatus.FINISHED:
                # Untouched by the others' aborts: exactly its tokens, and it finished before
                # its own abort time (if any) came.
                assert seq.num_output_tokens == seq.max_output_tokens
                assert seq.seq_id not in aborts or seq.finish_time <= aborts[seq.seq_id]
            else:
                assert seq.status is SequenceStatus.REJECTED
        assert run.summary["aborted"] == len(scheduler.aborted)
        assert run.summary["completed"] + run.summary["aborted"] + run.summary["failed"] == \
            len(sequences)
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks

    check()


# ---------------------------------------------------------------- the three places a request is


def _scheduler(async_compress: bool) -> Scheduler:
    # N_max = 3 blocks of 16 tokens; two slots back 6 blocks, 4 more for headroom.
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=async_compress,
                          hybrid=False, prefix_cache=False)
    return Scheduler(config, num_blocks=10, num_query_slots=2)


def _step(scheduler: Scheduler, completed=()) -> None:
    plan = scheduler.schedule()
    scheduler.finish(StepResult(step_id=plan.step_id, t_start=0.0, t_end=1.0,
                                completed_batches=list(completed)))
    return plan


def test_abort_running_frees_blocks_and_slot_at_once():
    scheduler = _scheduler(async_compress=False)
    a, b = Sequence("a", list(range(20)), 50), Sequence("b", list(range(20)), 50)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(5):
        _step(scheduler)
    assert a.status is SequenceStatus.RUNNING and len(a.block_table) == 2
    free_before = scheduler.block_manager.num_free_blocks
    slot = a.query_slot
    assert slot is not None and slot not in scheduler.slots.free
    assert scheduler.abort("a")
    assert a.status is SequenceStatus.ABORTED and a.block_table == []
    assert scheduler.block_manager.num_free_blocks == free_before + 2
    assert slot in scheduler.slots.free and a.query_slot is None
    assert list(scheduler.running) == [b]
    assert not scheduler.abort("a")  # already gone
    while scheduler.has_unfinished():
        _step(scheduler)
    assert b.num_output_tokens == 50
    assert scheduler.block_manager.num_free_blocks == 10


def test_abort_waiting_request_never_runs():
    scheduler = _scheduler(async_compress=False)
    a = Sequence("a", list(range(20)), 4)
    scheduler.add(a)
    assert scheduler.abort("a")
    assert a.status is SequenceStatus.ABORTED and not scheduler.has_unfinished()
    assert scheduler.schedule() is None


def test_abort_inside_async_batch_waits_for_the_batch():
    scheduler = _scheduler(async_compress=True)
    a = Sequence("a", list(range(40)), 100)
    scheduler.add(a)
    plan = _step(scheduler)  # prefill: 3 blocks (48 entries room), N_max = 3
    while plan.compress_launch is None:
        plan = _step(scheduler)
    batch = plan.compress_launch.batch_id
    assert a.compressing and scheduler.compressions.in_flight is not None
    assert scheduler.abort("a")
    # The batch still reads a's query slot and writes its target blocks: nothing is freed yet.
    assert a.status is SequenceStatus.RUNNING and a.block_table
    assert scheduler.block_manager.num_free_blocks < 10
    plan = _step(scheduler, completed=[batch])  # an idle step that sees the batch complete
    assert plan.kind == "idle"
    assert a.status is SequenceStatus.ABORTED and a.block_table == []
    assert scheduler.block_manager.num_free_blocks == 10
    assert sorted(scheduler.slots.free) == [0, 1]
    assert not scheduler.has_unfinished()
