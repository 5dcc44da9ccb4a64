"""Trace schema v1: the workload format both drivers replay.

A trace is a JSON object `{"version": 1, "name": ..., "requests": [...]}`; each request names its
arrival time, its prompt (a length, or explicit token ids), the prefix group it shares leading
tokens with, and exactly how many tokens it generates. This module loads and validates traces
(every mistake raises one `TraceError` line naming the file, the request, the field and the fix),
saves them in a diff-friendly one-request-per-line layout, synthesises prompt token ids
deterministically so prefix caching hits identically in the simulator and the real engine, and
re-stamps arrival times to turn an offline trace into an online one. The rules are documented in
`docs/traces.md`.
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import gzip
import io
import itertools
import json
import math
import operator
import os
import re
import reprlib
import zlib
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

import numpy as np
import xxhash

from zipage import request_fields
from zipage.errors import ConfigError, TraceError
from zipage.rundir import write_file_atomically

TRACE_VERSION = 1

TRACE_FIELDS = ("version", "name", "hash_block_size", "requests")
REQUEST_FIELDS = (
    "id",
    "arrival_s",
    "prompt_len",
    "prompt_token_ids",
    "prefix_group",
    "prefix_len",
    "block_hashes",
    "output_len",
    "session",
    "after",
    "after_s",
    "reasoning_len",
    *request_fields.NAMES,  # kv_budget, compress_scope, priority, scoring: declared there once
)
_REQUEST_FIELD_SET = frozenset(REQUEST_FIELDS)
_FIELD_DEFAULTS = {field.name: field.default for field in request_fields.FIELDS}
# The fields of most requests of a production-shaped trace: they take `_plain_request`'s path.
_PLAIN_FIELD_SET = frozenset(("id", "arrival_s", "prompt_len", "output_len"))

# Synthetic ids avoid the low range, where tokenizers keep special and control tokens, and stay
# below 32000 so one trace yields the same ids for every model with a vocabulary of at least 32000.
SYNTHETIC_TOKEN_LOW = 100
SYNTHETIC_TOKEN_HIGH = 32000
DEFAULT_VOCAB_SIZE = 32000

# Bounds on numbers. No model's context comes near 2^31 tokens, and larger values (a writer's
# overflow, a stray timestamp) would overflow int32/int64 arithmetic downstream, so they are
# rejected at load time; lengths under the bound that cannot fit this deployment are rejected per
# request at admission instead (the scheduler's reason, no simulation).
MAX_LENGTH = 2**31 - 1  # prompt_len, output_len, prefix_len, and every token id
# Seconds from the trace start (about 31.7 years): an absolute Unix time is a mistake.
MAX_ARRIVAL_S = 1e9
# Tokens one block hash names. Production traces hash 512-token blocks (Mooncake); an engine whose
# block size divides it shares exactly the blocks the trace says are identical.
MAX_HASH_BLOCK_SIZE = 1 << 20
MAX_BLOCK_HASH = 2**63 - 1

# A gzip stream starts with these bytes; any trace file may be compressed.
GZIP_MAGIC = b"\x1f\x8b"

# Bounds on what reading a file holds at once (docs/traces.md, "Bounded reading"), so a damaged or
# hostile file (a gzip bomb inflating to one endless line) is refused in one line, never read
# until memory runs out. Both count bytes after decompression.
# The longest line of any trace file, JSON Lines or CSV. A request line is ~100 bytes; one that
# lists its prompt's token ids takes up to 11 bytes a token (~7 for real vocabularies): ~0.9 MB for
# a 128k-token prompt, 11 MB even for a 1M-token prompt of 10-digit ids. Decoding a line this long
# holds a few hundred MB at most.
MAX_LINE_BYTES = 16 << 20
# The largest trace in the JSON layout (one document, parsed whole: the text and every decoded
# object at once, ~13 times its size: 0.78 GB peak for bench/trace_load.py's 62 MB). 64 MiB is
# half a million to a million requests, a hundred times the largest shipped trace; anything
# larger is what JSON Lines is for (read a line at a time).
MAX_JSON_TRACE_BYTES = 64 << 20

ARRIVAL_PATTERNS = ("poisson", "bursty")
# Arrival times are rounded so stamped traces stay compact; a microsecond is far below a step.
ARRIVAL_DECIMALS = 6


@dataclass(frozen=True)
class TraceRequest:
    """One request: when it arrives, what it reads, and exactly how many tokens it generates.

    `prompt_len` is always set (it is `len(prompt_token_ids)` when ids are given). Requests of the
    same `prefix_group` share their first `prefix_len` tokens; `prefix_len` is 0 without a group.
    `block_hashes` names the prompt's blocks of `hash_block_size` tokens (the trace's, declared once
    at its top level): requests whose leading hashes agree share those blocks' tokens.
    `kv_budget` is the request's own KV budget (None: the deployment's `--budget`).

    Sessions (docs/traces.md, "Sessions"): a request `after` an earlier one is a follow-up, sent
    `after_s` seconds after that predecessor's last token, never at a time of its own (its
    `arrival_s` is its session's start, a lower bound drivers only sort by). Its prompt begins
    with `prefix_len` tokens of the predecessor's history: the predecessor's prompt, then its
    output without the first `reasoning_len` tokens (the thinking the next turn does not see).
    `session` names the conversation or agent run (a follow-up's is its predecessor's).
    `compress_scope` is what the request's compressions may evict (None: the deployment's
    `--compress-scope`); `priority` its class under `--scheduling-policy priority` (lower
    first); `scoring` the eviction scoring policy of its compressions (None: the deployment's
    `--scoring`). These, and `kv_budget`, are declared in `zipage/request_fields.py`.
    """

    id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    prefix_group: str | None = None
    prefix_len: int = 0
    kv_budget: int | None = None
    block_hashes: tuple[int, ...] | None = None
    hash_block_size: int = 0
    session: str | None = None
    after: str | None = None
    after_s: float = 0.0
    reasoning_len: int = 0
    compress_scope: str | None = None
    priority: int = 0
    scoring: str | None = None


@dataclass(frozen=True)
class Trace:
    """A named list of requests; list order breaks ties between equal arrival times (FCFS)."""

    name: str
    requests: list[TraceRequest]


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace file (JSON or JSON Lines, either optionally gzipped); a missing
    `name` defaults to the file's stem."""
    source = str(path)
    try:
        file = open_trace_file(path)
    except OSError as error:
        reason = error.strerror or error
        raise TraceError(f"{source}: cannot read the trace file: {reason}") from None
    # A file name that is not valid UTF-8 must not make a valid trace's default name invalid.
    stem = trace_stem(path).encode("utf-8", "backslashreplace").decode("utf-8")
    with file:
        return read_trace(file, source, default_name=stem)


def trace_stem(path: str | os.PathLike[str]) -> str:
    """The file's name without its trace suffixes: day.jsonl.gz -> day, hour.csv -> hour."""
    name = Path(path).name.removesuffix(".gz")
    for suffix in (".jsonl", ".json", ".csv"):
        if name.endswith(suffix):
            return name.removesuffix(suffix) or Path(path).name
    return Path(name).stem


def parse_trace_bytes(data: bytes, source: str = "<trace>",
                      default_name: str | None = None) -> Trace:
    """Decode and validate the bytes of a trace file.

    Any byte sequence either loads or raises one `TraceError` line (docs/traces.md, "What the
    loader guarantees"): bad encodings, NUL bytes, nesting deeper than Python can parse, integers
    too long to convert, duplicated keys and sizes past the reader's bounds are reported like any
    schema mistake.
    """
    with open_trace_bytes(data) as file:
        return read_trace(file, source, default_name)


def read_trace(file: IO[bytes], source: str, default_name: str | None = None) -> Trace:
    """The trace in `file` (an `open_trace_file`), read in bounded memory: a JSON Lines trace a
    chunk of lines at a time, a JSON document whole, up to MAX_JSON_TRACE_BYTES."""
    # Decoding builds millions of objects for a big trace, none in a reference cycle; the garbage
    # collector's passes over them are pure cost (a quarter of the load time at 10^6 requests).
    collecting = gc.isenabled()
    gc.disable()
    try:
        first = read_first_line(file, source)
        header = jsonl_header(first_line_text(first))
        if header is not None:
            name, hash_block_size = parse_trace_header(header, source, default_name,
                                                       streamed=True)
            requests = list(read_requests(file, source, hash_block_size, ordered=False))
            return Trace(name=name, requests=requests)
        text = _decode_text(first + _read_document_rest(file, source, len(first)), source)
        return parse_trace(_decode_json(text, source), source=source, default_name=default_name)
    finally:
        if collecting:
            gc.enable()


def open_trace_file(path: str | os.PathLike[str]) -> IO[bytes]:
    """The file's bytes, decompressed as they are read when it is a gzip stream (told by its
    content, not its name)."""
    with open(path, "rb") as file:
        compressed = file.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    return gzip.open(path, "rb") if compressed else open(path, "rb")


def open_trace_bytes(data: bytes) -> IO[bytes]:
    """`open_trace_file` for bytes in memory."""
    file = io.BytesIO(data)
    return gzip.GzipFile(fileobj=file, mode="rb") if data.startswith(GZIP_MAGIC) else file


def read_chunk(file: IO[bytes], source: str, size: int, line: bool = False) -> bytes:
    """At most `size` bytes of `file` (up to the next line end with `line`), or one line naming
    why they cannot be read."""
    try:
        return file.readline(size) if line else file.read(size)
    except (OSError, EOFError, zlib.error) as error:
        if isinstance(file, gzip.GzipFile):
            raise TraceError(f"{source}: a damaged gzip file: {error}") from None
        raise TraceError(f"{source}: cannot read the trace file: {error}") from None


def read_first_line(file: IO[bytes], source: str) -> bytes:
    """The file's first line with its newline; a longer one than MAX_LINE_BYTES is cut there (it
    is no JSON Lines header, and no CSV header either)."""
    return read_chunk(file, source, MAX_LINE_BYTES + 1, line=True)


def first_line_text(first: bytes) -> str:
    """A first line as text for `jsonl_header`: empty when it cannot be a header (too long, or
    not UTF-8: the loader then names what is wrong)."""
    if len(first) > MAX_LINE_BYTES:
        return ""
    try:
        return first.decode("utf-8-sig")
    except UnicodeDecodeError:
        return ""


def line_chunks(file: IO[bytes], source: str, first_line: int, chunk_size: int) -> Iterator[bytes]:
    """The rest of `file` in whole lines, about `chunk_size` bytes at a time (the last line may
    lack its newline); `first_line` is the number of the file's next line. A line is joined once
    from the reads it spans (linear time however long), and one longer than MAX_LINE_BYTES is
    refused after at most that much of it is held."""
    line = first_line  # the number of the line the next chunk starts with
    pieces: list[bytes] = []  # the start of a line that no read so far ends
    held = 0
    while data := read_chunk(file, source, chunk_size):
        end = data.rfind(b"\n") + 1
        if end == 0:
            pieces.append(data)
            held += len(data)
            _check_line_length(held, line, source)
            continue
        if pieces:
            _check_line_length(held + data.find(b"\n"), line, source)
            chunk = b"".join((*pieces, data[:end]))
        else:
            chunk = data[:end]
        yield chunk
        line += chunk.count(b"\n")
        pieces = [data[end:]] if end < len(data) else []
        held = len(data) - end
    if pieces:
        yield b"".join(pieces)


def _check_line_length(length: int, line: int, source: str) -> None:
    if length > MAX_LINE_BYTES:
        raise TraceError(
            f"{source}: line {line} is longer than {_size(MAX_LINE_BYTES)}, the most one line "
            f"of a trace may hold (a request is a few hundred bytes, a few hundred KB even with "
            f"the token ids of a 128k-token prompt): the file is damaged or not a trace (a "
            f"decompression bomb?); check what wrote it, and give one request a line")


def _size(count: int) -> str:
    """A bound in bytes as a message gives it: 16 MiB (or 4,096 bytes, a bound a test lowers)."""
    return f"{count >> 20} MiB" if count >= 1 << 20 else f"{count:,} bytes"


def _read_document_rest(file: IO[bytes], source: str, read: int) -> bytes:
    """The rest of a JSON trace after its first `read` bytes, refused past MAX_JSON_TRACE_BYTES."""
    rest = read_chunk(file, source, max(MAX_JSON_TRACE_BYTES + 1 - read, 0))
    if read + len(rest) > MAX_JSON_TRACE_BYTES:
        raise TraceError(
            f"{source}: over {_size(MAX_JSON_TRACE_BYTES)} as one JSON document, the most a "
            f"JSON trace may be (it is parsed whole), and not JSON Lines (its first line is no "
            f'header): write a large trace as JSON Lines, a header line such as {{"version": 1, '
            f'"name": "day"}} then one request a line, read a line at a time (save it as '
            f".jsonl or .jsonl.gz; docs/traces.md, 'JSON Lines and gzip')")
    return rest


def jsonl_header(text: str) -> dict[str, Any] | None:
    """The header object of a JSON Lines trace, or None when `text` is not one.

    A JSON Lines trace's first line is a whole object with `version` and no `requests`; each
    further non-blank line is one request. A JSON trace's first line is never a whole object with
    `version` alone, since its requests follow inside it.
    """
    first = text.lstrip("\ufeff").split("\n", 1)[0].strip()
    if not first.startswith("{"):
        return None
    try:
        obj = json.loads(first)
    except (ValueError, RecursionError):  # not a header; the JSON path reports what is wrong
        return None
    if isinstance(obj, dict) and "version" in obj and "requests" not in obj:
        return obj
    return None


# Characters of JSON Lines decoded in one call of the C parser (a few MB: the copies stay small).
JSONL_CHUNK = 1 << 22


def _decode_jsonl_fast(body: str) -> list[Any] | None:
    """The request lines of a JSON Lines trace decoded a chunk of lines at a time, each chunk
    as one JSON array (its newlines made commas): one call into the C parser per chunk instead
    of one per line, three to four times faster. None when a chunk does not decode to exactly
    one value per line (a blank line inside it, a bad line, a line with two values): the caller
    then decodes line by line, which accepts and rejects exactly what this would have."""
    requests: list[Any] = []
    start = 0
    while start < len(body):
        end = body.find("\n", start + JSONL_CHUNK)
        end = len(body) if end < 0 else end
        chunk = body[start:end].strip()  # blank lines around a chunk are skipped, as line by line
        start = end + 1
        if not chunk:
            continue
        try:
            values = json.loads("[" + chunk.replace("\n", ",") + "]",
                                object_pairs_hook=_object_from_pairs)
        except (ValueError, RecursionError):
            return None
        if len(values) != chunk.count("\n") + 1:
            return None
        requests += values
    return requests


def _decode_text(data: bytes, source: str) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise TraceError(f"{source}: the file is UTF-16 or UTF-32 text (it starts with a byte "
                         f"order mark); a trace must be UTF-8: re-save it as UTF-8")
    # A UTF-8 byte order mark (as some Windows editors write) is skipped.
    return utf8_text(data, source, lambda offset: f"{text_position(data, offset)} (byte {offset})",
                     "utf-8-sig")


def utf8_text(data: bytes, source: str, position: Callable[[int], str],
              encoding: str = "utf-8") -> str:
    """`data` as text, or one line naming where it is not UTF-8 text (`position(offset)`): the
    whole file here, a chunk of one in zipage/trace_stream.py."""
    offset = data.find(b"\x00")
    if offset >= 0:
        # JSON text never holds a raw NUL (inside strings it must be escaped), so this is
        # UTF-16/UTF-32 without a byte order mark, or not text at all.
        raise TraceError(f"{source}: not a UTF-8 JSON file: NUL byte at {position(offset)} "
                         "(UTF-16 text or a binary file?); a trace must be UTF-8 JSON")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as error:
        raise TraceError(
            f"{source}: not UTF-8 text: byte 0x{data[error.start]:02x} at "
            f"{position(error.start)} is not valid UTF-8 (Latin-1 or another legacy "
            f"encoding?); a trace must be UTF-8: re-save it as UTF-8"
        ) from None


def text_position(data: bytes, offset: int, lines_before: int = 0) -> str:
    """Where byte `offset` of `data` is, as "line L column C" (`lines_before` lines precede it)."""
    line = lines_before + data.count(b"\n", 0, offset) + 1
    column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
    return f"line {line} column {column}"


def _decode_json(text: str, source: str) -> Any:
    try:
        try:
            return json.loads(text, object_pairs_hook=_object_from_pairs)
        except json.JSONDecodeError:
            raise
        except ValueError:
            # Only an integer literal longer than Python converts (4300 digits) gets here. Parse
            # again, keeping such literals as markers, so the schema check can name the request
            # and field that holds one; the fast path above pays nothing for this.
            return json.loads(text, object_pairs_hook=_object_from_pairs,
                              parse_int=_parse_int)
    except json.JSONDecodeError as error:
        raise TraceError(
            f"{source}: not valid JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
    except RecursionError:
        raise TraceError(
            f"{source}: not a trace: JSON nested too deeply for the parser (a trace nests at most "
            f"4 levels: trace, requests, request, prompt_token_ids)"
        ) from None


class _OversizedInteger:
    """An integer literal too long to convert; it fails every field check with its size."""

    def __init__(self, literal: str) -> None:
        self.digits = len(literal.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _parse_int(literal: str) -> int | _OversizedInteger:
    try:
        return int(literal)
    except ValueError:
        return _OversizedInteger(literal)


class _DuplicatedKeys(dict):
    """A JSON object that names a key more than once: parse_trace rejects it, naming the key."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        self.duplicated = [key for key, _ in pairs if key in seen or seen.add(key)]


def _object_from_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of duplicated keys silently; a duplicated key in a trace is a bug in
    # whatever wrote it, so it must surface. An exact dict means "no duplicates".
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _DuplicatedKeys(pairs)


def _duplicated_keys_message(obj: _DuplicatedKeys) -> str:
    duplicated = list(dict.fromkeys(obj.duplicated))
    keys = ", ".join(_show(key) for key in duplicated[:MAX_NAMED_FIELDS])
    if len(duplicated) > MAX_NAMED_FIELDS:
        keys += f" and {len(duplicated) - MAX_NAMED_FIELDS} more"
    noun = "key" if len(duplicated) == 1 else "keys"
    return (f"duplicated {noun} {keys}: JSON objects must name each key once (a duplicated key is "
            f"a bug in whatever wrote the trace; keep the right one)")


def parse_trace(obj: Any, source: str = "<trace>", default_name: str | None = None) -> Trace:
    """Validate a decoded trace object; `source` names it in error messages."""
    name, hash_block_size = parse_trace_header(obj, source, default_name)
    checker = RequestChecker(source, hash_block_size)
    return Trace(name=name, requests=[checker.check(raw) for raw in obj["requests"]])


def parse_trace_header(obj: Any, source: str, default_name: str | None = None,
                       streamed: bool = False) -> tuple[str, int]:
    """Check a trace's top level (a JSON Lines trace's header line when `streamed`: its requests
    follow on their own lines); returns its name and `hash_block_size` (0: none)."""
    if not isinstance(obj, dict):
        raise TraceError(
            f"{source}: a trace must be a JSON object with keys version, name, requests, "
            f"got {_json_type(obj)}"
        )
    unknown = [key for key in obj if key not in TRACE_FIELDS]
    if unknown:
        raise TraceError(f"{source}: {_unknown_fields_message(unknown, TRACE_FIELDS)}")
    if isinstance(obj, _DuplicatedKeys):
        raise TraceError(f"{source}: {_duplicated_keys_message(obj)}")
    if "version" not in obj:
        raise TraceError(f'{source}: version is missing; add "version": {TRACE_VERSION}')
    version = obj["version"]
    if not _is_integer(version) or version != TRACE_VERSION:
        raise TraceError(
            f"{source}: version must be {TRACE_VERSION} (the trace schema this Zipage reads), "
            f"got {_show(version)}"
        )
    name = obj.get("name", default_name if default_name is not None else source)
    if not isinstance(name, str) or not name or not _is_unicode(name):
        raise TraceError(
            f"{source}: name must be a non-empty string, got {_show(name)}"
            + _surrogate_hint(name)
        )
    if not streamed:
        if "requests" not in obj:
            raise TraceError(
                f"{source}: requests is missing; add a non-empty list of request objects")
        requests = obj["requests"]
        if not isinstance(requests, list):
            raise TraceError(
                f"{source}: requests must be a non-empty list of request objects, "
                f"got {_json_type(requests)}"
            )
        if not requests:
            raise TraceError(EMPTY_TRACE.format(source=source))
    hash_block_size = obj.get("hash_block_size", 0)
    if "hash_block_size" in obj and (
            type(hash_block_size) is not int or not 1 <= hash_block_size <= MAX_HASH_BLOCK_SIZE):
        raise TraceError(f"{source}: hash_block_size must be an integer between 1 and "
                         f"{MAX_HASH_BLOCK_SIZE} (the tokens one block hash names), "
                         f"got {_show(hash_block_size)}")
    return name, hash_block_size


EMPTY_TRACE = "{source}: requests is empty; a trace needs at least one request"


def session_history(request: TraceRequest) -> int:
    """Tokens of `request` a turn that follows it sees: its prompt and its output less the
    thinking (`reasoning_len`)."""
    return request.prompt_len + request.output_len - request.reasoning_len


class RequestChecker:
    """Validates a trace's requests one at a time, in order: each on its own, and against the
    earlier ones (unique ids, prefix groups that agree, follow-ups that follow an earlier turn of
    their session). What it keeps of the earlier ones: their ids, per prefix group the member of
    longest prefix, and per turn of a session three numbers."""

    def __init__(self, source: str, hash_block_size: int) -> None:
        self.source, self.hash_block_size = source, hash_block_size
        self.count = 0  # requests checked so far: the next one's index
        self._index_of_id: dict[str, int] = {}
        self._longest_member: dict[str, tuple[int, TraceRequest]] = {}
        # Per request of a session: (session, the session's start, its history's length), what
        # a later turn that follows it is checked against (~150 bytes a turn).
        self._turns: dict[str, tuple[str, float, int]] = {}
        self._session_starts: dict[str, int] = {}  # session -> the index of its first turn

    def check(self, raw: Any) -> TraceRequest:
        index = self.count
        request = _parse_request(raw, index, self.source, self.hash_block_size)
        if request.after is not None:
            request = self._follow_up(request, index)
        first = self._index_of_id.setdefault(request.id, index)
        if first != index:
            raise _request_error(self.source, index, request.id,
                                 f"id duplicates request #{first}; ids must be unique")
        if request.prefix_group is not None:
            _check_group_consistency(request, request.prefix_group, index,
                                     self._longest_member, self.source)
        if request.session is not None:
            if request.after is None:
                began = self._session_starts.setdefault(request.session, index)
                if began != index:
                    raise _request_error(
                        self.source, index, request.id,
                        f"session {_show(request.session)} already began at request #{began}; "
                        "a later turn of it names the turn it follows (after), or give this "
                        "request a session of its own")
            self._turns[request.id] = (request.session, request.arrival_s,
                                       session_history(request))
        self.count += 1
        return request

    def _follow_up(self, request: TraceRequest, index: int) -> TraceRequest:
        """A follow-up checked against its predecessor, with what it inherits filled in: its
        session, its session's start (its `arrival_s`) and, by default, the whole history."""
        def fail(message: str) -> TraceError:
            return _request_error(self.source, index, request.id, message)

        after = request.after
        turn = self._turns.get(after)
        if turn is None:
            if after in self._index_of_id:
                raise fail(f"after names {_show(after)}, which is in no session: give that "
                           f"request a session (the conversation its turns share)")
            raise fail(f"after names {_show(after)}, which is no request above this one: a "
                       f"follow-up comes after its predecessor in the file (a missing, later or "
                       f"own id would make the turns wait forever)")
        session, start, history = turn
        if request.session is not None and request.session != session:
            raise fail(f"session {_show(request.session)} differs from its predecessor's "
                       f"({_show(session)}); a follow-up stays in its predecessor's session "
                       f"(drop session to inherit it)")
        shared = request.prefix_len
        if shared < 0:
            if history > request.prompt_len:
                raise fail(f"the history it follows is {history} tokens (its predecessor's "
                           f"prompt and output less reasoning_len), longer than prompt_len "
                           f"{request.prompt_len}: raise prompt_len to include it, or give "
                           f"prefix_len for a turn that keeps only part of it")
            shared = history
        elif shared > history:
            raise fail(f"prefix_len {shared} is longer than the history it follows ({history} "
                       f"tokens: its predecessor's prompt and output less reasoning_len)")
        return dataclasses.replace(request, session=session, arrival_s=start, prefix_len=shared)

    def check_plain(self, requests: list[TraceRequest]) -> bool:
        """Take `plain_requests`' requests (each valid on its own) at once when no id among them
        repeats one seen before; else take none and answer False (`check` one at a time then
        finds the repeat where the reader reaches it)."""
        index_of_id = dict(zip([request.id for request in requests], itertools.count(self.count)))
        if len(index_of_id) != len(requests) or not self._index_of_id.keys().isdisjoint(index_of_id):
            return False
        self._index_of_id.update(index_of_id)
        self.count += len(requests)
        return True


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write `trace` with one request per line; it is validated first, so no bad file is written.

    The file's name picks the layout: `.jsonl` is JSON Lines (a header line, then one request a
    line: what large traces use), anything else one JSON object (at most MAX_JSON_TRACE_BYTES,
    as the loader reads); a further `.gz` compresses it.
    """
    request_objects = [_request_to_json(request) for request in trace.requests]
    header_fields = _header_fields(trace.name, _hash_block_size_of(trace))
    parse_trace({**header_fields, "requests": request_objects}, source=str(path))
    _write_trace_file(path, header_fields,
                      (json.dumps(request, separators=(",", ":")) for request in request_objects))


def save_trace_stream(requests: Iterable[TraceRequest], path: str | os.PathLike[str], name: str,
                      hash_block_size: int = 0) -> int:
    """Write requests as they come (`save_trace`'s layouts and bytes), holding a batch of lines,
    not the trace; returns how many were written. Each request is checked as the loader checks
    it before it is written, and the file appears only once whole. Not checked: that the ids are
    unique (a set of ten million ids would be the memory this saves); the caller's must be, as
    an import's FORMAT-ROW ids are."""
    source = str(path)
    header_fields = _header_fields(name, hash_block_size)
    parse_trace_header(header_fields, source, streamed=True)

    def lines() -> Iterator[str]:
        for index, request in enumerate(requests):
            if request.block_hashes is not None and request.hash_block_size != hash_block_size:
                raise ConfigError(f"{source}: request #{index} hashes blocks of "
                                  f"{request.hash_block_size} tokens, the trace's are "
                                  f"{hash_block_size}; one trace hashes blocks of one size")
            obj = _request_to_json(request)
            _parse_request(obj, index, source, hash_block_size)
            yield json.dumps(obj, separators=(",", ":"))

    return _write_trace_file(path, header_fields, lines())


def _header_fields(name: str, hash_block_size: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"version": TRACE_VERSION, "name": name}
    if hash_block_size:
        fields["hash_block_size"] = hash_block_size
    return fields


# Request lines encoded and written in one call: each call costs, and a batch stays small.
WRITE_BATCH = 4096


def _write_trace_file(path: str | os.PathLike[str], header_fields: dict[str, Any],
                      lines: Iterator[str]) -> int:
    """Write the layout the name picks (see `save_trace`) beside `path` under a name of its own,
    then move it there (`write_file_atomically`): a file stopped by a bad request, or by the JSON
    layout's bound, is never left behind, and two writers of one path never share a file."""
    path = Path(path)
    jsonl = path.name.removesuffix(".gz").endswith(".jsonl")

    def write(target: Path) -> int:
        with open(target, "wb") as raw:
            if path.name.endswith(".gz"):
                compressed = _GzipWriter(raw)
                count = _write_layout(compressed, header_fields, lines, jsonl, str(path))
                compressed.finish()
            else:
                count = _write_layout(raw, header_fields, lines, jsonl, str(path))
        if not count:
            raise TraceError(EMPTY_TRACE.format(source=path))
        return count

    return write_file_atomically(path, write)


class _GzipWriter:
    """Gzip written as the data comes, in the bytes `gzip.compress(data, mtime=0)` makes of it
    whole: zlib's own gzip wrapper, with no file name or time inside (the same bytes each run)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.deflate = zlib.compressobj(9, zlib.DEFLATED, 31)  # level 9, gzip wrapper

    def write(self, data: bytes) -> None:
        self.raw.write(self.deflate.compress(data))

    def finish(self) -> None:
        self.raw.write(self.deflate.flush())


def _write_layout(out: IO[bytes] | _GzipWriter, header_fields: dict[str, Any], lines: Iterator[str],
                  jsonl: bool, source: str) -> int:
    """JSON Lines (a header line, a line a request) or one JSON object with a request a line;
    returns the requests written."""
    if jsonl:
        opening, separator, closing = json.dumps(header_fields) + "\n", "\n", "\n"
    else:
        opening = json.dumps(header_fields)[:-1] + ', "requests": [\n'
        separator, closing = ",\n", "\n]}\n"
    count = written = 0
    text = opening
    for batch in iter(lambda: list(itertools.islice(lines, WRITE_BATCH)), []):
        text += ("" if not count else separator) + separator.join(batch)
        count += len(batch)
        written += _write_text(out, text, written, jsonl, source)
        text = ""
    _write_text(out, text + closing, written, jsonl, source)
    return count


def _write_text(out: IO[bytes] | _GzipWriter, text: str, written: int, jsonl: bool, source: str) -> int:
    data = text.encode("utf-8")
    if not jsonl and written + len(data) > MAX_JSON_TRACE_BYTES:
        raise TraceError(
            f"{source}: over {_size(MAX_JSON_TRACE_BYTES)} as one JSON document, the most "
            f"the loader reads as a JSON trace (it is parsed whole): name the file .jsonl or "
            f".jsonl.gz to write JSON Lines, read a line at a time")
    out.write(data)
    return len(data)


def _hash_block_size_of(trace: Trace) -> int:
    sizes = {request.hash_block_size for request in trace.requests if request.block_hashes}
    if len(sizes) > 1:
        raise ConfigError(f"trace {trace.name!r}: block_hashes of different hash_block_size "
                          f"({sorted(sizes)}); one trace hashes blocks of one size")
    return sizes.pop() if sizes else 0


def prompt_token_ids(request: TraceRequest, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """The prompt's token ids: the trace's own ids if it gives them, else synthesised ones.

    Synthesis: the first `prefix_len` tokens are drawn from a stream keyed by the prefix group,
    the rest from a stream keyed by the request id, each a numpy PCG64 generator seeded with
    xxh64 of the key. So requests of one group share exactly their first `prefix_len` tokens
    (two members with different prefix lengths share the shorter one), everything else is
    independent, and the ids are identical across processes and machines. Ids lie in
    [100, min(vocab_size, 32000)), hence are the same for every vocabulary of 32000 or more.
    """
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    high = min(vocab_size, SYNTHETIC_TOKEN_HIGH)
    if high <= SYNTHETIC_TOKEN_LOW:
        raise ConfigError(
            f"vocab_size must be greater than {SYNTHETIC_TOKEN_LOW} to synthesise prompt tokens, "
            f"got {vocab_size}"
        )
    if request.block_hashes is not None:
        return _hashed_blocks(request.block_hashes, request.hash_block_size,
                              request.prompt_len, high)
    shared = request.prefix_len if request.prefix_group is not None else 0
    tokens: list[int] = []
    if shared:
        tokens = token_stream("prefix_group", request.prefix_group, shared, high)
    return tokens + token_stream("request", request.id, request.prompt_len - shared, high)


def stamp_arrivals(
    trace: Trace,
    rate_qps: float,
    pattern: str = "poisson",
    seed: int = 0,
    burst_size: int = 8,
) -> Trace:
    """A copy of `trace` whose arrival times follow an open-loop arrival process at `rate_qps`.

    Requests keep their order; the first arrives at 0.
    - "poisson": independent exponential gaps with mean 1 / rate_qps.
    - "bursty": bursts of `burst_size` consecutive requests arrive at the same instant; the burst
      instants form a Poisson process of rate rate_qps / burst_size, so the long-run request rate
      is still rate_qps but the queue sees spikes. A burst of 4 over a trace whose samples are
      listed together models users asking for 4 samples of one question at once.
    """
    if not isinstance(rate_qps, (int, float)) or isinstance(rate_qps, bool) or not (
        math.isfinite(rate_qps) and rate_qps > 0
    ):
        raise ConfigError(
            f"rate_qps must be a finite number > 0 (requests per second), got {rate_qps!r}"
        )
    if pattern not in ARRIVAL_PATTERNS:
        raise ConfigError(
            f"pattern must be one of {', '.join(ARRIVAL_PATTERNS)}, got {pattern!r}"
        )
    if not _is_integer(burst_size) or burst_size < 1:
        raise ConfigError(f"burst_size must be an integer >= 1, got {burst_size!r}")
    if not _is_integer(seed) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    # A session's follow-ups follow its first turn (their arrival_s is its start, not a time
    # of their own): only the others are stamped.
    num_requests = sum(request.after is None for request in trace.requests)
    generator = np.random.default_rng([seed, stable_hash(f"arrivals\0{pattern}")])
    if pattern == "poisson":
        gaps = generator.exponential(1.0 / rate_qps, size=num_requests)
        gaps[0] = 0.0
        arrivals = np.cumsum(gaps)
    else:
        num_bursts = math.ceil(num_requests / burst_size)
        burst_gaps = generator.exponential(burst_size / rate_qps, size=num_bursts)
        burst_gaps[0] = 0.0
        arrivals = np.repeat(np.cumsum(burst_gaps), burst_size)[:num_requests]
    return restamp(trace, arrivals)


def restamp(trace: Trace, arrivals) -> Trace:
    """A copy of `trace` whose requests that follow none arrive at `arrivals` (one time each, in
    trace order). A session's follow-ups keep their closed loop (`after`, `after_s`); their
    `arrival_s`, a lower bound drivers only sort by, becomes their session's new start."""
    stamped = iter(arrivals)
    start: dict[str, float] = {}  # request of a session -> its session's new start
    requests = []
    for request in trace.requests:
        if request.after is None:
            arrival = round(float(next(stamped)), ARRIVAL_DECIMALS)
        else:
            arrival = start[request.after]
        if request.session is not None:
            start[request.id] = arrival
        requests.append(dataclasses.replace(request, arrival_s=arrival))
    return Trace(name=trace.name, requests=requests)


def scale_arrivals(trace: Trace, speedup: float) -> Trace:
    """A copy of `trace` with every arrival time divided by `speedup`: the same requests in the
    same order, `speedup` times the load."""
    if not (isinstance(speedup, (int, float)) and math.isfinite(speedup) and speedup > 0):
        raise ConfigError(f"speedup must be a finite number > 0, got {speedup!r}")
    return Trace(name=trace.name, requests=[
        dataclasses.replace(request, arrival_s=round(request.arrival_s / speedup, ARRIVAL_DECIMALS))
        for request in trace.requests])


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that is the same in every process and on every machine.

    Python's hash() is salted per process, so seeds derived from names use xxh64 instead.
    """
    return xxhash.xxh64_intdigest(text.encode("utf-8"))


def prompt_block_keys(request: TraceRequest, block_size: int) -> list[int] | None:
    """Keys of the prompt's full blocks of `block_size` tokens, equal for two blocks exactly when
    `prompt_token_ids` would make them equal (a block's tokens and everything before it), without
    synthesising a token; None when only the tokens can tell (the request gives its ids, or its
    hashed blocks do not align with `block_size`).

    A block's identity is where its tokens are drawn from: inside a prefix group's shared tokens
    (group, block), inside hashed blocks (their hashes, and the block's place in them), else the
    request's own stream (request, block). Keys are chained (each covers every block before it)
    unless all of a prompt is its own stream: (request, block) then names the prefix already.
    """
    if request.prompt_token_ids is not None:
        return None
    hashed = request.block_hashes is not None
    if hashed and request.hash_block_size % block_size and block_size % request.hash_block_size:
        return None
    digest = xxhash.xxh64_intdigest  # one call over the concatenation = the streamed hash
    if request.block_hashes is None and request.prefix_group is None:
        # Most requests draw every block from their own stream, so a block's key need only name
        # (request, block): a run of consecutive keys from the id's digest, one hash a request
        # (a million requests' blocks are keyed per run). Negative, they never equal a chained
        # key (an xxh64 digest); 2^32 apart, two requests' runs never overlap (2^31 blocks at
        # most).
        own = -((digest(f"r\0{request.id}".encode("utf-8"), 1) + 1) << 32)  # seed 1
        # count, not range: a range of such large integers makes each one from its index
        return list(itertools.islice(itertools.count(own), request.prompt_len // block_size))
    keys = []
    previous = 0
    for index in range(request.prompt_len // block_size):
        identity = _block_identity(request, index, block_size)
        previous = digest(previous.to_bytes(8, "little") + identity.encode("utf-8"), seed=1)
        keys.append(previous)
    return keys


def _block_identity(request: TraceRequest, index: int, block_size: int) -> str:
    start, end = index * block_size, (index + 1) * block_size
    if request.block_hashes is not None:
        hashed = request.hash_block_size
        if block_size <= hashed:
            return f"h\0{request.block_hashes[start // hashed]}\0{start % hashed}"
        return "h\0" + ",".join(map(str, request.block_hashes[start // hashed:end // hashed]))
    if request.prefix_group is not None and end <= request.prefix_len:
        return f"g\0{request.prefix_group}\0{index}"
    return f"r\0{request.id}\0{index}"


def _hashed_blocks(hashes: tuple[int, ...], block_size: int, prompt_len: int,
                   high: int) -> list[int]:
    # Each block's tokens come from a stream keyed by its hash alone; the prefix cache hashes a
    # block together with everything before it, so equal hashes after different ones never hit.
    tokens: list[int] = []
    for block_hash in hashes:
        tokens += token_stream("block", str(block_hash), block_size, high)
    return tokens[:prompt_len]


def token_stream(namespace: str, key: str, count: int, high: int) -> list[int]:
    # The namespace keeps a group and a request that happen to share a name from sharing tokens.
    generator = np.random.default_rng(stable_hash(f"{namespace}\0{key}"))
    return generator.integers(SYNTHETIC_TOKEN_LOW, high, size=count).tolist()


def _parse_request(raw: Any, index: int, source: str, hash_block_size: int = 0) -> TraceRequest:
    # This runs once per request (a million in a big trace), so the common case is kept to
    # C-level set and type tests; every failure still gets its own one-line message.
    if type(raw) is dict and raw.keys() == _PLAIN_FIELD_SET:
        request = _plain_request(raw)
        if request is not None:
            return request
    if not isinstance(raw, dict):
        raise _request_error(source, index, None, f"must be a JSON object, got {_json_type(raw)}")
    request_id = raw.get("id")
    label_id = request_id if type(request_id) is str and _is_unicode(request_id) else None
    if not raw.keys() <= _REQUEST_FIELD_SET:
        unknown = [key for key in raw if key not in _REQUEST_FIELD_SET]
        message = _unknown_fields_message(unknown, REQUEST_FIELDS)
        raise _request_error(source, index, label_id, message)
    if isinstance(raw, _DuplicatedKeys):
        raise _request_error(source, index, label_id, _duplicated_keys_message(raw))
    if "id" not in raw:
        raise _request_error(
            source, index, None, "id is missing; give every request a unique string id"
        )
    if type(request_id) is not str or not request_id or label_id is None:
        raise _request_error(
            source, index, None,
            f"id must be a non-empty string, got {_show(request_id)}"
            + _surrogate_hint(request_id),
        )

    def fail(message: str) -> TraceError:
        return _request_error(source, index, request_id, message)

    after = raw.get("after")
    if "after" in raw:
        if type(after) is not str or not after or not _is_unicode(after):
            raise fail(f"after must be the id of an earlier request (the turn this one "
                       f"follows), got {_show(after)}" + _surrogate_hint(after))
        for field in ("arrival_s", "prefix_group", "block_hashes", "prompt_token_ids"):
            if field in raw:
                raise fail(f"{field} does not go with after: a follow-up is sent after_s "
                           f"after its predecessor's last token, and its prompt begins with "
                           f"the predecessor's history; drop {field}")
        arrival = 0  # its session's start, filled in by `RequestChecker`
    elif "arrival_s" not in raw:
        raise fail(
            "arrival_s is missing; give the arrival time in seconds (0 for offline workloads)"
        )
    else:
        arrival = raw["arrival_s"]
    # Chained comparisons refuse NaN, infinities and integers too large for a float alike.
    if not _is_number(arrival) or not 0 <= arrival <= MAX_ARRIVAL_S:
        raise fail(
            f"arrival_s must be a number between 0 and {MAX_ARRIVAL_S:.0f} (seconds from the "
            f"trace start, not an absolute time), got {_show(arrival)}"
        )
    after_s = raw.get("after_s", 0.0)
    if "after_s" in raw:
        if after is None:
            raise fail("after_s needs after: name the request this one follows, or drop after_s")
        if not _is_number(after_s) or not 0 <= after_s <= MAX_ARRIVAL_S:
            raise fail(f"after_s must be a number of seconds between 0 and "
                       f"{MAX_ARRIVAL_S:.0f} (the think or tool time after the predecessor's "
                       f"last token), got {_show(after_s)}")
    session = raw.get("session")
    if "session" in raw and (type(session) is not str or not session or not _is_unicode(session)):
        raise fail(f"session must be a non-empty string (the conversation or agent run the "
                   f"request belongs to), got {_show(session)}" + _surrogate_hint(session))

    has_length, has_ids = "prompt_len" in raw, "prompt_token_ids" in raw
    if has_length == has_ids:
        raise fail(
            "give exactly one of prompt_len or prompt_token_ids, got "
            + ("both" if has_length else "neither")
        )
    token_ids: list[int] | None = None
    if has_length:
        prompt_len = raw["prompt_len"]
        if type(prompt_len) is not int or not 1 <= prompt_len <= MAX_LENGTH:
            raise fail(f"prompt_len must be an integer between 1 and {MAX_LENGTH}, "
                       f"got {_show(prompt_len)}")
    else:
        token_ids = raw["prompt_token_ids"]
        if not isinstance(token_ids, list) or not token_ids:
            raise fail(f"prompt_token_ids must be a non-empty list of token ids, "
                       f"got {_show(token_ids)}")
        _check_integers(token_ids, "prompt_token_ids", MAX_LENGTH, fail)
        prompt_len = len(token_ids)

    group = raw.get("prefix_group")
    if "prefix_group" in raw and (type(group) is not str or not group or not _is_unicode(group)):
        raise fail(f"prefix_group must be a non-empty string, got {_show(group)}"
                   + _surrogate_hint(group))
    if "prefix_len" in raw and group is None and after is None:
        raise fail(
            "prefix_len needs prefix_group: name the group of requests that share these leading "
            "tokens, or drop prefix_len"
        )
    prefix_len = 0
    if after is not None:
        # The predecessor's history this prompt begins with; -1: all of it (`RequestChecker`
        # knows the history's length and checks both against it).
        prefix_len = raw.get("prefix_len", -1)
        if "prefix_len" in raw and (type(prefix_len) is not int
                                    or not 0 <= prefix_len <= prompt_len):
            raise fail(f"prefix_len must be an integer between 0 and the prompt length "
                       f"({prompt_len}): the tokens of the predecessor's history this prompt "
                       f"begins with, got {_show(prefix_len)}")
    elif group is not None:
        prefix_len = raw.get("prefix_len", prompt_len)
        if type(prefix_len) is not int or not 1 <= prefix_len <= prompt_len:
            raise fail(
                f"prefix_len must be an integer between 1 and the prompt length ({prompt_len}), "
                f"got {_show(prefix_len)}"
            )

    block_hashes = None
    if "block_hashes" in raw:
        block_hashes = _parse_block_hashes(raw, token_ids is not None, group, prompt_len,
                                           hash_block_size, fail)

    if "output_len" not in raw:
        raise fail("output_len is missing; give the exact number of tokens the request generates")
    output_len = raw["output_len"]
    if type(output_len) is not int or not 1 <= output_len <= MAX_LENGTH:
        raise fail(f"output_len must be an integer between 1 and {MAX_LENGTH}, "
                   f"got {_show(output_len)}")

    own = dict(_FIELD_DEFAULTS)  # the request's scheduling fields (zipage/request_fields.py)
    for field in request_fields.FIELDS:
        if field.name in raw:
            value = own[field.name] = raw[field.name]
            reason = field.reason(value)
            if reason is not None:
                raise fail(reason)

    reasoning_len = raw.get("reasoning_len", 0)
    if "reasoning_len" in raw and (type(reasoning_len) is not int
                                   or not 0 <= reasoning_len <= output_len):
        raise fail(f"reasoning_len must be an integer between 0 and output_len ({output_len}): "
                   f"the output tokens that are thinking, which the next turn does not see, "
                   f"got {_show(reasoning_len)}")

    return _validated_request(
        id=request_id,
        arrival_s=float(arrival),
        prompt_len=prompt_len,
        output_len=output_len,
        prompt_token_ids=token_ids,
        prefix_group=group,
        prefix_len=prefix_len,
        block_hashes=block_hashes,
        hash_block_size=hash_block_size if block_hashes is not None else 0,
        session=session,
        after=after,
        after_s=float(after_s),
        reasoning_len=reasoning_len,
        **own,
    )


def _plain_request(raw: dict) -> TraceRequest | None:
    """The commonest request, its four fields and no other, when each is valid (the rules of
    `_parse_request`, stricter on types: exact int and float, as JSON decodes them); else None,
    and `_parse_request` names what is wrong."""
    request_id, arrival = raw["id"], raw["arrival_s"]
    prompt_len, output_len = raw["prompt_len"], raw["output_len"]
    if (type(request_id) is str and request_id
            and (request_id.isascii() or _is_unicode(request_id))  # (no call for most ids)
            and (type(arrival) is float or type(arrival) is int) and 0 <= arrival <= MAX_ARRIVAL_S
            and type(prompt_len) is int and 1 <= prompt_len <= MAX_LENGTH
            and type(output_len) is int and 1 <= output_len <= MAX_LENGTH):
        return _validated_request(
            id=request_id, arrival_s=float(arrival), prompt_len=prompt_len,
            output_len=output_len, prompt_token_ids=None, prefix_group=None, prefix_len=0,
            block_hashes=None, hash_block_size=0, session=None, after=None,
            after_s=0.0, reasoning_len=0, **_FIELD_DEFAULTS)
    return None


def _parse_block_hashes(raw: dict, has_ids: bool, group: str | None, prompt_len: int,
                        hash_block_size: int, fail) -> tuple[int, ...]:
    if has_ids or group is not None:
        raise fail("block_hashes names the prompt's blocks itself; give it with prompt_len "
                   "alone (no prompt_token_ids, no prefix_group)")
    if not hash_block_size:
        raise fail('block_hashes needs the trace\'s hash_block_size: add "hash_block_size": '
                   "512 (the tokens one hash names) at the top level of the trace")
    hashes = raw["block_hashes"]
    expected = -(-prompt_len // hash_block_size)
    if not isinstance(hashes, list) or len(hashes) != expected:
        raise fail(f"block_hashes must be a list of {expected} block hashes (prompt_len "
                   f"{prompt_len} in blocks of {hash_block_size}), got {_show(hashes)}")
    _check_integers(hashes, "block_hashes", MAX_BLOCK_HASH, fail)
    return tuple(hashes)


def _check_integers(values: list, field: str, high: int, fail) -> None:
    for position, value in enumerate(values):
        if type(value) is not int or not 0 <= value <= high:
            raise fail(f"{field}[{position}] must be an integer between 0 and {high}, "
                       f"got {_show(value)}")


# A plain request's line exactly as `save_trace` writes it (its four fields in this order, no
# space, an id without escape or control character, numbers without sign or leading zero), found
# with the newline before it. The JSON decoder's values for such a line are its texts: the id's
# characters, and float() or int() of each number's literal (the decoder's own conversions).
_PLAIN_LINE = re.compile(
    r'\n\{"id":"([^"\\\x00-\x1f]+)",'
    r'"arrival_s":((?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?),'
    r'"prompt_len":([1-9][0-9]{0,9}),"output_len":([1-9][0-9]{0,9})\}(?=\n)')


def plain_requests(text: str) -> list[TraceRequest] | None:
    """The requests of `text` (whole request lines) when each line is a plain request's in the
    layout `save_trace` writes and valid on its own, as `_parse_request` makes them, without a
    JSON decoder's call; else None (the caller decodes the lines, which then says what is wrong).
    The commonest chunk of a production-shaped JSON Lines trace."""
    lines = "\n" + text if text.endswith("\n") else "\n" + text + "\n"
    rows = _PLAIN_LINE.findall(lines)
    if len(rows) != lines.count("\n") - 1:  # a line that is not one (each has one match at most)
        return None
    requests = []
    new = object.__new__
    for request_id, arrival, prompt_len, output_len in rows:
        arrival, prompt_len, output_len = float(arrival), int(prompt_len), int(output_len)
        if arrival > MAX_ARRIVAL_S or prompt_len > MAX_LENGTH or output_len > MAX_LENGTH:
            return None
        request = new(TraceRequest)  # `_validated_request`, inline: run once a request
        request.__dict__.update(
            id=request_id, arrival_s=arrival, prompt_len=prompt_len, output_len=output_len,
            prompt_token_ids=None, prefix_group=None, prefix_len=0,
            block_hashes=None, hash_block_size=0, session=None, after=None, after_s=0.0,
            reasoning_len=0, **_FIELD_DEFAULTS)
        requests.append(request)
    return requests


def _validated_request(**fields: Any) -> TraceRequest:
    # The frozen dataclass's __init__ sets each field through object.__setattr__, a third of the
    # load time at 10^6 requests. These values are validated, so the instance dict is filled
    # directly: the same frozen, equal object, three times faster to build.
    request = object.__new__(TraceRequest)
    request.__dict__.update(fields)
    return request


def _check_group_consistency(
    request: TraceRequest,
    group: str,
    index: int,
    longest_member: dict[str, tuple[int, TraceRequest]],
    source: str,
) -> None:
    # Comparing with the member of longest prefix seen so far is enough: that member agrees with
    # every earlier one on their shorter prefixes, so agreement is transitive.
    if group not in longest_member:
        longest_member[group] = (index, request)
        return
    reference_index, reference = longest_member[group]
    if (request.prompt_token_ids is None) != (reference.prompt_token_ids is None):
        raise _request_error(
            source, index, request.id,
            f"prefix_group {group!r} mixes prompt_token_ids and prompt_len (request "
            f"#{reference_index} uses the other); use one form for every member of a group",
        )
    if request.prompt_token_ids is not None and reference.prompt_token_ids is not None:
        shared = min(request.prefix_len, reference.prefix_len)
        for position in range(shared):
            if request.prompt_token_ids[position] != reference.prompt_token_ids[position]:
                raise _request_error(
                    source, index, request.id,
                    f"prompt_token_ids[{position}] differs from request #{reference_index} "
                    f"(id {reference.id!r}) inside their shared prefix of group {group!r} "
                    f"({shared} tokens); fix the ids or lower prefix_len",
                )
    if request.prefix_len > reference.prefix_len:
        longest_member[group] = (index, request)


def _request_to_json(request: TraceRequest) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": request.id}
    if request.after is None:
        obj["arrival_s"] = request.arrival_s
        if request.session is not None:
            obj["session"] = request.session
    else:
        obj["after"] = request.after
        if request.after_s:
            obj["after_s"] = request.after_s
    if request.prompt_token_ids is not None:
        obj["prompt_token_ids"] = list(request.prompt_token_ids)
    else:
        obj["prompt_len"] = request.prompt_len
    if request.prefix_group is not None:
        obj["prefix_group"] = request.prefix_group
    if request.prefix_group is not None or request.after is not None:
        obj["prefix_len"] = request.prefix_len
    if request.block_hashes is not None:
        obj["block_hashes"] = list(request.block_hashes)
    obj["output_len"] = request.output_len
    if request.reasoning_len:
        obj["reasoning_len"] = request.reasoning_len
    for field in request_fields.FIELDS:
        value = getattr(request, field.name)
        if value != field.default:
            obj[field.name] = value
    return obj


def _request_error(source: str, index: int, request_id: str | None, message: str) -> TraceError:
    label = (f"request #{index}" if request_id is None
             else f"request #{index} (id {_show(request_id)})")
    return TraceError(f"{source}: {label}: {message}")


# Values quoted in error messages are shortened (a 10 MB id or a 4000-digit number still gives
# one short line) and never recurse deeply (a list nested 900 levels).
_SHOWN = reprlib.Repr()
MAX_NAMED_FIELDS = 5  # unknown or duplicated keys named in one message
_SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 80, 40, 80
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 3, 8, 4


def _show(value: Any) -> str:
    return _SHOWN.repr(value)


def _is_unicode(text: str) -> bool:
    # JSON's \ud800 escapes decode to lone surrogates, which no file or terminal can encode.
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_hint(value: Any) -> str:
    if type(value) is not str or _is_unicode(value):
        return ""
    position = next(i for i, char in enumerate(value) if 0xD800 <= ord(char) <= 0xDFFF)
    return (f" (an unpaired surrogate \\u{ord(value[position]):04x} at character {position}, "
            f"half of a UTF-16 pair?)")


def _unknown_fields_message(unknown: list[str], allowed: tuple[str, ...]) -> str:
    hints = []
    for key in unknown[:MAX_NAMED_FIELDS]:
        close = difflib.get_close_matches(str(key), allowed, n=1)
        hints.append(f"{_show(key)} (did you mean {close[0]!r}?)" if close else _show(key))
    if len(unknown) > MAX_NAMED_FIELDS:
        hints.append(f"and {len(unknown) - MAX_NAMED_FIELDS} more")
    noun = "field" if len(unknown) == 1 else "fields"
    return f"unknown {noun} {', '.join(hints)}; allowed fields are {', '.join(allowed)}"


def _is_integer(value: Any) -> bool:
    # JSON true/false decode to bool, a subclass of int; a flag is never a valid count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    names = {
        dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"
    }
    return names.get(type(value), "a number")


# ---------------------------------------------------------------- JSON Lines requests

def read_requests(file: IO[bytes], source: str, hash_block_size: int,
                  ordered: bool) -> Iterator[TraceRequest]:
    """The requests on the lines after a JSON Lines header (`file` is past it), each checked as
    it is read; `ordered`: refuse one that arrives before the request above it."""
    checker = RequestChecker(source, hash_block_size)
    previous: tuple[int, TraceRequest] | None = None  # the last request not a follow-up
    lines_before = 1  # the header's
    for chunk in line_chunks(file, source, lines_before + 1, JSONL_CHUNK):
        text = utf8_text(chunk, source,
                         lambda offset: text_position(chunk, offset, lines_before))
        requests = plain_requests(text)
        if requests is not None and (
                not ordered or _in_order(previous and previous[1], requests)) \
                and checker.check_plain(requests):
            yield from requests
            previous = (checker.count - 1, requests[-1])
            lines_before += len(requests)  # one a line: a chunk of plain lines has no blank
        else:
            previous = yield from _checked(text, source, lines_before, checker, previous,
                                           ordered)
            lines_before += chunk.count(b"\n")
    if checker.count == 0:
        raise TraceError(EMPTY_TRACE.format(source=source))


def _checked(text: str, source: str, lines_before: int, checker: RequestChecker,
             previous: tuple[int, TraceRequest] | None,
             ordered: bool) -> Generator[TraceRequest, None, tuple[int, TraceRequest] | None]:
    """The requests of a chunk of lines that are not all plain, decoded in one call of the C
    parser (line by line where the chunk does not decode, so a mistake names its line), then
    checked one at a time, and when `ordered` against the one before for the arrival order (a
    follow-up has no arrival time of its own: only the others are in order); returns the last
    of those, with its index."""
    objects = _decode_jsonl_fast(text)
    if objects is None:
        objects = [_decode_json(line, f"{source}: line {number}")
                   for number, line in enumerate(text.split("\n"), lines_before + 1)
                   if line.strip()]
    for raw in objects:
        request = checker.check(raw)
        if request.after is not None:  # released by its predecessor, not at a time of its own
            yield request
            continue
        if ordered and previous is not None and request.arrival_s < previous[1].arrival_s:
            raise _request_error(
                source, checker.count - 1, request.id,
                f"arrival_s {_show(request.arrival_s)} is earlier than request "
                f"#{previous[0]}'s {_show(previous[1].arrival_s)}: a JSON Lines trace "
                "is read as it is replayed, so its requests must be in arrival order; sort "
                "its lines by arrival_s (or save it as .json, which is loaded whole)")
        previous = (checker.count - 1, request)
        yield request
    return previous


def _in_order(previous: TraceRequest | None, requests: list[TraceRequest]) -> bool:
    """Whether `requests` come in arrival order, after `previous`."""
    arrivals = [request.arrival_s for request in requests]
    return ((previous is None or previous.arrival_s <= arrivals[0])
            and all(map(operator.le, arrivals, arrivals[1:])))
