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

The client is aiohttp with a hand-read event stream (not the openai package), as `vllm bench
serve`'s is: at hundreds of concurrent streams the client's own per-chunk cost must stay far
below the server's (httpx reads the same streams for 2.2-2.5x the CPU, and near 16k streamed
tokens a second measures seconds of TTFT where the server's own is ~20 ms: docs/serve.md,
'Benchmark a server'). Where the
server publishes vLLM's `vllm:time_to_first_token_seconds` histogram (vLLM and Zipage do), the
summary holds its mean over the run, `server_ttft_mean_s`, beside the client's `mean_ttft_s`:
each request's span there lies inside the client's, so what the client measures beyond it is
the HTTP path's (the server's event loop and this client's), not the engine's.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import aiohttp

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
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
CHAT_NEEDS_TEXT = ("--endpoint /v1/chat/completions sends messages of text, and these prompts are "
                   "token ids; use --endpoint /v1/completions, or a text dataset "
                   "(--dataset-name sharegpt, or random with --tokenizer)")
# Without a terminal, a progress line at least this often (while requests finish).
LINE_EVERY_S = 10.0
_COUNTER = re.compile(r"^zipage:(compressions|preemptions|prefix_cache_queries|prefix_cache_hits)"
                      r"_total\{[^}]*\}\s+(\S+)$", re.M)
_ROUTED = re.compile(r'^zipage:requests_routed_total\{[^}]*replica="(\d+)"[^}]*\}\s+(\S+)$', re.M)
# vLLM's name, which a Zipage server publishes too (zipage/serve/metrics.py): one series a replica.
_TTFT = re.compile(r"^vllm:time_to_first_token_seconds_(sum|count)\{[^}]*\}\s+(\S+)$", re.M)


@dataclass(frozen=True)
class ReportSpec:
    """What the vLLM-style report holds: which latencies (`--percentile-metrics`), at which
    percentiles (`--metric-percentiles`, beside mean, median and standard deviation), and the
    service-level objectives in ms a request must all meet to count towards goodput
    (`--goodput`; None: no goodput)."""

    metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    percentiles: tuple[float, ...] = (99.0,)
    goodput: dict[str, float] | None = None


@dataclass
class Timing:
    """One request as the client saw it: when it was sent, when each streamed chunk that
    carried output came, and when its response fully came back."""

    sent: float | None = None
    chunks: list[float] = field(default_factory=list)
    ended: float | None = None

    def itls(self) -> list[float]:
        """Inter-token latencies: every gap between successive output chunks (s)."""
        return [later - earlier for earlier, later in zip(self.chunks, self.chunks[1:])]


@dataclass
class BenchResult:
    summary: dict
    records: list[RequestRecord]
    timings: dict[str, Timing]  # by request id (those never sent have none)


async def bench_serve(trace: Trace, url: str, model: str | None = None, **options
                      ) -> tuple[dict, list[RequestRecord]]:
    """Replay `trace` against the server at `url`; the run's summary and its request records
    (in trace order). The options are `run_bench`'s."""
    result = await run_bench(trace, url, model, **options)
    return result.summary, result.records


async def run_bench(trace: Trace, url: str, model: str | None = None, *,
                    api_key: str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    progress: bool = False, users: int | None = None,
                    texts: dict[str, str] | None = None, endpoint: str = COMPLETIONS,
                    max_concurrency: int | None = None, report: ReportSpec = ReportSpec()
                    ) -> BenchResult:
    """Replay `trace` against the server at `url`. `users`: at most that many sessions at once
    (`ArrivalQueue`'s closed population). `texts`: prompts to send as text, by request id (a
    text dataset; the others go as token ids). `endpoint`: COMPLETIONS or CHAT (text prompts
    only). `max_concurrency`: at most that many requests in flight."""
    if endpoint not in ENDPOINTS:
        raise ZipageError(f"--endpoint: expected one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if endpoint == CHAT and (texts is None or any(r.id not in texts for r in trace.requests)):
        raise ZipageError(CHAT_NEEDS_TEXT)
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No cap on connections (a request waits for a slot only under `max_concurrency`, as in
    # vLLM) and no timeout: a request takes as long as the server streams it.
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as client:
        model = await _served_model(client, base, model)
        counters_before = await _server_counters(client, base)
        bar = _Progress(len(trace.requests)) if progress else None
        replay = _Replay(client, base, trace, model, vocab_size, bar, users, texts, endpoint,
                         max_concurrency)
        started = time.perf_counter()
        try:
            records = await replay.run()
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - started
        counters_after = await _server_counters(client, base)
    summary = _summary(records, counters_before, counters_after)
    summary.update(_prefix_summary(replay, records))
    summary.update(_session_summary(replay, records))
    summary.update(wall_s=wall, driver="served", kind=SERVED, url=base, model=model,
                   settings={})
    summary["bench"] = bench_report(records, replay.timings, wall, report)
    return BenchResult(summary, records, replay.timings)


class _Progress:
    """Requests done, on stderr: a bar on a terminal; into a file or a pipe, a plain line at
    each tenth of the requests or LINE_EVERY_S after the last line (a bar's carriage returns
    would fill a log with its every redraw)."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.bar = None
        if sys.stderr.isatty():
            from zipage.core.recorder import progress_bar

            self.bar = progress_bar(total, "requests", "req")
        self.started = self.last_line = time.perf_counter()
        self.tenths = 0

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.perf_counter()
        tenths = 10 * self.done // max(self.total, 1)
        if tenths > self.tenths or now - self.last_line >= LINE_EVERY_S:
            self.tenths, self.last_line = tenths, now
            print(f"bench serve: {self.done}/{self.total} requests done "
                  f"({100 * self.done / max(self.total, 1):.0f} %) in {now - self.started:.1f} s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Replay:
    """The sink `ArrivalQueue` hands due requests to: each is sent by a task of its own, whose
    end (the response read to its last byte, or an error) is `queue.done`, which makes the turns
    that follow it due."""

    def __init__(self, client: aiohttp.ClientSession, base: str, trace: Trace, model: str,
                 vocab_size: int, bar: _Progress | None, users: int | None = None,
                 texts: dict[str, str] | None = None, endpoint: str = COMPLETIONS,
                 max_concurrency: int | None = None) -> None:
        self.client, self.base, self.model, self.bar = client, base, model, bar
        self.texts, self.endpoint = texts, endpoint
        # In-flight requests at most (vLLM's --max-concurrency): a request waits for a slot
        # once it is due, and its clock (TTFT, E2EL) starts when it has one, as vLLM's does.
        self.slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
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
        self.timings: dict[str, Timing] = {}
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
            self.bar.update()

    # ---- one request

    def _body(self, seq: Sequence, followed: bool) -> dict:
        text = self.texts.get(seq.seq_id) if self.texts is not None else None
        body = {"model": self.model, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.endpoint == CHAT:
            body["messages"] = [{"role": "user", "content": text}]
            body["max_completion_tokens"] = seq.max_output_tokens
        else:
            body["prompt"] = text if text is not None else seq.prompt_token_ids
            body["max_tokens"] = seq.max_output_tokens
        if seq.turn is not None and seq.turn.session:
            body["session_id"] = seq.turn.session
        if followed:
            body["return_token_ids"] = True
        return body

    async def _send(self, seq: Sequence) -> None:
        followed = self.followers.get(seq.seq_id, 0) > 0  # a later turn is built from it
        body = self._body(seq, followed)
        self.lags.append(self.now() - seq.arrival_s)
        if self.slots is not None:
            await self.slots.acquire()
        try:
            outcome = await self._exchange(body)
        finally:
            if self.slots is not None:
                self.slots.release()
        timing, error = outcome.timing, outcome.error
        self.timings[seq.seq_id] = timing
        # A request's clock starts when it was due, or when it got its slot if it waited.
        arrival = timing.sent if self.slots is not None else seq.arrival_s
        first = timing.chunks[0] if timing.chunks else None
        if error is None and first is None:
            error = "the stream ended without a token"
        if error is None and isinstance(outcome.cached, int):
            self.cached[seq.seq_id] = outcome.cached
        # The server's count of the prompt (a text prompt's tokens, a chat template's) where
        # it says; else the workload's.
        prompt_len = outcome.prompt_tokens if isinstance(outcome.prompt_tokens, int) \
            else seq.prompt_len
        self._record(RequestRecord(
            id=seq.seq_id, arrival=arrival, first_token=first,
            finish=timing.chunks[-1] if error is None else None, prompt_len=prompt_len,
            output_len=(outcome.output_len if outcome.output_len is not None
                        else len(timing.chunks)),
            n_preempted=None, n_compressions=None, max_blocks_held_after_first_compression=None,
            status=FINISHED if error is None else FAILED, error=error))
        # What the queue tells the turns that follow: finished, or failed (and why).
        if error is None and followed and not outcome.got_ids:
            error = NO_TOKEN_IDS
        if error is None:
            seq.status = SequenceStatus.FINISHED
            if followed:
                self.histories[seq.seq_id] = list(seq.prompt_token_ids) + outcome.output_ids
        else:
            seq.status = SequenceStatus.REJECTED
            seq.error = error
        self.queue.done(seq, timing.ended)

    async def _exchange(self, body: dict) -> _Outcome:
        """One streamed request, read to its last byte: its timing, and what it said."""
        outcome = _Outcome(Timing(sent=self.now()))
        timing = outcome.timing
        try:
            async with self.client.post(self.base + self.endpoint, json=body) as response:
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")
                    outcome.error = f"HTTP {response.status}: {_error_message(text)}"
                else:
                    async for line in _lines(response.content):
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            # Read on to the end: a response left unread closes its connection,
                            # and the next request would pay for a new one.
                            continue
                        chunk = json.loads(data)
                        if "error" in chunk:
                            outcome.error = _error_message(data)
                            break
                        if chunk.get("choices"):
                            timing.chunks.append(self.now())
                            ids = chunk["choices"][0].get("token_ids")
                            if isinstance(ids, list):
                                outcome.output_ids += ids
                                outcome.got_ids = True
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                            outcome.output_len = usage["completion_tokens"]
                            outcome.prompt_tokens = usage.get("prompt_tokens")
                            outcome.cached = (usage.get("prompt_tokens_details")
                                              or {}).get("cached_tokens")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            outcome.error = f"a malformed response ({type(exc).__name__}: {exc})"
        timing.ended = self.now()  # the response fully came back
        return outcome


async def _lines(stream: aiohttp.StreamReader):
    """A response's lines as they come in, however its bytes were cut into reads (a line may be
    longer than aiohttp's own line reader allows)."""
    pending = b""
    async for data in stream.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.decode()
    if pending:
        yield pending.decode()


@dataclass
class _Outcome:
    timing: Timing
    error: str | None = None
    output_len: int | None = None
    prompt_tokens: int | None = None
    cached: int | None = None
    output_ids: list[int] = field(default_factory=list)
    got_ids: bool = False


def bench_report(records: list[RequestRecord], timings: dict[str, Timing], duration: float,
                 spec: ReportSpec) -> dict:
    """vLLM's `bench serve` result, under its key names: counts and throughputs over the
    benchmark's wall duration, each latency's mean, median, standard deviation and percentiles
    in ms over the finished requests (ITL over every gap between their chunks), goodput, and
    the most requests this client had in flight at once (sent to response fully read)."""
    done = [record for record in records if record.status == FINISHED]
    per_request = {
        "ttft": [record.first_token - record.arrival for record in done],
        "tpot": [(record.finish - record.first_token) / (record.output_len - 1)
                 for record in done if record.output_len > 1],
        "itl": [gap for record in done for gap in timings[record.id].itls()],
        "e2el": [record.finish - record.arrival for record in done],
    }
    input_tokens = sum(record.prompt_len for record in done)
    output_tokens = sum(record.output_len for record in done)

    def rate(count: int) -> float:
        return count / duration if duration > 0 else 0.0

    report = {
        "duration": duration, "completed": len(done), "failed": len(records) - len(done),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": rate(len(done)),
        "request_goodput": rate(_good(done, spec.goodput)) if spec.goodput else None,
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "max_concurrent_requests": peak_in_flight(timings.values()),
    }
    for metric in spec.metrics:
        values = sorted(1000.0 * value for value in per_request[metric])
        report[f"mean_{metric}_ms"] = statistics.fmean(values) if values else 0.0
        report[f"median_{metric}_ms"] = percentile(values, 50, True)
        report[f"std_{metric}_ms"] = statistics.pstdev(values) if values else 0.0
        for percent in spec.percentiles:
            report[f"p{percent_name(percent)}_{metric}_ms"] = percentile(values, percent, True)
    return report


def _good(done: list[RequestRecord], slos: dict[str, float]) -> int:
    """Finished requests that met every objective (ms): TTFT, TPOT (0 for one token), E2EL."""
    good = 0
    for record in done:
        observed = {"ttft": record.first_token - record.arrival,
                    "tpot": ((record.finish - record.first_token) / (record.output_len - 1)
                             if record.output_len > 1 else 0.0),
                    "e2el": record.finish - record.arrival}
        good += all(1000.0 * observed[name] <= limit for name, limit in slos.items())
    return good


def peak_in_flight(timings) -> int:
    """The most requests in flight at once: each from sent to its response fully read (one
    ending as another is sent counts apart)."""
    events = sorted([(t.sent, 1) for t in timings if t.sent is not None]
                    + [(t.ended, -1) for t in timings if t.ended is not None])
    peak = current = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start
        current += step
        peak = max(peak, current)
    return peak


def percent_name(percent: float) -> str:
    """99 -> "99", 99.9 -> "99.9": a percentile's name in keys and labels, as vLLM writes it."""
    return str(int(percent)) if float(percent).is_integer() else str(percent)


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
    # The server's own time to first token (arrival at it to its first token there), its mean
    # over the run: the part of the client's TTFT the HTTP path did not add.
    summary["server_ttft_mean_s"] = server_ttft_mean(before, after)
    # Beside `zipage plan --replicas N --routing P`'s own key of that name: how the server's
    # router spread this trace (a replicated Zipage server; None elsewhere).
    summary["requests_per_replica"] = None
    if before is not None and after is not None and after["routed"]:
        summary["requests_per_replica"] = [
            int(after["routed"][replica] - before["routed"].get(replica, 0.0))
            for replica in sorted(after["routed"], key=int)]
    return summary


def ttft_histogram(metrics: str) -> dict[str, float]:
    """`ttft_sum` and `ttft_count` of a /metrics text's TTFT histogram, summed over its series (one
    a replica); empty where the server publishes none."""
    found: dict[str, float] = {}
    for part, value in _TTFT.findall(metrics):
        found[f"ttft_{part}"] = found.get(f"ttft_{part}", 0.0) + float(value)
    return found


def server_ttft_mean(before: dict | None, after: dict | None) -> float | None:
    """The mean of the server's TTFT histogram between two readings (`ttft_histogram`'s keys;
    None: it has none, or no request got a token meanwhile). A labelled series appears with its
    first observation: one missing before had counted nothing."""
    if before is None or after is None or "ttft_count" not in after:
        return None
    count = after["ttft_count"] - before.get("ttft_count", 0.0)
    if count <= 0:
        return None
    return (after["ttft_sum"] - before.get("ttft_sum", 0.0)) / count


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


async def _served_model(client: aiohttp.ClientSession, base: str, model: str | None) -> str:
    """`model`, or the server's first; a server nothing answers at is refused first, whether
    or not `--model` was given (every request would fail alike)."""
    try:
        async with client.get(base + "/v1/models") as response:
            status, text = response.status, await response.text(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        # ValueError: a --url the URL parser refuses (aiohttp's InvalidURL is one too).
        raise ZipageError(f"--url: nothing answers at {base} ({type(error).__name__}: {error}); "
                          "start the server first (zipage serve --model ...) or fix --url") \
            from None
    if model is not None:
        return model  # a server may list no models: the name given is the one sent
    try:
        if status != 200:
            raise ValueError(f"HTTP {status}")
        return json.loads(text)["data"][0]["id"]
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise ZipageError(f"--url: no model list at {base}/v1/models ({error}); check the URL "
                          "or pass --model NAME") from None


async def _server_counters(client: aiohttp.ClientSession, base: str) -> dict | None:
    """Compressions, preemptions, prefix-cache queries and hits and the requests routed to each
    replica so far, from a Zipage server's /metrics, and the TTFT histogram's sum and count from
    a vLLM or Zipage server's (None where it has none of them)."""
    try:
        async with client.get(base + "/metrics") as response:
            text = await response.text(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    found: dict = {}
    for name, value in _COUNTER.findall(text):  # one series per replica: their sum
        found[name] = found.get(name, 0.0) + float(value)
    found.update(ttft_histogram(text))
    if not found:
        return None
    found["routed"] = {replica: float(value) for replica, value in _ROUTED.findall(text)}
    return found


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]
