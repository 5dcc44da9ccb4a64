"""Property tests of the shared core, driven by the instant driver with every invariant checked
each step (zipage/core/invariants.py): deadlock freedom within the documented step bound, exact
output counts, the N_max cap, refcounts and leaks, shared blocks never written, slots <= M, no
preemption of compressed/compressing requests, FCFS first admission, and rule 7."""

from __future__ import annotations

import pytest
from hypothesis import given

from strategies import MODES, cases
from zipage.core.scheduler import Scheduler
from zipage.sim.instant import InstantDriver


def run_case(case):
    scheduler = Scheduler(case.config, case.num_blocks, case.num_slots)
    driver = InstantDriver(scheduler, compress_delay=case.delay, seed=7, check=True)
    sequences = case.sequences()
    result = driver.run(sequences)
    return scheduler, sequences, result


@pytest.mark.parametrize("mode", list(MODES))
def test_invariants_hold(mode):
    @given(case=cases(mode))
    def check(case):
        scheduler, sequences, result = run_case(case)
        accepted = [seq for seq in sequences if seq.error is None]
        rejected = [seq for seq in sequences if seq.error is not None]
        # Every request that can be served finishes with exactly its tokens; the others are
        # rejected alone, with a reason.
        assert result.summary["completed"] == len(accepted)
        assert all(seq.num_output_tokens == seq.max_output_tokens for seq in accepted)
        for seq in rejected:
            assert "request" in seq.error and scheduler.peak_blocks(
                seq.prompt_len, seq.max_output_tokens) > case.num_blocks or "max_num" in seq.error
        if not case.config.compress:
            assert result.summary["compressions"] == 0
        else:
            assert result.summary["max_blocks_after_compress"] <= case.config.n_max

    check()
