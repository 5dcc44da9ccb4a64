"""Per-request and elastic budgets in the simulator and in `zipage plan`
(docs/architecture.md, 'Per-request and elastic budgets'): a trace's `kv_budget`s reach the core,
a bad one fails alone; the elastic policy keeps Full-KV exactness on a few requests, raises the
budget requests keep under load without breaking any invariant; the budget policy is a plan axis.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest
from tolerance import close

from zipage.cli.parser import build_parser
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.errors import ConfigError
from zipage.sim.simulate import simulate
from zipage.trace import Trace, TraceRequest, load_trace, stamp_arrivals

ROOT = Path(__file__).resolve().parent.parent


def settings(**knobs) -> ReplaySettings:
    config = ZipageConfig(**{**dict(block_size=64, kv_budget=512), **knobs})
    return ReplaySettings(model="qwen3-8b", hardware="h200", kv_memory_gb=2.0, config=config)


def test_trace_budgets_reach_the_core_and_a_bad_one_fails_alone():
    trace = Trace("budgets", [
        TraceRequest("small", 0.0, prompt_len=100, output_len=2000, kv_budget=256),
        TraceRequest("large", 0.0, prompt_len=100, output_len=2000, kv_budget=1024),
        TraceRequest("default", 0.0, prompt_len=100, output_len=2000),
        TraceRequest("bad", 0.0, prompt_len=100, output_len=20, kv_budget=100)])
    summary, run = simulate(trace, settings(), check=True)
    records = {record.id: record for record in run.requests}
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert "kv_budget 100 must be a positive multiple of block_size 64" in records["bad"].error
    for name, budget in (("small", 256), ("large", 1024), ("default", 512)):
        assert records[name].kv_budget == budget and records[name].kept_budget == close(budget)
        assert records[name].max_blocks_held_after_first_compression == budget // 64 + 1
    assert summary["mean_kept_budget"] == pytest.approx((256 + 1024 + 512) / 3)


def test_elastic_keeps_full_kv_for_a_few_requests():
    """A few long requests in a pool that holds all of them: the elastic policy never compresses
    (Full-KV exactness) where the fixed one compresses each of them every block."""
    trace = Trace("few", [TraceRequest(f"r{index}", 0.0, prompt_len=200, output_len=3000)
                          for index in range(4)])
    fixed, _ = simulate(trace, settings(), check=True)
    elastic, _ = simulate(trace, settings(budget_policy="elastic"), check=True)
    full, _ = simulate(trace, settings(compress=False), check=True)
    assert fixed["compressions"] > 100 and fixed["mean_kept_budget"] == close(512)
    assert elastic["compressions"] == 0 and elastic["preemptions"] == 0
    assert elastic["mean_kept_budget"] == close(3199) and full["mean_kept_budget"] == close(3199)
    assert elastic["output_tokens"] == fixed["output_tokens"]


def test_elastic_under_load_keeps_more_and_breaks_no_invariant():
    """An online mixture in a pool that binds at times: elastic requests keep more than the
    budget on average, and every invariant holds on every step (checked)."""
    trace = load_trace(ROOT / "traces" / "gsm8k.json")
    trace = stamp_arrivals(Trace("gsm8k-200", trace.requests[:200]), rate_qps=20.0, seed=1)
    small = dict(kv_memory_gb=0.5)
    fixed, _ = simulate(trace, replace(settings(), **small), check=True)
    elastic, _ = simulate(trace, replace(settings(budget_policy="elastic"), **small), check=True)
    assert fixed["completed"] == elastic["completed"] == 200
    assert fixed["mean_kept_budget"] == close(512)
    assert elastic["mean_kept_budget"] > 512
    assert elastic["compressions"] < fixed["compressions"]


def test_budget_policy_is_a_plan_axis(tmp_path, capsys):
    trace_path = ROOT / "traces" / "tiny.json"
    parser = build_parser()
    args = parser.parse_args([
        "plan", str(trace_path), "--hardware", "h100", "--budget", "64",
        "--budget-policy", "fixed,elastic", "--block-size", "32", "--kv-memory-gb", "1",
        "--workers", "1", "--no-progress", "--out", str(tmp_path)])
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert "2 points (2 budget policies)" in printed
    with (tmp_path / "results.csv").open() as handle:
        rows = {row["budget_policy"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"fixed", "elastic"}
    assert float(rows["elastic"]["mean_kept_budget"]) > float(rows["fixed"]["mean_kept_budget"])
    args = parser.parse_args(["plan", str(trace_path), "--budget-policy", "fixed,adaptive"])
    with pytest.raises(ConfigError, match="--budget-policy: got 'adaptive'"):
        args.handler(args)
