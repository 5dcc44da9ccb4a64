"""Traces read as they are replayed (`TraceStream`), and the JSON Lines one: a few MB of lines at a
time, each request checked as it is read, so a simulation holds the requests that have arrived,
not the trace (docs/traces.md, 'Streamed traces'). The other kind, a production file, is
`zipage.trace_import.ProductionStream`.

`open_trace_stream(path)` answers None for anything that is not a Zipage JSON Lines trace (a JSON
trace, a production trace, a file whose first line is not a header);
`zipage.trace_import.stream_trace_file` reads any of them, a JSON trace whole. A stream checks each
request exactly as the loader does, with the loader's messages (`RequestChecker`), plus one rule a
loaded trace does not need: its requests come in arrival order (a loaded trace is sorted; a stream
cannot be). A mistake is raised as a `TraceError` when the reader reaches its line, so a simulation
stops there (and `zipage replay` discards the run directory). What a stream keeps of the requests
it has read: their ids (a duplicate is an error), ~100 bytes a request. The loader reads a JSON
Lines trace through the same `zipage.trace.read_requests`, keeping the requests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from zipage.errors import TraceError
from zipage.trace import (
    TraceRequest,
    first_line_text,
    jsonl_header,
    open_trace_file,
    parse_trace_header,
    read_first_line,
    read_requests,
    trace_stem,
)


@runtime_checkable
class TraceStream(Protocol):
    """A trace read as it is replayed, where a `Trace` is loaded whole: a name, and requests made
    only when asked for, in arrival order (the trace's order among equal times), anew each time
    it is iterated. A driver that takes one holds the requests that have arrived, not the
    trace."""

    name: str

    def __iter__(self) -> Iterator[TraceRequest]: ...


class JsonLinesStream:
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


def open_trace_stream(path: str | os.PathLike[str]) -> JsonLinesStream | None:
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
    return JsonLinesStream(path, name, hash_block_size)
