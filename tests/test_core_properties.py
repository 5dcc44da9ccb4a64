"""Property tests of the shared core, driven by the instant driver with every invariant checked
each step (zipage/core/invariants.py): deadlock freedom within the documented step bound, exact
output counts, the N_max cap, refcounts and leaks, shared blocks never written, slots <= M and
their hand-out, the victim rule of each mode and the front-of-queue rule, FCFS admission, the
prefix index, and rule 7.

Each mode draws its own examples, weighted to reach its rules (tests/strategies.py); the rules an
example reached are hypothesis events (`--hypothesis-show-statistics`), tallied per mode and
printed at the end of the run, and each mode must reach each of its rules in the share of
examples tests/rule_coverage.py asks for."""

from __future__ import annotations

import pytest
from hypothesis import event, given
from rule_coverage import MIN_SHARE, TALLY, RuleObserver
from strategies import MODES, cases, mode_seed

from zipage.sim.instant import InstantDriver


def run_case(case, observe: bool = False):
    scheduler = case.new_scheduler()
    driver = InstantDriver(scheduler, compress_delay=case.delay, seed=7, check=True)
    observer = RuleObserver(driver) if observe else None
    sequences = case.sequences()
    result = driver.run(sequences)
    return scheduler, sequences, result, observer


def pinned(seq, config) -> int:
    """The prompt blocks a request's compressions keep in place under the "output" scope."""
    return -(-seq.prompt_len // config.block_size) if config.compress_scope == "output" else 0


@pytest.mark.parametrize("mode", list(MODES))
def test_invariants_hold(mode):
    tally_before = TALLY[mode].copy()

    @mode_seed(mode)
    @given(case=cases(mode))
    def check(case):
        scheduler, sequences, result, observer = run_case(case, observe=True)
        for rule in sorted(observer.finish(mode)):
            event(rule)
        accepted = [seq for seq in sequences if seq.error is None]
        rejected = [seq for seq in sequences if seq.error is not None]
        # Every request that can be served finishes with exactly its tokens; the others are
        # rejected alone, with a reason.
        assert result.summary["completed"] == len(accepted)
        assert all(seq.num_output_tokens == seq.max_output_tokens for seq in accepted)
        config = case.config
        for seq in rejected:
            assert "request" in seq.error and scheduler.admission.peak_blocks(
                seq.prompt_len, seq.max_output_tokens, config.n_max + pinned(seq, config)
            ) > case.num_blocks or "max_num" in seq.error
        if not config.compress:
            assert result.summary["compressions"] == 0
        elif result.summary["compressions"]:
            # Rule 6, with the blocks an "output" scope keeps besides the budget's.
            assert result.summary["max_blocks_after_compress"] <= config.n_max + max(
                pinned(seq, config) for seq in accepted if seq.num_compressions)

    check()
    tally = TALLY[mode] - tally_before
    short = {rule: f"{tally[rule]}/{tally['examples']}" for rule, share in MIN_SHARE[mode].items()
             if tally[rule] < share * tally["examples"]}
    assert not short, f"{mode}: the generator reaches these rules too rarely: {short}"
