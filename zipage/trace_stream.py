"""A JSON Lines trace read as it is used: a few MB of lines at a time, each request checked as it
is read, so a simulation holds the requests that have arrived, not the trace (docs/traces.md,
'Streamed traces').

`open_trace_stream(path)` answers None for anything that is not a Zipage JSON Lines trace (a
JSON trace, a production trace, a file whose first line is not a header): those load whole
(`zipage.trace.load_trace`), as before. A stream checks each request exactly as the loader does,
with the loader's messages (`RequestChecker`), plus one rule a loaded trace does not need: its
requests come in arrival order (a loaded trace is sorted; a stream cannot be). A mistake is
raised as a `TraceError` when the reader reaches its line, so a simulation stops there (and
`zipage replay` discards the run directory). What a stream keeps of the requests it has read:
their ids (a duplicate is an error), ~100 bytes a request. The loader reads a JSON Lines trace
through the same `read_requests`, keeping the requests.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Generator, Iterator
from typing import IO

from zipage.errors import TraceError
from zipage.trace import (
    EMPTY_TRACE,
    JSONL_CHUNK,
    RequestChecker,
    TraceRequest,
    _decode_json,
    _decode_jsonl_fast,
    _request_error,
    _show,
    first_line_text,
    jsonl_header,
    line_chunks,
    open_trace_file,
    parse_trace_header,
    plain_requests,
    read_first_line,
    text_position,
    trace_stem,
    utf8_text,
)


class TraceStream:
    """The requests of a JSON Lines trace, read lazily in file order (= arrival order) each time
    it is iterated."""

    def __init__(self, path: str | os.PathLike[str], name: str, hash_block_size: int) -> None:
        self.path, self.source = path, str(path)
        self.name = name
        self.hash_block_size = hash_block_size

    def __iter__(self) -> Iterator[TraceRequest]:
        with open_trace_file(self.path) as file:
            read_first_line(file, self.source)  # the header line, checked on opening
            yield from read_requests(file, self.source, self.hash_block_size, ordered=True)


def read_requests(file: IO[bytes], source: str, hash_block_size: int,
                  ordered: bool) -> Iterator[TraceRequest]:
    """The requests on the lines after a JSON Lines header (`file` is past it), each checked as
    it is read; `ordered`: refuse one that arrives before the request above it."""
    checker = RequestChecker(source, hash_block_size)
    previous: TraceRequest | None = None
    lines_before = 1  # the header's
    for chunk in line_chunks(file, source, lines_before + 1, JSONL_CHUNK):
        text = utf8_text(chunk, source,
                         lambda offset: text_position(chunk, offset, lines_before))
        requests = plain_requests(text)
        if requests is not None and (not ordered or _in_order(previous, requests)) \
                and checker.check_plain(requests):
            yield from requests
            previous = requests[-1]
            lines_before += len(requests)  # one a line: a chunk of plain lines has no blank
        else:
            previous = yield from _checked(text, source, lines_before, checker,
                                           previous if ordered else None)
            lines_before += chunk.count(b"\n")
    if checker.count == 0:
        raise TraceError(EMPTY_TRACE.format(source=source))


def _checked(text: str, source: str, lines_before: int, checker: RequestChecker,
             previous: TraceRequest | None) -> Generator[TraceRequest, None, TraceRequest | None]:
    """The requests of a chunk of lines that are not all plain, decoded in one call of the C
    parser (line by line where the chunk does not decode, so a mistake names its line), then
    checked one at a time, and against `previous` for the arrival order unless it is None;
    returns the last one."""
    objects = _decode_jsonl_fast(text)
    if objects is None:
        objects = [_decode_json(line, f"{source}: line {number}")
                   for number, line in enumerate(text.split("\n"), lines_before + 1)
                   if line.strip()]
    for raw in objects:
        request = checker.check(raw)
        if previous is not None and request.arrival_s < previous.arrival_s:
            raise _request_error(
                source, checker.count - 1, request.id,
                f"arrival_s {_show(request.arrival_s)} is earlier than request "
                f"#{checker.count - 2}'s {_show(previous.arrival_s)}: a JSON Lines trace "
                "is read as it is replayed, so its requests must be in arrival order; sort "
                "its lines by arrival_s (or save it as .json, which is loaded whole)")
        previous = request
        yield request
    return previous


def _in_order(previous: TraceRequest | None, requests: list[TraceRequest]) -> bool:
    """Whether `requests` come in arrival order, after `previous`."""
    arrivals = [request.arrival_s for request in requests]
    return ((previous is None or previous.arrival_s <= arrivals[0])
            and all(map(operator.le, arrivals, arrivals[1:])))


def open_trace_stream(path: str | os.PathLike[str]) -> TraceStream | None:
    """A stream of the trace at `path` if it is a Zipage JSON Lines trace (gzipped or not; its
    header checked now), else None."""
    source = str(path)
    try:
        with open_trace_file(path) as file:
            first = read_first_line(file, source)
    except (OSError, TraceError):
        return None  # the whole-file loader reports what is wrong
    header = jsonl_header(first_line_text(first))
    if header is None:
        return None
    default_name = trace_stem(path).encode("utf-8", "backslashreplace").decode("utf-8")
    name, hash_block_size = parse_trace_header(header, source, default_name, streamed=True)
    return TraceStream(path, name, hash_block_size)
