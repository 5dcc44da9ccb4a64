"""`zipage bench serve TRACE --url URL`: replay a trace against any OpenAI-compatible server.

Requests are sent when `ArrivalQueue` (zipage/core/arrivals.py) makes them due on the wall clock
from the start, the one rule every driver follows: a request on its own at its `arrival_s` (open
loop), a session's follow-up turn `after_s` after its predecessor's response fully came back
(closed loop: a slower server is sent its next turns later, as users and agents send them;
docs/traces.md, 'Sessions'). Each goes to /v1/completions with its prompt as token ids
(`zipage.core.deployment.iter_trace_sequences`: the very ids `zipage replay` feeds the engine),
`max_tokens` = its `output_len`, `ignore_eos` and greedy sampling, streamed. A follow-up's prompt
is built when it comes due, as the engine builds it (`zipage.sessions.follow_up_tokens`): its
predecessor's prompt and the token ids the server generated for it (asked for with
`return_token_ids`), less the first `reasoning_len`, then the turn's own tokens; so the server's
prefix cache sees what production would show it. Every turn carries its session as `session_id`
(a router keeps a session on one replica). A turn whose predecessor failed is never sent: it
fails alone, naming that turn.

TTFT, TPOT and the finish time are measured from the stream on this side, TTFT from the moment the
request was due; the output length is the server's usage count. The result is a run like `zipage
replay`'s: the same summary keys (`--json`) and the same `requests.csv` columns, so `zipage
compare` sets a served run beside an offline replay or a simulation of the same trace; the summary
adds the sessions' keys (`SESSION_KEYS`). What only the server knows (steps, decisions, the
config, per-request compressions) is left out: the run's "kind" is "served", its steps.csv is
empty and it has no decisions.log, and `zipage compare` compares its requests only. Against
`zipage serve`, the run's compressions, preemptions and `prefill_tokens` come from its /metrics
(the whole server's over the run). Its `prefix_hit_tokens` are its own requests' prompt tokens
served from the prefix cache, as each response's `usage.prompt_tokens_details.cached_tokens`
says (any server that reports them), with their share of those requests' prompt tokens; the
/metrics figure is beside it (`server_prefix_hit_tokens`), equal on a server of its own that
preempted nothing (a request readmitted after a preemption counts its hits again there, as in
an offline run's summary).

The client is httpx with a hand-read event stream (not the openai package): at hundreds of
concurrent streams the client's own per-chunk cost must stay far below the server's.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import replace

import httpx

from zipage.core.arrivals import ArrivalQueue, Done
from zipage.core.deployment import iter_trace_sequences
from zipage.core.metrics import percentile, summarize
from zipage.core.sequence import Sequence, SequenceStatus
from zipage.errors import ZipageError
from zipage.records import RequestRecord
from zipage.rundir import SERVED
from zipage.sessions import follow_up_tokens
from zipage.trace import DEFAULT_VOCAB_SIZE, Trace

# What a client cannot see: per-step records and the server's per-request bookkeeping.
SERVER_ONLY_KEYS = ("peak_running", "mean_running", "max_blocks_after_compress", "steps",
                    "n_max", "max_concurrency", "num_blocks")
# The summary's keys of sessions (None where the trace has no follow-up; `_session_summary`).
SESSION_KEYS = ("follow_ups", "follow_ups_failed", "follow_ups_not_sent", "sent_late",
                "max_send_lag_s", "turns")
# The summary's keys of the prefix cache, from the responses' `cached_tokens` (None where the
# server reports none; `_prefix_summary`).
PREFIX_KEYS = ("prefix_hit_tokens", "prefix_hit_share")
# A request sent more than this after it was due counts as sent late: the client's own event
# loop lagged (its TTFT counts the lag, which the server never saw).
LATE_S = 0.05
FINISHED, FAILED = "finished", "failed"
NO_TOKEN_IDS = ("the server sent back no generated token ids (return_token_ids), which the turns "
                "that follow it are built from")
_COUNTER = re.compile(r"^zipage:(compressions|preemptions|prefix_cache_queries|prefix_cache_hits)"
                      r"_total\{[^}]*\}\s+(\S+)$", re.M)
_ROUTED = re.compile(r'^zipage:requests_routed_total\{[^}]*replica="(\d+)"[^}]*\}\s+(\S+)$', re.M)


async def bench_serve(trace: Trace, url: str, model: str | None = None, *,
                      api_key: str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                      progress: bool = False, users: int | None = None,
                      transport: httpx.AsyncBaseTransport | None = None
                      ) -> tuple[dict, list[RequestRecord]]:
    """Replay `trace` against the server at `url`; the run's summary and its request records
    (in trace order). `users`: at most that many sessions at once (`ArrivalQueue`'s closed
    population). `transport`: httpx's, to watch or fake the exchanges (tests)."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=None, limits=limits,
                                 transport=transport) as client:
        model = model or await _served_model(client, base)
        counters_before = await _server_counters(client)
        bar = None
        if progress:
            from zipage.core.recorder import progress_bar

            bar = progress_bar(len(trace.requests), "requests", "req")
        replay = _Replay(client, trace, model, vocab_size, bar, users)
        started = time.perf_counter()
        try:
            records = await replay.run()
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - started
        counters_after = await _server_counters(client)
    summary = _summary(records, counters_before, counters_after)
    summary.update(_prefix_summary(replay, records))
    summary.update(_session_summary(replay, records))
    summary.update(wall_s=wall, driver="served", kind=SERVED, url=base, model=model,
                   settings={})
    return summary, records


class _Replay:
    """The sink `ArrivalQueue` hands due requests to: each is sent by a task of its own, whose
    end (the response read to its last byte, or an error) is `queue.done`, which makes the turns
    that follow it due."""

    def __init__(self, client: httpx.AsyncClient, trace: Trace, model: str, vocab_size: int,
                 bar, users: int | None = None) -> None:
        self.client, self.model, self.bar = client, model, bar
        self.sequences = list(iter_trace_sequences(trace, vocab_size, need_tokens=True))
        # Turns that follow each request, still to come due: its history (prompt + generated
        # ids) is kept until the last of them was built from it.
        self.followers = Counter(request.after for request in trace.requests
                                 if request.after is not None)
        self.histories: dict[str, list[int]] = {}
        self.depth: dict[str, int] = {}  # 1: follows none; a follow-up: its predecessor's + 1
        for request in trace.requests:
            self.depth[request.id] = (1 if request.after is None
                                      else self.depth.get(request.after, 1) + 1)
        self.records: dict[str, RequestRecord] = {}
        self.lags: list[float] = []  # per request sent: seconds from due to sent
        # Per request finished: its usage's prompt_tokens_details.cached_tokens (those whose
        # server sent it).
        self.cached: dict[str, int] = {}
        self.not_sent = 0  # follow-ups of failed turns, failed without being sent
        self.queue = ArrivalQueue(self.sequences, on_release=self._release, users=users)
        self.queue.on_change = self._wake
        self.tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None  # a bug in a request's task
        self.event: asyncio.Event | None = None
        self.started = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.started

    async def run(self) -> list[RequestRecord]:
        self.event = asyncio.Event()
        self.started = time.perf_counter()
        queue = self.queue
        try:
            while True:
                queue.admit_due(self, self.now())
                self.event.clear()
                if self.failure is not None:
                    raise self.failure
                if not queue.has_pending and not self.tasks:
                    break
                due = queue.next_arrival_s  # None: only follow-ups of requests in flight wait
                try:
                    await asyncio.wait_for(self.event.wait(),
                                           None if due is None else max(0.0, due - self.now()))
                except asyncio.TimeoutError:
                    pass
        finally:
            for task in self.tasks:
                task.cancel()
        return [self.records[seq.seq_id] for seq in self.sequences]

    def _wake(self) -> None:
        if self.event is not None:
            self.event.set()

    # ---- the sink

    def add(self, seq: Sequence) -> bool:
        task = asyncio.get_running_loop().create_task(self._send(seq))
        self.tasks.add(task)
        task.add_done_callback(self._ended)
        return True

    def refuse(self, seq: Sequence, reason: str) -> None:
        """A follow-up of a failed turn: failed, never sent (the queue then fails its own)."""
        seq.status = SequenceStatus.REJECTED
        seq.error = reason
        self.not_sent += 1
        self._used_history(seq.turn.follows)
        self._record(RequestRecord(
            id=seq.seq_id, arrival=seq.arrival_s, first_token=None, finish=None,
            prompt_len=seq.prompt_len, output_len=0, n_preempted=None, n_compressions=None,
            max_blocks_held_after_first_compression=None, status=FAILED, error=reason))

    def _release(self, seq: Sequence, predecessor: Done) -> None:
        """A follow-up comes due: its prompt from what the server generated for its
        predecessor (its own tokens were its prompt until now)."""
        seq.prompt_token_ids = follow_up_tokens(
            self.histories[predecessor.seq_id], predecessor.prompt_len,
            predecessor.reasoning_len, seq.turn.shared_len, seq.prompt_token_ids)
        seq.prompt_len = len(seq.prompt_token_ids)
        self._used_history(predecessor.seq_id)

    def _used_history(self, seq_id: str) -> None:
        self.followers[seq_id] -= 1
        if self.followers[seq_id] <= 0:
            del self.followers[seq_id]
            self.histories.pop(seq_id, None)

    def _ended(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
        self._wake()

    def _record(self, record: RequestRecord) -> None:
        self.records[record.id] = record
        if self.bar is not None:
            self.bar.update(1)

    # ---- one request

    async def _send(self, seq: Sequence) -> None:
        followed = self.followers.get(seq.seq_id, 0) > 0  # a later turn is built from it
        body = {"model": self.model, "prompt": seq.prompt_token_ids,
                "max_tokens": seq.max_output_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        if seq.turn is not None and seq.turn.session:
            body["session_id"] = seq.turn.session
        if followed:
            body["return_token_ids"] = True
        self.lags.append(self.now() - seq.arrival_s)
        first = finish = None
        chunks = 0
        output_len = None
        error = None
        output_ids: list[int] = []
        got_ids = False
        cached = None
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    error = f"HTTP {response.status_code}: {_error_message(text)}"
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = _error_message(data)
                            break
                        if chunk.get("choices"):
                            now = self.now()
                            first = now if first is None else first
                            finish = now
                            chunks += 1
                            ids = chunk["choices"][0].get("token_ids")
                            if isinstance(ids, list):
                                output_ids += ids
                                got_ids = True
                        if chunk.get("usage"):
                            output_len = chunk["usage"]["completion_tokens"]
                            cached = (chunk["usage"].get("prompt_tokens_details")
                                      or {}).get("cached_tokens")
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            error = f"a malformed response ({type(exc).__name__}: {exc})"
        ended = self.now()  # the response fully came back
        if error is None and first is None:
            error = "the stream ended without a token"
        if error is None and isinstance(cached, int):
            self.cached[seq.seq_id] = cached
        self._record(RequestRecord(
            id=seq.seq_id, arrival=seq.arrival_s, first_token=first,
            finish=finish if error is None else None, prompt_len=seq.prompt_len,
            output_len=output_len if output_len is not None else chunks,
            n_preempted=None, n_compressions=None, max_blocks_held_after_first_compression=None,
            status=FINISHED if error is None else FAILED, error=error))
        # What the queue tells the turns that follow: finished, or failed (and why).
        if error is None and followed and not got_ids:
            error = NO_TOKEN_IDS
        if error is None:
            seq.status = SequenceStatus.FINISHED
            if followed:
                self.histories[seq.seq_id] = list(seq.prompt_token_ids) + output_ids
        else:
            seq.status = SequenceStatus.REJECTED
            seq.error = error
        self.queue.done(seq, ended)


def _summary(records: list[RequestRecord], before: dict | None, after: dict | None) -> dict:
    # The shared summary over records whose server-side counts are unknown (zero for the sum).
    known = [replace(record, n_preempted=0, n_compressions=0,
                     max_blocks_held_after_first_compression=0) for record in records]
    summary = summarize([], known)
    for key in SERVER_ONLY_KEYS:
        summary[key] = None
    for key in ("compressions", "preemptions"):
        summary[key] = _advance(before, after, key)
    # The whole server's over the run, as an offline run counts them: prompt tokens computed,
    # and found in the prefix cache (`prefix_hit_tokens` is this run's own, `_prefix_summary`).
    hits = _advance(before, after, "prefix_cache_hits")
    queries = _advance(before, after, "prefix_cache_queries")
    summary["prefill_tokens"] = None if hits is None or queries is None else queries - hits
    summary["server_prefix_hit_tokens"] = hits
    # Beside `zipage plan --replicas N --routing P`'s own key of that name: how the server's
    # router spread this trace (a replicated Zipage server; None elsewhere).
    summary["requests_per_replica"] = None
    if before is not None and after is not None and after["routed"]:
        summary["requests_per_replica"] = [
            int(after["routed"][replica] - before["routed"].get(replica, 0.0))
            for replica in sorted(after["routed"], key=int)]
    return summary


def _advance(before: dict | None, after: dict | None, name: str) -> int | None:
    """How far a /metrics counter advanced over the run (None: not on this server)."""
    if before is None or after is None or name not in before or name not in after:
        return None
    return int(after[name] - before[name])


def _prefix_summary(replay: _Replay, records: list[RequestRecord]) -> dict:
    """This run's prompt tokens served from the prefix cache (the finished requests' usage
    `cached_tokens`, summed) and their share of those requests' prompt tokens; None against a
    server that reports no `cached_tokens`."""
    served = [record for record in records if record.id in replay.cached]
    if not served:
        return dict.fromkeys(PREFIX_KEYS)
    hits = sum(replay.cached[record.id] for record in served)
    prompt = sum(record.prompt_len for record in served)
    return {"prefix_hit_tokens": hits, "prefix_hit_share": hits / prompt if prompt else 0.0}


def _session_summary(replay: _Replay, records: list[RequestRecord]) -> dict:
    """The sessions' keys: follow-ups, those that failed (sent or not), requests sent late, and
    per turn (1: requests that follow none, 2: the turns after them, ...) the latencies."""
    follow_ups = [record for record in records if replay.depth[record.id] > 1]
    if not follow_ups:
        return dict.fromkeys(SESSION_KEYS)
    turns = []
    for depth in range(1, max(replay.depth.values()) + 1):
        group = [record for record in records if replay.depth[record.id] == depth]
        done = [record for record in group if record.status == FINISHED]
        ttfts = sorted(record.first_token - record.arrival for record in done)
        e2es = sorted(record.finish - record.arrival for record in done)
        tpots = sorted((record.finish - record.first_token) / (record.output_len - 1)
                       for record in done if record.output_len > 1)
        tokens = sum(record.output_len for record in done)
        span = (max(record.finish for record in done) - min(record.arrival for record in done)
                if done else 0.0)
        turns.append({
            "turn": depth, "requests": len(group), "completed": len(done),
            "failed": len(group) - len(done), "output_tokens": tokens,
            "tps": tokens / span if span > 0 else 0.0,
            **{f"ttft_p{p}_s": percentile(ttfts, p, True) for p in (50, 90, 99)},
            **{f"e2e_p{p}_s": percentile(e2es, p, True) for p in (50, 90, 99)},
            "tpot_p50_ms": 1000.0 * percentile(tpots, 50, True)})
    return {
        "follow_ups": len(follow_ups),
        "follow_ups_failed": sum(record.status != FINISHED for record in follow_ups),
        "follow_ups_not_sent": replay.not_sent,
        "sent_late": sum(lag > LATE_S for lag in replay.lags),
        "max_send_lag_s": max(replay.lags, default=0.0),
        "turns": turns,
    }


async def _served_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise ZipageError(f"--url: no model list at {base}/v1/models ({error}); check the URL "
                          "or pass --model NAME") from None


async def _server_counters(client: httpx.AsyncClient) -> dict | None:
    """Compressions, preemptions, prefix-cache queries and hits so far, and the requests routed
    to each replica, from a Zipage server's /metrics (None elsewhere)."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    found: dict = {}
    for name, value in _COUNTER.findall(response.text):  # one series per replica: their sum
        found[name] = found.get(name, 0.0) + float(value)
    if not found:
        return None
    found["routed"] = {replica: float(value) for replica, value in _ROUTED.findall(response.text)}
    return found


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]
