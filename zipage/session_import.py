"""Session-shaped production traces in: agent runs and conversations as closed-loop sessions.

- `copilot`: the GitHub Copilot coding-agent traces (Azure/AzurePublicDataset, June 2026),
  JSON Lines (gzipped shards) of one agent session a line: `session_id`, `date`, `turns`, each
  turn's `llm_calls` with `timestamp`, `duration_ms`, `result` and `tokens` (prompt, completion,
  cached). A session's calls form a tree: each follows the latest-ending call that had ended by
  its start, sent the tool and think time after it (`after_s`), its prompt beginning with that
  call's history; calls the agent ran in parallel follow the same call and overlap in replay.
- `mooncake --sessions`: the Mooncake/Kimi FAST'25 traces with sessions inferred from the hash
  chains: a request whose hash ids begin with all the full blocks of an earlier request's prompt
  follows it. The records have no latency, so `after_s` is an estimate: the arrival gap less an
  assumed service time of the predecessor (`SessionOptions`).

Each call or row is kept as a few numbers (`_Calls`); the predecessors are linked, rows that
cannot become a request are counted by reason (a follow-up of a skipped one follows the kept turn
before it), whole sessions are kept or dropped by `--span` (by their first turn) and
`--sample`, and the requests are made in the grouped layout: sessions in order of their start,
each session's turns right after its first, so `zipage replay` streams the written trace exactly.
The mapping is described in docs/traces.md, "Session imports".
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import re
import reprlib
from array import array
from collections import Counter
from dataclasses import dataclass
from datetime import date as calendar_date
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

import numpy as np

from zipage.errors import TraceError
from zipage.production_rows import (
    MOONCAKE_HASH_BLOCK,
    ImportOptions,
    ImportReport,
    _check_options,
    _nothing_left,
    _read,
    _text_lines,
)
from zipage.production_rows import _opened as _open_file
from zipage.trace import (
    ARRIVAL_DECIMALS,
    MAX_ARRIVAL_S,
    MAX_LENGTH,
    Trace,
    TraceRequest,
    save_trace_stream,
    stable_hash,
    trace_stem,
)

SESSION_FORMATS = ("copilot",)  # formats whose records are sessions (mooncake: with --sessions)
# What `mooncake --sessions` assumes a predecessor took to serve, when no latency is recorded:
# its first token after ASSUMED_TTFT_S, each further one ASSUMED_TPOT_S later.
ASSUMED_TTFT_S = 1.0
ASSUMED_TPOT_S = 0.03
COPILOT_SUCCESS = "Success"
# A prompt whose full blocks requests continue in more ways than this is a shared template (a
# system prompt, a document many ask about), not a conversation's turn: no request follows it.
# Real turns of the FAST'25 conversation trace are continued in at most 7 ways (their own last
# partial block, retries and edited follow-ups), its shared system block in thousands.
MOONCAKE_MAX_BRANCHES = 8
# A call whose timestamp is further than this from its record's `date` partition is skipped:
# the dataset's own analysis notes client clock skew far from the partition date.
COPILOT_DATE_SLACK = timedelta(days=1)

_NO_TIMESTAMP = "no timestamp"
_NO_DURATION = "no duration_ms (the tool time after it is unknown)"
_CLOCK_SKEW = "timestamp more than a day outside its session's date (client clock skew)"
_NO_PROMPT = "no prompt tokens"
_NO_OUTPUT = "no output tokens (a failed request in the source)"
_OUTSIDE = "outside --span"
_UNSAMPLED = "not in the --sample"

_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 60, 60, 2, 4, 3


@dataclass(frozen=True)
class SessionOptions:
    """`sessions`: infer Mooncake sessions from hash chains (copilot is always sessions);
    `assumed_ttft_s`, `assumed_tpot_s`: the service time Mooncake's `after_s` estimate assumes
    for the predecessor, TTFT + TPOT x (its output - 1)."""

    sessions: bool = False
    assumed_ttft_s: float = ASSUMED_TTFT_S
    assumed_tpot_s: float = ASSUMED_TPOT_S


def uses_sessions(fmt: str, session_options: SessionOptions = SessionOptions()) -> bool:
    """Whether `fmt` is imported as sessions (by this module)."""
    return fmt in SESSION_FORMATS or (fmt == "mooncake" and session_options.sessions)


def session_options(fmt: str, sessions: bool, ttft_s: float | None,
                    tpot_s: float | None) -> SessionOptions:
    """The CLI's session flags, checked: --sessions is Mooncake's, the assumed service times go
    with it."""
    if sessions and fmt not in ("mooncake", *SESSION_FORMATS):
        raise TraceError(f"--sessions: {fmt} records name no session and no shared prompt "
                         f"blocks; it applies to mooncake (copilot records are sessions)")
    for flag, value in (("--assumed-ttft", ttft_s), ("--assumed-tpot", tpot_s)):
        if value is None:
            continue
        if not (fmt == "mooncake" and sessions):
            raise TraceError(f"{flag}: only mooncake --sessions estimates the think time from "
                             f"an assumed service time; drop {flag}")
        if not (math.isfinite(value) and 0 <= value <= 3600):
            raise TraceError(f"{flag}: seconds in [0, 3600], got {value}")
    return SessionOptions(sessions=sessions or fmt in SESSION_FORMATS,
                          assumed_ttft_s=ASSUMED_TTFT_S if ttft_s is None else ttft_s,
                          assumed_tpot_s=ASSUMED_TPOT_S if tpot_s is None else tpot_s)


class SessionImportReport(ImportReport):
    """`ImportReport` and what sessions add: how many, how their follow-ups were linked."""

    def __init__(self, fmt: str, rows: int = 0) -> None:
        super().__init__(fmt, rows)
        self.sessions = self.follow_ups = 0
        self.trimmed = 0  # follow-ups whose prompt is shorter than the history they follow
        self.clipped = 0  # follow-ups sent before their predecessor's (assumed) end: after_s 0
        # copilot: calls begun before the kept call before them ended, which follow the latest
        # call ended by their start (fan-out); calls that follow a parallel batch's latest-ending
        # call rather than the call before them (join)
        self.fanned = self.joined = 0
        self.inherited = self.follow_up_tokens = 0  # prefix_len and prompt_len of follow-ups
        self.not_success: Counter = Counter()  # kept copilot calls by result, other than Success
        self.estimate: tuple[float, float] | None = None  # mooncake's assumed (TTFT, TPOT)
        self.notes: list[str] = []  # read-time notes (records with no call)

    def kept(self, request: TraceRequest) -> None:
        super().kept(request)
        if request.after is None:
            self.sessions += 1
        else:
            self.follow_ups += 1
            self.inherited += request.prefix_len
            self.follow_up_tokens += request.prompt_len

    def lines(self) -> list[str]:
        lines = super().lines()
        skipped_at = next((index for index, line in enumerate(lines)
                           if line.startswith("  skipped ")), len(lines))
        extra = [f"  {self.sessions:,} sessions, {self.follow_ups:,} follow-ups (each sent "
                 f"after_s after its predecessor's last token)"]
        if self.follow_up_tokens:
            extra.append(f"  follow-up prompt tokens from the history they follow: "
                         f"{self.inherited / self.follow_up_tokens:.1%}")
        if self.trimmed:
            extra.append(f"  {self.trimmed:,} follow-ups shorter than the history they follow "
                         f"(a trimmed context): prefix_len from tokens.cached")
        if self.estimate is not None:
            ttft, tpot = self.estimate
            extra.append(f"  after_s estimated: the arrival gap less an assumed service time "
                         f"(TTFT {ttft:g} s + TPOT {tpot:g} s a further output token)")
            if self.clipped:
                extra.append(f"  {self.clipped:,} follow-ups arrived sooner than that: after_s 0")
        else:
            if self.fanned:
                extra.append(f"  {self.fanned:,} calls began before the call before them ended "
                             f"(parallel calls): each follows the latest call ended by its "
                             f"start, fanning out with the calls begun alongside")
            if self.joined:
                extra.append(f"  {self.joined:,} calls after a parallel batch follow its "
                             f"latest-ending call")
            if self.clipped:
                extra.append(f"  {self.clipped:,} calls began before any call of their session "
                             f"ended: each follows the session's first call, after_s 0")
        if self.not_success:
            extra.append(f"  kept {sum(self.not_success.values()):,} calls that did not succeed "
                         f"but used tokens: " + ", ".join(
                             f"{result} {count:,}" for result, count in
                             sorted(self.not_success.items(), key=lambda item: -item[1])))
        return lines[:skipped_at] + extra + self.notes + lines[skipped_at:]


class _Calls:
    """The calls (rows) of a session-shaped trace as columns, a few numbers each: the call's
    start and end on its own clock, its lengths, its predecessor before any is skipped (-1:
    none; copilot: the session's call before in time, the links being chosen from the times
    once the kept calls are known, `_copilot_links`), the reason it is skipped on its own (an
    index into `reasons`, 0: kept), and what names it."""

    def __init__(self) -> None:
        self.times, self.ends = array("d"), array("d")
        self.prompts, self.outputs = array("q"), array("q")
        self.cached = array("q")  # copilot's tokens.cached (0 when not given)
        self.preds = array("q")
        self.reasons = array("b")
        self.reason_names: list[str | None] = [None]
        self.results = array("h")  # index into result_names; 0: Success
        self.result_names: list[str] = [COPILOT_SUCCESS]
        self.names = array("q")  # copilot: (record, turn, call) packed; mooncake: the row
        self.sessions: list[str] = []  # copilot: each record's session_id
        self.records = array("q")  # copilot: the call's record (index into sessions)

    def __len__(self) -> int:
        return len(self.times)

    def reason_code(self, reason: str | None) -> int:
        if reason not in self.reason_names:
            self.reason_names.append(reason)
        return self.reason_names.index(reason)

    def result_code(self, result: str) -> int:
        if result not in self.result_names:
            self.result_names.append(result)
        return self.result_names.index(result)


class SessionStream:
    """A session-shaped production trace, read whole as columns when made; its requests are made
    when iterated, in the grouped layout (sessions by start, each session's turns after its
    first)."""

    def __init__(self, fmt: str, path: str | os.PathLike[str],
                 options: ImportOptions = ImportOptions(),
                 session_options: SessionOptions = SessionOptions()) -> None:
        if not uses_sessions(fmt, session_options):
            raise TraceError(f"format {fmt!r} is not imported as sessions; give copilot, or "
                             f"mooncake with --sessions")
        _check_options(options)
        self.format, self.options, self.session_options = fmt, options, session_options
        self.name = options.name or trace_stem(path)
        self.skipped_at_read: Counter = Counter()  # calls with no place in time
        self.notes: list[str] = []
        if fmt == "copilot":
            self.calls = _read_copilot(path, self.skipped_at_read, self.notes)
            self.hashes: list[tuple[int, ...]] = []
        else:
            self.calls, self.hashes = _read_mooncake_sessions(path, options, session_options)
        self.rows = len(self.calls) + sum(self.skipped_at_read.values())
        self.links = array("b")  # copilot: how each kept call was linked (`_copilot_links`)

    def requests(self, report: SessionImportReport) -> Iterator[TraceRequest]:
        """The kept calls as requests; each one not kept is counted in `report.skipped`. Held
        besides the columns: a few integers a call (a week of Copilot traffic is 9.3 million
        calls)."""
        report.skipped.update(self.skipped_at_read)
        calls, options = self.calls, self.options
        count = len(calls)
        if not count:
            return
        times = np.frombuffer(calls.times, dtype=np.float64)
        order = np.argsort(times, kind="stable")
        origin = float(times.min())
        reasons, names = self._row_reasons()
        kept = (reasons == 0).tolist()
        if self.format == "copilot":
            linked, self.links = _copilot_links(calls, kept)
        else:
            linked = self._chain_links(order, kept)
        roots = array("q", [-1]) * count
        for index in array("q", order.astype(np.int64).tobytes()):
            if kept[index]:  # a predecessor comes before its follower in time order
                before = linked[index]
                roots[index] = index if before < 0 else roots[before]
        del kept
        # Whole sessions are kept or dropped: by the window their first turn arrives in, and by
        # one draw of the sample each, in order of their start.
        linked_np = np.frombuffer(linked, dtype=np.int64)
        roots_np = np.frombuffer(roots, dtype=np.int64)
        first = order[((reasons == 0) & (linked_np < 0))[order]]
        start, duration = options.window or (0.0, math.inf)
        offsets = times[first] - origin - start
        sampler = np.random.default_rng([options.seed, stable_hash(f"sample\0{self.format}")])
        draws = sampler.random(len(first))
        verdict = np.zeros(count, dtype=np.int8)  # per first turn: 0 kept, 1 window, 2 sample
        verdict[first] = np.where((offsets >= 0) & (offsets < duration),
                                  np.where(draws < options.sample, 0, 2), 1)
        session_verdict = np.where(reasons == 0, verdict[np.maximum(roots_np, 0)], 0)
        for code, number in enumerate(np.bincount(reasons, minlength=len(names)).tolist()):
            if code and number:
                report.skipped[names[code]] += number
        for code, reason in ((1, _OUTSIDE), (2, _UNSAMPLED)):
            number = int(np.count_nonzero(session_verdict == code))
            if number:
                report.skipped[reason] += number
        members = np.flatnonzero((reasons == 0) & (session_verdict == 0))
        if not len(members):
            return
        rank = np.empty(count, dtype=np.int64)
        rank[order] = np.arange(count, dtype=np.int64)
        grouped = members[np.lexsort((rank[members], rank[roots_np[members]]))]
        yield from self._made(grouped.tolist(), linked, roots, origin, start, report)

    def _chain_links(self, order: np.ndarray, kept: list[bool]) -> array:
        """The predecessor each kept row follows (-1: none): its own, or the kept turn before a
        skipped one."""
        preds, count = self.calls.preds, len(self.calls)
        kept_before = array("q", bytes(8 * count))  # the chain's latest kept call, + 1 (0: none)
        linked = array("q", [-1]) * count
        for index in array("q", order.astype(np.int64).tobytes()):
            pred = preds[index]
            before = kept_before[pred] - 1 if pred >= 0 else -1
            if not kept[index]:
                kept_before[index] = before + 1
                continue
            linked[index], kept_before[index] = before, index + 1
        return linked

    def _row_reasons(self) -> tuple[np.ndarray, list[str | None]]:
        """Why each call is skipped on its own, as a code per call (0: it is not), and the
        reasons the codes name."""
        calls, limit = self.calls, self.options.max_model_len
        codes = np.frombuffer(calls.reasons, dtype=np.int8).astype(np.int64)
        prompts = np.frombuffer(calls.prompts, dtype=np.int64)
        outputs = np.frombuffer(calls.outputs, dtype=np.int64)
        rules = [(prompts < 1, _NO_PROMPT), (outputs < 1, _NO_OUTPUT)]
        if limit is not None:
            rules.append((prompts + outputs > limit,
                          f"prompt + output longer than --max-model-len {limit}"))
        for mask, reason in rules:
            codes[(codes == 0) & mask] = calls.reason_code(reason)
        return codes, calls.reason_names

    def _made(self, grouped: list[int], linked: list[int], roots: list[int], origin: float,
              start: float, report: SessionImportReport) -> Iterator[TraceRequest]:
        calls, mooncake = self.calls, self.format == "mooncake"
        speedup = self.options.speedup
        arrivals: dict[int, float] = {}  # first turn -> its arrival
        for index in grouped:
            prompt_len, output_len = calls.prompts[index], calls.outputs[index]
            root = roots[index]
            if index == root:
                arrival = round((calls.times[index] - origin - start) / speedup, ARRIVAL_DECIMALS)
                arrivals[index] = arrival
                hashes = self.hashes[calls.names[index]] if mooncake else None
                yield TraceRequest(
                    id=self._id(index), arrival_s=arrival, prompt_len=prompt_len,
                    output_len=output_len, block_hashes=hashes,
                    hash_block_size=MOONCAKE_HASH_BLOCK if mooncake else 0,
                    session=self._session(index))
                continue
            pred = linked[index]
            gap = calls.times[index] - calls.ends[pred]
            if gap < 0:
                report.clipped += 1
            elif not mooncake:
                link = self.links[index]
                report.fanned += link == _FANNED
                report.joined += link == _JOINED
            history = calls.prompts[pred] + calls.outputs[pred]
            if mooncake:
                prefix_len = min(self._shared_blocks(pred, index) * MOONCAKE_HASH_BLOCK,
                                 history, prompt_len)
            elif prompt_len >= history:
                prefix_len = history
            else:
                report.trimmed += 1
                prefix_len = min(calls.cached[index], prompt_len, history)
            result = calls.results[index]
            if result:
                report.not_success[calls.result_names[result]] += 1
            yield TraceRequest(
                id=self._id(index), arrival_s=arrivals[root], prompt_len=prompt_len,
                output_len=output_len, prefix_len=prefix_len, session=self._session(root),
                after=self._id(pred),
                after_s=min(round(max(gap, 0.0), ARRIVAL_DECIMALS), MAX_ARRIVAL_S))
        if mooncake:
            report.estimate = (self.session_options.assumed_ttft_s,
                               self.session_options.assumed_tpot_s)

    def _shared_blocks(self, pred: int, index: int) -> int:
        """Leading hash ids two Mooncake rows share, within the predecessor's full blocks."""
        mine, theirs = self.hashes[self.calls.names[index]], self.hashes[self.calls.names[pred]]
        full = self.calls.prompts[pred] // MOONCAKE_HASH_BLOCK
        shared = 0
        for a, b in zip(mine[:full], theirs[:full]):
            if a != b:
                break
            shared += 1
        return shared

    def _id(self, index: int) -> str:
        name = self.calls.names[index]
        if self.format == "mooncake":
            return f"mooncake-{name}"
        record, turn, call = _unpacked(name)
        return f"copilot-{record}-{turn}-{call}"

    def _session(self, index: int) -> str:
        if self.format == "mooncake":
            return self._id(index)
        return self.calls.sessions[self.calls.records[index]]


def import_sessions(fmt: str, path: str | os.PathLike[str],
                    options: ImportOptions = ImportOptions(),
                    session_options: SessionOptions = SessionOptions(sessions=True)
                    ) -> tuple[Trace, SessionImportReport]:
    """Read a session-shaped trace and return the Zipage trace (grouped layout) and the report."""
    stream, report = _opened(fmt, path, options, session_options)
    requests = list(report.follow(stream.requests(report)))
    if not requests:
        raise _nothing_left(path, report.rows, report.skipped)
    return Trace(name=stream.name, requests=requests), report


def import_sessions_file(fmt: str, path: str | os.PathLike[str], output: str | os.PathLike[str],
                         options: ImportOptions = ImportOptions(),
                         session_options: SessionOptions = SessionOptions(sessions=True)
                         ) -> SessionImportReport:
    """`import_sessions` written to `output` as the requests are made (`save_trace`'s layouts);
    memory follows the calls' columns, not the requests."""
    stream, report = _opened(fmt, path, options, session_options)
    requests = report.follow(stream.requests(report))
    first = next(requests, None)
    if first is None:
        raise _nothing_left(path, report.rows, report.skipped)
    save_trace_stream(itertools.chain([first], requests), output, stream.name,
                      MOONCAKE_HASH_BLOCK if fmt == "mooncake" else 0)
    return report


def _opened(fmt: str, path: str | os.PathLike[str], options: ImportOptions,
            session_options: SessionOptions) -> tuple[SessionStream, SessionImportReport]:
    stream = SessionStream(fmt, path, options, session_options)
    report = SessionImportReport(fmt, rows=stream.rows)
    report.notes = stream.notes
    return stream, report


def looks_like_copilot(first_line: str) -> bool:
    """Whether a file's first line (perhaps cut short: a session record can be megabytes) is a
    Copilot agent-session record: a JSON object that begins with `session_id` or has both
    `session_id` and `turns`."""
    try:
        obj = json.loads(first_line)
    except (ValueError, RecursionError):
        return bool(re.match(r'\s*\{\s*"session_id"\s*:', first_line))
    return isinstance(obj, dict) and {"session_id", "turns"} <= obj.keys()


# ---------------------------------------------------------------- copilot

def _packed(record: int, turn: int, call: int) -> int:
    return (record << 40) | (turn << 20) | call


def _unpacked(name: int) -> tuple[int, int, int]:
    return name >> 40, (name >> 20) & 0xFFFFF, name & 0xFFFFF


# How `_copilot_links` linked a call: after the call before it (or the first of its session),
# fanned out of a parallel batch, joined after a batch's latest-ending call, or begun before any
# call of its session ended (it follows the first, after_s 0).
_CHAINED, _FANNED, _JOINED, _EARLY = 0, 1, 2, 3


def _copilot_links(calls: _Calls, kept: list[bool]) -> tuple[array, array]:
    """The call each kept Copilot call follows (-1: it is its session's first kept call) and how
    it was linked (`_CHAINED` ...). A call follows the latest-ending kept call of its session
    that had ended by its start (the latest begun among equal ends), so calls the agent ran in
    parallel follow the same call, and the call after a batch follows the batch's last to end;
    one begun before any had ended follows the session's first call (a session has one first
    turn; `after_s` 0). A record's calls are contiguous in the columns, in time order; held
    besides: a heap of the session's calls not yet ended."""
    count = len(calls)
    linked = array("q", [-1]) * count
    links = array("b", bytes(count))
    times, ends, records = calls.times, calls.ends, calls.records
    record = first = previous = -1
    running: list[tuple[float, int]] = []  # (end, call) of the session's calls not yet ended
    ended = (-math.inf, -1)  # (end, call) of the latest-ending call ended so far
    for index in range(count):
        if records[index] != record:
            record, first, previous = records[index], -1, -1
            running, ended = [], (-math.inf, -1)
        if not kept[index]:
            continue
        start = times[index]
        while running and running[0][0] <= start:
            ended = max(ended, heapq.heappop(running))
        if first < 0:
            first = index
        elif ended[1] < 0:
            linked[index], links[index] = first, _EARLY
        else:
            linked[index] = ended[1]
            if ends[previous] > start:
                links[index] = _FANNED
            elif ended[1] != previous:
                links[index] = _JOINED
        heapq.heappush(running, (ends[index], index))
        previous = index
    return linked, links


def _read_copilot(path: str | os.PathLike[str], skipped: Counter, notes: list[str]) -> _Calls:
    source = str(path)
    calls = _Calls()
    empty = 0
    with _open_file(path) as file:
        record = -1
        for line, raw in enumerate(_text_lines(file, source), start=1):
            if not raw.strip():
                continue
            record += 1
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError) as error:
                raise TraceError(f"{source}: line {line}: not a JSON object: {error}") from None
            if not _copilot_session(obj, record, _Where(source, line), calls, skipped):
                empty += 1
    if empty:
        notes.append(f"  {empty:,} session records with no LLM call")
    return calls


class _Where:
    """Where in the file a value is, for a message: the file, the line, the session, the
    field's path."""

    def __init__(self, source: str, line: int, session: str | None = None) -> None:
        self.source, self.line, self.session = source, line, session

    def fail(self, field: str, message: str, value: Any) -> TraceError:
        session = f" (session {_SHOWN.repr(self.session)})" if self.session is not None else ""
        return TraceError(f"{self.source}: line {self.line}{session}: {field} {message}, "
                          f"got {_SHOWN.repr(value)}")


def _copilot_session(obj: Any, record: int, where: _Where, calls: _Calls,
                     skipped: Counter) -> bool:
    """Read one session record's calls into `calls` (in time order, `preds` the call before;
    `_copilot_links` chooses whom each follows); False when it has none."""
    if not isinstance(obj, dict):
        raise where.fail("the record", "must be a JSON object (one agent session: session_id, "
                         "date, turns)", obj)
    session_id = obj.get("session_id")
    if type(session_id) is not str or not session_id.strip():
        raise where.fail("session_id", "must be a non-empty string", session_id)
    where.session = session_id
    day = _record_date(obj.get("date"), where)
    turns = obj.get("turns")
    if turns is None or not isinstance(turns, list):
        raise where.fail("turns", "must be a list of turns (each with llm_calls)", turns)
    found = []  # (time, turn, call, fields)
    for turn_index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise where.fail(f"turns[{turn_index}]", "must be a JSON object with llm_calls", turn)
        llm_calls = turn.get("llm_calls")
        if llm_calls is None:
            continue
        if not isinstance(llm_calls, list):
            raise where.fail(f"turns[{turn_index}].llm_calls", "must be a list of LLM calls",
                             llm_calls)
        for call_index, call in enumerate(llm_calls):
            field = f"turns[{turn_index}].llm_calls[{call_index}]"
            if turn_index >= 1 << 20 or call_index >= 1 << 20:
                raise where.fail(field, "is past the 2^20 turns or calls a session may have",
                                 len(llm_calls))
            fields = _copilot_call(call, field, where)
            stamp = fields[0]
            if stamp is None:
                skipped[_NO_TIMESTAMP] += 1
                continue
            if day is not None and not (day - COPILOT_DATE_SLACK <= stamp
                                        < day + timedelta(days=1) + COPILOT_DATE_SLACK):
                skipped[_CLOCK_SKEW] += 1
                continue
            found.append((stamp.timestamp(), turn_index, call_index, fields))
    if not found:
        return False
    sessions_index = len(calls.sessions)
    calls.sessions.append(session_id)
    found.sort(key=lambda item: item[0])  # stable: file order among equal times
    pred = -1
    for time_s, turn_index, call_index, (_, duration_ms, prompt, completion, cached,
                                         result) in found:
        index = len(calls)
        calls.times.append(time_s)
        calls.ends.append(time_s + duration_ms / 1000.0 if duration_ms is not None else math.nan)
        calls.prompts.append(prompt)
        calls.outputs.append(completion)
        calls.cached.append(cached)
        calls.preds.append(pred)
        calls.reasons.append(calls.reason_code(_NO_DURATION) if duration_ms is None else 0)
        calls.results.append(0 if result in (None, COPILOT_SUCCESS)
                             else calls.result_code(result))
        calls.names.append(_packed(record, turn_index, call_index))
        calls.records.append(sessions_index)
        pred = index
    return True


def _record_date(value: Any, where: _Where) -> datetime | None:
    if value is None:
        return None
    try:
        day = calendar_date.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        day = None
    if day is None:
        raise where.fail("date", "must be the UTC partition date, YYYY-MM-DD", value)
    return datetime(day.year, day.month, day.day, tzinfo=timezone.utc)


def _copilot_call(call: Any, field: str, where: _Where) -> tuple:
    """(timestamp, duration_ms, prompt, completion, cached, result) of one LLM call; a missing
    or null value is None (a count: 0), a value of the wrong kind an error."""
    if not isinstance(call, dict):
        raise where.fail(field, "must be a JSON object (one LLM call)", call)
    stamp = call.get("timestamp")
    moment = None
    if stamp is not None:
        try:
            moment = datetime.fromisoformat(stamp.strip()) if isinstance(stamp, str) else None
        except ValueError:
            moment = None
        if moment is None:
            raise where.fail(f"{field}.timestamp", "must be an ISO 8601 date and time such as "
                             "2026-06-01T14:03:12.345Z", stamp)
        if moment.tzinfo is None:  # read as UTC, as the dataset's partitions are
            moment = moment.replace(tzinfo=timezone.utc)
    duration = call.get("duration_ms")
    if duration is not None and (isinstance(duration, bool)
                                 or not isinstance(duration, (int, float))
                                 or not 0 <= duration <= MAX_ARRIVAL_S):
        raise where.fail(f"{field}.duration_ms", "must be a number of milliseconds >= 0",
                         duration)
    tokens = call.get("tokens")
    if tokens is None:
        tokens = {}
    if not isinstance(tokens, dict):
        raise where.fail(f"{field}.tokens", "must be a JSON object (prompt, completion, cached)",
                         tokens)
    counts = []
    for name in ("prompt", "completion", "cached"):
        value = tokens.get(name)
        if value is None:
            counts.append(0)
        elif type(value) is int and 0 <= value <= MAX_LENGTH:
            counts.append(value)
        else:
            raise where.fail(f"{field}.tokens.{name}", f"must be a token count between 0 and "
                             f"{MAX_LENGTH}", value)
    result = call.get("result")
    if result is not None and type(result) is not str:
        raise where.fail(f"{field}.result", "must be a string such as Success or UserCancel",
                         result)
    return moment, duration, *counts, result


# ---------------------------------------------------------------- mooncake --sessions

def _read_mooncake_sessions(path: str | os.PathLike[str], options: ImportOptions,
                            session_options: SessionOptions
                            ) -> tuple[_Calls, list[tuple[int, ...]]]:
    """Mooncake's rows, each following the earlier row whose full prompt blocks its hash ids
    begin with (`_predecessors`); its end is its arrival plus the assumed service time."""
    rows = _read("mooncake", path, options)
    calls = _Calls()
    times = np.frombuffer(rows.times, dtype=np.float64) if len(rows) else np.empty(0)
    order = np.argsort(times, kind="stable").tolist()
    preds = _predecessors(rows, order)
    ttft, tpot = session_options.assumed_ttft_s, session_options.assumed_tpot_s
    for index in range(len(rows)):
        calls.times.append(rows.times[index])
        calls.ends.append(rows.times[index] + ttft + tpot * max(rows.outputs[index] - 1, 0))
        calls.prompts.append(rows.prompts[index])
        calls.outputs.append(rows.outputs[index])
        calls.cached.append(0)
        calls.preds.append(preds[index])
        calls.reasons.append(0)
        calls.results.append(0)
        calls.names.append(index)
    return calls, rows.hashes


def _predecessors(rows, order: list[int]) -> list[int]:
    """Each row's predecessor (-1: none): of the earlier rows (strictly earlier timestamps) whose
    full prompt blocks are all leading hash ids of this row, the one with the most such blocks,
    the latest among equals. A row qualifies as a predecessor only when its prompt is its own
    and no template: one of its full blocks was first seen in its own session, and requests
    across the file continue its full blocks in at most MOONCAKE_MAX_BRANCHES ways (a shared
    system prompt is continued by everyone, so followed by no one)."""
    count = len(rows)
    preds = [-1] * count
    session = list(range(count))
    hashes, prompts, times = rows.hashes, rows.prompts, rows.times
    # The tree of hash chains of the whole file, and how many ways each prefix is continued.
    children: dict[tuple[int, int], int] = {}  # (parent node, hash) -> node of that chain
    branches: Counter = Counter()  # node -> its children
    for index in range(count):
        node = -1
        for block in hashes[index]:
            following = children.get((node, block))
            if following is None:
                following = children[(node, block)] = len(children)
                branches[node] += 1
            node = following
    tail: dict[int, int] = {}  # node -> the latest qualifying row whose full blocks end there
    writer: dict[int, int] = {}  # hash -> the session that first had it
    pending: list[int] = []  # rows of the current timestamp, registered once time moves on

    def register(index: int) -> None:
        mine = session[index]
        owned = False
        full = prompts[index] // MOONCAKE_HASH_BLOCK
        for position, block in enumerate(hashes[index]):
            if writer.setdefault(block, mine) == mine and position < full:
                owned = True
        node = -1
        for block in hashes[index][:full]:
            node = children[(node, block)]
        if full and owned and branches[node] <= MOONCAKE_MAX_BRANCHES:
            tail[node] = index

    previous_time = None
    for index in order:
        if times[index] != previous_time:
            for earlier in pending:
                register(earlier)
            pending, previous_time = [], times[index]
        node, best = -1, -1
        for block in hashes[index]:
            node = children[(node, block)]
            best = tail.get(node, best)
        if best >= 0:
            preds[index], session[index] = best, session[best]
        pending.append(index)
    return preds
