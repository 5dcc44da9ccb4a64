"""Step-time replay: the simulator driven by an engine run's measured clock makes exactly the
engine's decisions, step for step, with sync and async compression, with online arrivals, and
with chunked prefill (mixed steps)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402
from tolerance import assert_close  # noqa: E402

from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.deployment import ReplaySettings  # noqa: E402
from zipage.engine.replay import replay_on_engine  # noqa: E402
from zipage.errors import ZipageError  # noqa: E402
from zipage.records import STEP_COLUMNS  # noqa: E402
from zipage.rundir import write_run  # noqa: E402
from zipage.sim.step_replay import replay_step_times  # noqa: E402
from zipage.trace import Trace, TraceRequest  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_qwen3(directory)
    return directory


# Arrivals 5 ms apart into 0.1 MB of KV overlap and preempt whether a step takes 0.1 ms or 10 ms
# (40 ms apart, a fast machine finished each request before the next arrived: no preemption).
# The fitting tests keep the wider spacing, whose steps vary more.
TIGHT = dict(spacing=0.005, kv_memory_gb=0.0001)
WIDE = dict(spacing=0.04, kv_memory_gb=0.00012)


def online_trace(spacing: float = TIGHT["spacing"]) -> Trace:
    """Requests arriving while the engine runs (some share a prefix), long enough to compress."""
    shapes = [(20, 70), (33, 40), (5, 90), (40, 30), (17, 60), (64, 20), (21, 80), (48, 35)]
    return Trace("online", [
        TraceRequest(id=f"r{i}", arrival_s=spacing * i, prompt_len=prompt, output_len=output,
                     prefix_group="g" if i % 2 else None, prefix_len=16 if i % 2 else 0)
        for i, (prompt, output) in enumerate(shapes)])


def engine_run(model_dir, out_dir, trace: Trace, asynchronous: bool,
               kv_memory_gb: float = TIGHT["kv_memory_gb"], **knobs):
    """`zipage replay --engine cpu --out` of `trace` in a cache small enough to compress and
    preempt."""
    torch.set_num_threads(1)
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=asynchronous,
                          **knobs)
    settings = ReplaySettings(model=str(model_dir), dtype="float32", kv_memory_gb=kv_memory_gb,
                              config=config)
    summary, run = replay_on_engine(trace, settings, "cpu", log_decisions=True)
    return write_run(out_dir, summary, run.steps, run.requests, run.decision_log), summary, run


# Zipage compresses (sync and async); Full KV preempts (under Zipage the hybrid admission rule
# lends no reserved block, and this pool then never runs out: docs/architecture.md, 'Scheduling').
@pytest.mark.parametrize("asynchronous, compress", [(False, True), (True, True), (False, False)])
def test_step_replay_makes_the_engines_decisions(tiny_model, tmp_path, asynchronous, compress):
    trace = online_trace()
    out, summary, run = engine_run(tiny_model, tmp_path / "engine", trace, asynchronous,
                                   compress=compress)
    if compress:
        assert summary["compressions"] > 0 and summary["completed"] == len(trace.requests)
    else:  # one request needs more blocks than the pool holds: it fails alone
        assert summary["preemptions"] > 0 and summary["completed"] == len(trace.requests) - 1

    replayed, replay_run = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
    assert replay_run.decision_log == run.decision_log
    # Same clock, same decisions: the same latencies, request by request.
    engine_times = {r.id: (r.first_token, r.finish) for r in run.requests}
    assert_close({r.id: (r.first_token, r.finish) for r in replay_run.requests}, engine_times)


# Arrivals 0.2 s apart: the engine runs out of work between some, and an iteration that plans
# nothing settles the last step (no step is recorded for it).
@pytest.mark.parametrize("async_compress, spacing", [(False, TIGHT["spacing"]),
                                                     (True, TIGHT["spacing"]), (True, 0.2)])
def test_step_replay_of_an_async_scheduling_run(tiny_model, tmp_path, async_compress, spacing):
    """Each step planned while the one before runs: the replay interleaves plans and results as
    the engine's loop did (steps.csv's `planned_early`, `settled_late`)."""
    trace = online_trace(spacing)
    out, summary, run = engine_run(tiny_model, tmp_path / "engine", trace, async_compress,
                                   async_scheduling=True)
    assert summary["compressions"] > 0 and summary["completed"] == len(trace.requests)
    late = [step.settled_late for step in run.steps]
    assert sum(late) > len(late) // 2, "most steps launched behind the one before"
    if spacing > TIGHT["spacing"]:
        assert any(before.settled_late and not step.planned_early
                   for before, step in zip(run.steps, run.steps[1:]))
    assert all(step.planned_at <= step.t_start + 1e-9 for step in run.steps)

    replayed, replay_run = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
    engine_times = {r.id: (r.first_token, r.finish) for r in run.requests}
    assert_close({r.id: (r.first_token, r.finish) for r in replay_run.requests}, engine_times)


def test_step_replay_of_an_async_run_with_stops(tiny_model, tmp_path, monkeypatch):
    """A request that samples its EOS is stopped one step late under async scheduling (it was
    in the plan made before its token was seen); the replay stops it there too."""
    import zipage.engine.replay as engine_replay
    from zipage import SamplingParams

    trace = online_trace()
    _, _, plain = engine_run(tiny_model, tmp_path / "plain", trace, True, async_scheduling=True)
    # The EOS: the token most requests sample somewhere after their first output token.
    outputs = [tokens[request.prompt_len + 1:] for request, tokens in
               ((r, plain.tokens[r.id]) for r in trace.requests)]
    counts = {}
    for output in outputs:
        for token in set(output):
            counts[token] = counts.get(token, 0) + 1
    eos = max(counts, key=counts.get)
    monkeypatch.setattr(engine_replay, "SamplingParams",
                        lambda **values: SamplingParams(**{**values, "ignore_eos": False}))
    real_loop = engine_replay.EngineLoop
    monkeypatch.setattr(engine_replay, "EngineLoop",
                        lambda *args, **kw: real_loop(*args, eos_token_ids=frozenset({eos}), **kw))
    out, summary, run = engine_run(tiny_model, tmp_path / "engine", trace, True,
                                   async_scheduling=True)
    stopped = [r.id for r, request in zip(sorted(run.requests, key=lambda r: r.id),
                                          sorted(trace.requests, key=lambda r: r.id))
               if r.status == "finished" and r.output_len < request.output_len]
    assert len(stopped) >= 2, counts[eos]

    replayed, replay_run = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
    assert {r.id: r.output_len for r in replay_run.requests} == {
        r.id: r.output_len for r in run.requests}


def test_step_replay_reports_drift(tiny_model, tmp_path):
    trace = online_trace()
    out, _, _ = engine_run(tiny_model, tmp_path / "engine", trace, asynchronous=False)
    # A scheduling change the engine did not have: fewer running requests at once.
    values = json.loads((out / "summary.json").read_text())
    values["settings"]["config"]["max_num_seqs"] = 1
    (out / "summary.json").write_text(json.dumps(values))
    replayed, _ = replay_step_times(trace, out)
    assert not replayed["decisions_match"]
    assert replayed["first_decision_difference"]["step"] >= 0


def test_step_replay_needs_a_run_directory(tmp_path):
    with pytest.raises(ZipageError, match="--step-times"):
        replay_step_times(online_trace(), tmp_path)


def test_profile_fitted_from_the_run_simulates_it(tiny_model, tmp_path):
    from zipage.sim.profile_from_runs import profile_from_runs
    from zipage.sim.simulate import simulate

    trace = online_trace(WIDE["spacing"])
    # Whole-prompt prefill: a fit needs prefill-only steps, which chunked prefill mixes away.
    out, summary, _ = engine_run(tiny_model, tmp_path / "engine", trace, asynchronous=False,
                                 kv_memory_gb=WIDE["kv_memory_gb"], chunked_prefill=False)
    profile = profile_from_runs([out], gpu="h100")
    assert profile["decode"] and profile["prefill"] and profile["compress"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    settings = ReplaySettings(model=str(tiny_model), hardware="h100", dtype="float32",
                              kv_memory_gb=WIDE["kv_memory_gb"], cost_model=str(path),
                              config=ZipageConfig(block_size=16, window=4, kv_budget=32,
                                                  async_compress=False, chunked_prefill=False))
    simulated, _ = simulate(trace, settings)
    assert simulated["completed"] == summary["completed"]
    # The same decisions with fitted step times: the makespan within a factor of five. A unit or
    # feature mistake in the fit is off by orders of magnitude; a CPU shared with other work
    # stalls some measured steps, which a least-squares fit prices as noise (0.34 of the
    # engine's makespan at load average 14 on 2 cores, 0.8-1.2 on a quiet machine).
    assert 0.2 < simulated["makespan_s"] / summary["makespan_s"] < 5.0


def test_cli_step_times_and_calibrate_from_run(tiny_model, tmp_path, capsys):
    from zipage.cli.parser import main

    trace = online_trace(WIDE["spacing"])
    out, _, _ = engine_run(tiny_model, tmp_path / "engine", trace, asynchronous=True,
                           kv_memory_gb=WIDE["kv_memory_gb"], chunked_prefill=False)
    trace_path = tmp_path / "trace.json"
    from zipage.trace import save_trace

    save_trace(trace, trace_path)
    assert main(["replay", str(trace_path), "--step-times", str(out), "--no-progress"]) == 0
    assert "decisions: identical to the engine's, step for step" in capsys.readouterr().out
    profile = tmp_path / "profile.json"
    assert main(["calibrate", "--from-run", str(out), "--hardware", "h100",
                 "--out", str(profile)]) == 0
    assert json.loads(profile.read_text())["source"] == "runs"
    assert main(["calibrate", "--from-run", str(tmp_path / "nothing"), "--out",
                 str(profile)]) == 2
    assert "--from-run" in capsys.readouterr().err


@pytest.mark.parametrize("asynchronous", [False, True])
def test_step_replay_of_a_chunked_prefill_run(tiny_model, tmp_path, asynchronous):
    trace = online_trace()
    out, summary, run = engine_run(tiny_model, tmp_path / "engine", trace, asynchronous,
                                   chunked_prefill=True, max_num_batched_tokens=24)
    assert "mixed" in {record.kind for record in run.steps}
    assert summary["completed"] == len(trace.requests)
    replayed, replay_run = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
    # Every step, mixed ones included, lasts exactly what the engine measured.
    assert_close([(r.kind, r.t_start, r.t_end) for r in replay_run.steps],
                 [(r.kind, r.t_start, r.t_end) for r in run.steps])
    if not asynchronous:
        from zipage.sim.calibrated import CalibratedCostModel
        from zipage.sim.profile_from_runs import profile_from_runs

        # Pure prefill steps come only where nothing decodes: on a loaded machine this run's
        # arrivals can crowd together and leave fewer than the prefill fit needs, and a chunk
        # that ran faster than the run's median decode step is no point (`profile_from_runs`).
        # Runs of one whole prompt each (unchunked: every prefill step samples and is a point)
        # guarantee six, however loaded the machine.
        lone_outs = [engine_run(tiny_model, tmp_path / f"lone{length}",
                                Trace(f"lone{length}", [TraceRequest(id=f"p{length}", arrival_s=0.0,
                                                                     prompt_len=length,
                                                                     output_len=2)]),
                                asynchronous, chunked_prefill=False)[0]
                     for length in (16, 24, 40, 56, 72, 88)]
        profile = profile_from_runs([out, *lone_outs], gpu="h100")
        assert CalibratedCostModel.from_profile(profile).mixed_fit.num_points == len(
            profile["mixed"]) >= 2


def test_step_replay_refuses_a_served_run(tmp_path):
    """`zipage bench serve --out` measures from the client: no engine steps, no settings."""
    (tmp_path / "summary.json").write_text(json.dumps({"driver": "served", "settings": {},
                                                       "num_blocks": 0}))
    (tmp_path / "steps.csv").write_text(",".join(STEP_COLUMNS) + "\n")
    (tmp_path / "requests.csv").write_text("id,status,output_len\n")
    with pytest.raises(ZipageError, match="served run has no engine steps"):
        replay_step_times(online_trace(), tmp_path)
