"""The simulator's shortcuts give what the general path gives: a step priced from its plan's
counts (no `StepWork` built) costs what its `StepWork` costs, and a run whose sink takes
no request records (finished requests counted from their sequences) has the summary of a run
that makes every record."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tolerance import assert_close, close

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.recorder import RecordSink
from zipage.core.step import DECODE, MIXED, PREFILL, PrefillItem, StepPlan
from zipage.hardware import get_hardware
from zipage.presets import get_preset
from zipage.sim.cost_loader import load_cost_model
from zipage.sim.cost_model import StepWork
from zipage.sim.simulate import simulate
from zipage.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
QWEN3_8B = get_preset("qwen3-8b")
A100 = get_hardware("a100")
# (batch, summed context, longest context, shared KV entries) of decode steps
DECODE_STEPS = [(1, 700, 700, 0), (52, 52 * 600, 0, 0), (52, 31200, 6000, 0),
                (130, 250_000, 9000, 40_000), (512, 600_000, 1300, 0)]


# (num_cached_tokens, num_tokens, samples) of prompt chunks
CHUNKS = [(0, 3000, True), (1024, 2048, False), (4096, 4600, True)]


@pytest.mark.parametrize("spec", ["analytic", "example-synthetic"])
def test_a_step_costs_what_its_step_work_costs(spec):
    cost = load_cost_model(spec, QWEN3_8B, A100)
    plans = []
    for batch, context, longest, shared in DECODE_STEPS:
        plans.append(StepPlan(0, DECODE, num_decode=batch, decode_context_tokens=context,
                              decode_max_context=longest, shared_kv_tokens=shared))
        expected = cost.forward_time_for(StepWork(batch, context, decode_max_context=longest,
                                                  shared_kv_tokens=shared))
        assert expected > 0
        assert cost.forward_time(batch, context, 0, 0, 0, 0, 0, longest, shared) == close(expected)
    for batch, context, longest, shared in [(0, 0, 0, 0)] + DECODE_STEPS[:3]:
        chunks = [PrefillItem(None, cached, total, samples) for cached, total, samples in CHUNKS]
        plans.append(StepPlan(0, MIXED if batch else PREFILL, prefill=chunks, num_decode=batch,
                              decode_context_tokens=context, decode_max_context=longest,
                              shared_kv_tokens=shared))
    for plan in plans:
        chunks = plan.prefill
        work = StepWork(plan.num_decode, plan.decode_context_tokens, len(chunks),
                        sum(item.samples for item in chunks),
                        sum(item.num_new_tokens for item in chunks),
                        sum(item.num_cached_tokens for item in chunks),
                        sum(item.attention_pairs for item in chunks), plan.decode_max_context,
                        plan.shared_kv_tokens)
        assert StepWork.of(plan) == work  # (counts: ints)
        assert cost.step_time(plan) == close(cost.forward_time_for(work))


class Collector(RecordSink):
    """A sink that keeps the request records it is given (and says it takes them)."""

    takes_requests = True

    def __init__(self) -> None:
        self.requests = []

    def request(self, record) -> None:
        self.requests.append(record)


def without_wall(summary: dict) -> dict:
    return {key: value for key, value in summary.items() if key != "wall_s"}


@pytest.mark.parametrize("trace_name, config", [
    ("chat.json", ZipageConfig()),
    ("longbench.json", ZipageConfig(budget_policy="elastic")),
    # Requests longer than max_model_len are rejected: failed records beside counted ones.
    ("tiny.json", ZipageConfig(block_size=16, window=4, kv_budget=64, max_model_len=400)),
])
def test_counting_finished_requests_without_records_keeps_the_summary(trace_name, config):
    trace = load_trace(ROOT / "traces" / trace_name)
    settings = ReplaySettings(model="qwen3-8b", hardware="h200", config=config)
    if trace_name == "tiny.json":
        settings = replace(settings, kv_memory_gb=1.0)
    kept_summary, kept = simulate(trace, settings)
    collector = Collector()
    streamed_summary, streamed = simulate(trace, settings, sink=collector)
    counted_summary, counted = simulate(trace, settings, sink=RecordSink())

    assert kept_summary["completed"] > 0
    assert_close(without_wall(counted_summary), without_wall(kept_summary), what="summary")
    assert_close(without_wall(streamed_summary), without_wall(kept_summary), what="summary")
    # A sink that takes request records gets every one; one that takes none, none; the failed
    # ones stay in the run either way.
    assert_close(collector.requests, kept.requests, what="requests")
    failed = [record for record in kept.requests if record.error is not None]
    assert_close(counted.requests, failed, what="failed")
    assert_close(streamed.requests, failed, what="failed")
    if trace_name == "tiny.json":
        assert failed and kept_summary["failed"] == len(failed)
