"""The compression scope: under "output" a compression never touches the prompt (it keeps the
prompt's blocks in place, so the next turn of a session finds them in the prefix cache) and a
request is accounted as its prompt plus its budget; "all" is the paper's rule."""

from __future__ import annotations

import pytest

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, trace_sequences
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.errors import ConfigError, TraceError
from zipage.sim.instant import InstantDriver
from zipage.sim.simulate import simulate
from zipage.trace import Trace, TraceRequest, parse_trace

B = 16


def _scheduler(scope: str, num_blocks: int = 64, **knobs) -> Scheduler:
    config = ZipageConfig(block_size=B, window=4, kv_budget=2 * B, async_compress=False,
                          compress_scope=scope, **knobs)
    return Scheduler(config, num_blocks=num_blocks, num_query_slots=4)


def test_output_scope_keeps_the_prompt_blocks_in_place_through_every_compression():
    scheduler = _scheduler("output")
    seq = Sequence("a", list(range(100, 100 + 5 * B + 3)), 10 * B)  # 5 full blocks + 3
    run = InstantDriver(scheduler, check=True, log_decisions=True).run([seq])
    assert run.summary["completed"] == 1 and run.summary["compressions"] >= 3
    compressions = [line for line in run.decision_log if "compress(" in line]
    prompt_blocks = compressions[0].split(":", 1)[1].split("|")[0]
    assert all(f":{prompt_blocks}|" in line for line in compressions)  # the same 6 blocks
    assert prompt_blocks.count(",") == 5
    # N_max = its prompt's 6 blocks + the budget's 2 + 1: after each compression it holds 9.
    assert seq.n_max == 9 and seq.max_blocks_after_first_compression == 9
    # Its kept budget is the budget (the generated entries it kept), not the prompt.
    assert seq.kept_budget == 2 * B


def test_all_scope_compresses_the_prompt_as_the_paper_does():
    scheduler = _scheduler("all")
    seq = Sequence("a", list(range(100, 100 + 5 * B + 3)), 10 * B)
    run = InstantDriver(scheduler, check=True, log_decisions=True).run([seq])
    assert seq.n_max == 3 and seq.max_blocks_after_first_compression == 3
    assert not any("|" in line for line in run.decision_log)


def test_a_request_is_accounted_as_its_prompt_plus_its_budget():
    # Output scope: a prompt of 20 blocks with a 2-block budget peaks at 20 + 2 + 1 blocks, so
    # a 22-block pool refuses it (with its reason) where "all" admits it (peak 20 blocks).
    for scope, refused in (("output", True), ("all", False)):
        scheduler = _scheduler(scope, num_blocks=22)
        seq = Sequence("long", None, 10 * B, prompt_len=20 * B)
        reason = scheduler.admission.rejection_reason(seq)
        assert (reason is not None) == refused, (scope, reason)
        if refused:
            assert "needs 23 KV blocks at its peak but only 22 exist" in reason


def test_a_request_may_choose_its_own_scope():
    requests = [TraceRequest("keep", 0.0, prompt_len=4 * B, output_len=8 * B,
                             compress_scope="output"),
                TraceRequest("thin", 0.0, prompt_len=4 * B, output_len=8 * B)]
    scheduler = _scheduler("all")
    sequences = trace_sequences(Trace("t", requests), 32000, need_tokens=False,
                                scheduler=scheduler, block_keys=True)
    InstantDriver(scheduler, check=True).run(sequences)
    keep, thin = sequences
    assert (keep.pinned, keep.n_max) == (4, 7) and (thin.pinned, thin.n_max) == (0, 3)


def test_bad_scopes_name_the_field():
    with pytest.raises(ConfigError, match="compress_scope"):
        ZipageConfig(compress_scope="prompt").validate()
    with pytest.raises(TraceError, match="compress_scope must be one of 'all', 'output'"):
        parse_trace({"version": 1, "requests": [
            {"id": "x", "arrival_s": 0, "prompt_len": 5, "output_len": 5,
             "compress_scope": "none"}]})


def _agent_trace(sessions: int = 8, turns: int = 6) -> Trace:
    """Agent-shaped sessions: a shared system prompt, each call re-reading the last one's
    prompt and output plus a tool result."""
    requests = []
    for number in range(sessions):
        name = f"s{number}"
        prompt = 1024
        requests.append(TraceRequest(f"{name}-0", 0.2 * number, prompt_len=prompt,
                                     output_len=256, session=name, prefix_group="system",
                                     prefix_len=512))
        for turn in range(1, turns):
            history = prompt + 256
            prompt = history + 256
            requests.append(TraceRequest(f"{name}-{turn}", 0.0, prompt_len=prompt,
                                         output_len=256, after=f"{name}-{turn - 1}",
                                         after_s=0.5, prefix_len=history))
    from zipage.trace import _request_to_json

    return parse_trace({"version": 1, "name": "agent",
                        "requests": [_request_to_json(request) for request in requests]})


def test_output_scope_keeps_the_next_turns_prefix_hits_where_all_loses_them():
    # The simulator on agent sessions whose prompts outgrow the budget, in memory that binds:
    # "all" rewrites the prompt blocks a compression finds unshared, so the next call
    # re-prefills them; "output" keeps them, and hits at least as much as Full KV.
    trace = _agent_trace()
    hits = {}
    for name, knobs in (("all", {}), ("output", {"compress_scope": "output"}),
                        ("full", {"compress": False})):
        config = ZipageConfig(block_size=64, kv_budget=512, **knobs)
        settings = ReplaySettings(model="qwen3-8b", hardware="h200", kv_memory_gb=2,
                                  config=config)
        summary, _ = simulate(trace, settings, check=True)
        assert summary["completed"] == len(trace.requests)
        hits[name] = summary["prefix_hit_tokens"]
    assert hits["output"] >= 0.95 * hits["full"] and hits["output"] > 1.5 * hits["all"]


def test_the_engine_compresses_past_the_prompt_and_decides_as_the_core_does(tmp_path):
    # The CPU engine on a tiny model under the "output" scope: jobs cover only the blocks after
    # the prompt, the prompt's blocks stay in the table, and a step-time replay of the run
    # decides exactly as the engine did.
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import save_tiny_qwen3

    from zipage.engine.replay import replay_on_engine
    from zipage.rundir import write_run
    from zipage.sim.step_replay import replay_step_times

    torch.set_num_threads(1)
    save_tiny_qwen3(tmp_path / "model")
    requests = [TraceRequest(f"r{index}", 0.0, prompt_len=20 + 9 * index, output_len=90,
                             prefix_group="g", prefix_len=16) for index in range(4)]
    trace = Trace("scope", requests)
    for asynchronous in (False, True):
        config = ZipageConfig(block_size=16, window=4, kv_budget=32, compress_scope="output",
                              async_compress=asynchronous)
        settings = ReplaySettings(model=str(tmp_path / "model"), dtype="float32",
                                  kv_memory_gb=0.0002, config=config)
        summary, run = replay_on_engine(trace, settings, "cpu", log_decisions=True)
        assert summary["completed"] == 4 and summary["compressions"] > 0
        assert any("|" in line for line in run.decision_log)  # prompt blocks kept aside
        run_dir = write_run(tmp_path / f"run-{asynchronous}", summary, run.steps, run.requests,
                            run.decision_log)
        replayed, _ = replay_step_times(trace, run_dir)
        assert replayed["decisions_match"], replayed["first_decision_difference"]
