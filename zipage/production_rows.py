"""Production trace rows: what every importer shares (the options, the report of what was kept,
the reading of a file a chunk of lines at a time) and each row format's reader: `azure`,
`mooncake`, `burstgpt` (docs/traces.md, "Production traces"). Each row is kept as a few numbers
(`_Rows`); `zipage.trace_import` turns them into requests, `zipage.session_import` into sessions.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from array import array
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, Callable, Iterator

import numpy as np

from zipage.errors import TraceError
from zipage.trace import JSONL_CHUNK, MAX_LENGTH, TraceRequest, line_chunks, open_trace_file, read_chunk, text_position

ROW_FORMATS = ("azure", "mooncake", "burstgpt")  # the formats read a row at a time

MOONCAKE_HASH_BLOCK = 512  # tokens one Mooncake hash id names (the FAST'25 release's README)


@dataclass(frozen=True)
class ImportOptions:
    """What part of a production trace to take, and how fast to play it.

    `window` is (start_s, duration_s) from the first row's time; `speedup` divides the arrival
    times (2 = the same requests in half the time); `sample` keeps each row with this probability
    (deterministic for a `seed`); `max_model_len` drops rows whose prompt + output exceed it.
    """

    window: tuple[float, float] | None = None
    speedup: float = 1.0
    sample: float = 1.0
    seed: int = 0
    max_model_len: int | None = None
    name: str | None = None


class ImportReport:
    """What an import read, kept and skipped (by reason), and the kept requests' statistics,
    gathered as they are made (an import holds no list of them)."""

    def __init__(self, fmt: str, rows: int = 0) -> None:
        self.format, self.rows = fmt, rows
        self.skipped: Counter = Counter()
        self.imported = 0
        self.span_s = 0.0  # the last kept request's arrival
        self._prompts, self._outputs = array("q"), array("q")
        self._thinking = 0  # output tokens that are thinking (reasoning_len), summed
        self._chains = _PrefixChains()

    def follow(self, requests: Iterator[TraceRequest]) -> Iterator[TraceRequest]:
        """`requests`, each recorded as kept as it passes."""
        for request in requests:
            self.kept(request)
            yield request

    def kept(self, request: TraceRequest) -> None:
        self.imported += 1
        self.span_s = request.arrival_s
        self._prompts.append(request.prompt_len)
        self._outputs.append(request.output_len)
        self._thinking += request.reasoning_len
        self._chains.add(request)

    def lines(self) -> list[str]:
        span = self.span_s
        rate = self.imported / span if span > 0 else float("nan")
        lines = [f"{self.format}: {self.rows:,} rows read, {self.imported:,} requests imported "
                 f"over {span:,.1f} s ({rate:,.2f} requests/s)"]
        if self.imported:
            for label, values in (("prompt", self._prompts), ("output", self._outputs)):
                counts = np.frombuffer(values, dtype=np.int64)
                lines.append(f"  {label} tokens: mean {counts.mean():,.0f}, p50 "
                             f"{np.percentile(counts, 50):,.0f}, p99 "
                             f"{np.percentile(counts, 99):,.0f}, max {counts.max():,}")
        if self._thinking:
            share = self._thinking / np.frombuffer(self._outputs, dtype=np.int64).sum()
            lines.append(f"  thinking (reasoning_len): {share:.1%} of output tokens")
        shared = self._chains.fraction()
        if shared is not None:
            lines.append(f"  prompt blocks seen before (prefix-cache hits at best): {shared:.1%}")
        for reason, count in sorted(self.skipped.items(), key=lambda item: -item[1]):
            lines.append(f"  skipped {count:,}: {reason}")
        return lines


class _PrefixChains:
    """The share of full prompt blocks whose whole chain of leading hashes was seen before: what
    an unbounded prefix cache could reuse (None unless every request names its blocks)."""

    def __init__(self) -> None:
        self.hashed = True
        self.chains: dict[tuple[int, int], int] = {}  # (parent chain, last hash) -> chain
        self.total = self.shared = 0

    def add(self, request: TraceRequest) -> None:
        if not self.hashed:
            return
        if request.block_hashes is None:
            self.hashed, self.chains = False, {}
            return
        parent = -1
        for block_hash in request.block_hashes[:request.prompt_len // request.hash_block_size]:
            self.total += 1
            key = (parent, block_hash)
            if key in self.chains:
                self.shared += 1
            else:
                self.chains[key] = len(self.chains)
            parent = self.chains[key]

    def fraction(self) -> float | None:
        return self.shared / self.total if self.hashed and self.total else None


class _Rows:
    """A production trace's rows, as columns of what an import needs of each: its time, its
    lengths and Mooncake's hash ids; ~24 bytes a row besides the hashes. A row's index is its
    position among the file's data rows, from 0."""

    def __init__(self) -> None:
        self.times = array("d")  # the row's own clock, any origin
        self.prompts, self.outputs = array("q"), array("q")
        self.hashes: list[tuple[int, ...]] = []  # Mooncake's rows only

    def __len__(self) -> int:
        return len(self.times)

    def add(self, time_s: float, prompt_len: int, output_len: int) -> None:
        self.times.append(time_s)
        self.prompts.append(prompt_len)
        self.outputs.append(output_len)


# Rows turned into requests per numpy call: their columns are read a block at a time.
ROW_BLOCK = 1 << 12


def _read(fmt: str, path: str | os.PathLike[str], options: ImportOptions) -> _Rows:
    if fmt not in ROW_FORMATS:
        raise TraceError(f"format must be one of {', '.join(ROW_FORMATS)}, got {fmt!r}")
    _check_options(options)
    source = str(path)
    rows = _Rows()
    with _opened(path) as file:
        _READERS[fmt](_text_lines(file, source), source, rows)
    return rows


def _nothing_left(path: str | os.PathLike[str], rows: int, skipped: Counter) -> TraceError:
    return TraceError(f"{path}: no request left to import ({rows:,} rows read; "
                      + "; ".join(f"{count:,} {reason}" for reason, count in skipped.items())
                      + ")")


def parse_window(text: str) -> tuple[float, float]:
    """`START:DURATION` in seconds (each may end in s, m or h) -> (start_s, duration_s)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise TraceError(f"--span: got {text!r}, expected START:DURATION, e.g. 0:3600 or 2h:30m")
    start, duration = (_seconds(part, text) for part in parts)
    if duration <= 0:
        raise TraceError(f"--span: the duration must be > 0, got {text!r}")
    return start, duration


def _seconds(part: str, text: str) -> float:
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    scale = units.get(part[-1:], None)
    number = part[:-1] if scale else part
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise TraceError(f"--span: {part!r} in {text!r} is not a time such as 90, 90s, "
                         f"15m or 2h") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"--span: times must be finite and >= 0, got {part!r}")
    return value


def _check_options(options: ImportOptions) -> None:
    if not (math.isfinite(options.speedup) and options.speedup > 0):
        raise TraceError(f"--speedup: must be a finite number > 0, got {options.speedup}")
    if not 0 < options.sample <= 1:
        raise TraceError(f"--sample: the fraction of rows to keep, in (0, 1], "
                         f"got {options.sample}")
    if options.max_model_len is not None and options.max_model_len < 2:
        raise TraceError(f"--max-model-len: must be >= 2 (prompt + output), "
                         f"got {options.max_model_len}")


def _opened(path: str | os.PathLike[str]) -> IO[bytes]:
    """The file's bytes, decompressed as they are read when it is gzipped."""
    try:
        return open_trace_file(path)
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace file: {error.strerror or error}") from None


def _head_text(path: str | os.PathLike[str], limit: int) -> str:
    """The file's first `limit` bytes as text (telling a format apart reads no further,
    compressed or not: a day of traffic is read once, by its loader)."""
    with _opened(path) as file:
        return read_chunk(file, str(path), limit).decode("utf-8", errors="replace")


def _text_lines(file: IO[bytes], source: str) -> Iterator[str]:
    """The file's lines, each with its newline (the last may lack it), decoded a chunk of lines
    at a time: a line longer than MAX_LINE_BYTES is refused, never held whole."""
    lines_before = 0
    for chunk in line_chunks(file, source, 1, JSONL_CHUNK):
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as error:
            raise TraceError(f"{source}: {text_position(chunk, error.start, lines_before)}: byte "
                             f"0x{chunk[error.start]:02x} is not UTF-8 text (Latin-1 or another "
                             f"legacy encoding?); re-save the file as UTF-8") from None
        yield from io.StringIO(text)  # split at "\n" only, as the CSV reader wants
        lines_before += chunk.count(b"\n")


def _skip_reason(prompt_len: int, output_len: int, offset: float, duration: float, draw: float,
                 options: ImportOptions) -> str | None:
    if not 0 <= offset < duration:
        return "outside --span"
    if draw >= options.sample:
        return "not in the --sample"
    if prompt_len < 1:
        return "no prompt tokens"
    if output_len < 1:
        return "no output tokens (a failed request in the source)"
    if options.max_model_len is not None and prompt_len + output_len > options.max_model_len:
        return f"prompt + output longer than --max-model-len {options.max_model_len}"
    return None


def _azure_rows(lines: Iterator[str], source: str, rows: _Rows) -> None:
    reader = csv.reader(lines)
    for line, row in _csv_rows(reader, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), source):
        stamp, prompt, output = row
        try:
            moment = datetime.fromisoformat(stamp.strip())
            # A stamp without a zone is read as UTC: local time would bend arrivals at DST.
            time_s = (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
        except (ValueError, AttributeError):
            raise TraceError(f"{source}: line {line}: TIMESTAMP {stamp!r} is not a date and time "
                             f"like 2023-11-16 18:15:46.6805900") from None
        rows.add(time_s, _count(prompt, "ContextTokens", source, line),
                 _count(output, "GeneratedTokens", source, line))


def _burstgpt_rows(lines: Iterator[str], source: str, rows: _Rows) -> None:
    reader = csv.reader(lines)
    for line, (stamp, prompt, output) in _csv_rows(
            reader, ("Timestamp", "Request tokens", "Response tokens"), source):
        rows.add(_number(stamp, "Timestamp", source, line),
                 _count(prompt, "Request tokens", source, line),
                 _count(output, "Response tokens", source, line))


def _mooncake_rows(lines: Iterator[str], source: str, rows: _Rows) -> None:
    for line, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.removesuffix("\n"))
        except (ValueError, RecursionError) as error:
            raise TraceError(f"{source}: line {line}: not a JSON object: {error}") from None
        if not isinstance(record, dict):
            raise TraceError(f"{source}: line {line}: expected a JSON object with timestamp, "
                             f"input_length, output_length, hash_ids")
        prompt_len = _count(record.get("input_length"), "input_length", source, line)
        rows.add(_number(record.get("timestamp"), "timestamp", source, line) / 1000.0, prompt_len,
                 _count(record.get("output_length"), "output_length", source, line))
        rows.hashes.append(_hash_ids(record, prompt_len, source, line))


def _hash_ids(record: dict, prompt_len: int, source: str, line: int) -> tuple[int, ...]:
    hashes = record.get("hash_ids")
    expected = -(-prompt_len // MOONCAKE_HASH_BLOCK)
    if (not isinstance(hashes, list) or len(hashes) != expected
            or not all(type(value) is int and value >= 0 for value in hashes)):
        raise TraceError(f"{source}: line {line}: hash_ids must list {expected} non-negative "
                         f"integers (one per {MOONCAKE_HASH_BLOCK} tokens of input_length "
                         f"{prompt_len}), got {str(hashes)[:80]}")
    return tuple(hashes)


def _csv_rows(reader, columns: tuple[str, ...],
              source: str) -> Iterator[tuple[int, list[str | None]]]:
    """(line number, the row's values of `columns`, None where the row is short) for each data
    row of a CSV file; blank rows are skipped."""
    try:
        positions = _column_positions(next(reader, []), columns, source)
        last = max(positions)
        for row in reader:
            if not row:
                continue
            if len(row) > last:
                yield reader.line_num, [row[position] for position in positions]
            else:
                yield reader.line_num, [row[position] if position < len(row) else None
                                        for position in positions]
    except csv.Error as error:
        raise TraceError(f"{source}: line {reader.line_num}: not a CSV row: {error}") from None


def _column_positions(header: list[str], columns: tuple[str, ...], source: str) -> list[int]:
    present = [name.strip() for name in header]
    missing = [name for name in columns if name not in present]
    if missing:
        raise TraceError(f"{source}: line 1: missing column(s) {', '.join(missing)}; "
                         f"the header is {','.join(present)[:120]}")
    for name in columns:
        if present.count(name) > 1:
            raise TraceError(f"{source}: line 1: column {name} is named {present.count(name)} "
                             f"times in the header, so which value a row means is unclear; keep "
                             f"one {name} column (rename or delete the others)")
    return [present.index(name) for name in columns]


def _number(value: object, column: str, source: str, line: int) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise TraceError(f"{source}: line {line}: {column} must be a number, got {value!r}")
    return number


def _count(value: object, column: str, source: str, line: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        try:
            number = int(str(value).strip())
        except ValueError:
            number = -1
    if not 0 <= number <= MAX_LENGTH:
        raise TraceError(f"{source}: line {line}: {column} must be a token count between 0 and "
                         f"{MAX_LENGTH}, got {value!r}")
    return number


_READERS: dict[str, Callable[[Iterator[str], str, _Rows], None]] = {
    "azure": _azure_rows, "mooncake": _mooncake_rows, "burstgpt": _burstgpt_rows}
