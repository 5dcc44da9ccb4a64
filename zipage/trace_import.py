"""Production traces in: the formats users arrive with, turned into Zipage traces.

- `azure`: the Azure LLM inference traces (2023 and 2024), CSV `TIMESTAMP,ContextTokens,
  GeneratedTokens` with wall-clock timestamps;
- `mooncake`: the Mooncake/Kimi traces (FAST'25), JSON Lines `timestamp` (ms), `input_length`,
  `output_length`, `hash_ids` (one id per 512-token prompt block; equal ids, equal blocks);
- `burstgpt`: BurstGPT, CSV with `Timestamp` (s), `Request tokens`, `Response tokens` and more.
- `copilot`: the GitHub Copilot coding-agent traces, one agent session a JSON line: imported as
  sessions by zipage/session_import.py (as `mooncake` is with `--sessions`).
- `servegen`: a model directory of Alibaba's ServeGen release (per-client arrival fits and
  length distributions, no request log), composed into requests by zipage/servegen_import.py.

Each row becomes one request whose id is the format's name and the row's position in the file
(stable under windows and samples), arriving at its timestamp relative to the window's start,
divided by the speed-up. Rows that cannot become a request (no prompt, no output: a failed call)
are counted by reason, never silently dropped. `load_trace_file` reads any of these or a Zipage
trace, telling them apart by content, so `zipage replay` and `zipage plan` take them directly;
`stream_trace_file` is the simulator's reading of the same files. A file is read a chunk of lines
at a time and each row kept as a few numbers (`_Rows`), then sorted by time (`ProductionStream`),
and each request is made only when asked for: `import_trace_file` writes them as they are made
and `zipage replay` simulates them as they arrive, so memory follows the row count, not the
bytes or the requests (docs/traces.md, "Bounded reading"). The formats are described in
docs/traces.md, "Production traces".
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter
from typing import Iterator

import numpy as np

from zipage.errors import TraceError
from zipage.production_rows import (
    MOONCAKE_HASH_BLOCK,
    ROW_BLOCK,
    ROW_FORMATS,
    ImportReport,
    _head_text,
    _nothing_left,
    _read,
    _skip_reason,
)

# The importers' options and the window syntax, where their callers have always found them.
from zipage.production_rows import ImportOptions as ImportOptions
from zipage.production_rows import parse_window as parse_window
from zipage.servegen_import import ServeGenStream, looks_like_servegen
from zipage.trace import (
    ARRIVAL_DECIMALS,
    Trace,
    TraceRequest,
    jsonl_header,
    load_trace,
    save_trace_stream,
    stable_hash,
    trace_stem,
)
from zipage.trace_stream import TraceStream, open_trace_stream

FORMATS = ROW_FORMATS + ("copilot", "servegen")  # zipage/session_import.py, servegen_import.py


class ProductionStream:
    """A production trace read as it is replayed (a `TraceStream`): its rows are read and ordered
    by time when it is opened, as a few numbers each (`_Rows`), and each request is made only when
    asked for, in arrival order (file order among equal times), anew each time it is iterated."""

    def __init__(self, fmt: str, path: str | os.PathLike[str],
                 options: ImportOptions = ImportOptions()) -> None:
        self.format, self.options = fmt, options
        self.name = options.name or trace_stem(path)
        self.rows = _read(fmt, path, options)
        self.order = np.argsort(np.frombuffer(self.rows.times, dtype=np.float64), kind="stable")

    def __iter__(self) -> Iterator[TraceRequest]:
        return self.requests(Counter())

    def requests(self, skipped: Counter) -> Iterator[TraceRequest]:
        """The kept rows as requests; each row not kept is counted in `skipped` by reason."""
        rows, options = self.rows, self.options
        if not len(rows):
            return
        times = np.frombuffer(rows.times, dtype=np.float64)
        prompts, outputs = (np.frombuffer(column, dtype=np.int64)
                            for column in (rows.prompts, rows.outputs))
        origin = float(times.min())
        # One draw a row in time order, a block at a time: the same draws as all at once.
        sampler = np.random.default_rng([options.seed, stable_hash(f"sample\0{self.format}")])
        start, duration = options.window or (0.0, math.inf)
        for low in range(0, len(rows), ROW_BLOCK):
            indices = self.order[low:low + ROW_BLOCK]
            for index, time_s, prompt_len, output_len, draw in zip(
                    indices.tolist(), times[indices].tolist(), prompts[indices].tolist(),
                    outputs[indices].tolist(), sampler.random(len(indices)).tolist()):
                offset = time_s - origin - start
                reason = _skip_reason(prompt_len, output_len, offset, duration, draw, options)
                if reason is not None:
                    skipped[reason] += 1
                    continue
                hashes = rows.hashes[index] if rows.hashes else None
                yield TraceRequest(
                    id=f"{self.format}-{index}",
                    arrival_s=round(offset / options.speedup, ARRIVAL_DECIMALS),
                    prompt_len=prompt_len, output_len=output_len, block_hashes=hashes,
                    hash_block_size=MOONCAKE_HASH_BLOCK if hashes is not None else 0)


def import_trace(fmt: str, path: str | os.PathLike[str],
                 options: ImportOptions = ImportOptions()) -> tuple[Trace, ImportReport]:
    """Read `path` in production format `fmt` and return the Zipage trace and what was kept."""
    if fmt == "copilot":  # sessions: zipage/session_import.py
        from zipage.session_import import import_sessions

        return import_sessions(fmt, path, options)
    stream, report = _opened_stream(fmt, path, options)
    requests = list(report.follow(stream.requests(report.skipped)))
    if not requests:
        raise _nothing_left(path, report.rows, report.skipped)
    return Trace(name=stream.name, requests=requests), report


def import_trace_file(fmt: str, path: str | os.PathLike[str], output: str | os.PathLike[str],
                      options: ImportOptions = ImportOptions()) -> ImportReport:
    """`import_trace` written to `output` as it is made (`save_trace`'s layouts): memory follows
    the rows' columns, not the requests, so a week of traffic imports on a laptop."""
    if fmt == "copilot":  # sessions: zipage/session_import.py
        from zipage.session_import import import_sessions_file

        return import_sessions_file(fmt, path, output, options)
    stream, report = _opened_stream(fmt, path, options)
    requests = report.follow(stream.requests(report.skipped))
    first = next(requests, None)
    if first is None:
        raise _nothing_left(path, report.rows, report.skipped)
    save_trace_stream(itertools.chain([first], requests), output, stream.name,
                      first.hash_block_size)
    return report


def _opened_stream(fmt: str, path: str | os.PathLike[str],
                   options: ImportOptions) -> tuple[ProductionStream | ServeGenStream, ImportReport]:
    if fmt == "servegen":  # a pool's "rows" are its clients' active windows
        pool = ServeGenStream(path, options)
        return pool, ImportReport(fmt, rows=pool.rows)
    stream = ProductionStream(fmt, path, options)
    return stream, ImportReport(fmt, rows=len(stream.rows))


def detect_format(path: str | os.PathLike[str]) -> str:
    """`zipage` for a Zipage trace (JSON or JSON Lines), else the production format's name."""
    if os.path.isdir(path):
        if looks_like_servegen(path):
            return "servegen"
        raise TraceError(f"{path}: a directory, and not a ServeGen model directory (no "
                         f"chunk-N-trace.csv in it); give a trace file")
    text = _head_text(path, limit=64 * 1024)
    if not text.strip() or "\x00" in text:
        return "zipage"  # empty, UTF-16/32 or binary: the Zipage loader says exactly what is wrong
    first = text.lstrip("\ufeff").lstrip().split("\n", 1)[0].strip()
    if first.startswith("{") or first.startswith("["):
        if jsonl_header(text) is not None:
            return "zipage"
        from zipage.session_import import looks_like_copilot

        try:
            obj = json.loads(first)
        except (ValueError, RecursionError):
            # A JSON trace spread over lines (its loader names any mistake), or a Copilot
            # session record longer than the head read here.
            return "copilot" if looks_like_copilot(first) else "zipage"
        if isinstance(obj, dict) and {"timestamp", "input_length", "output_length"} <= obj.keys():
            return "mooncake"
        return "copilot" if looks_like_copilot(first) else "zipage"
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


def stream_trace_file(path: str | os.PathLike[str]) -> Trace | TraceStream:
    """Any trace file, as the simulator replays it: a JSON Lines trace or a production trace
    read as the simulated clock reaches its requests (a `TraceStream`), a JSON trace loaded
    whole. A production file's rows are all read now, so a malformed row, or none left to
    replay, is refused before the run starts."""
    fmt = detect_format(path)
    if fmt == "zipage":
        return open_trace_stream(path) or load_trace(path)
    if fmt == "copilot":  # sessions are linked across the file: loaded whole
        return import_trace(fmt, path)[0]
    stream, report = _opened_stream(fmt, path, ImportOptions())
    if next(stream.requests(report.skipped), None) is None:
        raise _nothing_left(path, report.rows, report.skipped)
    return stream


# ---------------------------------------------------------------- the formats


