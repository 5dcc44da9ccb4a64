"""Samples of one prompt (docs/architecture.md, 'Samples of one prompt'): a request queued right
behind its leader (`Sequence.fork_of`) is forked when the leader samples its first token. Named
witnesses of each condition of the rule, and a property test over every scheduling mode with
groups of samples, every invariant checked each step (zipage/core/invariants.py: the fork's
blocks are exactly the leader's full prompt blocks plus a fresh copy of its partial one, the
leader computes its last prompt token in that step, no prompt with window queries is forked,
FCFS, refcounts, no write into a shared block). `python tests/mutation_check.py fork` runs them
against deliberate breaks of the rule. Blocks are 16 tokens, windows 4.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_core_rules_witnesses import Stepper, config, own

from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.sim.instant import InstantDriver

B = 16


def samples(name: str, prompt: list[int], n: int, output: int, arrival: float = 0.0,
            prompt_logits: bool = False) -> list[Sequence]:
    """A request with n samples, as the engine and the server queue it: the leader, then the
    others pointing at it."""
    group = []
    for index in range(n):
        seq = Sequence(name if index == 0 else f"{name}#{index}", list(prompt), output,
                       arrival_s=arrival)
        if index == 0:
            seq.prompt_logits = prompt_logits
        else:
            seq.fork_of = group[0]
        group.append(seq)
    return group


def run(sequences: list[Sequence], *, num_blocks: int = 64, num_slots: int = 8,
        delay: int = 1, **knobs):
    """Run through the instant driver, every invariant checked; the plans and the run."""
    scheduler = Scheduler(config(**knobs), num_blocks, num_slots)
    driver = InstantDriver(scheduler, compress_delay=delay, check=True)
    plans = []
    schedule = driver.recorder.schedule

    def recorded():
        plan = schedule()
        if plan is not None:
            plans.append(plan)
        return plan

    driver.recorder.schedule = recorded
    result = driver.run(sequences)
    return plans, result


def test_n_samples_prefill_once_and_fork_the_rest():
    group = samples("a", own("a", 40), 8, 6)
    plans, result = run(group)
    assert result.summary["completed"] == 8
    first = plans[0]
    assert [(item.seq.seq_id, item.num_cached_tokens, item.num_tokens) for item in first.prefill] \
        == [("a", 0, 40)]  # the prompt is computed once
    assert [fork.seq.seq_id for fork in first.forks] == [f"a#{i}" for i in range(1, 8)]
    # The leader's partial third block is copied into a block of each fork's own (the checker
    # verified each fork's table against the leader's when the step was planned).
    assert len({fork.copy[0] for fork in first.forks}) == 1
    assert len({fork.copy[1] for fork in first.forks}) == 7
    assert sum(plan.num_prefill_tokens for plan in plans) == 40
    assert sorted(seq.seq_id for seq in first.sampled) == sorted(seq.seq_id for seq in group)
    assert "fork=a#1<a(" in first.describe()
    assert all(seq.num_output_tokens == 6 for seq in group)


def test_a_prompt_of_whole_blocks_is_shared_without_a_copy():
    plans, _ = run(samples("a", own("a", 32), 3, 4))
    assert len(plans[0].forks) == 2 and plans[0].block_copies == []


def test_steps_count_the_shared_entries_once_per_extra_holder():
    # Eight samples of a 40-token prompt share its two full blocks (B = 16): seven extra holders
    # of each, the cost feature a decode step's shared reads are priced by; the partial third
    # block is copied, not shared. Once a request finishes its holds go with it.
    plans, _ = run(samples("a", own("a", 40), 8, 6), compress=False)
    assert plans[0].shared_kv_tokens == 7 * 2 * B
    assert plans[1].shared_kv_tokens == 7 * 2 * B and plans[1].kind == "decode"
    assert plans[-1].shared_kv_tokens == 7 * 2 * B  # all eight finish in the same step
    alone, _ = run(samples("b", own("b", 40), 1, 6), compress=False)
    assert {plan.shared_kv_tokens for plan in alone} == {0}


def test_a_prompt_that_wrote_window_queries_is_not_forked():
    # N_max = 3 (budget 32): entries 44..47 of block 2 write window queries; a 46-token prompt
    # wrote two, which only the leader's slot holds. Its samples prefill through the prefix
    # cache instead (mapping its two full blocks).
    plans, result = run(samples("a", own("a", 46), 3, 20), kv_budget=2 * B, prefix_cache=True)
    assert result.summary["completed"] == 3
    assert not any(plan.forks for plan in plans)
    assert sum(plan.prefix_hit_tokens for plan in plans) == 2 * 32
    assert result.summary["compressions"] > 0


def test_forks_respect_max_num_seqs_and_the_rest_prefill_later():
    plans, result = run(samples("a", own("a", 20), 4, 3), max_num_seqs=2, prefix_cache=True)
    assert result.summary["completed"] == 4
    assert [fork.seq.seq_id for fork in plans[0].forks] == ["a#1"]
    assert max(plan.num_running for plan in plans) <= 2
    later = [item.seq.seq_id for plan in plans[1:] for item in plan.prefill]
    assert later == ["a#2", "a#3"] or sorted(later) == ["a#2", "a#3"]


def test_constrained_forks_only_with_a_free_slot():
    plans, result = run(samples("a", own("a", 20), 3, 3), hybrid=False, num_slots=2,
                        num_blocks=16, kv_budget=2 * B)
    assert result.summary["completed"] == 3
    assert [fork.seq.seq_id for fork in plans[0].forks] == ["a#1"]


def test_a_prompt_logits_request_maps_no_prefix_block():
    first = samples("a", own("a", 40), 1, 2)
    again = samples("b", own("a", 40), 1, 2, arrival=5, prompt_logits=True)
    plans, _ = run(first + again, prefix_cache=True)
    items = [item for plan in plans for item in plan.prefill if item.seq.seq_id == "b"]
    assert [(item.num_cached_tokens, item.num_tokens, item.prompt_logits) for item in items] \
        == [(0, 40, True)]


def test_a_sample_whose_leader_already_ran_prefills_alone():
    leader, late = samples("a", own("a", 40), 2, 3)
    stepper = Stepper(Scheduler(config(prefix_cache=True), 64, 8))
    stepper.recorder.add(leader)
    stepper.step()
    stepper.recorder.add(late)
    plan = stepper.step()
    assert not plan.forks
    assert [(item.seq.seq_id, item.num_cached_tokens) for item in plan.prefill] == [("a#1", 32)]
    stepper.run_out()


def test_forks_sharing_a_prompt_without_the_prefix_cache_never_stall():
    """Two slot holders forked from one prompt, elastic, prefix cache off, have grown past their
    N_max and each needs a fresh target block to compress its shared prompt blocks out of. Only
    preempting one (uncompressed, so its blocks are the other's alone again) lets them go on:
    the uncompressed-victim rule holds whenever a block is shared at a step's start, not only
    with the prefix cache (docs/architecture.md, 'Deadlock freedom'). Without it this run
    stopped with SchedulerStuck at step 57."""
    for hybrid in (True, False):
        _, result = run(samples("a", own("a", 56), 3, 60), num_blocks=12, num_slots=3,
                        hybrid=hybrid, prefix_cache=False, window=8, kv_budget=48,
                        budget_policy="elastic", max_num_seqs=2)
        assert result.summary["completed"] == 3
        assert result.summary["preemptions"] >= 1


MODES = {
    "full_kv": dict(compress=False, prefix_cache=True),
    "constrained": dict(hybrid=False, prefix_cache=False),
    "hybrid": dict(hybrid=True, prefix_cache=False),
    "hybrid_prefix": dict(hybrid=True, prefix_cache=True),
    "chunked": dict(hybrid=True, prefix_cache=True, chunked_prefill=True,
                    max_num_batched_tokens=48),
    "async": dict(hybrid=True, prefix_cache=True, async_compress=True),
    # Forks share their leader's prompt blocks without the prefix cache too; an elastic request
    # grows past N_max into blocks it must compress out of later (the fork stall below).
    "hybrid_elastic": dict(hybrid=True, prefix_cache=False, budget_policy="elastic"),
    "constrained_elastic": dict(hybrid=False, prefix_cache=False, budget_policy="elastic"),
}


@st.composite
def groups(draw):
    mode = draw(st.sampled_from(sorted(MODES)))
    requests = []
    for index in range(draw(st.integers(1, 5))):
        prompt = own(f"r{draw(st.integers(0, 2))}", draw(st.integers(1, 70)))
        requests.append((f"r{index}", prompt, draw(st.integers(1, 5)), draw(st.integers(1, 40)),
                         draw(st.integers(0, 6)), draw(st.booleans())))
    return (mode, requests, draw(st.integers(12, 40)), draw(st.integers(1, 4)),
            draw(st.sampled_from([2, 3, 512])))


@settings(max_examples=examples(150))
@given(case=groups())
def test_samples_in_every_mode_keep_every_invariant(case):
    mode, requests, num_blocks, num_slots, max_num_seqs = case
    sequences = []
    for name, prompt, n, output, arrival, prompt_logits in requests:
        sequences += samples(name, prompt, n, output, arrival, prompt_logits)
    knobs = dict(MODES[mode], kv_budget=2 * B, max_num_seqs=max_num_seqs)
    scheduler = Scheduler(config(**knobs), num_blocks, min(num_slots, num_blocks // 3))
    driver = InstantDriver(scheduler, compress_delay=(0, 2), seed=3, check=True)
    result = driver.run(sequences)
    accepted = [seq for seq in sequences if seq.error is None]
    assert result.summary["completed"] == len(accepted)
    assert all(seq.num_output_tokens == seq.max_output_tokens for seq in accepted)
