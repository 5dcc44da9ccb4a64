"""Session-shaped production traces in (docs/traces.md, 'Session imports'): the Copilot
coding-agent traces (a fixture to the published schema) and Mooncake's conversation trace with
sessions inferred from its hash chains (an excerpt of the real file), imported into the grouped
layout a streamed replay reads exactly, then replayed in the simulator."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from tolerance import close

from zipage.core.deployment import ReplaySettings
from zipage.errors import TraceError
from zipage.session_import import SessionOptions, import_sessions, import_sessions_file, looks_like_copilot
from zipage.sim.simulate import simulate
from zipage.trace import load_trace, session_history
from zipage.trace_import import ImportOptions, detect_format, import_trace, load_trace_file
from zipage.trace_stream import open_trace_stream

FIXTURES = Path(__file__).parent / "fixtures" / "session_traces"
COPILOT = FIXTURES / "copilot_sessions.jsonl"
MOONCAKE = FIXTURES / "mooncake_conversation_excerpt.jsonl"
SIM = ["--model", "qwen3-8b", "--hardware", "h200", "--json", "--no-progress"]

# The fixture's calls in the grouped layout: sessions by start (a3f9c1 at 0 s, c0ffee at 10 s,
# b77e02 at 30 s though its record comes second, e7b0a2 at 180 s), each session's calls after its
# first.
COPILOT_ORDER = ["copilot-0-0-0", "copilot-0-0-1", "copilot-0-1-0", "copilot-0-1-1",
                 "copilot-0-1-2", "copilot-2-0-0", "copilot-2-0-2", "copilot-1-0-1",
                 "copilot-1-0-0", "copilot-1-1-1", "copilot-4-0-0", "copilot-4-0-1",
                 "copilot-4-0-2", "copilot-4-0-3", "copilot-4-0-4"]
# e7b0a2: a call, then a parallel batch of three, then the call after the batch.
BATCH = ["copilot-4-0-1", "copilot-4-0-2", "copilot-4-0-3"]
COPILOT_SKIPPED = {"no output tokens (a failed request in the source)": 1,
                   "no prompt tokens": 1, "no timestamp": 1,
                   "timestamp more than a day outside its session's date (client clock skew)": 1}


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zipage.cli", *args], capture_output=True,
                          text=True, check=check)


def _replayed(path: Path, *extra: str) -> dict:
    return json.loads(_cli("replay", str(path), *SIM, *extra).stdout)


def _streamed(path: Path) -> list:
    """The requests as a streamed replay reads them (arrival order checked line by line)."""
    stream = open_trace_stream(path)
    assert stream is not None
    return list(stream)


# ---------------------------------------------------------------- copilot

def test_copilot_imports_through_the_cli_and_replays(tmp_path):
    out = tmp_path / "agents.jsonl"
    done = _cli("trace", "import", "copilot", str(COPILOT), "-o", str(out))
    assert "copilot: 19 rows read, 15 requests imported" in done.stdout
    assert "4 sessions, 11 follow-ups" in done.stdout
    assert ("2 calls began before the call before them ended (parallel calls): each follows "
            "the latest call ended by its start" in done.stdout)
    assert "1 calls after a parallel batch follow its latest-ending call" in done.stdout
    assert ("1 calls began before any call of their session ended: each follows the session's "
            "first call, after_s 0" in done.stdout)
    assert "kept 1 calls that did not succeed but used tokens: UserCancel 1" in done.stdout
    assert "1 session records with no LLM call" in done.stdout
    assert "skipped 1: no timestamp" in done.stdout
    requests = _streamed(out)  # the grouped layout streams: every line in order
    assert [request.id for request in requests] == COPILOT_ORDER
    assert [request.id for request in load_trace(out).requests] == COPILOT_ORDER
    summary = _replayed(out)
    assert summary["requests"] == summary["completed"] == 15
    assert summary["prefix_hit_tokens"] > 0  # follow-ups re-read their history


def test_copilot_mapping():
    trace, report = import_sessions("copilot", COPILOT)
    by_id = {request.id: request for request in trace.requests}
    assert report.rows == 19 and report.skipped == COPILOT_SKIPPED
    assert (report.sessions, report.follow_ups) == (4, 11)
    first = by_id["copilot-0-0-0"]
    assert (first.session, first.after, first.arrival_s) == ("a3f9c1", None, close(0.0))
    # after = the latest-ending call ended by its start (in a chain: the call before in time);
    # after_s = its start less the predecessor's end.
    expected = {  # id: (after, after_s, prefix_len)
        "copilot-0-0-1": ("copilot-0-0-0", 2.0, 5200),  # 4 s - (0 + 2 s); all 5000 + 200
        # The UserCancel call at 6 s made no output: skipped, so the next turn follows 0-0-1.
        "copilot-0-1-0": ("copilot-0-0-1", 54.5, 5750),  # 60 - (4 + 1.5)
        "copilot-0-1-1": ("copilot-0-1-0", 1.5, 1024),  # trimmed: 3000 < 6700, cached 1024
        "copilot-0-1-2": ("copilot-0-1-1", 1.0, 3100),  # cancelled, but it used tokens: kept
        "copilot-2-0-2": ("copilot-2-0-0", 1.5, 1260),  # the call without timestamp skipped
        # Began 1 s before 1-0-1, the session's first call, ended (none had): follows it.
        "copilot-1-0-0": ("copilot-1-0-1", 0.0, 8400),
        "copilot-1-1-1": ("copilot-1-0-0", 95.0, 8720),  # the empty call at 120 s skipped
    }
    for request_id, (after, after_s, prefix_len) in expected.items():
        request = by_id[request_id]
        assert (request.after, request.after_s, request.prefix_len) == (
            after, close(after_s), prefix_len), request_id
    assert by_id["copilot-1-0-0"].session == "b77e02"
    assert [by_id[name].arrival_s for name in ("copilot-2-0-0", "copilot-1-0-1")] == [
        close(10.0), close(30.0)]
    assert (report.trimmed, report.clipped, report.fanned, report.joined) == (1, 1, 2, 1)
    assert report.not_success == {"UserCancel": 1}


def test_copilot_parallel_calls_fan_out_and_overlap_in_replay(tmp_path):
    # e7b0a2 (from 180 s): 4-0-0 runs 0-2 s; the agent's parallel batch 4-0-1 (3-6 s), 4-0-2
    # (3.5-5 s), 4-0-3 (4-5 s); 4-0-4 at 7 s. Before, each call followed the one before it
    # (4-0-2 after 4-0-1 with after_s 0, ...): one at a time in replay.
    out = tmp_path / "agents.jsonl"
    report = import_sessions_file("copilot", COPILOT, out)
    by_id = {request.id: request for request in load_trace(out).requests}
    # Each follows the latest call ended by its start (4-0-0, at 2 s): after_s = start - 2 s;
    # all prompts are at least 4-0-0's history (4000 + 300), so prefix_len is all of it.
    for request_id, after_s in zip(BATCH, (1.0, 1.5, 2.0)):
        request = by_id[request_id]
        assert (request.session, request.after, request.after_s, request.prefix_len) == (
            "e7b0a2", "copilot-4-0-0", close(after_s), 4300), request_id
    # The call after the batch follows its latest-ending call, 4-0-1 (ended at 6 s, after 4-0-2
    # and 4-0-3 at 5 s): after_s 1 s, prefix_len its history 4500 + 300.
    after_batch = by_id["copilot-4-0-4"]
    assert (after_batch.after, after_batch.after_s, after_batch.prefix_len) == (
        "copilot-4-0-1", close(1.0), 4800)
    assert (report.fanned, report.joined) == (2, 1)
    # Replayed, the batch runs at once: each is sent after_s after 4-0-0's last token, and all
    # three are in flight together.
    summary, run = simulate(load_trace(out), ReplaySettings(model="qwen3-8b", hardware="h200"))
    assert summary["completed"] == 15
    records = {record.id: record for record in run.requests}
    for request in by_id.values():
        if request.after is not None:
            assert records[request.id].arrival == close(records[request.after].finish
                                                        + request.after_s)
    batch = [records[request_id] for request_id in BATCH]
    assert max(record.arrival for record in batch) < min(record.finish for record in batch)
    assert records["copilot-4-0-4"].arrival >= records["copilot-4-0-1"].finish


def _call(second: float, duration_s: float, prompt: int = 1000, output: int = 50,
          cached: int = 0) -> dict:
    return {"timestamp": f"2026-06-01T10:00:{second:06.3f}Z", "duration_ms": duration_s * 1000,
            "tokens": {"prompt": prompt, "completion": output, "cached": cached}}


def test_copilot_parallel_edge_cases(tmp_path):
    source = tmp_path / "edges.jsonl"
    records = [
        # Three calls begun together at the session's start: none had ended, so the second and
        # third follow the first, after_s 0, side by side.
        [_call(0, 2), _call(0, 1, prompt=1100), _call(0, 3, prompt=1100)],
        # A call with no output (skipped) ends last in the batch: the call after follows the
        # latest-ending kept one. Equal ends: the later begun is followed.
        [_call(0, 1), _call(2, 2, prompt=1100), _call(2.5, 1.5, prompt=1100),
         _call(3, 5, prompt=1200, output=0), _call(5, 1, prompt=1200)],
        # A call begun exactly as the one before ended follows it (the chain, after_s 0); a
        # shorter prompt than the chosen predecessor's history keeps the cached tokens.
        [_call(0, 1), _call(1, 4, prompt=1100), _call(2, 1, prompt=900, cached=512)],
    ]
    source.write_text("".join(json.dumps({"session_id": f"s{number}", "date": "2026-06-01",
                                          "turns": [{"llm_calls": calls}]}) + "\n"
                              for number, calls in enumerate(records)))
    trace, report = import_sessions("copilot", source)
    got = {request.id: (request.after, request.after_s, request.prefix_len)
           for request in trace.requests if request.after is not None}
    assert got == {
        "copilot-0-0-1": ("copilot-0-0-0", 0.0, 1050),
        "copilot-0-0-2": ("copilot-0-0-0", 0.0, 1050),
        "copilot-1-0-1": ("copilot-1-0-0", 1.0, 1050),
        "copilot-1-0-2": ("copilot-1-0-0", 1.5, 1050),  # 1-0-1 runs till 4 s
        "copilot-1-0-4": ("copilot-1-0-2", 1.0, 1150),  # 1-0-1 and 1-0-2 both end at 4 s
        "copilot-2-0-1": ("copilot-2-0-0", 0.0, 1050),
        "copilot-2-0-2": ("copilot-2-0-0", 1.0, 512),  # 2-0-1 runs till 5 s; 900 < 1050
    }
    assert (report.sessions, report.clipped, report.fanned, report.joined) == (3, 2, 2, 0)
    assert report.skipped == {"no output tokens (a failed request in the source)": 1}
    summary, run = simulate(trace, ReplaySettings(model="qwen3-8b", hardware="h200"))
    records = {record.id: record for record in run.requests}
    side_by_side = [records["copilot-0-0-1"], records["copilot-0-0-2"]]
    assert side_by_side[0].arrival == side_by_side[1].arrival == close(
        records["copilot-0-0-0"].finish)


def test_copilot_raw_file_is_told_by_content_and_replays(tmp_path):
    assert detect_format(COPILOT) == "copilot"
    packed = tmp_path / "shard-0000.jsonl.gz"
    packed.write_bytes(gzip.compress(COPILOT.read_bytes()))
    assert detect_format(packed) == "copilot"
    assert [request.id for request in load_trace_file(packed).requests] == COPILOT_ORDER
    summary = _replayed(packed)
    assert summary["completed"] == 15
    # A record longer than the head detect_format reads is still told apart.
    record = json.loads(COPILOT.read_text().splitlines()[0])
    record["turns"][0]["llm_calls"][0]["message_metadata"] *= 2000
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps(record) + "\n")
    assert len(long.read_bytes()) > 64 * 1024 and detect_format(long) == "copilot"
    assert looks_like_copilot('{"session_id": "x", "dat') and not looks_like_copilot('{"id": 1')


def test_copilot_window_speedup_sample_and_max_model_len():
    # The window keeps the sessions that start in it, whole; arrivals count from its start.
    trace, report = import_sessions("copilot", COPILOT, ImportOptions(window=(5.0, 60.0),
                                                                      speedup=2.0))
    assert [request.id for request in trace.requests] == COPILOT_ORDER[5:10]
    assert report.skipped["outside --span"] == 10
    roots = [request for request in trace.requests if request.after is None]
    assert [request.arrival_s for request in roots] == [close(2.5), close(12.5)]
    # --speedup divides arrivals, not the think and tool time.
    assert trace.requests[-1].after_s == close(95.0)
    # A call dropped for its length: the next follows the kept one before it.
    trace, report = import_sessions("copilot", COPILOT, ImportOptions(max_model_len=6000))
    by_id = {request.id: request for request in trace.requests}
    assert "copilot-0-1-0" not in by_id and not any(r.session == "b77e02"
                                                   for r in trace.requests)
    relinked = by_id["copilot-0-1-1"]
    assert (relinked.after, relinked.after_s, relinked.prefix_len) == (
        "copilot-0-0-1", close(58.5), 1024)
    assert report.skipped["prompt + output longer than --max-model-len 6000"] == 4
    # A sample keeps or drops whole sessions.
    full, _ = import_sessions("copilot", COPILOT)
    sizes = set()
    for seed in range(8):
        try:
            trace, _ = import_sessions("copilot", COPILOT, ImportOptions(sample=0.5, seed=seed))
        except TraceError as error:  # every session drawn out
            assert "15 not in the --sample" in str(error)
            continue
        kept = {request.session for request in trace.requests}
        assert [r.id for r in trace.requests] == [r.id for r in full.requests
                                                  if r.session in kept]
        sizes.add(len(kept))
    assert len(sizes) > 1


# ---------------------------------------------------------------- mooncake --sessions

def test_mooncake_sessions_on_the_real_excerpt(tmp_path):
    out = tmp_path / "conversation.jsonl.gz"
    done = _cli("trace", "import", "mooncake", str(MOONCAKE), "--sessions", "-o", str(out))
    assert "13 rows read, 13 requests imported" in done.stdout
    assert "6 sessions, 7 follow-ups" in done.stdout
    assert "after_s estimated" in done.stdout
    requests = _streamed(out)
    by_id = {request.id: request for request in requests}
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    # Three conversations: rows 2 <- 7 <- 9 <- 11 (the same 1902-token prompt asked again,
    # 3 full blocks shared), 4 <- 5 <- 8, 6 <- 10 <- 12; rows 0, 1 and 3 are single turns
    # (1 and 3 share only block 0, the system prompt every request begins with).
    chains = {"mooncake-7": "mooncake-2", "mooncake-9": "mooncake-7",
              "mooncake-11": "mooncake-9", "mooncake-5": "mooncake-4",
              "mooncake-8": "mooncake-5", "mooncake-10": "mooncake-6",
              "mooncake-12": "mooncake-10"}
    assert {r.id: r.after for r in requests if r.after is not None} == chains
    assert [r.id for r in requests] == [
        "mooncake-0", "mooncake-1", "mooncake-2", "mooncake-7", "mooncake-9", "mooncake-11",
        "mooncake-3", "mooncake-4", "mooncake-5", "mooncake-8", "mooncake-6", "mooncake-10",
        "mooncake-12"]
    for follower, pred in chains.items():
        row, before = rows[int(follower.split("-")[1])], rows[int(pred.split("-")[1])]
        request = by_id[follower]
        assert request.block_hashes is None and request.session == by_id[pred].session
        full = before["input_length"] // 512  # the predecessor's full blocks, all shared
        assert row["hash_ids"][:full] == before["hash_ids"][:full]
        assert request.prefix_len == min(full * 512, session_history(by_id[pred]),
                                         row["input_length"])
        service = 1.0 + 0.03 * (before["output_length"] - 1)
        gap = (row["timestamp"] - before["timestamp"]) / 1000
        assert request.after_s == close(max(gap - service, 0.0), rel=1e-6)
    assert by_id["mooncake-5"].prefix_len == 2560  # 2651 tokens: 5 full blocks
    assert by_id["mooncake-4"].block_hashes == tuple(rows[4]["hash_ids"])
    assert _replayed(out)["completed"] == 13
    # Other assumed service times, other estimates.
    _cli("trace", "import", "mooncake", str(MOONCAKE), "--sessions", "--assumed-ttft", "0",
         "--assumed-tpot", "0", "-o", str(out))
    assert {r.id: r.after_s for r in _streamed(out)}["mooncake-5"] == close(27.0)


def _mooncake_row(time_ms: int, length: int, output: int, hashes: list[int]) -> str:
    return json.dumps({"timestamp": time_ms, "input_length": length, "output_length": output,
                       "hash_ids": hashes})


def test_mooncake_sessions_follow_genuine_continuations_only(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join([
        _mooncake_row(0, 1500, 10, [0, 1, 2]),  # 0: a turn; its last block is partial
        _mooncake_row(0, 1800, 10, [0, 1, 7, 8]),  # 1: same time as 0: follows no one
        _mooncake_row(1000, 700, 10, [0, 5]),  # 2: system block 0 only: never followed
        _mooncake_row(2000, 1500, 10, [0, 1, 2]),  # 3: row 0 asked again: follows 0
        _mooncake_row(3000, 2600, 10, [0, 1, 9, 10, 11, 12]),  # 4: continues 3 (the latest)
        _mooncake_row(4000, 900, 10, [0, 6]),  # 5: shares block 0 with everyone: a root
        _mooncake_row(5000, 9000, 600, list(range(20, 38))),  # 6: over --max-model-len
        _mooncake_row(6000, 9300, 10, list(range(20, 38)) + [40]),  # 7: continues 6
    ]) + "\n")
    trace, report = import_sessions("mooncake", source, ImportOptions(max_model_len=9500))
    after = {request.id: request.after for request in trace.requests}
    assert after == {"mooncake-0": None, "mooncake-1": None, "mooncake-2": None,
                     "mooncake-3": "mooncake-0", "mooncake-4": "mooncake-3",
                     "mooncake-5": None, "mooncake-7": None}
    by_id = {request.id: request for request in trace.requests}
    assert by_id["mooncake-4"].prefix_len == 1024  # row 3's 2 full blocks
    # Row 7's predecessor was dropped: it starts its own session, with its block hashes.
    assert by_id["mooncake-7"].block_hashes is not None
    assert report.skipped == {"prompt + output longer than --max-model-len 9500": 1}
    assert (report.sessions, report.follow_ups) == (5, 2)


# ---------------------------------------------------------------- the grouped layout

@st.composite
def _copilot_records(draw, span: int = 600) -> list[dict]:
    records = []
    for number in range(draw(st.integers(1, 4))):
        calls = []
        for _ in range(draw(st.integers(1, 5))):
            second = draw(st.integers(0, span))
            calls.append({"timestamp": f"2026-06-01T10:{second // 60:02d}:{second % 60:02d}Z",
                          "duration_ms": draw(st.integers(0, 20_000)),
                          "result": draw(st.sampled_from(["Success", "UserCancel"])),
                          "tokens": {"prompt": draw(st.integers(0, 9000)),
                                     "completion": draw(st.integers(0, 500)),
                                     "cached": draw(st.integers(0, 9000))}})
        records.append({"session_id": f"s{number}", "date": "2026-06-01",
                        "turns": [{"llm_calls": calls, "tool_batches": []}]})
    return records


@settings(max_examples=examples(25))
@given(records=_copilot_records(), window_start=st.sampled_from([0, 100, 400]))
def test_any_import_is_a_valid_grouped_stream(tmp_path_factory, records, window_start):
    source = tmp_path_factory.mktemp("sessions") / "shard.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    try:
        trace, _ = import_sessions("copilot", source, ImportOptions(window=(window_start, 300)))
    except TraceError as error:
        assert "no request left to import" in str(error)
        return
    seen: dict[str, object] = {}
    for request in trace.requests:
        if request.after is None:
            assert request.session not in {r.session for r in seen.values()}  # one block each
        else:
            pred = seen[request.after]  # written before: the grouped layout streams
            assert request.session == pred.session and request.after_s >= 0
            assert request.prefix_len <= min(session_history(pred), request.prompt_len)
            # A session's turns follow its first without another session between.
            assert trace.requests[len(seen) - 1].session == request.session
        seen[request.id] = request
    out = source.with_name("out.jsonl")
    import_sessions_file("copilot", source, out, ImportOptions(window=(window_start, 300)))
    assert [request.id for request in _streamed(out)] == [r.id for r in trace.requests]


def _reference_links(records: list[dict]) -> dict[str, tuple[str, float, int]]:
    """The documented rule, directly: per session, each kept call (in time order, file order
    among equal times) after the first follows the kept call of latest end (the later one among
    equal ends) that ended by its start, else the session's first call."""
    from datetime import datetime

    expected = {}
    for record_index, record in enumerate(records):
        calls = []
        for call_index, call in enumerate(record["turns"][0]["llm_calls"]):
            tokens = call["tokens"]
            if tokens["prompt"] < 1 or tokens["completion"] < 1:
                continue
            start = datetime.fromisoformat(call["timestamp"]).timestamp()
            calls.append((start, start + call["duration_ms"] / 1000, tokens,
                          f"copilot-{record_index}-0-{call_index}"))
        calls.sort(key=lambda call: call[0])
        for position, (start, _, tokens, name) in enumerate(calls[1:], start=1):
            ended = [(calls[k][1], k) for k in range(position) if calls[k][1] <= start]
            pred = max(ended)[1] if ended else 0
            history = calls[pred][2]["prompt"] + calls[pred][2]["completion"]
            prompt = tokens["prompt"]
            prefix = history if prompt >= history else min(tokens["cached"], prompt, history)
            expected[name] = (calls[pred][3], round(max(start - calls[pred][1], 0.0), 6), prefix)
    return expected


@settings(max_examples=examples(25))
@given(records=_copilot_records(span=30))  # calls overlap often
def test_each_call_follows_the_latest_call_ended_by_its_start(tmp_path_factory, records):
    source = tmp_path_factory.mktemp("sessions") / "shard.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    try:
        trace, report = import_sessions("copilot", source)
    except TraceError as error:
        assert "no request left to import" in str(error)
        return
    got = {request.id: (request.after, request.after_s, request.prefix_len)
           for request in trace.requests if request.after is not None}
    expected = _reference_links(records)
    assert got.keys() == expected.keys()
    for name, (after, after_s, prefix) in expected.items():
        assert got[name] == (after, after_s, prefix), name  # after_s to the microsecond
    assert report.fanned + report.joined + report.clipped <= report.follow_ups


# ---------------------------------------------------------------- mistakes

def _record(**calls_fields) -> dict:
    call = {"timestamp": "2026-06-01T10:00:00Z", "duration_ms": 1000.0,
            "tokens": {"prompt": 100, "completion": 10, "cached": 0}}
    call.update(calls_fields)
    return {"session_id": "s1", "date": "2026-06-01", "turns": [{"llm_calls": [call]}]}


@pytest.mark.parametrize("line, expected", [
    ("{not json", "line 2: not a JSON object"),
    ("[1, 2]", "line 2: the record must be a JSON object"),
    (json.dumps({"turns": []}), "line 2: session_id must be a non-empty string, got None"),
    (json.dumps({"session_id": "s1", "turns": {}}), "line 2 (session 's1'): turns must be a list"),
    (json.dumps({"session_id": "s1", "date": "June 1", "turns": []}),
     "line 2 (session 's1'): date must be the UTC partition date, YYYY-MM-DD"),
    (json.dumps(_record(tokens={"prompt": "100"})),
     "turns[0].llm_calls[0].tokens.prompt must be a token count between 0 and 2147483647, "
     "got '100'"),
    (json.dumps(_record(timestamp="yesterday")),
     "turns[0].llm_calls[0].timestamp must be an ISO 8601 date and time"),
    (json.dumps(_record(duration_ms=-5)),
     "turns[0].llm_calls[0].duration_ms must be a number of milliseconds >= 0, got -5"),
    (json.dumps(_record(result=3)), "turns[0].llm_calls[0].result must be a string"),
])
def test_copilot_mistakes_name_the_file_line_and_field(tmp_path, line, expected):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(_record()) + "\n" + line + "\n")
    with pytest.raises(TraceError) as raised:
        import_trace("copilot", source)
    message = str(raised.value)
    assert message.startswith(f"{source}: ") and expected in message and "\n" not in message


def test_cli_refuses_bad_input_and_flags_in_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_record(tokens={"completion": -1})) + "\n")
    for args, expected in [
        (("copilot", str(bad)), "line 1 (session 's1'): turns[0].llm_calls[0].tokens.completion"),
        (("azure", str(COPILOT), "--sessions"), "--sessions: azure records name no session"),
        (("mooncake", str(MOONCAKE), "--assumed-ttft", "2"),
         "--assumed-ttft: only mooncake --sessions"),
        (("mooncake", str(MOONCAKE), "--sessions", "--assumed-tpot", "-1"),
         "--assumed-tpot: seconds in [0, 3600], got -1.0"),
        (("copilot", str(COPILOT), "--window", "1h:1m"), "no request left to import"),
    ]:
        done = _cli("trace", "import", *args, "-o", str(tmp_path / "out.jsonl"), check=False)
        assert done.returncode == 2, (args, done.stderr)
        assert expected in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_session_options_default_to_the_documented_estimate():
    options = SessionOptions()
    assert (options.sessions, options.assumed_ttft_s, options.assumed_tpot_s) == (
        False, close(1.0), close(0.03))
