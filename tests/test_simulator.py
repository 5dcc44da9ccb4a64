"""The simulator twin: same decisions as the instant driver in sync mode, the core's invariants
under random step and compression durations (async included), mixed steps (chunked prefill)
timed by the cost model as one step, and the CLI's contract."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from strategies import MODES, cases, mode_seed
from tolerance import close

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.step import DECODE, IDLE, MIXED, PREFILL
from zipage.hardware import get_hardware
from zipage.presets import get_preset
from zipage.sim.analytic import AnalyticCostModel
from zipage.sim.cost_model import CostModel
from zipage.sim.instant import InstantDriver
from zipage.sim.simulate import simulate
from zipage.sim.simulator import Simulator
from zipage.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent


class RandomCostModel(CostModel):
    """Durations drawn at random: the core's decisions must stay valid whatever the timing."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def step_time(self, plan) -> float:
        return self.rng.uniform(0.001, 0.2 if plan.prefill else 0.05)

    def compress_time(self, jobs) -> float:
        return self.rng.uniform(0.0, 0.3)

    def decode_contention(self, overlap_fraction: float) -> float:
        return 1.0 + 0.3 * overlap_fraction

    def forward_time_for(self, work):
        raise NotImplementedError

    def compress_time_for(self, blocks):
        raise NotImplementedError


def offline(case):
    return replace(case, requests=[(i, t, o, 0) for i, t, o, _ in case.requests])


@pytest.mark.parametrize("mode", list(MODES))
def test_sync_simulator_decides_exactly_like_the_instant_driver(mode):
    @mode_seed(mode)
    @settings(max_examples=examples(60))
    @given(case=cases(mode), seed=st.integers(0, 1000))
    def check(case, seed):
        case = offline(case)
        config = replace(case.config, async_compress=False)
        instant = InstantDriver(case.new_scheduler(config),
                                log_decisions=True).run(case.sequences())
        simulated = Simulator(case.new_scheduler(config),
                              RandomCostModel(seed), log_decisions=True).run(case.sequences())
        assert simulated.decision_log == instant.decision_log

    check()


@pytest.mark.parametrize("mode", list(MODES))
def test_invariants_hold_under_random_timing(mode):
    @mode_seed(mode)
    @settings(max_examples=examples(100))
    @given(case=cases(mode), seed=st.integers(0, 1000))
    def check(case, seed):
        check_random_timing(case, seed)

    check()


def check_random_timing(case, seed: int) -> None:
    """Every request finishes with its tokens, every invariant holding, under random step times."""
    scheduler = case.new_scheduler()
    sequences = case.sequences()
    for seq in sequences:  # arrivals in seconds instead of steps
        seq.arrival_s = seq.arrival_s * 0.05
    run = Simulator(scheduler, RandomCostModel(seed), check=True).run(sequences)
    accepted = [seq for seq in sequences if seq.error is None]
    assert run.summary["completed"] == len(accepted)
    assert all(seq.num_output_tokens == seq.max_output_tokens for seq in accepted)


@pytest.mark.parametrize("mode", list(MODES))
def test_plain_clock_runs_exactly_the_simpy_processes(mode):
    # `Simulator.run` on its own clock skips SimPy; on a SimPy environment it runs the processes.
    # Random step and compression times (zero-length batches included: a batch ending with a
    # step) and arrivals during steps: the same decisions, step times and request times.
    @mode_seed(mode)
    @settings(max_examples=examples(60))
    @given(case=cases(mode), seed=st.integers(0, 1000))
    def check(case, seed):
        runs = []
        for env in (None, simpy.Environment()):
            sequences = case.sequences()
            for seq in sequences:  # arrivals in seconds, some of them during steps
                seq.arrival_s = seq.arrival_s * 0.05
            scheduler = case.new_scheduler()
            runs.append(Simulator(scheduler, RandomCostModel(seed), log_decisions=True,
                                  env=env).run(sequences))
        plain, simulated = runs
        assert plain.decision_log == simulated.decision_log
        assert [(s.t_start, s.t_end) for s in plain.steps] == [
            (close(s.t_start), close(s.t_end)) for s in simulated.steps]
        assert [(r.id, r.first_token, r.finish) for r in plain.requests] == [
            (r.id, close(r.first_token), close(r.finish)) for r in simulated.requests]

    check()


def simulate_tiny_beside_instant(config: ZipageConfig):
    """traces/tiny.json simulated with the analytic cost model (sync compression) and run by the
    instant driver at the same capacity: (summary, simulated run, instant run)."""
    from zipage.core.deployment import trace_sequences
    from zipage.model_spec import resolve_shape

    trace = load_trace(ROOT / "traces" / "tiny.json")
    settings_ = ReplaySettings(model="qwen3-0.6b", kv_memory_gb=0.05, config=config)
    summary, run = simulate(trace, settings_, log_decisions=True, check=True)
    shape = resolve_shape("qwen3-0.6b")
    scheduler = Scheduler(replace(config, max_model_len=shape.max_position),
                          summary["num_blocks"], summary["max_concurrency"])
    instant = InstantDriver(scheduler, log_decisions=True).run(
        trace_sequences(trace, shape.vocab_size, need_tokens=True))
    return summary, run, instant


def test_tiny_trace_decisions_match_instant_driver_with_real_cost_model():
    config = ZipageConfig(block_size=16, window=4, kv_budget=64, async_compress=False)
    summary, run, instant = simulate_tiny_beside_instant(config)
    trace = load_trace(ROOT / "traces" / "tiny.json")
    assert run.decision_log == instant.decision_log
    assert summary["completed"] == len(trace.requests) and summary["compressions"] > 0


def test_async_compression_starts_behind_its_step_and_stretches_the_next():
    # The engine launches a batch behind its step's forward: the batch starts when that step
    # ends, so it is never reported done in it, and it slows the steps it overlaps by the
    # contention factor (free at 1.0); sync compression has no overlap to pay for.
    trace = load_trace(ROOT / "traces" / "tiny.json")
    base = ZipageConfig(block_size=16, window=4, kv_budget=64)
    makespans = {}
    for asynchronous in (True, False):
        for contention in (1.0, 3.0):
            config = replace(base, async_compress=asynchronous)
            summary, run = simulate(trace, ReplaySettings(model="qwen3-8b", kv_memory_gb=1.0,
                                                          config=config),
                                    contention_factor=contention)
            makespans[asynchronous, contention] = summary["makespan_s"]
            if asynchronous:
                launches = [step for step in run.steps if step.n_compress]
                assert launches and not any(step.batches_done for step in launches
                                            if step.kind != IDLE)
    assert makespans[True, 3.0] > makespans[True, 1.0]
    assert makespans[False, 3.0] == close(makespans[False, 1.0])


CHUNKED_SHAPES = [(70, 12), (5, 30), (130, 8), (33, 20), (64, 1), (200, 15)]  # prompt, output


def chunked_run(driver_class, **driver_knobs):
    """A run of the core's chunked prefill (sync compression, a step budget of 48 tokens, so
    prompts split and share steps with decodes), and the plans it was made of."""
    config = ZipageConfig(block_size=16, window=4, kv_budget=64, async_compress=False,
                          chunked_prefill=True, max_num_batched_tokens=48)
    scheduler = Scheduler(config, num_blocks=64, num_query_slots=4)
    plans, schedule = [], scheduler.schedule

    def recording_schedule():
        plan = schedule()
        if plan is not None:
            plans.append(plan)
        return plan

    scheduler.schedule = recording_schedule
    # Arrivals about one analytic Qwen3-0.6B step apart (2-3 ms), so that prompts arrive while
    # others decode and a mixed step carries a sync compression.
    sequences = [Sequence(f"r{index}", [1000 * index + token for token in range(prompt)], output,
                          arrival_s=0.003 * index)
                 for index, (prompt, output) in enumerate(CHUNKED_SHAPES)]
    run = driver_class(scheduler, check=True, **driver_knobs).run(sequences)
    assert run.summary["completed"] == len(CHUNKED_SHAPES)
    assert run.summary["output_tokens"] == sum(output for _, output in CHUNKED_SHAPES)
    return run, plans


def test_simulator_times_mixed_steps_as_one_forward():
    cost = AnalyticCostModel(get_preset("qwen3-0.6b"), get_hardware("h200"), block_size=16,
                             window=4, kv_budget=64)
    run, plans = chunked_run(Simulator, cost_model=cost)
    assert {DECODE, PREFILL, MIXED} <= {record.kind for record in run.steps}
    assert any(plan.kind == MIXED and plan.compress_sync for plan in plans)
    for record, plan in zip(run.steps, plans, strict=True):
        assert record.kind == plan.kind
        assert record.t_end - record.t_start == pytest.approx(cost.step_time(plan), rel=1e-9)


def test_instant_driver_runs_a_mixed_step_as_one_step():
    run, plans = chunked_run(InstantDriver)
    assert MIXED in {record.kind for record in run.steps}
    assert [record.t_end - record.t_start for record in run.steps] == [1.0] * len(plans)


def test_sync_simulator_decides_like_the_instant_driver_with_chunked_prefill():
    config = ZipageConfig(block_size=16, window=4, kv_budget=64, async_compress=False,
                          chunked_prefill=True, max_num_batched_tokens=48)
    summary, run, instant = simulate_tiny_beside_instant(config)
    assert run.decision_log == instant.decision_log
    assert MIXED in {record.kind for record in run.steps}
    assert summary["completed"] == len(load_trace(ROOT / "traces" / "tiny.json").requests)


@pytest.mark.parametrize("mode", list(MODES))
def test_invariants_hold_under_random_timing_with_chunked_prefill(mode):
    from test_core_chunked import chunked_cases

    @mode_seed(mode)
    @settings(max_examples=examples(40))
    @given(case=chunked_cases(mode), seed=st.integers(0, 1000))
    def check(case, seed):
        check_random_timing(case, seed)

    check()


def run_cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zipage.cli", *arguments], capture_output=True,
                          text=True, cwd=ROOT)


def test_cli_json_prints_exactly_one_object(tmp_path):
    result = run_cli("replay", "traces/tiny.json", "--json", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    required = {"requests", "completed", "failed", "output_tokens", "makespan_s", "tps",
                "mean_tpot_ms", "peak_running", "mean_running", "preemptions", "compressions",
                "max_blocks_after_compress", "n_max", "max_concurrency", "num_blocks", "steps",
                "wall_s"}
    assert required <= set(summary)
    for name in ("summary.json", "steps.csv", "requests.csv", "decisions.log.gz", "timeline.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0


@pytest.mark.parametrize("arguments,fragment", [
    (("replay", "traces/tiny.json", "--budget", "100"), "kv_budget"),
    (("replay", "traces/tiny.json", "--model", "gpt-17"), "unknown preset"),
    (("replay", "traces/tiny.json", "--kv-memory-gb", "0.01"), "cannot hold one request"),
    (("replay", "traces/tiny.json", "--hardware", "tpu"), "unknown GPU"),
    (("replay", "no-such-trace.json"), "no-such-trace.json"),
])
def test_cli_errors_exit_2_with_one_line(arguments, fragment):
    result = run_cli(*arguments)
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_each_step_records_the_tokens_it_sampled():
    """`n_sampled`: a prompt chunk before its last samples nothing (what tells an engine run's
    steps that returned at their launch, `unsynced_chunk_steps`); every other token a step
    samples is one output token of a request."""
    from zipage.trace import Trace, TraceRequest

    trace = Trace(name="chunks", requests=[TraceRequest(id=f"r{i}", arrival_s=0.05 * i, prompt_len=length,
                                                   output_len=outputs)
                                           for i, (length, outputs) in enumerate([(900, 5), (40, 30), (300, 12)])])
    config = ZipageConfig(block_size=16, window=4, kv_budget=64, chunked_prefill=True,
                          max_num_batched_tokens=128)
    summary, run = simulate(trace, ReplaySettings(model="qwen3-0.6b", kv_memory_gb=0.5, config=config))
    assert summary["completed"] == 3 and summary["preemptions"] == 0
    sampled = [step.n_sampled for step in run.steps]
    assert sum(sampled) == sum(request.output_len for request in trace.requests)
    silent = [step for step in run.steps if step.n_sampled == 0 and step.kind != IDLE]
    # the 900-token prompt's chunks before its last: prefill steps (nothing else runs yet)
    assert silent and all(step.kind == PREFILL and step.n_decode == 0 for step in silent)
    assert all(step.n_sampled >= step.n_decode for step in run.steps)
