"""Tests of the session shapes of `zipage trace make` (zipage/session_workloads.py): chat,
coding agent and deep research sessions are deterministic per seed, load as valid sessions in
every layout, match the published statistics they are parameterised by, take their parameters
as flags whose mistakes are one line (exit 2), and the shipped session traces equal their
generator."""

from __future__ import annotations

import inspect
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from tolerance import assert_close, assert_text_close, close

from zipage.cli.parser import main
from zipage.errors import ConfigError
from zipage.session_workloads import (
    AGENT_CALLS_PER_TURN,
    AGENT_MEAN_PROMPT,
    AGENT_OUTPUT_TOKENS,
    AGENT_TURNS,
    CHAT_OUTPUT_TOKENS,
    CHAT_TURNS,
    CHAT_USER_TOKENS,
    REASONING_THINKING_TOKENS,
    RESEARCH_STEPS_PER_TURN,
    SESSION_OPTIONS,
    SESSION_WORKLOADS,
    session_statistics,
)
from zipage.trace import Trace, TraceRequest, load_trace, save_trace, session_history
from zipage.workloads import make_trace

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACES_DIR = REPO_ROOT / "traces"
SMALL = {"sessions": 5}


def sessions_of(trace: Trace) -> dict[str, list[TraceRequest]]:
    grouped: dict[str, list[TraceRequest]] = {}
    for request in trace.requests:
        grouped.setdefault(request.session, []).append(request)
    return grouped


def check_sessions(trace: Trace, context_limit: int | None = None) -> None:
    """What every generated session trace holds: sessions written whole and in order of start,
    each a chain of calls whose prompt is the previous call's whole history plus new tokens
    (or, at a compaction, the shared system prompt plus new tokens)."""
    by_id = {request.id: request for request in trace.requests}
    order = [request.session for request in trace.requests]
    assert all(order.count(name) == len(group) and order.index(name) + len(group) - 1
               == len(order) - 1 - order[::-1].index(name)
               for name, group in sessions_of(trace).items())  # each session contiguous
    starts = [request.arrival_s for request in trace.requests if request.after is None]
    assert starts == sorted(starts) and starts[0] == 0.0
    for group in sessions_of(trace).values():
        first, *rest = group
        assert first.after is None and first.session is not None
        assert all(request.arrival_s == first.arrival_s for request in group)
        for previous, request in zip(group, rest):
            assert request.after == previous.id and request.prefix_group is None
            assert request.after_s >= 0 and request.prompt_len > request.prefix_len
            history = session_history(by_id[request.after])
            if request.prefix_len != history:  # a compaction: the system prompt stays
                assert context_limit is not None and first.prefix_len < history
                assert request.prefix_len == first.prefix_len
            elif context_limit is not None and history > first.prefix_len:
                assert request.prompt_len <= context_limit  # else nothing to compact
        for request in group:
            assert 0 <= request.reasoning_len < request.output_len


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("kind", list(SESSION_WORKLOADS))
def test_generation_is_deterministic_and_seeded(kind: str) -> None:
    trace = make_trace(kind, 0, **SMALL)
    assert_close(make_trace(kind, 0, **SMALL), trace)
    assert make_trace(kind, 1, **SMALL) != trace
    assert trace.name == kind and len({r.session for r in trace.requests}) == SMALL["sessions"]


@pytest.mark.parametrize("kind", list(SESSION_WORKLOADS))
def test_a_session_does_not_depend_on_how_many_are_generated(kind: str) -> None:
    few, more = make_trace(kind, 3, sessions=3), make_trace(kind, 3, sessions=7)
    assert more.requests[:len(few.requests)] == few.requests


# ----------------------------------------------------------------------------- validity


@pytest.mark.parametrize("kind", list(SESSION_WORKLOADS))
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.gz"])
def test_every_generated_trace_loads_as_valid_sessions(kind: str, suffix: str,
                                                      tmp_path: Path) -> None:
    trace = make_trace(kind, 0, **SMALL)
    check_sessions(trace, {"chat-sessions": None, "agent-sessions": 200_000,
                           "research-sessions": 128_000}[kind])
    path = tmp_path / f"{kind}{suffix}"
    save_trace(trace, path)
    assert_close(load_trace(path), trace)  # follow-ups' session and start are as loaded


@settings(max_examples=examples(30))
@given(kind=st.sampled_from(list(SESSION_WORKLOADS)), seed=st.integers(0, 2**32),
       sessions=st.integers(1, 4), turns=st.floats(1, 4), calls=st.floats(1, 6),
       scale=st.floats(0.001, 2), context_limit=st.integers(1, 5000),
       system_prompt_len=st.integers(0, 3000))
def test_any_parameters_give_valid_sessions(kind, seed, sessions, turns, calls, scale,
                                            context_limit, system_prompt_len) -> None:
    options = dict(sessions=sessions, turns=turns, scale=scale,
                   system_prompt_len=system_prompt_len)
    if kind != "chat-sessions":
        options.update(calls=calls, context_limit=context_limit)
    trace = make_trace(kind, seed, **options)
    limit = None if kind == "chat-sessions" else max(1, round(context_limit * scale))
    check_sessions(trace, limit)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.jsonl"
        save_trace(trace, path)  # validates as the loader does
        assert_close(load_trace(path), trace)


# ----------------------------------------------------------------------------- statistics

# The rows of docs/traces.md's table of measured statistics: label -> (kind, arguments); the
# shipped traces are the rows whose label is a file.
MEASURED = {
    "`traces/chat-sessions.jsonl`": None,
    "`chat-sessions --sessions 4000`": ("chat-sessions", {"sessions": 4000}),
    "`traces/agent-sessions.jsonl`": None,
    "`agent-sessions --sessions 2500`": ("agent-sessions", {"sessions": 2500}),
    "`research-sessions`": ("research-sessions", {}),
    "`research-sessions --sessions 600`": ("research-sessions", {"sessions": 600}),
}


@pytest.fixture(scope="module")
def measured() -> dict[str, Trace]:
    return {label: load_trace(TRACES_DIR / label.strip("`").removeprefix("traces/"))
            if made is None else make_trace(made[0], 0, **made[1])
            for label, made in MEASURED.items()}


def test_the_documented_statistics_are_measured(measured: dict[str, Trace]) -> None:
    docs = (REPO_ROOT / "docs" / "traces.md").read_text()
    for label, trace in measured.items():
        row = session_statistics(trace).row(label)
        assert row in docs, f"docs/traces.md, 'Session shapes': the row should read {row}"


def new_tokens(trace: Trace) -> np.ndarray:
    return np.array([r.prompt_len - r.prefix_len for r in trace.requests])


def test_chat_sessions_match_lmsys_chat_1m(measured: dict[str, Trace]) -> None:
    trace = measured["`chat-sessions --sessions 4000`"]
    stats = session_statistics(trace)
    assert stats.turns_per_session == close(CHAT_TURNS, rel=0.05)
    assert stats.mean_output == close(CHAT_OUTPUT_TOKENS, rel=0.05)
    assert new_tokens(trace).mean() == close(CHAT_USER_TOKENS, rel=0.06)
    starts = np.array([r.arrival_s for r in trace.requests if r.after is None])
    assert np.diff(starts).mean() == close(1 / 0.5, rel=0.06)  # Poisson, 0.5 sessions/s
    think = np.array([r.after_s for r in trace.requests if r.after is not None])
    assert think.mean() == close(20.0, rel=0.1) and think.min() > 0
    system = {r.prefix_len for r in trace.requests if r.prefix_group is not None}
    assert system == {256}
    assert stats.compactions == 0 and all(r.reasoning_len == 0 for r in trace.requests)


def test_chat_sessions_take_their_rate_and_think_time() -> None:
    trace = make_trace("chat-sessions", 0, sessions=2000, session_rate=4.0, think_time=5.0,
                       system_prompt_len=0)
    starts = np.array([r.arrival_s for r in trace.requests if r.after is None])
    assert np.diff(starts).mean() == close(1 / 4.0, rel=0.06)
    think = np.array([r.after_s for r in trace.requests if r.after is not None])
    assert think.mean() == close(5.0, rel=0.1)
    assert all(r.prefix_group is None for r in trace.requests)


def test_agent_sessions_match_the_copilot_traces(measured: dict[str, Trace]) -> None:
    trace = measured["`agent-sessions --sessions 2500`"]
    stats = session_statistics(trace)
    assert stats.turns_per_session == close(AGENT_TURNS, rel=0.06)
    assert stats.calls_per_session / stats.turns_per_session == close(
        AGENT_CALLS_PER_TURN, rel=0.06)
    assert stats.mean_output == close(AGENT_OUTPUT_TOKENS, rel=0.05)
    assert stats.mean_prompt == close(AGENT_MEAN_PROMPT, rel=0.06)
    # A perfect prefix cache serves more than the 85.7 % the production caches did.
    assert 0.95 < stats.history_share < stats.shared_share < 0.99
    assert 0 < stats.compactions < 0.01 * len(trace.requests)  # published: 0.46 % of calls
    assert max(r.prompt_len for r in trace.requests) <= 200_000
    tool_times = [r.after_s for r in trace.requests if r.after is not None and "-c0" not in r.id]
    assert np.mean(tool_times) == close(5.0, rel=0.1)


def test_agent_sessions_scale_keeps_the_shape() -> None:
    full = session_statistics(make_trace("agent-sessions", 0, sessions=400))
    small_trace = make_trace("agent-sessions", 0, sessions=400, scale=0.125)
    small = session_statistics(small_trace)
    assert small.calls_per_session == full.calls_per_session
    assert small.mean_prompt == close(0.125 * full.mean_prompt, rel=0.02)
    assert abs(small.history_share - full.history_share) < 0.005
    assert max(r.prompt_len for r in small_trace.requests) <= 25_000


def test_research_sessions_think_long_and_read_documents(measured: dict[str, Trace]) -> None:
    trace = measured["`research-sessions --sessions 600`"]
    stats = session_statistics(trace)
    assert stats.turns_per_session == close(1.5, rel=0.06)
    assert stats.calls_per_session / stats.turns_per_session == close(
        RESEARCH_STEPS_PER_TURN, rel=0.06)
    steps = [r for r in trace.requests if r.reasoning_len]
    thinking = sum(r.reasoning_len for r in steps) / sum(r.output_len for r in steps)
    assert 0.7 < thinking < 0.9  # 90 % of a step, less with the reports
    documents = [r.prompt_len - r.prefix_len for r in trace.requests
                 if r.after is not None and "-c0" not in r.id and r.prefix_len > 2000]
    assert np.mean(documents) == close(2500, rel=0.06)
    assert stats.history_share > 0.9 and stats.compactions > 0


def test_a_reasoning_models_chat_thinks_as_servegens_deepseek_r1() -> None:
    plain = make_trace("chat-sessions", 0, sessions=2000)
    trace = make_trace("chat-sessions", 0, sessions=2000, thinking=REASONING_THINKING_TOKENS)
    thinking = np.array([r.reasoning_len for r in trace.requests])
    answers = np.array([r.output_len - r.reasoning_len for r in trace.requests])
    # Lognormal of mean 1,135 and median 478, clipped at 20 times the mean (a few % off the mean).
    assert thinking.mean() == close(REASONING_THINKING_TOKENS, rel=0.08)
    assert np.median(thinking) == close(478, rel=0.1)
    assert answers.mean() == close(CHAT_OUTPUT_TOKENS, rel=0.06)
    # The same conversations (turns, messages) as without thinking; the history drops it.
    assert [r.id for r in trace.requests] == [r.id for r in plain.requests]
    by_id = {r.id: r for r in trace.requests}
    for request in trace.requests:
        if request.after is not None:
            before = by_id[request.after]
            assert request.prefix_len == (before.prompt_len + before.output_len
                                          - before.reasoning_len)
    assert session_statistics(trace).mean_prompt == close(
        session_statistics(plain).mean_prompt, rel=0.01)
    assert make_trace("chat-sessions", 0, sessions=50, thinking=0).requests == make_trace(
        "chat-sessions", 0, sessions=50).requests


# ----------------------------------------------------------------------------- the CLI


def test_trace_make_writes_json_lines_when_the_name_says_so(tmp_path: Path, capsys) -> None:
    path = tmp_path / "agent.jsonl"
    assert main(["trace", "make", "agent-sessions", "--sessions", "3", "--scale", "0.05",
                 "--turns", "2", "--calls", "4", "--tool-time", "2", "--think-time", "9",
                 "--system-prompt-len", "4000", "--context-limit", "60000", "--seed", "2",
                 "-o", str(path)]) == 0
    expected = make_trace("agent-sessions", 2, sessions=3, scale=0.05, turns=2.0, calls=4.0,
                          tool_time=2.0, think_time=9.0, system_prompt_len=4000,
                          context_limit=60000)
    header, *lines = path.read_text().splitlines()
    assert json.loads(header) == {"version": 1, "name": "agent-sessions"}
    assert len(lines) == len(expected.requests)
    assert_close(load_trace(path), expected)
    assert f"{len(expected.requests)} requests" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["chat-sessions", "--sessions", "0"],
     "--sessions must be an integer >= 1 and <= 10,000,000 (how many sessions), got 0; "
     "e.g. --sessions 64"),
    (["chat-sessions", "--sessions", "2.5"], "--sessions must be an integer"),
    (["agent-sessions", "--session-rate", "0"], "--session-rate must be a number > 0"),
    (["agent-sessions", "--session-rate", "inf"], "--session-rate must be a number > 0"),
    (["agent-sessions", "--scale", "nan"], "--scale must be a number > 0 and <= 100"),
    (["research-sessions", "--turns", "0.5"], "--turns must be a number >= 1"),
    (["agent-sessions", "--calls", "lots"], "got 'lots'; e.g. --calls 8"),
    (["agent-sessions", "--think-time", "-1"], "--think-time must be a number >= 0"),
    (["agent-sessions", "--context-limit", "0"], "--context-limit must be an integer >= 1"),
    (["chat-sessions", "--calls", "3"],
     "--calls does not apply to chat-sessions: it shapes agent-sessions, research-sessions; "
     "drop --calls or make one of those"),
    (["chat-sessions", "--tool-time", "3"], "--tool-time does not apply to chat-sessions"),
    (["amc23", "--sessions", "3"], "--sessions does not apply to amc23: it shapes chat-sessions"),
])
def test_flag_mistakes_are_one_line(argv: list[str], expected: str, tmp_path: Path,
                                    capsys) -> None:
    assert main(["trace", "make", *argv, "-o", str(tmp_path / "out.jsonl")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and expected in error, error
    assert not (tmp_path / "out.jsonl").exists()


def test_a_session_flag_on_a_trace_file_is_refused(tmp_path: Path, capsys) -> None:
    source = TRACES_DIR / "chat-sessions.jsonl"
    assert main(["trace", "make", str(source), "--turns", "3", "-o",
                 str(tmp_path / "out.json")]) == 2
    assert "--turns shapes a generated session workload" in capsys.readouterr().err


def test_make_trace_names_the_options_of_a_session_shape() -> None:
    with pytest.raises(ConfigError, match="workload 'chat-sessions' has no option 'calls'"):
        make_trace("chat-sessions", calls=3)
    with pytest.raises(ConfigError, match="--sessions must be an integer"):
        make_trace("agent-sessions", sessions=True)
    for kind, generator in SESSION_WORKLOADS.items():  # every parameter is a flag
        names = [n for n, p in inspect.signature(generator).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert set(names) <= set(SESSION_OPTIONS), kind


@pytest.mark.parametrize("flags", [[], ["--no-compress"]])
def test_the_shipped_agent_trace_replays_with_prefix_hits(flags: list[str], capsys) -> None:
    assert main(["replay", str(TRACES_DIR / "agent-sessions.jsonl"), "--model", "qwen3-8b",
                 "--hardware", "h200", "--json", "--no-progress", *flags]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["failed"] == 0 and summary["completed"] == summary["requests"]
    hit = summary["prefix_hit_tokens"]
    assert hit / (hit + summary["prefill_tokens"]) > 0.9  # the history share, less block edges


# ----------------------------------------------------------------------------- shipped traces


def shipped_sessions() -> dict:
    sys.path.insert(0, str(TRACES_DIR))
    try:
        from make_all import SESSIONS, SHIPPED_SEED
    finally:
        sys.path.remove(str(TRACES_DIR))
    return {stem: (kind, arguments, SHIPPED_SEED) for stem, (kind, arguments) in SESSIONS.items()}


@pytest.mark.parametrize("stem", list(shipped_sessions()))
def test_shipped_session_trace_equals_its_generator(stem: str, tmp_path: Path) -> None:
    kind, arguments, seed = shipped_sessions()[stem]
    shipped = TRACES_DIR / f"{stem}.jsonl"
    regenerated = tmp_path / f"{stem}.jsonl"
    trace = make_trace(kind, seed, **arguments)
    save_trace(trace, regenerated)
    assert_text_close(regenerated.read_text(), shipped.read_text(), what=(
        f"{shipped} drifted from its generator; run `python traces/make_all.py`"))
    assert_close(load_trace(shipped), trace)
    assert shipped.stat().st_size < 300_000
    assert session_statistics(trace).history_share == close(
        session_statistics(load_trace(shipped)).history_share)
