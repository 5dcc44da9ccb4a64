"""Sessions: a follow-up turn arrives after its predecessor finished (closed loop) in every driver,
its prompt begins with its predecessor's history (block keys equal exactly where the engine's
tokens are), a failed turn fails the turns after it, and a bad session trace is one line naming
the request."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from tolerance import close

from zipage.cli.parser import main
from zipage.config import ZipageConfig
from zipage.core.block_manager import prompt_block_hashes
from zipage.core.deployment import ReplaySettings, trace_sequences
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import SequenceStatus
from zipage.errors import TraceError
from zipage.sessions import SessionKeys, follow_up_tokens, own_tokens
from zipage.sim.instant import InstantDriver
from zipage.sim.simulate import simulate
from zipage.trace import (
    Trace,
    TraceRequest,
    load_trace,
    parse_trace,
    prompt_block_keys,
    prompt_token_ids,
    save_trace,
    session_history,
    token_stream,
)
from zipage.trace_stream import open_trace_stream

VOCAB = 32000


# ---------------------------------------------------------------- session traces


@st.composite
def session_traces(draw, max_sessions: int = 4, max_turns: int = 6) -> Trace:
    """Sessions of up to `max_turns` turns, some sharing a system prompt (a prefix group), each
    turn following an earlier one of its session (fan-out: several may follow one), keeping all
    of its history or a part, in a file order that interleaves sessions."""
    sessions = []
    for number in range(draw(st.integers(1, max_sessions))):
        name = f"s{number}"
        prompt = draw(st.integers(1, 90))
        shared = draw(st.sampled_from([0, 0, min(prompt, 40)]))
        root = TraceRequest(
            id=f"{name}-0", arrival_s=float(draw(st.integers(0, 20))), prompt_len=prompt,
            output_len=draw(st.integers(1, 40)), session=name,
            prefix_group="system" if shared else None, prefix_len=shared,
            reasoning_len=0)
        root = _with_reasoning(draw, root)
        turns = [root]
        for index in range(1, draw(st.integers(1, max_turns))):
            predecessor = draw(st.sampled_from(turns[-2:]))  # mostly the latest; fan-out too
            history = session_history(predecessor)
            kept = history if draw(st.booleans()) else draw(st.integers(0, history))
            new = draw(st.integers(0 if kept else 1, 40))
            turn = TraceRequest(
                id=f"{name}-{index}", arrival_s=root.arrival_s, prompt_len=kept + new,
                output_len=draw(st.integers(1, 40)), session=name, after=predecessor.id,
                after_s=float(draw(st.sampled_from([0, 0, 1, 3]))), prefix_len=kept)
            turns.append(_with_reasoning(draw, turn))
        sessions.append(turns)
    # Interleave the sessions: each keeps its own order (a turn after its predecessor).
    order = draw(st.permutations([index for index, turns in enumerate(sessions)
                                  for _ in turns]))
    positions = [0] * len(sessions)
    requests = []
    for index in order:
        requests.append(sessions[index][positions[index]])
        positions[index] += 1
    return Trace("sessions", requests)


def _with_reasoning(draw, request: TraceRequest) -> TraceRequest:
    from dataclasses import replace

    return replace(request, reasoning_len=draw(st.integers(0, request.output_len)))


def output_tokens(request: TraceRequest) -> list[int]:
    """What an engine that computes tokens produced for `request` (any fixed tokens will do)."""
    return token_stream("output", request.id, request.output_len, VOCAB)


def engine_prompts(trace: Trace) -> dict[str, list[int]]:
    """Each request's prompt as the engine builds it: a follow-up's from its predecessor's
    prompt and output (`follow_up_tokens`)."""
    prompts: dict[str, list[int]] = {}
    by_id = {request.id: request for request in trace.requests}
    for request in trace.requests:
        if request.after is None:
            prompts[request.id] = prompt_token_ids(request, VOCAB)
            continue
        predecessor = by_id[request.after]
        history = prompts[predecessor.id] + output_tokens(predecessor)
        prompts[request.id] = follow_up_tokens(history, predecessor.prompt_len,
                                               predecessor.reasoning_len, request.prefix_len,
                                               own_tokens(request, VOCAB))
    return prompts


@settings(max_examples=examples(150))
@given(trace=session_traces(), block_size=st.sampled_from([4, 8, 16]))
def test_block_keys_are_equal_exactly_where_the_engines_tokens_are(trace, block_size):
    # The simulator's keys of every prompt block against the prefix cache's hashes of the
    # engine's tokens (each covers its block and every token before it): the same partition.
    trace = parse_trace(_as_json(trace))  # what the loader fills in (sessions' starts)
    prompts = engine_prompts(trace)
    keys = SessionKeys(block_size, lambda request: prompt_block_keys(request, block_size))
    key_of_hash: dict[int, int] = {}
    hash_of_key: dict[int, int] = {}
    for request in trace.requests:
        assert len(prompts[request.id]) == request.prompt_len
        ours = keys.keys(keys.note(request))
        theirs = prompt_block_hashes(prompts[request.id], block_size)
        assert len(ours) == len(theirs) == request.prompt_len // block_size
        for key, block_hash in zip(ours, theirs):
            assert key_of_hash.setdefault(block_hash, key) == key, request.id
            assert hash_of_key.setdefault(key, block_hash) == block_hash, request.id


def _as_json(trace: Trace) -> dict:
    from zipage.trace import _request_to_json

    return {"version": 1, "name": trace.name,
            "requests": [_request_to_json(request) for request in trace.requests]}


# ---------------------------------------------------------------- closed loop


def _scheduler(**knobs) -> Scheduler:
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=False, **knobs)
    return Scheduler(config, num_blocks=48, num_query_slots=3)


@settings(max_examples=examples(100))
@given(trace=session_traces(), compress=st.booleans(), prefix_cache=st.booleans())
def test_instant_driver_sends_each_turn_after_its_predecessor(trace, compress, prefix_cache):
    trace = parse_trace(_as_json(trace))
    scheduler = _scheduler(compress=compress, prefix_cache=prefix_cache, max_model_len=160)
    sequences = trace_sequences(trace, VOCAB, need_tokens=False, scheduler=scheduler,
                                block_keys=True)
    run = InstantDriver(scheduler, check=True).run(sequences)
    by_id = {seq.seq_id: seq for seq in sequences}
    for request in trace.requests:
        seq = by_id[request.id]
        if request.after is None:
            assert seq.arrival_s == request.arrival_s
            continue
        predecessor = by_id[request.after]
        if predecessor.status is SequenceStatus.FINISHED:
            assert seq.arrival_s == close(predecessor.finish_time + request.after_s)
            assert seq.first_admitted_step is None or seq.first_token_time >= seq.arrival_s
        else:  # a failed turn fails the turns after it, each alone, naming it
            assert seq.status is SequenceStatus.REJECTED
            assert f"the turn it follows, {predecessor.seq_id}, failed" in seq.error
    assert run.summary["requests"] == len(trace.requests)
    # Hits at first admission are the prefix hits less a preempted request's own blocks found
    # again: all of them in a run without preemptions.
    summary = run.summary
    assert 0 <= summary["first_hit_tokens"] <= summary["prefix_hit_tokens"]
    if not summary["preemptions"]:
        assert summary["first_hit_tokens"] == summary["prefix_hit_tokens"]


def test_a_rejected_turn_fails_its_followers_and_nothing_else():
    requests = [
        TraceRequest("a0", 0.0, prompt_len=300, output_len=4, session="a"),  # too long
        TraceRequest("a1", 0.0, prompt_len=310, output_len=4, session="a", after="a0",
                     prefix_len=300),
        TraceRequest("a2", 0.0, prompt_len=320, output_len=4, session="a", after="a1",
                     prefix_len=310),
        TraceRequest("b0", 0.0, prompt_len=20, output_len=4, session="b"),
        TraceRequest("b1", 0.0, prompt_len=30, output_len=4, session="b", after="b0",
                     after_s=5.0, prefix_len=24),
    ]
    scheduler = _scheduler(max_model_len=200)
    sequences = trace_sequences(Trace("t", requests), VOCAB, need_tokens=False,
                                scheduler=scheduler, block_keys=True)
    InstantDriver(scheduler, check=True).run(sequences)
    by_id = {seq.seq_id: seq for seq in sequences}
    assert [by_id[name].status for name in ("a0", "a1", "a2", "b0", "b1")] == [
        SequenceStatus.REJECTED] * 3 + [SequenceStatus.FINISHED] * 2
    assert "a0, failed" in by_id["a1"].error and "a1, failed" in by_id["a2"].error
    assert by_id["b1"].arrival_s == by_id["b0"].finish_time + 5.0
    # Each names the first failure of the chain once, not its predecessor's whole message.
    for name, before in (("a1", "a0"), ("a2", "a1")):
        assert by_id[name].error == (f"request {name}: the turn it follows, {before}, failed "
                                     f"({by_id['a0'].error})")


def test_a_long_failed_session_keeps_each_message_short():
    """Turn n of a session whose first turn failed would carry n nested messages (quadratic
    memory over a day of agent traffic); each carries the first failure once."""
    requests = [TraceRequest("s0", 0.0, prompt_len=300, output_len=4, session="s")]  # too long
    requests += [TraceRequest(f"s{turn}", 0.0, prompt_len=300 + turn, output_len=4, session="s",
                              after=f"s{turn - 1}", prefix_len=300 + turn - 1)
                 for turn in range(1, 200)]
    scheduler = _scheduler(max_model_len=200)
    sequences = trace_sequences(Trace("t", requests), VOCAB, need_tokens=False,
                                scheduler=scheduler, block_keys=True)
    InstantDriver(scheduler, check=True).run(sequences)
    root = sequences[0].error
    assert all(len(seq.error) <= len(root) + 100 for seq in sequences[1:])


def _settings(**knobs) -> ReplaySettings:
    config = ZipageConfig(block_size=16, window=4, kv_budget=64, **knobs)
    return ReplaySettings(model="qwen3-0.6b", hardware="h100", kv_memory_gb=0.2, config=config)


@settings(max_examples=examples(40))
@given(trace=session_traces(max_sessions=6, max_turns=8), slow=st.booleans())
def test_the_simulator_closes_the_loop_on_its_clock(trace, slow):
    trace = parse_trace(_as_json(trace))
    settings_ = _settings(prefix_cache=True)
    if slow:  # a slower engine is sent its next turns later, not the same load
        settings_ = dataclasses.replace(settings_, hardware="a100")
    summary, run = simulate(trace, settings_, check=True)
    records = {record.id: record for record in run.requests}
    for request in trace.requests:
        record = records[request.id]
        if request.after is not None and records[request.after].error is None:
            assert record.arrival == close(records[request.after].finish + request.after_s)
    assert summary["requests"] == len(trace.requests)


def test_a_streamed_session_trace_replays_like_the_loaded_one(tmp_path):
    # Sessions written turn after turn, each before the sessions that start after it: the
    # stream reads every turn by the time it comes due, so the two runs are one.
    requests = []
    for number in range(12):
        name = f"s{number}"
        requests.append(TraceRequest(f"{name}-0", number * 0.3, prompt_len=200, output_len=60,
                                     session=name, prefix_group="system", prefix_len=64))
        for turn in range(1, 5):
            requests.append(TraceRequest(f"{name}-{turn}", 0.0, prompt_len=200 + 100 * turn,
                                         output_len=60, after=f"{name}-{turn - 1}",
                                         after_s=0.5, reasoning_len=20,
                                         prefix_len=200 + 100 * (turn - 1) + 40))
    path = tmp_path / "sessions.jsonl"
    save_trace(Trace("sessions", requests), path)
    loaded = load_trace(path)
    stream = open_trace_stream(path)
    assert stream is not None
    settings_ = _settings(compress=False)  # (compression would rewrite the prompts' blocks)
    whole, _ = simulate(loaded, settings_)
    streamed, _ = simulate(stream, settings_)
    for key in ("makespan_s", "ttft_p50_s", "prefix_hit_tokens", "completed", "preemptions"):
        assert streamed[key] == close(whole[key]), key
    assert whole["prefix_hit_tokens"] > 0


def test_a_session_of_a_cluster_goes_on_wherever_its_turn_finished():
    from zipage.sim.cluster import simulate_cluster

    requests = []
    for number in range(6):
        requests.append(TraceRequest(f"s{number}-0", 0.1 * number, prompt_len=100,
                                     output_len=30, session=f"s{number}"))
        requests.append(TraceRequest(f"s{number}-1", 0.0, prompt_len=200, output_len=30,
                                     after=f"s{number}-0", after_s=2.0, prefix_len=130))
    summary = simulate_cluster(Trace("t", requests), _settings(), replicas=2)
    assert summary["completed"] == 12
    assert summary["makespan_s"] > 2.0  # every second turn waited for its first


@settings(max_examples=examples(40))
@given(trace=session_traces(max_sessions=6, max_turns=4), users=st.integers(1, 3),
       lone=st.integers(0, 3))
def test_users_run_at_most_that_many_sessions_at_once_in_trace_order(trace, users, lone):
    # A closed population: a session starts at its arrival or when one of the users is free,
    # in trace order; a request in no session is a session of one turn.
    requests = list(parse_trace(_as_json(trace)).requests)
    requests += [TraceRequest(f"lone{index}", 0.0, prompt_len=20, output_len=5)
                 for index in range(lone)]
    trace = Trace("t", requests)
    summary, run = simulate(trace, dataclasses.replace(_settings(), users=users), check=True)
    assert summary["completed"] + summary["failed"] == len(requests)
    records = {record.id: record for record in run.requests}
    spans: dict[str, list[float]] = {}
    order = []
    for request in sorted(requests, key=lambda request: request.arrival_s):  # (stable)
        session = request.session or request.id
        record = records[request.id]
        end = record.finish if record.finish is not None else record.arrival
        if session not in spans:
            order.append(session)
            spans[session] = [record.arrival, end]
            assert record.arrival >= request.arrival_s - 1e-9
        else:
            spans[session][1] = max(spans[session][1], end)
    starts = [spans[session][0] for session in order]
    assert starts == sorted(starts)  # sessions start in trace order
    for session in order:  # at any session's start, at most `users` sessions are running
        start = spans[session][0]
        running = sum(1 for other in order if spans[other][0] <= start < spans[other][1])
        assert running <= users


def test_a_stream_that_gives_a_turn_late_says_so(tmp_path, capsys):
    # a1 follows a0 but sits after b0, which starts 5 s later: a streamed replay reads a1 only
    # when it reaches b0, long after a0 finished, and warns on stderr (stdout stays JSON).
    path = tmp_path / "late.jsonl"
    path.write_text('{"version": 1, "name": "late"}\n'
                    '{"id":"a0","arrival_s":0,"session":"a","prompt_len":20,"output_len":4}\n'
                    '{"id":"b0","arrival_s":5,"session":"b","prompt_len":20,"output_len":4}\n'
                    '{"id":"a1","after":"a0","prompt_len":40,"output_len":4}\n')
    assert main(["replay", str(path), "--json", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["completed"] == 3
    assert err.startswith("warning: 1 session turns were read after they came due")
    grouped = tmp_path / "grouped.jsonl"  # the same sessions, each whole before the next
    lines = path.read_text().splitlines()
    grouped.write_text("\n".join([lines[0], lines[1], lines[3], lines[2]]) + "\n")
    assert main(["replay", str(grouped), "--json", "--no-progress"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_two_first_turns_of_one_session_share_its_user():
    # Built by hand (a trace's loader refuses it): a session with two first turns runs on one
    # user, and the user is free again when both are done, so one user serves everything.
    requests = [TraceRequest("a0", 0.0, prompt_len=20, output_len=4, session="a"),
                TraceRequest("a1", 0.0, prompt_len=20, output_len=4, session="a"),
                TraceRequest("b0", 0.0, prompt_len=20, output_len=4, session="b")]
    summary, run = simulate(Trace("t", requests), dataclasses.replace(_settings(), users=1),
                            check=True)
    assert summary["completed"] == 3
    records = {record.id: record for record in run.requests}
    assert records["b0"].arrival >= max(records["a0"].finish, records["a1"].finish) - 1e-9


# ---------------------------------------------------------------- bad session traces


def _write(tmp_path, *lines: dict):
    header = {"version": 1, "name": "bad"}
    root = {"id": "a1", "arrival_s": 0, "session": "a", "prompt_len": 600, "output_len": 300,
            "reasoning_len": 100}
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in (header, root, *lines)) + "\n")
    return path


@pytest.mark.parametrize("line, message", [
    ({"id": "a2", "after": "zz", "prompt_len": 900, "output_len": 9},
     "after names 'zz', which is no request above this one"),
    ({"id": "a2", "after": "a2", "prompt_len": 900, "output_len": 9},
     "after names 'a2', which is no request above this one"),
    ({"id": "a2", "after": "a1", "arrival_s": 3, "prompt_len": 900, "output_len": 9},
     "arrival_s does not go with after"),
    ({"id": "a2", "after": "a1", "prompt_len": 700, "output_len": 9},
     "the history it follows is 800 tokens"),
    ({"id": "a2", "after": "a1", "prompt_len": 900, "output_len": 9, "prefix_len": 850},
     "prefix_len 850 is longer than the history it follows (800 tokens"),
    ({"id": "a2", "after": "a1", "session": "b", "prompt_len": 900, "output_len": 9},
     "session 'b' differs from its predecessor's ('a')"),
    ({"id": "a2", "arrival_s": 1, "after_s": 2, "prompt_len": 900, "output_len": 9},
     "after_s needs after"),
    ({"id": "a2", "after": "a1", "after_s": -1, "prompt_len": 900, "output_len": 9},
     "after_s must be a number of seconds"),
    ({"id": "a2", "arrival_s": 1, "prompt_len": 9, "output_len": 9, "reasoning_len": 10},
     "reasoning_len must be an integer between 0 and output_len (9)"),
    ({"id": "a2", "after": "a1", "prompt_len": 900, "output_len": 9,
      "prefix_group": "g"}, "prefix_group does not go with after"),
    ({"id": "a2", "arrival_s": 1, "session": "a", "prompt_len": 9, "output_len": 9},
     "session 'a' already began at request #0"),
])
def test_a_bad_session_is_one_line_naming_the_request_and_exits_2(tmp_path, capsys, line,
                                                                    message):
    path = _write(tmp_path, line)
    with pytest.raises(TraceError, match="request #1 \\(id 'a2'\\)") as error:
        load_trace(path)
    assert message in str(error.value)
    assert main(["replay", str(path)]) == 2  # streamed: the reader reaches the line
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert len(error_lines) == 1 and message in error_lines[0]


def test_a_follow_up_of_a_request_in_no_session_names_the_fix(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 1, "requests": [
        {"id": "x", "arrival_s": 0, "prompt_len": 5, "output_len": 5},
        {"id": "y", "after": "x", "prompt_len": 15, "output_len": 5}]}))
    with pytest.raises(TraceError, match="after names 'x', which is in no session: give that "
                                         "request a session"):
        load_trace(path)


def test_a_session_trace_saves_and_loads_unchanged(tmp_path):
    trace = Trace("t", [
        TraceRequest("a0", 1.5, prompt_len=50, output_len=20, session="a", reasoning_len=5),
        TraceRequest("a1", 1.5, prompt_len=80, output_len=20, session="a", after="a0",
                     after_s=0.25, prefix_len=65),
        TraceRequest("a2", 1.5, prompt_len=30, output_len=20, session="a", after="a0",
                     prefix_len=10)])
    for name in ("t.json", "t.jsonl", "t.jsonl.gz"):
        save_trace(trace, tmp_path / name)
        assert load_trace(tmp_path / name).requests == trace.requests


def test_a_follow_up_takes_its_sessions_start_and_the_whole_history_by_default():
    trace = parse_trace({"version": 1, "requests": [
        {"id": "a0", "arrival_s": 4, "session": "a", "prompt_len": 10, "output_len": 6,
         "reasoning_len": 2},
        {"id": "a1", "after": "a0", "prompt_len": 20, "output_len": 5}]})
    follow_up = trace.requests[1]
    assert (follow_up.session, follow_up.arrival_s, follow_up.prefix_len) == ("a", 4.0, 14)


def test_a_turn_read_out_of_order_in_a_stream_is_counted_late():
    from zipage.core.arrivals import ArrivalQueue
    from zipage.core.sequence import Sequence, Turn

    class Sink:
        def __init__(self):
            self.added = []

        def add(self, seq):
            self.added.append(seq.seq_id)
            return True

        def refuse(self, seq, reason):
            raise AssertionError(reason)

    first = Sequence("a0", None, 1, 0.0, prompt_len=1)
    first.turn = Turn("a")
    other = Sequence("b0", None, 1, 5.0, prompt_len=1)
    follow = Sequence("a1", None, 1, 0.0, prompt_len=1)
    follow.turn = Turn("a", follows="a0", after_s=1.0)
    queue = ArrivalQueue(iter([first, other, follow]), ordered=True)
    sink = Sink()
    queue.admit_due(sink, 0.0)
    assert sink.added == ["a0"] and queue.next_arrival_s == 5.0
    first.status = SequenceStatus.FINISHED
    queue.done(first, 1.0)  # a1 is due at 2.0, but the reader reaches it only at 5.0
    queue.admit_due(sink, 5.0)
    assert sink.added == ["a0", "a1", "b0"] and queue.late == 1
    assert follow.arrival_s == 2.0


# ---------------------------------------------------------------- the engine


def test_the_engine_builds_each_turn_from_what_its_predecessor_produced(tmp_path):
    # The CPU engine on a tiny model closes the loop in real time, two users at a time: a
    # turn's prompt is its predecessor's prompt and visible output, then its own tokens; and a
    # step-time replay of that run decides exactly as the engine did.
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import save_tiny_qwen3

    from zipage.engine.replay import replay_on_engine
    from zipage.rundir import write_run
    from zipage.sim.step_replay import replay_step_times

    torch.set_num_threads(1)
    save_tiny_qwen3(tmp_path / "model")
    requests = []
    for number in range(3):
        name = f"s{number}"
        requests.append(TraceRequest(f"{name}-0", 0.01 * number, prompt_len=40, output_len=30,
                                     session=name, prefix_group="system", prefix_len=16,
                                     reasoning_len=10))
        requests.append(TraceRequest(f"{name}-1", 0.0, prompt_len=75, output_len=30,
                                     after=f"{name}-0", after_s=0.02, prefix_len=60))
        requests.append(TraceRequest(f"{name}-2", 0.0, prompt_len=50, output_len=20,
                                     after=f"{name}-1", prefix_len=40))
    trace = parse_trace(_as_json(Trace("engine-sessions", requests)))
    config = ZipageConfig(block_size=16, window=4, kv_budget=32, async_compress=False)
    settings_ = ReplaySettings(model=str(tmp_path / "model"), dtype="float32",
                               kv_memory_gb=0.0002, users=2, config=config)
    summary, run = replay_on_engine(trace, settings_, "cpu", log_decisions=True)
    assert summary["completed"] == len(requests)
    tokens, records = run.tokens, {record.id: record for record in run.requests}
    for request in trace.requests:
        if request.after is None:
            continue
        before = next(r for r in trace.requests if r.id == request.after)
        history = tokens[before.id]
        seen = history[:before.prompt_len] + history[before.prompt_len + before.reasoning_len:]
        assert tokens[request.id][:request.prefix_len] == seen[:request.prefix_len]
        assert len(tokens[request.id]) == request.prompt_len + request.output_len
        assert records[request.id].arrival == close(records[before.id].finish + request.after_s)
    assert summary["prefix_hit_tokens"] > 0
    run_dir = write_run(tmp_path / "run", summary, run.steps, run.requests, run.decision_log)
    replayed, _ = replay_step_times(trace, run_dir)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
