"""The simulator under async scheduling (docs/architecture.md, 'Async scheduling'): each step
planned while the one before runs, its result settled after that plan, as the engine's loop does.

- every invariant holds under random step and compression times, for every scheduling mode, and
  every request finishes with its tokens;
- its interleaving is the engine's: the simulated run, replayed step by step on its own clock by
  the step-time replay (whose interleaving tests/test_step_replay.py checks against the CPU
  engine's async runs), makes the same decisions;
- the analytic model hides the host's part of a step behind the device's; a profile measured
  synchronously is refused for an async run.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from strategies import MODES, cases, mode_seed
from test_simulator import ROOT, RandomCostModel
from tolerance import close

from zipage.core.deployment import ReplaySettings
from zipage.errors import ConfigError
from zipage.hardware import get_hardware
from zipage.presets import get_preset
from zipage.sim.analytic import AnalyticCostModel
from zipage.sim.simulate import simulate
from zipage.sim.simulator import Simulator
from zipage.sim.step_replay import replay_steps
from zipage.trace import load_trace


def async_case(case):
    return case.config.__class__(**{**case.config.to_dict(), "async_scheduling": True})


def simulated(case, seed: int, check: bool = False):
    config = async_case(case)
    sequences = case.sequences()
    for seq in sequences:  # arrivals in seconds, some of them during steps
        seq.arrival_s = seq.arrival_s * 0.05
    scheduler = case.new_scheduler(config)
    run = Simulator(scheduler, RandomCostModel(seed), check=check,
                    log_decisions=True).run(sequences)
    return config, sequences, run


@pytest.mark.parametrize("mode", list(MODES))
def test_invariants_hold_under_random_timing_with_async_scheduling(mode):
    @mode_seed(mode)
    @settings(max_examples=examples(60))
    @given(case=cases(mode), seed=st.integers(0, 1000))
    def check(case, seed):
        _, sequences, run = simulated(case, seed, check=True)
        accepted = [seq for seq in sequences if seq.error is None]
        assert run.summary["completed"] == len(accepted)
        assert all(seq.num_output_tokens == seq.max_output_tokens for seq in accepted)
        # Each step was planned before it started (1 ns: the sum of two float times).
        assert all(step.planned_at <= step.t_start + 1e-9 for step in run.steps)

    check()


@pytest.mark.parametrize("mode", list(MODES))
def test_the_step_time_replay_of_an_async_simulation_makes_its_decisions(mode):
    @mode_seed(mode)
    @settings(max_examples=examples(40))
    @given(case=cases(mode), seed=st.integers(0, 1000))
    def check(case, seed):
        config, sequences, run = simulated(case, seed)
        produced = {record.id: record.output_len for record in run.requests
                    if record.status == "finished"}
        fresh = case.sequences()
        for seq in fresh:
            seq.arrival_s = seq.arrival_s * 0.05
        replayed, drifted = replay_steps(case.new_scheduler(config), fresh, run.steps, produced)
        assert not drifted
        assert replayed.decision_log == run.decision_log

    check()


def test_a_step_lasts_the_longer_of_host_and_device_under_async_scheduling():
    shape, gpu = get_preset("qwen3-8b"), get_hardware("h200")
    sync = AnalyticCostModel(shape, gpu)
    overlapped = AnalyticCostModel(shape, gpu, async_scheduling=True)
    for batch, context in ((1, 512), (64, 64 * 2048), (512, 512 * 4096)):
        both = sync.forward_time(batch, context, 0, 0, 0, 0, 0, 0, 0)
        longer = overlapped.forward_time(batch, context, 0, 0, 0, 0, 0, 0, 0)
        host = gpu.step_overhead_s + batch * 5e-6
        assert longer < both
        assert close(both - longer) == min(host, both - host)


def test_a_synchronous_profile_is_refused_for_an_async_run(tmp_path):
    """Every shipped profile was measured with steps one after another, their host time in
    each: it would price an async run's steps long."""
    profile = str(ROOT / "sim" / "profiles" / "qwen3-8b-h200-b64-k512-zipage.json")
    assert "async_scheduling" not in json.load(open(profile))
    config = ReplaySettings.from_dict({
        "model": "qwen3-8b", "hardware": "h200", "kv_memory_gb": 6, "cost_model": profile,
        "config": {"block_size": 64, "kv_budget": 512, "async_scheduling": True}})
    with pytest.raises(ConfigError, match="async_scheduling: measured with False"):
        simulate(load_trace(ROOT / "traces" / "tiny.json"), config)


def test_async_scheduling_replays_a_trace_on_the_analytic_model():
    trace = load_trace(ROOT / "traces" / "tiny.json")
    runs = {}
    for asynchronous in (False, True):
        settings_ = ReplaySettings.from_dict({"model": "qwen3-8b", "hardware": "h200",
                                              "config": {"async_scheduling": asynchronous}})
        runs[asynchronous], _ = simulate(trace, settings_)
    assert runs[True]["completed"] == runs[False]["completed"] == len(trace.requests)
    assert runs[True]["makespan_s"] < runs[False]["makespan_s"]
