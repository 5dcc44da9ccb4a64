"""Production traces in: the formats users arrive with, turned into Zipage traces.

- `azure`: the Azure LLM inference traces (2023 and 2024), CSV `TIMESTAMP,ContextTokens,
  GeneratedTokens` with wall-clock timestamps;
- `mooncake`: the Mooncake/Kimi traces (FAST'25), JSON Lines `timestamp` (ms), `input_length`,
  `output_length`, `hash_ids` (one id per 512-token prompt block; equal ids, equal blocks);
- `burstgpt`: BurstGPT, CSV with `Timestamp` (s), `Request tokens`, `Response tokens` and more.

Each row becomes one request whose id is the format's name and the row's position in the file
(stable under windows and samples), arriving at its timestamp relative to the window's start,
divided by the speed-up. Rows that cannot become a request (no prompt, no output: a failed call)
are counted by reason, never silently dropped. `load_trace_file` reads any of these or a Zipage
trace, telling them apart by content, so `zipage replay` and `zipage plan` take them directly.
The formats are described in docs/traces.md, "Production traces".
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np

from zipage.errors import TraceError
from zipage.trace import (
    ARRIVAL_DECIMALS,
    GZIP_MAGIC,
    MAX_LENGTH,
    Trace,
    TraceRequest,
    gunzipped,
    jsonl_header,
    load_trace,
    stable_hash,
    trace_stem,
)

FORMATS = ("azure", "mooncake", "burstgpt")
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


@dataclass
class ImportReport:
    """What an import read, kept and skipped (by reason)."""

    format: str
    rows: int = 0
    skipped: Counter = field(default_factory=Counter)
    span_s: float = 0.0

    def lines(self, trace: Trace) -> list[str]:
        requests = trace.requests
        prompts = np.array([r.prompt_len for r in requests], dtype=np.int64)
        outputs = np.array([r.output_len for r in requests], dtype=np.int64)
        span = requests[-1].arrival_s if requests else 0.0
        rate = len(requests) / span if span > 0 else float("nan")
        lines = [f"{self.format}: {self.rows:,} rows read, {len(requests):,} requests imported "
                 f"over {span:,.1f} s ({rate:,.2f} requests/s)"]
        if len(requests):
            lines.append(f"  prompt tokens: mean {prompts.mean():,.0f}, p50 "
                         f"{np.percentile(prompts, 50):,.0f}, p99 {np.percentile(prompts, 99):,.0f}, "
                         f"max {prompts.max():,}")
            lines.append(f"  output tokens: mean {outputs.mean():,.0f}, p50 "
                         f"{np.percentile(outputs, 50):,.0f}, p99 {np.percentile(outputs, 99):,.0f}, "
                         f"max {outputs.max():,}")
        shared = _shared_block_fraction(requests)
        if shared is not None:
            lines.append(f"  prompt blocks seen before (prefix-cache hits at best): {shared:.1%}")
        for reason, count in sorted(self.skipped.items(), key=lambda item: -item[1]):
            lines.append(f"  skipped {count:,}: {reason}")
        return lines


@dataclass(frozen=True)
class _Row:
    index: int  # position among the file's data rows, from 0
    time_s: float  # the row's own clock, any origin
    prompt_len: int
    output_len: int
    block_hashes: tuple[int, ...] | None = None


def import_trace(fmt: str, path: str | os.PathLike[str],
                 options: ImportOptions = ImportOptions()) -> tuple[Trace, ImportReport]:
    """Read `path` in production format `fmt` and return the Zipage trace and what was kept."""
    if fmt not in FORMATS:
        raise TraceError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    _check_options(options)
    source = str(path)
    text = _read_text(path)
    rows = list(_READERS[fmt](text, source))
    report = ImportReport(format=fmt, rows=len(rows))
    requests = _requests(rows, fmt, options, report)
    if not requests:
        raise TraceError(f"{source}: no request left to import ({report.rows:,} rows read; "
                         + "; ".join(f"{count:,} {reason}" for reason, count in
                                     report.skipped.items()) + ")")
    name = options.name or trace_stem(path)
    return Trace(name=name, requests=requests), report


def detect_format(path: str | os.PathLike[str]) -> str:
    """`zipage` for a Zipage trace (JSON or JSON Lines), else the production format's name."""
    text = _read_text(path, limit=64 * 1024)
    if not text.strip() or "\x00" in text:
        return "zipage"  # empty, UTF-16/32 or binary: the Zipage loader says exactly what is wrong
    first = text.lstrip("\ufeff").lstrip().split("\n", 1)[0].strip()
    if first.startswith("{") or first.startswith("["):
        if jsonl_header(text) is not None:
            return "zipage"
        try:
            obj = json.loads(first)
        except (ValueError, RecursionError):
            return "zipage"  # a JSON trace spread over lines; its loader names any mistake
        if isinstance(obj, dict) and {"timestamp", "input_length", "output_length"} <= obj.keys():
            return "mooncake"
        return "zipage"
    header = {name.strip() for name in first.split(",")}
    if {"ContextTokens", "GeneratedTokens"} <= header:
        return "azure"
    if {"Request tokens", "Response tokens"} <= header:
        return "burstgpt"
    raise TraceError(f"{path}: not a trace this Zipage reads: expected a Zipage trace (JSON or "
                     f"JSON Lines) or a production trace ({', '.join(FORMATS)}: docs/traces.md, "
                     f"'Production traces'); the first line is {first[:80]!r}")


def load_trace_file(path: str | os.PathLike[str]) -> Trace:
    """Any trace file this Zipage reads, by its content: a Zipage trace, or a production trace
    imported whole (`zipage trace import` takes windows and samples)."""
    fmt = detect_format(path)
    if fmt == "zipage":
        return load_trace(path)
    return import_trace(fmt, path)[0]


def parse_window(text: str) -> tuple[float, float]:
    """`START:DURATION` in seconds (each may end in s, m or h) -> (start_s, duration_s)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise TraceError(f"--window: got {text!r}, expected START:DURATION, e.g. 0:3600 or 2h:30m")
    start, duration = (_seconds(part, text) for part in parts)
    if duration <= 0:
        raise TraceError(f"--window: the duration must be > 0, got {text!r}")
    return start, duration


def _seconds(part: str, text: str) -> float:
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    scale = units.get(part[-1:], None)
    number = part[:-1] if scale else part
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise TraceError(f"--window: {part!r} in {text!r} is not a time such as 90, 90s, "
                         f"15m or 2h") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"--window: times must be finite and >= 0, got {part!r}")
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


def _read_text(path: str | os.PathLike[str], limit: int | None = None) -> str:
    """The file's text, or its first `limit` bytes (telling a format apart reads no further,
    compressed or not: a day of traffic is read once, by its loader)."""
    try:
        if limit is None:
            return gunzipped(Path(path).read_bytes(), str(path)).decode("utf-8")
        with open(path, "rb") as handle:
            compressed = handle.read(len(GZIP_MAGIC)) == GZIP_MAGIC
        with (gzip.open(path, "rb") if compressed else open(path, "rb")) as handle:
            return handle.read(limit).decode("utf-8", errors="replace")
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace file: {error.strerror or error}") from None
    except EOFError as error:
        raise TraceError(f"{path}: a damaged gzip file: {error}") from None


def _requests(rows: list[_Row], fmt: str, options: ImportOptions,
              report: ImportReport) -> list[TraceRequest]:
    if not rows:
        return []
    origin = min(row.time_s for row in rows)
    start, duration = options.window or (0.0, math.inf)
    keep = np.random.default_rng([options.seed, stable_hash(f"sample\0{fmt}")]).random(len(rows))
    requests = []
    for row, draw in zip(sorted(rows, key=lambda row: (row.time_s, row.index)), keep):
        offset = row.time_s - origin - start
        reason = _skip_reason(row, offset, duration, draw, options)
        if reason is not None:
            report.skipped[reason] += 1
            continue
        requests.append(TraceRequest(
            id=f"{fmt}-{row.index}",
            arrival_s=round(offset / options.speedup, ARRIVAL_DECIMALS),
            prompt_len=row.prompt_len, output_len=row.output_len,
            block_hashes=row.block_hashes,
            hash_block_size=MOONCAKE_HASH_BLOCK if row.block_hashes is not None else 0))
    return requests


def _skip_reason(row: _Row, offset: float, duration: float, draw: float,
                 options: ImportOptions) -> str | None:
    if not 0 <= offset < duration:
        return "outside --window"
    if draw >= options.sample:
        return "not in the --sample"
    if row.prompt_len < 1:
        return "no prompt tokens"
    if row.output_len < 1:
        return "no output tokens (a failed request in the source)"
    if options.max_model_len is not None and row.prompt_len + row.output_len > options.max_model_len:
        return f"prompt + output longer than --max-model-len {options.max_model_len}"
    return None


# ---------------------------------------------------------------- the formats

def _azure_rows(text: str, source: str) -> Iterator[_Row]:
    reader = csv.DictReader(io.StringIO(text))
    _require_columns(reader, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), source)
    for index, record in enumerate(reader):
        line = index + 2
        stamp = record["TIMESTAMP"]
        try:
            moment = datetime.fromisoformat(stamp.strip())
            # A stamp without a zone is read as UTC: local time would bend arrivals at DST.
            time_s = (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
        except (ValueError, AttributeError):
            raise TraceError(f"{source}: line {line}: TIMESTAMP {stamp!r} is not a date and time "
                             f"like 2023-11-16 18:15:46.6805900") from None
        yield _Row(index, time_s, _count(record, "ContextTokens", source, line),
                   _count(record, "GeneratedTokens", source, line))


def _burstgpt_rows(text: str, source: str) -> Iterator[_Row]:
    reader = csv.DictReader(io.StringIO(text))
    _require_columns(reader, ("Timestamp", "Request tokens", "Response tokens"), source)
    for index, record in enumerate(reader):
        line = index + 2
        yield _Row(index, _number(record, "Timestamp", source, line),
                   _count(record, "Request tokens", source, line),
                   _count(record, "Response tokens", source, line))


def _mooncake_rows(text: str, source: str) -> Iterator[_Row]:
    index = 0
    for line, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError) as error:
            raise TraceError(f"{source}: line {line}: not a JSON object: {error}") from None
        if not isinstance(record, dict):
            raise TraceError(f"{source}: line {line}: expected a JSON object with timestamp, "
                             f"input_length, output_length, hash_ids")
        prompt_len = _count(record, "input_length", source, line)
        yield _Row(index, _number(record, "timestamp", source, line) / 1000.0, prompt_len,
                   _count(record, "output_length", source, line),
                   _hash_ids(record, prompt_len, source, line))
        index += 1


def _hash_ids(record: dict, prompt_len: int, source: str, line: int) -> tuple[int, ...]:
    hashes = record.get("hash_ids")
    expected = -(-prompt_len // MOONCAKE_HASH_BLOCK)
    if (not isinstance(hashes, list) or len(hashes) != expected
            or not all(type(value) is int and value >= 0 for value in hashes)):
        raise TraceError(f"{source}: line {line}: hash_ids must list {expected} non-negative "
                         f"integers (one per {MOONCAKE_HASH_BLOCK} tokens of input_length "
                         f"{prompt_len}), got {str(hashes)[:80]}")
    return tuple(hashes)


def _require_columns(reader: csv.DictReader, columns: tuple[str, ...], source: str) -> None:
    present = [name.strip() for name in (reader.fieldnames or [])]
    missing = [name for name in columns if name not in present]
    if missing:
        raise TraceError(f"{source}: line 1: missing column(s) {', '.join(missing)}; "
                         f"the header is {','.join(present)[:120]}")
    reader.fieldnames = present


def _number(record: dict, column: str, source: str, line: int) -> float:
    value = record.get(column)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise TraceError(f"{source}: line {line}: {column} must be a number, got {value!r}")
    return number


def _count(record: dict, column: str, source: str, line: int) -> int:
    value = record.get(column)
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


def _shared_block_fraction(requests: list[TraceRequest]) -> float | None:
    # Full blocks whose whole chain of leading hashes was seen before: what an unbounded prefix
    # cache could reuse. A chain is named by (its parent's name, its last hash).
    chains: dict[tuple[int, int], int] = {}
    total = shared = 0
    for request in requests:
        if request.block_hashes is None:
            return None
        parent = -1
        for block_hash in request.block_hashes[:request.prompt_len // request.hash_block_size]:
            total += 1
            key = (parent, block_hash)
            if key in chains:
                shared += 1
            else:
                chains[key] = len(chains)
            parent = chains[key]
    return shared / total if total else None


_READERS = {"azure": _azure_rows, "mooncake": _mooncake_rows, "burstgpt": _burstgpt_rows}
