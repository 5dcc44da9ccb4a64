"""The core's async protocol (docs/architecture.md, 'Async scheduling'): `advance` a launched step,
`schedule` the next one, then `settle` the first with its result. Random traces with random
end-of-sequence stops and aborts through the instant driver, every invariant checked each step
(zipage/core/invariants.py), for every scheduling mode:

- every request that stops ends with exactly the tokens up to its stop, as it does synchronously,
  though its stop reaches the plans a step later; the rest finish whole; nothing leaks;
- with no stop and no async compression batch (Full KV, or compression before the step's
  decode), the plans are the synchronous ones, step for step: only a stop and an async batch's
  end reach the plans a step later."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import MODES, cases, mode_seed

from zipage.core.sequence import SequenceStatus
from zipage.sim.instant import InstantDriver


@st.composite
def cases_with_stops(draw, mode: str):
    case = draw(cases(mode))
    stops, aborts = {}, {}
    for seq_id, _, output_len, arrival in case.requests:
        if output_len > 1 and draw(st.booleans()):
            stops[seq_id] = draw(st.integers(1, output_len - 1))
        if draw(st.integers(0, 5)) == 0:
            aborts[seq_id] = arrival + draw(st.integers(0, 120))
    return case, stops, aborts


def outcome(sequences):
    return {seq.seq_id: (seq.status, seq.num_output_tokens) for seq in sequences}


@pytest.mark.parametrize("mode", list(MODES))
def test_async_stops_keep_every_invariant_and_the_synchronous_outputs(mode):
    @mode_seed(mode)
    @given(drawn=cases_with_stops(mode))
    def check(drawn):
        case, stops, _ = drawn
        results = {}
        for asynchronous in (False, True):
            sequences = case.sequences()
            driver = InstantDriver(case.new_scheduler(), compress_delay=case.delay, seed=7,
                                   check=True, stops=stops, asynchronous=asynchronous)
            driver.run(sequences)  # the checker fails any leak at the end
            results[asynchronous] = outcome(sequences)
            for seq in sequences:
                if seq.status is SequenceStatus.FINISHED:
                    expected = stops.get(seq.seq_id, seq.max_output_tokens)
                    assert seq.num_output_tokens == expected, (asynchronous, seq)
                    assert seq.finish_time is not None and seq.first_token_time is not None
                    assert seq.first_token_time <= seq.finish_time
        assert results[True] == results[False]

    check()


@pytest.mark.parametrize("mode", list(MODES))
def test_async_with_aborts_keeps_every_invariant(mode):
    @mode_seed(mode)
    @given(drawn=cases_with_stops(mode))
    def check(drawn):
        case, stops, aborts = drawn
        scheduler = case.new_scheduler()
        sequences = case.sequences()
        driver = InstantDriver(scheduler, compress_delay=case.delay, seed=7, check=True,
                               stops=stops, asynchronous=True)
        run = driver.run(sequences, aborts=aborts)
        for seq in sequences:
            if seq.status is SequenceStatus.FINISHED:
                assert seq.num_output_tokens == stops.get(seq.seq_id, seq.max_output_tokens)
            elif seq.status is SequenceStatus.ABORTED:
                assert seq.seq_id in aborts
        assert run.summary["completed"] + run.summary["aborted"] + run.summary["failed"] == \
            len(sequences)
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks

    check()


@pytest.mark.parametrize("mode", list(MODES))
def test_without_stops_async_plans_are_the_synchronous_ones(mode):
    @mode_seed(mode)
    @given(case=cases(mode))
    def check(case):
        logs = {}
        config = dataclasses.replace(case.config, async_compress=False)
        for asynchronous in (False, True):
            driver = InstantDriver(case.new_scheduler(config), seed=7, check=True,
                                   log_decisions=True, asynchronous=asynchronous)
            logs[asynchronous] = driver.run(case.sequences()).decision_log
        assert logs[True] == logs[False]

    check()
