"""Per-request KV budgets and the elastic budget policy in the shared core
(docs/architecture.md, 'Per-request and elastic budgets').

Property tests: every mode of tests/strategies.py again with a budget per request (some invalid,
some above the default) under the fixed and the elastic policy, with chunked prefill too, every
invariant checked on every step (zipage/core/invariants.py and budget_invariants.py): deadlock
freedom within the step bound, exact outputs, rule 6 with each request's own N_max, the slot
holders' N_max backed by the pool, elastic compressions never below the budget, no borrowing while
a request waits for memory, no preemption while a borrower can give blocks back. And: with memory
to spare, the elastic policy never compresses (Full-KV exactness). Unit tests: the rules one by
one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import MODES, Case, cases
from tolerance import assert_close, close

from zipage.config import ZipageConfig
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.errors import ConfigError
from zipage.sim.instant import InstantDriver

POLICIES = ("fixed", "elastic")


@dataclass
class BudgetCase:
    case: Case
    budgets: list[int | None]  # each request's own kv_budget (None: the default)

    def sequences(self) -> list[Sequence]:
        sequences = self.case.sequences()
        for seq, budget in zip(sequences, self.budgets):
            seq.kv_budget = budget
        return sequences


@st.composite
def budget_cases(draw, mode: str, policy: str, chunked: bool = False) -> BudgetCase:
    case = draw(cases(mode))
    b = case.config.block_size
    config = replace(case.config, budget_policy=policy)
    if chunked:
        config = replace(config, chunked_prefill=True, max_num_batched_tokens=draw(
            st.sampled_from([1, b // 2, b + 1, 3 * b])))
    # Valid budgets of 1 to 4 blocks (the default is 1 to 3), and invalid ones now and then.
    if draw(st.booleans()):
        # A crowd: more requests than slots, long outputs, arriving together or nearly, on a
        # pool with little to spare, so budgets bind, borrowers meet demand and blocks run out.
        n_max = config.n_max
        shared = draw(st.lists(st.integers(100, 999), min_size=2 * b, max_size=2 * b))
        requests = []
        for index in range(draw(st.integers(case.num_slots + 1, 12))):
            prompt = draw(st.sampled_from([1, b // 2, b, 2 * b, n_max * b + 1]))
            tokens = (shared[:prompt] if draw(st.booleans()) and prompt <= 2 * b else
                      [30_000 + index * 1_000 + position for position in range(prompt)])
            requests.append((f"r{index}", tokens, draw(st.integers(b, 8 * b)),
                             draw(st.sampled_from([0, 0, 1, 3, 8, 20]))))
        blocks = case.num_slots * n_max + draw(st.sampled_from([0, 1, 3, 8, 16]))
        case = replace(case, requests=requests, num_blocks=blocks)
    budget = st.sampled_from([None, None, None, b, 2 * b, 3 * b, 4 * b, b + 1])
    budgets = [draw(budget) for _ in case.requests]
    return BudgetCase(replace(case, config=config), budgets)


def run_budget_case(budget_case: BudgetCase):
    case = budget_case.case
    scheduler = case.new_scheduler()
    sequences = budget_case.sequences()
    result = InstantDriver(scheduler, compress_delay=case.delay, seed=7, check=True).run(
        sequences)
    return scheduler, sequences, result


def pinned(seq: Sequence, config: ZipageConfig) -> int:
    """The prompt blocks a request's compressions keep in place under the "output" scope."""
    return -(-seq.prompt_len // config.block_size) if config.compress_scope == "output" else 0


def check_outcome(scheduler: Scheduler, sequences: list[Sequence], result) -> None:
    config = scheduler.config
    b = config.block_size
    accepted = [seq for seq in sequences if seq.error is None]
    assert result.summary["completed"] == len(accepted)
    assert all(seq.num_output_tokens == seq.max_output_tokens for seq in accepted)
    for seq in sequences:
        if seq.error is None:
            continue
        if "kv_budget" in seq.error:  # a budget that is not a positive multiple of b
            assert seq.kv_budget % b or seq.kv_budget < b
        else:  # too big for the pool at its own N_max, or for max_num_batched_tokens
            budget = config.kv_budget if seq.kv_budget is None else seq.kv_budget
            peak = scheduler.admission.peak_blocks(seq.prompt_len, seq.max_output_tokens,
                                         budget // b + 1 + pinned(seq, config))
            assert peak > scheduler.block_manager.num_blocks or "max_num" in seq.error
    for seq in accepted:
        # Its budget's blocks, plus its prompt's under the "output" scope.
        assert seq.n_max == seq.kv_budget // b + 1 + pinned(seq, config)
        if not config.compress:
            assert seq.num_compressions == 0
        elif config.budget_policy == "fixed" and seq.num_compressions:
            assert seq.max_blocks_after_first_compression <= seq.n_max  # rule 6, own N_max
            assert seq.kept_budget == close(seq.kv_budget)
        elif seq.kept_budget is not None:
            assert seq.kept_budget >= seq.kv_budget  # elastic: never below the budget


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", list(MODES))
def test_invariants_hold_with_budgets(mode, policy):
    @given(budget_case=budget_cases(mode, policy))
    def check(budget_case):
        check_outcome(*run_budget_case(budget_case))

    check()


@pytest.mark.parametrize("mode", ["constrained_prefix", "hybrid", "hybrid_prefix"])
def test_invariants_hold_with_elastic_budgets_chunked(mode):
    @given(budget_case=budget_cases(mode, "elastic", chunked=True))
    def check(budget_case):
        check_outcome(*run_budget_case(budget_case))

    check()


@st.composite
def plentiful_cases(draw, mode: str) -> BudgetCase:
    """At most one request per query slot, and blocks for all of their KV plus one per request:
    the memory is plentiful."""
    budget_case = draw(budget_cases(mode, "elastic", chunked=draw(st.booleans())))
    case = budget_case.case
    b = case.config.block_size
    requests = case.requests[:case.num_slots]
    budgets = [budget if budget is None or budget % b == 0 else None
               for budget in budget_case.budgets[:case.num_slots]]
    whole = sum(-(-(len(tokens) + output - 1) // b) for _, tokens, output, _ in requests)
    case = replace(case, requests=requests, num_blocks=max(case.num_blocks,
                                                           whole + len(requests)))
    return BudgetCase(case, budgets)


@pytest.mark.parametrize("mode", ["constrained", "hybrid_prefix"])
def test_elastic_never_compresses_when_memory_is_plentiful(mode):
    """Full-KV exactness: a few requests in a pool that holds all their KV are never compressed
    (the same runs compress under the fixed policy whenever a request outgrows its budget)."""
    @given(budget_case=plentiful_cases(mode))
    def check(budget_case):
        scheduler, sequences, result = run_budget_case(budget_case)
        check_outcome(scheduler, sequences, result)
        assert result.summary["compressions"] == 0
        assert result.summary["preemptions"] == 0
        b = budget_case.case.config.block_size
        for seq in sequences:
            if seq.error is None and seq.kept_budget is not None:
                # It outgrew its budget and kept all of its KV.
                assert seq.kept_budget == close(seq.prompt_len + seq.max_output_tokens - 1)
                assert seq.kept_budget > seq.n_max * b

    check()


# ---------------------------------------------------------------------- unit tests


def config(**knobs) -> ZipageConfig:
    # The witnesses are written step by step for whole-prompt prefill (chunked ones say so).
    return ZipageConfig(**{**dict(block_size=16, window=4, kv_budget=32, async_compress=False,
                                  chunked_prefill=False),
                           **knobs})


def run(cfg: ZipageConfig, sequences: list[Sequence], num_blocks: int, num_slots: int = 2):
    scheduler, result, _ = run_plans(cfg, sequences, num_blocks, num_slots)
    return scheduler, result


def run_plans(cfg: ZipageConfig, sequences: list[Sequence], num_blocks: int, num_slots: int = 2):
    """The run, and every plan it made (in order)."""
    scheduler = Scheduler(cfg, num_blocks, num_slots)
    driver = InstantDriver(scheduler, check=True, log_decisions=True)
    plans = []
    schedule = driver.recorder.schedule

    def recording():
        plan = schedule()
        if plan is not None:
            plans.append(plan)
        return plan

    driver.recorder.schedule = recording
    return scheduler, driver.run(sequences), plans


def jobs_of(plans, seq_id: str) -> list:
    return [(plan.step_id, job) for plan in plans for job in plan.compressions
            if job.seq.seq_id == seq_id]


def test_a_request_budget_sets_its_own_cap_and_target():
    small = Sequence("small", list(range(10)), 100, kv_budget=16)
    large = Sequence("large", list(range(100, 110)), 100, kv_budget=64)
    plain = Sequence("plain", list(range(200, 210)), 100)
    scheduler, result = run(config(prefix_cache=False), [small, large, plain], num_blocks=32,
                            num_slots=3)
    assert (small.n_max, large.n_max, plain.n_max) == (2, 5, 3)
    assert plain.kv_budget == 32  # the default, filled in at add
    compressions = [line for line in result.decision_log if "compress" in line]
    assert compressions
    for seq in (small, large, plain):
        assert seq.max_blocks_after_first_compression == seq.n_max
        assert seq.kept_budget == close(seq.kv_budget)
    record = {r.id: r for r in result.requests}
    assert_close((record["small"].kv_budget, record["small"].kept_budget), (16, 16.0))
    assert result.summary["mean_kept_budget"] == pytest.approx((16 + 64 + 32) / 3)


def test_a_bad_budget_fails_alone_with_its_field_and_fix():
    bad = Sequence("bad", list(range(10)), 5, kv_budget=40)
    tiny = Sequence("tiny", list(range(10)), 5, kv_budget=8)
    ok = Sequence("ok", list(range(20, 30)), 5)
    _, result = run(config(), [bad, tiny, ok], num_blocks=12)
    assert result.summary["completed"] == 1 and result.summary["failed"] == 2
    assert bad.error == ("request bad: kv_budget 40 must be a positive multiple of block_size 16 "
                         "(N_max = kv_budget / 16 + 1 >= 2 blocks); use e.g. 32, or leave it out "
                         "for the default 32")
    assert "kv_budget 8 must be" in tiny.error and "use e.g. 16" in tiny.error
    with pytest.raises(ConfigError, match="kv_budget: got 40, expected a positive multiple"):
        config(kv_budget=40)
    with pytest.raises(ConfigError, match="budget_policy: got 'adaptive'"):
        config(budget_policy="adaptive")


def test_a_budget_too_large_for_the_pool_fails_alone():
    huge = Sequence("huge", list(range(10)), 500, kv_budget=320)  # N_max 21 > 12 blocks
    ok = Sequence("ok", list(range(20, 30)), 50)
    _, result = run(config(), [huge, ok], num_blocks=12)
    assert "needs 12 KV blocks" not in huge.error and "KV blocks at its peak" in huge.error
    assert result.summary["completed"] == 1


def test_slot_holders_never_need_more_blocks_than_the_pool():
    """A slot reserves the holder's N_max blocks (deadlock freedom with mixed budgets): with 8
    blocks, a holder of N_max 5 leaves no slot for a request of N_max 5, though a slot is free."""
    first = Sequence("first", list(range(40)), 100, kv_budget=64)
    second = Sequence("second", list(range(100, 140)), 100, kv_budget=64)
    cfg = config(hybrid=False, prefix_cache=False)
    scheduler, result = run(cfg, [first, second], num_blocks=8)
    log = result.decision_log
    assert "prefill=first[0:40]@q0" in log[0] and "second" not in log[0]
    # second starts only when first finished and gave its reservation back.
    start = next(index for index, line in enumerate(log) if "prefill=second" in line)
    assert all("decode=first" in line for line in log[1:start])
    assert result.summary["completed"] == 2


def test_hybrid_hand_out_waits_for_the_foremost_request_to_fit():
    """A freed slot goes to the foremost running request without one only when the pool can
    back it; nobody behind it overtakes."""
    scheduler = Scheduler(config(prefix_cache=False), num_blocks=9, num_query_slots=2)
    a = Sequence("a", list(range(10)), 60, kv_budget=64)  # N_max 5
    b = Sequence("b", list(range(20, 30)), 60, kv_budget=64)  # N_max 5: 5 + 5 > 9
    c = Sequence("c", list(range(40, 50)), 60, kv_budget=16)  # N_max 2 would fit
    for seq in (a, b, c):
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [item.seq.query_slot for item in plan.prefill] == [0, None, None]
    assert scheduler.slots.free == [1]


# ---------------------------------------------------------------------- elastic


def elastic(**knobs) -> ZipageConfig:
    return config(budget_policy="elastic", prefix_cache=False, **knobs)


def test_elastic_grows_while_the_pool_is_slack():
    seq = Sequence("a", list(range(10)), 200)  # 210 tokens: 14 blocks, N_max 3
    scheduler, result = run(elastic(), [seq], num_blocks=16, num_slots=1)
    assert result.summary["compressions"] == 0
    assert sum("grow=a" in line for line in result.decision_log) == 14 - 3
    assert seq.kept_budget == close(209.0)
    # The fixed policy compresses the same request every block once it holds N_max.
    fixed = Sequence("a", list(range(10)), 200)
    _, fixed_result = run(config(prefix_cache=False), [fixed], num_blocks=16, num_slots=1)
    assert fixed_result.summary["compressions"] == 11 and fixed.kept_budget == close(32)


def test_elastic_holds_its_blocks_when_the_pool_is_tight_and_nobody_waits():
    """With fewer free blocks than running requests (+1), a borrower compresses into the blocks
    it holds (hold) instead of growing; nobody waits, so it does not shrink."""
    a = Sequence("a", list(range(10)), 300)
    b = Sequence("b", list(range(100, 110)), 300)
    scheduler, result, plans = run_plans(elastic(), [a, b], num_blocks=12, num_slots=2)
    holds = [job for _, job in jobs_of(plans, "a") + jobs_of(plans, "b")
             if len(job.target_blocks) == len(job.source_table) - 1 > a.n_max - 1]
    assert holds
    assert min(a.kept_budget, b.kept_budget) > 32
    assert result.summary["preemptions"] == 0
    assert sum(len(job.source_table) for job in holds) > 0


def test_elastic_shrinks_to_the_budget_when_a_request_waits():
    """A borrower gives its blocks back at its next full block as soon as a waiting request
    needs them, and the waiting one is admitted without anybody being preempted."""
    grower = Sequence("grower", list(range(10)), 400)
    late = Sequence("late", list(range(500, 580)), 10, arrival_s=150)  # 80 tokens: 5 blocks
    scheduler, result, plans = run_plans(elastic(), [grower, late], num_blocks=14, num_slots=2)
    admitted = next(plan.step_id for plan in plans
                    if any(item.seq is late for item in plan.prefill))
    assert any(plan.grown == [grower] for plan in plans[:admitted])
    shrinks = [job for step, job in jobs_of(plans, "grower") if step < admitted]
    assert shrinks, "the borrower must give blocks back before late is admitted"
    assert len(shrinks[0].target_blocks) == grower.n_max - 1
    assert len(shrinks[0].source_table) > grower.n_max
    assert result.summary["preemptions"] == 0 and result.summary["completed"] == 2


def test_elastic_waits_for_a_borrower_instead_of_preempting():
    """When blocks run out, hybrid scheduling preempts the last request without a slot; elastic
    first waits while a borrower can give blocks back: the borrower shrinks at its next full
    block and the blocked requests go on. (The checker fails any preemption made while such a
    borrower existed.)"""
    borrower = Sequence("B", list(range(10)), 300, kv_budget=16)  # N_max 2, grows
    with_slot = Sequence("R", list(range(100, 110)), 60, kv_budget=64, arrival_s=40)
    slotless = Sequence("S", list(range(200, 210)), 60, kv_budget=64, arrival_s=40)
    _, result, plans = run_plans(config(budget_policy="elastic", prefix_cache=False),
                                 [borrower, with_slot, slotless], num_blocks=10, num_slots=2)
    stalled = [plan.step_id for plan in plans
               if plan.decode == [borrower] and plan.num_running == 3 and not plan.preempted]
    assert stalled, "R and S must wait for B's blocks"
    shrink = next(job for step, job in jobs_of(plans, "B") if step >= stalled[0])
    assert len(shrink.source_table) > borrower.n_max
    assert len(shrink.target_blocks) == borrower.n_max - 1
    first_preemption = min((plan.step_id for plan in plans if plan.preempted), default=None)
    assert first_preemption is None or first_preemption > stalled[0]
    assert result.summary["completed"] == 3
