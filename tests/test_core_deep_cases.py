"""Cases the deep hypothesis profile found (docs/testing.md), kept so the ci profile checks them
on every run. Each failed the invariant checker, not the scheduler: the plans were right, the
checker's rule for writing a shared block within the step that computes it was too narrow."""

from __future__ import annotations

from strategies import Case
from test_core_forks import MODES as FORK_MODES
from test_core_forks import B, config, samples

from zipage.config import ZipageConfig
from zipage.core.scheduler import Scheduler
from zipage.sim.instant import InstantDriver


def test_a_sample_forked_from_a_same_step_prefix_hit_may_hold_the_block_being_computed():
    # Step 0 prefills r0's 16-token prompt (block 0) and r2's 17-token one, which maps block 0
    # from the index in that step and forks r2#1 off it: r2#1 holds block 0 while r0 writes it,
    # and reads it only from the next step on. (Deep profile, seed 250870055.)
    prompt = list(range(162000000, 162000016))
    sequences = (samples("r0", prompt, 1, 1) + samples("r1", prompt[:1], 1, 1)
                 + samples("r2", prompt + [162000016], 2, 1) + samples("r3", prompt[:1], 1, 1))
    knobs = dict(FORK_MODES["async"], kv_budget=2 * B, max_num_seqs=512)
    scheduler = Scheduler(config(**knobs), 12, 1)
    run = InstantDriver(scheduler, compress_delay=(0, 2), seed=3, check=True).run(sequences)
    assert run.summary["completed"] == len(sequences)


def test_a_prefill_that_recomputes_a_freed_block_into_that_block_indexes_it_in_the_step():
    # r0's compression (step 16) rewrites the family's first prompt blocks and preempts r1 and r2;
    # r1's lookup then stops at block 0, so it recomputes its whole prompt, and the fresh block
    # it gets for position 4 is block 4 itself, freed with that very hash still indexed. r2
    # maps it from the index in the same step. (Deep profile, seed 250870055.)
    config_ = ZipageConfig(block_size=16, window=1, kv_budget=48, hybrid=True, prefix_cache=True,
                           async_compress=False,
                           chunked_prefill=True, max_compress_batch_blocks=1)
    family = list(range(100000, 100113))
    other = list(range(100000, 100080)) + list(range(21000, 21033))
    case = Case(config_, 12, 3, (0, 0),
                [("r0", family, 32, 1), ("r1", other, 32, 1), ("r2", family, 32, 2)])
    scheduler = case.new_scheduler()
    driver = InstantDriver(scheduler, compress_delay=case.delay, seed=7, check=True,
                           log_decisions=True)
    run = driver.run(case.sequences())
    assert run.summary["completed"] == 3
    assert "compress(sync)=r0" in driver.recorder.decision_log[16]
    assert driver.recorder.decision_log[32].startswith("step 32 prefill prefill=r1[0:129]")
