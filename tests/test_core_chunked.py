"""Chunked prefill and prefix sharing within a step, in the shared core.

Property tests: every mode of tests/strategies.py again with chunked prefill on and a small step
budget (so prompts really split), every invariant checked on every step (zipage/core/invariants.py
checks the chunk ranges, the budget and the within-step sharing rule too). Unit tests: the rules
of docs/architecture.md, 'Chunked prefill', one by one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import MODES, Case, cases, mode_seed

from zipage.config import ZipageConfig
from zipage.core.invariants import InvariantChecker
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.step import DECODE, MIXED, PREFILL, StepResult
from zipage.sim.instant import InstantDriver


@st.composite
def chunked_cases(draw, mode: str) -> Case:
    case = draw(cases(mode))
    b = case.config.block_size
    budget = draw(st.one_of(st.sampled_from([1, 2, b // 2, b, b + 1, 3 * b]),
                            st.integers(1, 4 * b)))
    config = replace(case.config, chunked_prefill=True, max_num_batched_tokens=budget)
    return replace(case, config=config)


@pytest.mark.parametrize("mode", list(MODES))
def test_invariants_hold_chunked(mode):
    @mode_seed(mode)
    @given(case=chunked_cases(mode))
    def check(case):
        scheduler = case.new_scheduler()
        sequences = case.sequences()
        result = InstantDriver(scheduler, compress_delay=case.delay, seed=7, check=True).run(
            sequences)
        accepted = [seq for seq in sequences if seq.error is None]
        assert result.summary["completed"] == len(accepted)
        assert all(seq.num_output_tokens == seq.max_output_tokens for seq in accepted)
        # Chunking never rejects a prompt for its length alone.
        assert all("max_num_batched_tokens" not in (seq.error or "") for seq in sequences)

    check()


# ---------------------------------------------------------------------- unit tests


def run(config: ZipageConfig, sequences: list[Sequence], num_blocks: int = 64,
        num_slots: int = 4):
    scheduler = Scheduler(config, num_blocks, num_slots)
    driver = InstantDriver(scheduler, check=True, log_decisions=True)
    return scheduler, driver.run(sequences)


def chunked(**knobs) -> ZipageConfig:
    base = dict(block_size=16, window=4, kv_budget=32, async_compress=False,
                chunked_prefill=True, max_num_batched_tokens=20)
    return ZipageConfig(**{**base, **knobs})


def test_long_prompt_is_split_and_decodes_share_its_steps():
    short = Sequence("short", list(range(5)), 8)
    long = Sequence("long", list(range(100, 170)), 2, arrival_s=1)
    scheduler, result = run(chunked(), [short, long])
    log = result.decision_log
    # 70 prompt tokens in chunks that leave room for short's decode token: 19 + 19 + 19 + 13.
    assert "prefill=long[0:19]+" in log[1] and "decode=short" in log[1]
    assert log[1].startswith("step 1 mixed")
    assert "long[19:38]+" in log[2] and "long[38:57]+" in log[3] and "long[57:70]@" in log[4]
    assert result.summary["completed"] == 2
    assert result.summary["prefill_tokens"] == 75
    assert all(step.prefill_tokens + step.n_decode <= 20 for step in result.steps)


def test_unchunked_rejects_what_chunked_serves():
    config = chunked(max_num_batched_tokens=32)
    seq = Sequence("long", list(range(100)), 3)
    assert Scheduler(replace(config, chunked_prefill=False), 64, 4).admission.rejection_reason(seq)
    assert Scheduler(config, 64, 4).admission.rejection_reason(seq) is None
    _, result = run(config, [Sequence("long", list(range(100)), 3)])
    assert result.summary["completed"] == 1
    kinds = [step.kind for step in result.steps]
    assert kinds[:4] == [PREFILL] * 4 and set(kinds[4:]) == {DECODE}


def test_partial_chunk_samples_no_token_and_first_token_comes_with_the_last_chunk():
    config = chunked(max_num_batched_tokens=16)
    scheduler = Scheduler(config, 64, 4)
    seq = Sequence("a", list(range(40)), 4)
    scheduler.add(seq)
    times = []
    for step in range(3):
        plan = scheduler.schedule()
        assert [item.samples for item in plan.prefill] == [step == 2]
        assert plan.sampled == ([seq] if step == 2 else [])
        scheduler.finish(StepResult(plan.step_id, t_start=step, t_end=step + 1))
        times.append((seq.kv_len, seq.num_output_tokens, seq.first_token_time))
    assert times == [(16, 0, None), (32, 0, None), (40, 1, 3)]


def test_running_prompts_continue_before_new_admissions_fcfs():
    config = chunked(max_num_batched_tokens=16, compress=False)
    first = Sequence("first", list(range(40)), 1)
    second = Sequence("second", list(range(1000, 1040)), 1)
    _, result = run(config, [first, second])
    log = result.decision_log
    assert "prefill=first[0:16]+" in log[0] and "second" not in log[0]
    assert "prefill=first[16:32]+" in log[1]
    assert "prefill=first[32:40],second[0:8]+" in log[2]


def test_prefix_shared_within_one_step_is_computed_once():
    prefix = list(range(500, 532))  # two full blocks
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=False)
    sequences = [Sequence("a", prefix + [1, 2], 4), Sequence("b", prefix + [3], 4)]
    _, result = run(config, sequences)
    assert "prefill=a[0:34]@q0,b[32:33]@q1" in result.decision_log[0]
    assert result.summary["prefill_tokens"] == 35
    assert result.summary["prefix_hit_tokens"] == 32
    assert result.summary["first_hit_tokens"] == 32  # b's first admission found a's blocks
    # Without the prefix cache both compute the prefix.
    _, plain = run(replace(config, prefix_cache=False),
                   [Sequence("a", prefix + [1, 2], 4), Sequence("b", prefix + [3], 4)])
    assert plain.summary["prefill_tokens"] == 67 and plain.summary["prefix_hit_tokens"] == 0


def test_chunks_index_only_what_they_compute():
    """A request admitted while another's chunks are computing a shared prefix maps only the
    blocks computed so far (or in this step); the rest it computes itself."""
    prefix = list(range(500, 564))  # four full blocks
    config = chunked(max_num_batched_tokens=24, compress=False)
    sequences = [Sequence("a", prefix + [1], 2), Sequence("b", prefix + [2], 2)]
    _, result = run(config, sequences)
    log = result.decision_log
    # Step 0: a computes 24 tokens (block 0 full, indexed). Step 1: a's next chunk completes
    # blocks 1 and 2 ... b can only be admitted once a's chunks leave budget.
    assert "a[0:24]+" in log[0]
    admitted = next(line for line in log if "b[" in line)
    start = int(admitted.split("b[")[1].split(":")[0])
    assert start % 16 == 0 and start > 0  # it found a's computed blocks


def test_preempted_partial_prefill_restarts_from_its_indexed_blocks():
    config = chunked(max_num_batched_tokens=17, compress=False)
    # 4 blocks in all: "long" (48 tokens) holds 3 and "grow" needs a block for its decode;
    # before that, long's first chunk (16 tokens next to grow's decode) fills a prompt block.
    grow = Sequence("grow", list(range(900, 915)), 6)
    long = Sequence("long", list(range(48)), 1, arrival_s=1)
    scheduler, result = run(config, [grow, long], num_blocks=4)
    assert result.summary["completed"] == 2
    assert result.summary["preemptions"] >= 1
    log = "\n".join(result.decision_log)
    assert "prefill=long[0:16]+" in log and "preempt=long" in log
    # Re-admitted, "long" maps the full prompt block its first chunk computed.
    assert "prefill=long[16:" in log.split("preempt=long")[1]
    assert result.summary["prefix_hit_tokens"] == 16
    # Those were its own blocks found again, not something the cache kept for it from others.
    assert result.summary["first_hit_tokens"] == 0


def test_decodes_alone_can_fill_the_budget():
    config = chunked(max_num_batched_tokens=2, compress=False, max_num_seqs=8)
    sequences = [Sequence(f"d{i}", [i], 5) for i in range(2)] + [
        Sequence("late", list(range(100, 110)), 1, arrival_s=2)]
    _, result = run(config, sequences)
    assert result.summary["completed"] == 3
    for step in result.steps:
        assert step.n_decode + step.prefill_tokens <= 2


def test_chunked_modes_report_mixed_steps():
    config = chunked()
    sequences = [Sequence("a", list(range(10)), 30), Sequence("b", list(range(50, 90)), 5,
                                                               arrival_s=2)]
    _, result = run(config, sequences)
    assert MIXED in {step.kind for step in result.steps}


def test_checker_catches_a_hit_on_an_uncomputed_block():
    """The within-step sharing rule is guarded: mapping a block nobody computed fails."""
    prefix = list(range(500, 532))
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=False)
    scheduler = Scheduler(config, 16, 2)
    checker = InvariantChecker(scheduler)
    a, b = Sequence("a", prefix + [1], 2), Sequence("b", prefix + [2], 2)
    scheduler.add(a)
    checker.before_schedule()
    plan = scheduler.schedule()
    checker.record_plan_writes(plan)
    scheduler.finish(StepResult(plan.step_id))
    checker.after_finish()
    checker.indexed_before = set()  # as if a's blocks had been indexed without being computed
    scheduler.add(b)
    checker.before_schedule()
    plan = scheduler.schedule()
    assert plan.prefill[0].num_cached_tokens == 32
    with pytest.raises(AssertionError, match="before any request computed it"):
        checker.after_schedule(plan)
