"""`zipage bench serve` replays a session trace in closed loop, over real HTTP on localhost.

One `zipage serve` of the tiny random Qwen3 (tests/tiny_models.py: vocabulary 256, no tokenizer, it
starts in seconds) with `--max-model-len 256`. A trace of two sessions (one with a chain of three
turns, reasoning and a trimmed history; one with two turns following one, an agent's parallel
calls), one session whose first turn the server refuses (400: too long), and one request on its
own. Every exchange is watched through a recording proxy on localhost (tests/http_stand_ins.py):
when it was sent, its body, and when its response ended with which generated token ids. Covered: a
follow-up is sent `after_s` after its predecessor's response fully came back (not before; at most
TIMING_SLACK_S later), its prompt is its predecessor's prompt + the ids the server generated for
it, less the first `reasoning_len`, cut to its `prefix_len`, then its own tokens; each turn carries
its `session_id`, and `return_token_ids` where a later turn is built from it; a failed turn fails
its followers, which are never sent, their errors naming the turn; the summary counts the
follow-ups, the failed and the late, per turn. `zipage bench serve` prints the sessions' lines. The
prefix cache (issue #45): a second turn that re-reads the first's prompt and output gets the first
prompt's full blocks as `usage.prompt_tokens_details.cached_tokens`, streamed or not, and /metrics'
`prefix_cache_hits` and `prefix_cache_queries` advance by exactly the hits and the prompt tokens;
bench serve's summary and printed line carry the responses' hits, equal to the server's counter.
Against a stand-in server (a real aiohttp server answering like one): a server that sends no token
ids fails the follow-ups, not the turn. The request fields: `session_id` on both endpoints and
`return_token_ids` are 400s naming the field on bad input, and a parsed request carries
`.session_id`.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")

from http_stand_ins import RecordingProxy, StandInServer  # noqa: E402
from serve_helpers import serving  # noqa: E402

VOCAB = 256  # the tiny model's
MAX_MODEL_LEN = 256
FLAGS = ["--engine", "cpu", "--dtype", "float32", "--kv-memory-gb", "0.05", "--block-size", "16",
         "--budget", "64", "--window", "4", "--max-model-len", str(MAX_MODEL_LEN),
         "--threads", "1"]
# A follow-up is sent at most this long after it was due (its predecessor's end + after_s):
# the client's event loop wakes at the due time; this allows a loaded 2-core machine's delays.
TIMING_SLACK_S = 0.25

TRACE = """\
{"version": 1, "name": "sessions"}
{"id":"a1","arrival_s":0.0,"session":"a","prompt_len":24,"output_len":6,"reasoning_len":2}
{"id":"a2","after":"a1","after_s":0.3,"prompt_len":38,"output_len":5}
{"id":"a3","after":"a2","after_s":0.0,"prompt_len":50,"output_len":4,"prefix_len":30}
{"id":"b1","arrival_s":0.1,"session":"b","prompt_len":30,"output_len":8}
{"id":"b2","after":"b1","after_s":0.2,"prompt_len":43,"output_len":3}
{"id":"b3","after":"b1","after_s":0.1,"prompt_len":40,"output_len":3,"prefix_len":33}
{"id":"c1","arrival_s":0.05,"session":"c","prompt_len":20,"output_len":250}
{"id":"c2","after":"c1","after_s":0.0,"prompt_len":20,"output_len":3,"prefix_len":10}
{"id":"c3","after":"c2","after_s":0.0,"prompt_len":25,"output_len":3}
{"id":"d","arrival_s":0.2,"prompt_len":12,"output_len":4}
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from tiny_models import save_tiny_qwen3

    directory = tmp_path_factory.mktemp("bench-sessions")
    save_tiny_qwen3(directory / "model")
    with serving(["--model", str(directory / "model"), *FLAGS], directory / "server.log",
                 180) as served:
        yield served.url


@pytest.fixture
def trace(tmp_path):
    from zipage.trace_import import load_trace_file

    path = tmp_path / "sessions.jsonl"
    path.write_text(TRACE)
    return load_trace_file(path)


def _cached_tokens(exchange: SimpleNamespace) -> int:
    """The usage chunk's prompt_tokens_details.cached_tokens."""
    for line in exchange.raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            usage = json.loads(line[5:]).get("usage")
            if usage:
                return usage["prompt_tokens_details"]["cached_tokens"]
    raise AssertionError("no usage chunk")


def _prefix_counters(url: str) -> dict[str, float]:
    """/metrics' prefix-cache counters and prompt tokens, summed over replicas."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = dict.fromkeys(("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens"), 0.0)
    for name, value in re.findall(r"^zipage:(\w+)_total\{[^}]*\}\s+(\S+)$", text, re.M):
        if name in found:
            found[name] += float(value)
    return found


def _generated_ids(exchange: SimpleNamespace) -> list[int]:
    ids = []
    for line in exchange.raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            for choice in json.loads(line[5:])["choices"]:
                ids += choice["token_ids"]
    return ids


def test_follow_ups_are_sent_after_their_predecessor_with_its_generated_history(url, trace):
    from zipage.serve.bench import bench_serve
    from zipage.sessions import own_tokens
    from zipage.trace import prompt_token_ids

    with RecordingProxy(url) as watched:
        summary, records = asyncio.run(bench_serve(trace, watched.url, vocab_size=VOCAB))
    requests = {request.id: request for request in trace.requests}
    record = {r.id: r for r in records}

    # Which request each exchange was: a request on its own or a first turn by its whole
    # prompt, a follow-up by its own tokens, which end its prompt.
    exchange = {}
    for seen in watched.exchanges:
        prompt = seen.body["prompt"]
        matches = [request.id for request in trace.requests
                   if (prompt == prompt_token_ids(request, vocab_size=VOCAB)
                       if request.after is None
                       else prompt[len(prompt) - (request.prompt_len - request.prefix_len):]
                       == own_tokens(request, VOCAB))]
        assert len(matches) == 1, (prompt, matches)
        exchange[matches[0]] = seen
    # The turns that follow the refused c1 were never sent; everything else was, once.
    assert len(watched.exchanges) == len(exchange) == 8
    assert set(exchange) == set(requests) - {"c2", "c3"}
    assert exchange["c1"].status == 400

    for request_id in ("a1", "a2", "a3", "b1", "b2", "b3", "d"):
        assert exchange[request_id].status == 200 and record[request_id].status == "finished"
        assert len(_generated_ids(exchange[request_id])) == requests[request_id].output_len
    for request_id in ("a2", "a3", "b2", "b3"):
        request = requests[request_id]
        before = requests[request.after]
        sent, previous = exchange[request_id], exchange[request.after]
        # The prompt: the predecessor's as sent, its generated ids less the first
        # reasoning_len, the first prefix_len of those, then the turn's own tokens.
        history = previous.body["prompt"] + _generated_ids(previous)[before.reasoning_len:]
        expected = history[:request.prefix_len] + own_tokens(request, VOCAB)
        assert sent.body["prompt"] == expected, request_id
        assert record[request_id].prompt_len == len(expected) == request.prompt_len
        # Sent after_s after the predecessor's response ended: never sooner, and on time.
        gap = sent.sent - previous.ended
        assert request.after_s <= gap <= request.after_s + TIMING_SLACK_S, (request_id, gap)
        # Its arrival (TTFT counts from it) is when it was due, after_s past the predecessor's
        # last token.
        wait = record[request_id].arrival - record[request.after].finish
        assert request.after_s <= wait <= request.after_s + TIMING_SLACK_S, (request_id, wait)
    # Requests that follow none are sent at their arrival_s (open loop).
    start = min(seen.sent for seen in watched.exchanges)
    for request_id in ("a1", "b1", "c1", "d"):
        offset = exchange[request_id].sent - start - requests[request_id].arrival_s
        assert -TIMING_SLACK_S <= offset <= TIMING_SLACK_S, (request_id, offset)

    # Each turn names its session; token ids are asked for where a later turn needs them.
    for request_id, seen in exchange.items():
        session = requests[request_id].session
        assert seen.body.get("session_id") == session, request_id
        assert seen.body.get("return_token_ids", False) == (request_id in ("a1", "a2", "b1", "c1"))
    assert "session_id" not in exchange["d"].body

    # A failed turn fails those that follow it, alone, each naming the turn it followed.
    assert record["c1"].error.startswith("HTTP 400: prompt: too long for this server")
    assert record["c2"].status == record["c3"].status == "failed"
    assert record["c2"].error.startswith("request c2: the turn it follows, c1, failed (HTTP 400")
    assert record["c3"].error.startswith("request c3: the turn it follows, c2, failed")
    assert [r.id for r in records] == [request.id for request in trace.requests]

    assert (summary["requests"], summary["completed"], summary["failed"]) == (10, 7, 3)
    assert summary["output_tokens"] == sum(requests[i].output_len
                                           for i in ("a1", "a2", "a3", "b1", "b2", "b3", "d"))
    assert summary["follow_ups"] == 6 and summary["follow_ups_failed"] == 2
    assert summary["follow_ups_not_sent"] == 2
    assert summary["sent_late"] == 0 and 0.0 <= summary["max_send_lag_s"] <= TIMING_SLACK_S
    turns = [(turn["turn"], turn["requests"], turn["completed"], turn["failed"])
             for turn in summary["turns"]]
    assert turns == [(1, 4, 3, 1), (2, 4, 3, 1), (3, 2, 1, 1)]
    for turn in summary["turns"]:
        assert 0 < turn["ttft_p50_s"] <= turn["e2e_p50_s"] and turn["tps"] > 0

    # The prefix cache: each follow-up found at least its predecessor's first prompt block (16
    # tokens); the summary sums the responses' cached_tokens, which the server's own counter
    # matches (nothing else ran, nothing was preempted).
    cached = {request_id: _cached_tokens(seen) for request_id, seen in exchange.items()
              if seen.status == 200}
    assert all(cached[i] >= 16 and cached[i] % 16 == 0 for i in ("a2", "a3", "b2", "b3"))
    assert cached["a1"] == cached["b1"] == cached["d"] == 0
    hits, prompt = sum(cached.values()), sum(record[i].prompt_len for i in cached)
    assert summary["preemptions"] == 0
    assert summary["prefix_hit_tokens"] == summary["server_prefix_hit_tokens"] == hits
    assert summary["prefix_hit_share"] == pytest.approx(hits / prompt)
    assert summary["prefill_tokens"] == prompt - hits


def test_a_second_turn_finds_the_first_prompt_in_the_prefix_cache(url):
    """Turn 1 (40 random tokens, not streamed) finds nothing; turn 2 (turn 1's prompt, its
    output, 5 more tokens; streamed) finds turn 1's two full prompt blocks (output blocks never
    enter the prefix index). /metrics advances by exactly that: hits 32, queries every prompt
    token (none was preempted), as the HTTP side's own prompt_tokens count says."""
    rng = random.Random(45)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]
    before = _prefix_counters(url)
    first = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second_prompt = prompt + first["choices"][0]["token_ids"] + [rng.randrange(VOCAB)
                                                                 for _ in range(5)]
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": second_prompt, "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as reply:
        raw = b"".join(reply.iter_bytes())
    assert _cached_tokens(SimpleNamespace(raw=raw)) == 32
    after = _prefix_counters(url)
    advanced = {name: after[name] - before[name] for name in after}
    assert advanced == {"prefix_cache_hits": 32, "prefix_cache_queries": 40 + 51,
                        "prompt_tokens": 40 + 51}


def test_cli_prints_the_sessions(url, tmp_path, capsys):
    from zipage.cli.parser import main

    path = tmp_path / "chain.jsonl"
    path.write_text(
        '{"version": 1, "name": "chain"}\n'
        '{"id":"x1","arrival_s":0.0,"session":"x","prompt_len":16,"output_len":3}\n'
        '{"id":"x2","after":"x1","after_s":0.05,"prompt_len":24,"output_len":2}\n'
        '{"id":"y1","arrival_s":0.0,"session":"y","prompt_len":10,"output_len":300}\n'
        '{"id":"y2","after":"y1","prompt_len":4,"output_len":2,"prefix_len":0}\n')
    out = tmp_path / "run"
    assert main(["bench", "serve", str(path), "--url", url, "--vocab-size", str(VOCAB),
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert ("sessions: 2 follow-up turns, 1 failed (1 not sent: the turn they follow failed); "
            "0 requests sent over 50 ms late") in printed
    assert "failed: y2: request y2: the turn it follows, y1, failed (HTTP 400" in printed
    # x2 re-reads x1's one prompt block (16 of its 24 tokens; x1's 16 found nothing).
    assert ("prefix cache: 16 prompt tokens of the responses from the cache (40.0 % of their "
            "prompt tokens); /metrics over the run: 16 hit, 24 computed") in printed
    summary = json.loads((out / "summary.json").read_text())
    assert [turn["completed"] for turn in summary["turns"]] == [1, 1]
    assert (summary["prefix_hit_tokens"], summary["server_prefix_hit_tokens"]) == (16, 16)
    assert summary["prefix_hit_share"] == 0.4 and summary["prefill_tokens"] == 24
    # The server's own TTFT (its histogram over the run: the two requests that got a token),
    # printed beside the client's: each request's span there lies inside the client's.
    server, client = summary["server_ttft_mean_s"], summary["mean_ttft_s"]
    assert 0 < server <= client
    assert (f"TTFT at the server (its /metrics, mean): {1000 * server:.1f} ms; at this client: "
            f"{1000 * client:.1f} ms") in printed


def test_a_server_that_sends_no_token_ids_fails_the_follow_ups_not_the_turn(tmp_path):
    """Against a stand-in server: a completion streamed without token ids finishes, and the
    turn built from it fails, naming why; it is never sent."""
    from zipage.serve.bench import NO_TOKEN_IDS, bench_serve
    from zipage.trace_import import load_trace_file

    path = tmp_path / "two.jsonl"
    path.write_text('{"version": 1, "name": "two"}\n'
                    '{"id":"p","arrival_s":0.0,"session":"s","prompt_len":8,"output_len":2}\n'
                    '{"id":"q","after":"p","prompt_len":12,"output_len":2}\n')
    with StandInServer(None) as server:
        summary, records = asyncio.run(bench_serve(load_trace_file(path), server.url))
    bodies = server.bodies
    assert len(bodies) == 1 and bodies[0]["return_token_ids"] is True
    assert bodies[0]["session_id"] == "s"
    assert [(r.id, r.status) for r in records] == [("p", "finished"), ("q", "failed")]
    assert records[1].error == f"request q: the turn it follows, p, failed ({NO_TOKEN_IDS})"
    assert summary["follow_ups_not_sent"] == 1 and summary["compressions"] is None
    # No cached_tokens in its usage and no /metrics: the prefix-cache keys are unknown.
    assert summary["prefix_hit_tokens"] is summary["prefix_hit_share"] is None
    assert summary["server_prefix_hit_tokens"] is summary["prefill_tokens"] is None
    assert summary["server_ttft_mean_s"] is None


def test_users_send_one_session_at_a_time(tmp_path):
    """`users=1` against a stand-in server: the second session's first turn is sent only after
    the first session's last turn came back (the core's closed population)."""
    from zipage.serve.bench import bench_serve
    from zipage.trace_import import load_trace_file

    path = tmp_path / "users.jsonl"
    path.write_text('{"version": 1, "name": "users"}\n'
                    '{"id":"a0","arrival_s":0.0,"session":"a","prompt_len":8,"output_len":2}\n'
                    '{"id":"a1","after":"a0","prompt_len":12,"output_len":2}\n'
                    '{"id":"b0","arrival_s":0.0,"session":"b","prompt_len":8,"output_len":2}\n')
    with StandInServer([5, 6]) as server:
        summary, records = asyncio.run(bench_serve(load_trace_file(path), server.url, users=1))
    assert [body["session_id"] for body in server.bodies] == ["a", "a", "b"]
    # One at a time, each response read to its end: one connection carried them all.
    assert len(set(server.peers)) == 1, server.peers
    assert [r.status for r in records] == ["finished"] * 3


@pytest.mark.parametrize("value", ["", 7, "x" * 257, ["s"], True, {"id": "s"}])
def test_a_bad_session_id_is_a_400_naming_it_on_both_endpoints(url, value):
    bodies = {"/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 1},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 1}}
    for route, body in bodies.items():
        reply = httpx.post(url + route, json={**body, "session_id": value}, timeout=30)
        assert reply.status_code == 400, (route, reply.text)
        error = reply.json()["error"]
        assert error["param"] == "session_id" and error["code"] == 400
        assert error["message"].startswith("session_id: expected a string of 1 to 256 characters")


def test_good_session_id_and_return_token_ids(url):
    from zipage.serve.protocol import ChatRequest, CompletionRequest

    reply = httpx.post(url + "/v1/completions", timeout=30, json={
        "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True, "session_id": "s" * 256,
        "return_token_ids": True})
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 3
    for value in ("yes", 1, None):
        reply = httpx.post(url + "/v1/completions", timeout=30,
                           json={"prompt": [1], "max_tokens": 1, "return_token_ids": value})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "return_token_ids"
        assert error["message"].startswith("return_token_ids: Input should be a valid boolean")
    # The parsed request carries the session for the router (None without one).
    assert CompletionRequest.model_validate({"prompt": [1]}).session_id is None
    assert CompletionRequest.model_validate({"prompt": [1], "session_id": "a"}).session_id == "a"
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                       "session_id": "b"})
    assert chat.session_id == "b"
