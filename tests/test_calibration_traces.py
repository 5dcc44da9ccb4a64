"""The traces calibration and the twin check run, sized to one engine (zipage/calibration_traces.py):
their size follows the engine's speed and the seconds asked, every request fits the deployment,
and the checking traces share no shape, name or seed with the fitting ones."""

from __future__ import annotations

import pytest

from zipage.calibration_traces import (
    LONG_CHAINS,
    LONG_PROMPTS,
    MAX_REQUESTS,
    EngineSpeed,
    check_traces,
    fit_traces,
    validation_trace,
)
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, trace_sequences
from zipage.core.scheduler import Scheduler
from zipage.sim.simulate import simulate
from zipage.trace import load_trace, prompt_block_keys, save_trace

# The probe of Qwen3-8B on an H200 (6 GB of KV, block 64, budget 512), and of its Full KV twin.
ZIPAGE = EngineSpeed(decode_step_s=9.1e-3, prefill_token_s=22e-6, concurrency=71,
                     kv_tokens=41_216, max_model_len=40_960, block_size=64, kv_budget=512,
                     step_tokens=2048)
FULL_KV = EngineSpeed(decode_step_s=8.0e-3, prefill_token_s=22e-6, concurrency=512,
                      kv_tokens=43_648, max_model_len=40_960, block_size=64, kv_budget=None,
                      step_tokens=2048)


def every_trace(speed: EngineSpeed, seconds: float = 20.0, seed: int = 3):
    return ([trace for trace, _ in fit_traces(speed, seconds)] + [validation_trace(speed, seconds)]
            + check_traces(speed, seconds, seed, count=5))


@pytest.mark.parametrize("speed", [ZIPAGE, FULL_KV], ids=["zipage", "full-kv"])
def test_every_request_fits_the_deployment(speed):
    config = ZipageConfig(block_size=speed.block_size, kv_budget=speed.kv_budget or 512,
                          compress=speed.kv_budget is not None, max_model_len=speed.max_model_len)
    scheduler = Scheduler(config, speed.kv_tokens // speed.block_size, speed.concurrency)
    for trace in every_trace(speed):
        for seq in trace_sequences(trace, 32_000, need_tokens=False, scheduler=scheduler):
            assert scheduler.admission.rejection_reason(seq) is None, trace.name
        assert len(trace.requests) >= 6, trace.name
        arrivals = [request.arrival_s for request in trace.requests]
        assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
        for request in trace.requests:
            assert request.prompt_len + request.output_len < speed.max_model_len
            assert request.prompt_len <= speed.kv_tokens // 3
            if request.kv_budget is not None:
                assert request.kv_budget % speed.block_size == 0
                assert request.kv_budget >= 2 * speed.block_size


def test_a_trace_lasts_the_seconds_asked_at_the_engines_speed():
    # Twice the seconds, twice the requests; a twice as fast engine, twice the requests.
    online = {trace.name: len(trace.requests) for trace, _ in fit_traces(ZIPAGE, 40.0)}
    longer = {trace.name: len(trace.requests) for trace, _ in fit_traces(ZIPAGE, 80.0)}
    faster = EngineSpeed(**{**ZIPAGE.__dict__, "decode_step_s": ZIPAGE.decode_step_s / 2,
                            "prefill_token_s": ZIPAGE.prefill_token_s / 2})
    quick = {trace.name: len(trace.requests) for trace, _ in fit_traces(faster, 40.0)}
    for name, count in online.items():
        assert longer[name] == pytest.approx(2 * count, rel=0.1), name
        assert quick[name] == pytest.approx(2 * count, rel=0.1), name
    huge = EngineSpeed(**{**ZIPAGE.__dict__, "decode_step_s": 1e-9, "prefill_token_s": 1e-12})
    assert all(len(trace.requests) == MAX_REQUESTS for trace, _ in fit_traces(huge, 1000.0))


def test_the_fitting_traces_cover_what_a_profile_needs():
    traces = dict((trace.name, (trace, changes)) for trace, changes in fit_traces(ZIPAGE, 60.0))
    assert traces["fit-long"][1] == {"chunked_prefill": False}  # whole-prompt prefill points
    long = [request.prompt_len for request in traces["fit-long"][0].requests]
    assert min(long) < 1024 and max(long) > 8192  # tokens and pairs vary apart
    compressing = [request.output_len > ZIPAGE.kv_budget
                   for request in traces["fit-pressure"][0].requests]
    assert all(compressing)
    shared = traces["fit-shared"][0].requests
    assert len({request.prefix_group for request in shared}) > 1
    assert all(request.prefix_len % ZIPAGE.block_size == 0 for request in shared)
    ingest = traces["fit-ingest"][0].requests
    assert all(request.output_len <= 64 for request in ingest)
    assert set(traces) == {"fit-online", "fit-long", "fit-pressure", "fit-shared", "fit-ingest",
                           "fit-longctx"}


@pytest.mark.parametrize("speed", [ZIPAGE, FULL_KV], ids=["zipage", "full-kv"])
def test_the_long_context_trace_holds_whole_long_prompts_at_small_batches(speed):
    # What pins the decode fit's context slope beside the longest request's term: chains of
    # long prompts, kept whole on a compressing deployment, beside a few short requests.
    trace, changes = dict((trace.name, (trace, changes))
                          for trace, changes in fit_traces(speed, 120.0))["fit-longctx"]
    assert changes == {}
    chained = [request for request in trace.requests if request.session is not None]
    assert sum(request.after is None for request in chained) == LONG_CHAINS
    assert all(request.prefix_len == 0 for request in chained if request.after is not None)
    cap = min(LONG_PROMPTS[1], speed.prompt_cap)
    assert all(min(LONG_PROMPTS[0], cap) <= request.prompt_len <= cap for request in chained)
    assert {request.compress_scope for request in chained} == (
        {"output"} if speed.compresses else {None})
    short = [request for request in trace.requests if request.session is None]
    assert len(short) >= 20
    assert all(request.output_len <= (speed.kv_budget or 512) for request in short)
    # Through the simulator (analytic costs of the deployment the speed was probed on): nearly
    # every decode step holds a long context, at a small batch, and nothing is preempted.
    settings = ReplaySettings(model="qwen3-8b", hardware="h200", kv_memory_gb=6.0,
                              config=ZipageConfig(block_size=speed.block_size, kv_budget=512,
                                                  compress=speed.compresses))
    summary, run = simulate(trace, settings)
    assert summary["preemptions"] == 0
    decode = [step for step in run.steps if step.kind == "decode"]
    long = [step for step in decode if step.decode_max_context >= LONG_PROMPTS[0]]
    assert len(decode) > 1000 and len(long) >= 0.9 * len(decode)
    batches = sorted(step.n_decode for step in decode)
    assert batches[0] == 1 and 4 <= batches[-1] <= 16  # the partitions vary with the batch


def test_checking_traces_are_fresh_and_reproducible(tmp_path):
    fitted = {trace.name for trace, _ in fit_traces(ZIPAGE, 20.0)} | {
        validation_trace(ZIPAGE, 20.0).name}
    checks = check_traces(ZIPAGE, 20.0, seed=7, count=5)
    assert [trace.name for trace in checks] == ["check-conv", "check-code", "check-overload",
                                                 "check-bursts", "check-conv-1"]
    assert not fitted & {trace.name for trace in checks}
    again = check_traces(ZIPAGE, 20.0, seed=7, count=5)
    assert [trace.requests for trace in checks] == [trace.requests for trace in again]
    other = check_traces(ZIPAGE, 20.0, seed=8, count=1)
    assert other[0].requests != checks[0].requests
    # Mooncake-shaped: hashed blocks, some shared with earlier prompts, and a valid trace file.
    overload = checks[2]
    keys = [prompt_block_keys(request, ZIPAGE.block_size) for request in overload.requests]
    seen, shared = set(), 0
    for request_keys in keys:
        shared += bool(request_keys and request_keys[0] in seen)
        seen.update(request_keys)
    assert shared > 0
    save_trace(overload, tmp_path / "overload.jsonl.gz")
    assert load_trace(tmp_path / "overload.jsonl.gz").requests == overload.requests
    # Bursts: per-request budgets on a compressing deployment, none on Full KV.
    assert len({request.kv_budget for request in checks[3].requests}) > 1
    assert {request.kv_budget for request in check_traces(FULL_KV, 20.0, 7, 4)[3].requests} \
        == {None}
