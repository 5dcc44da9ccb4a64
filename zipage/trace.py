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
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from zipage.errors import ConfigError, TraceError

TRACE_VERSION = 1

TRACE_FIELDS = ("version", "name", "requests")
REQUEST_FIELDS = (
    "id",
    "arrival_s",
    "prompt_len",
    "prompt_token_ids",
    "prefix_group",
    "prefix_len",
    "output_len",
)

# Synthetic ids avoid the low range, where tokenizers keep special and control tokens, and stay
# below 32000 so one trace yields the same ids for every model with a vocabulary of at least 32000.
SYNTHETIC_TOKEN_LOW = 100
SYNTHETIC_TOKEN_HIGH = 32000
DEFAULT_VOCAB_SIZE = 32000

ARRIVAL_PATTERNS = ("poisson", "bursty")
# Arrival times are rounded so stamped traces stay compact; a microsecond is far below a step.
ARRIVAL_DECIMALS = 6


@dataclass(frozen=True)
class TraceRequest:
    """One request: when it arrives, what it reads, and exactly how many tokens it generates.

    `prompt_len` is always set (it is `len(prompt_token_ids)` when ids are given). Requests of the
    same `prefix_group` share their first `prefix_len` tokens; `prefix_len` is 0 without a group.
    """

    id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    prefix_group: str | None = None
    prefix_len: int = 0


@dataclass(frozen=True)
class Trace:
    """A named list of requests; list order breaks ties between equal arrival times (FCFS)."""

    name: str
    requests: list[TraceRequest]


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace file; a missing `name` defaults to the file's stem."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        reason = error.strerror or error
        raise TraceError(f"{source}: cannot read the trace file: {reason}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceError(
            f"{source}: not valid JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
    return parse_trace(obj, source=source, default_name=Path(path).stem)


def parse_trace(obj: Any, source: str = "<trace>", default_name: str | None = None) -> Trace:
    """Validate a decoded trace object; `source` names it in error messages."""
    if not isinstance(obj, dict):
        raise TraceError(
            f"{source}: a trace must be a JSON object with keys {', '.join(TRACE_FIELDS)}, "
            f"got {_json_type(obj)}"
        )
    unknown = [key for key in obj if key not in TRACE_FIELDS]
    if unknown:
        raise TraceError(f"{source}: {_unknown_fields_message(unknown, TRACE_FIELDS)}")
    if "version" not in obj:
        raise TraceError(f'{source}: version is missing; add "version": {TRACE_VERSION}')
    version = obj["version"]
    if not _is_integer(version) or version != TRACE_VERSION:
        raise TraceError(
            f"{source}: version must be {TRACE_VERSION} (the trace schema this Zipage reads), "
            f"got {version!r}"
        )
    name = obj.get("name", default_name if default_name is not None else source)
    if not isinstance(name, str) or not name:
        raise TraceError(f"{source}: name must be a non-empty string, got {name!r}")
    if "requests" not in obj:
        raise TraceError(f"{source}: requests is missing; add a non-empty list of request objects")
    requests = obj["requests"]
    if not isinstance(requests, list):
        raise TraceError(
            f"{source}: requests must be a non-empty list of request objects, "
            f"got {_json_type(requests)}"
        )
    if not requests:
        raise TraceError(f"{source}: requests is empty; a trace needs at least one request")
    parsed: list[TraceRequest] = []
    index_of_id: dict[str, int] = {}
    longest_member: dict[str, int] = {}
    for index, raw in enumerate(requests):
        request = _parse_request(raw, index, source)
        if request.id in index_of_id:
            raise _request_error(
                source, index, request.id,
                f"id duplicates request #{index_of_id[request.id]}; ids must be unique",
            )
        index_of_id[request.id] = index
        if request.prefix_group is not None:
            _check_group_consistency(
                request, request.prefix_group, index, parsed, longest_member, source
            )
        parsed.append(request)
    return Trace(name=name, requests=parsed)


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write `trace` with one request per line; it is validated first, so no bad file is written."""
    request_objects = [_request_to_json(request) for request in trace.requests]
    parse_trace(
        {"version": TRACE_VERSION, "name": trace.name, "requests": request_objects},
        source=str(path),
    )
    header = json.dumps({"version": TRACE_VERSION, "name": trace.name})[:-1]
    lines = [json.dumps(request, separators=(",", ":")) for request in request_objects]
    text = header + ', "requests": [\n' + ",\n".join(lines) + "\n]}\n"
    Path(path).write_text(text, encoding="utf-8")


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
    shared = request.prefix_len if request.prefix_group is not None else 0
    tokens: list[int] = []
    if shared:
        tokens = _token_stream("prefix_group", request.prefix_group, shared, high)
    return tokens + _token_stream("request", request.id, request.prompt_len - shared, high)


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
    num_requests = len(trace.requests)
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
    return Trace(
        name=trace.name,
        requests=[
            dataclasses.replace(request, arrival_s=round(float(arrival), ARRIVAL_DECIMALS))
            for request, arrival in zip(trace.requests, arrivals)
        ],
    )


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that is the same in every process and on every machine.

    Python's hash() is salted per process, so seeds derived from names use xxh64 instead.
    """
    return xxhash.xxh64_intdigest(text.encode("utf-8"))


def _token_stream(namespace: str, key: str, count: int, high: int) -> list[int]:
    # The namespace keeps a group and a request that happen to share a name from sharing tokens.
    generator = np.random.default_rng(stable_hash(f"{namespace}\0{key}"))
    return generator.integers(SYNTHETIC_TOKEN_LOW, high, size=count).tolist()


def _parse_request(raw: Any, index: int, source: str) -> TraceRequest:
    if not isinstance(raw, dict):
        raise _request_error(source, index, None, f"must be a JSON object, got {_json_type(raw)}")
    request_id = raw.get("id")
    label_id = request_id if isinstance(request_id, str) else None
    unknown = [key for key in raw if key not in REQUEST_FIELDS]
    if unknown:
        message = _unknown_fields_message(unknown, REQUEST_FIELDS)
        raise _request_error(source, index, label_id, message)
    if "id" not in raw:
        raise _request_error(
            source, index, None, "id is missing; give every request a unique string id"
        )
    if not isinstance(request_id, str) or not request_id:
        raise _request_error(
            source, index, None, f"id must be a non-empty string, got {request_id!r}"
        )

    def fail(message: str) -> TraceError:
        return _request_error(source, index, request_id, message)

    if "arrival_s" not in raw:
        raise fail(
            "arrival_s is missing; give the arrival time in seconds (0 for offline workloads)"
        )
    arrival = raw["arrival_s"]
    if not _is_number(arrival) or not math.isfinite(arrival) or arrival < 0:
        raise fail(
            f"arrival_s must be a finite number >= 0 (seconds from the trace start), "
            f"got {arrival!r}"
        )

    has_length, has_ids = "prompt_len" in raw, "prompt_token_ids" in raw
    if has_length == has_ids:
        raise fail(
            "give exactly one of prompt_len or prompt_token_ids, got "
            + ("both" if has_length else "neither")
        )
    token_ids: list[int] | None = None
    if has_length:
        prompt_len = raw["prompt_len"]
        if not _is_integer(prompt_len) or prompt_len < 1:
            raise fail(f"prompt_len must be an integer >= 1, got {prompt_len!r}")
    else:
        token_ids = raw["prompt_token_ids"]
        if not isinstance(token_ids, list) or not token_ids:
            raise fail(f"prompt_token_ids must be a non-empty list of token ids, got {token_ids!r}")
        for position, token in enumerate(token_ids):
            if not _is_integer(token) or token < 0:
                raise fail(f"prompt_token_ids[{position}] must be an integer >= 0, got {token!r}")
        prompt_len = len(token_ids)

    group = raw.get("prefix_group")
    if "prefix_group" in raw and (not isinstance(group, str) or not group):
        raise fail(f"prefix_group must be a non-empty string, got {group!r}")
    if "prefix_len" in raw and group is None:
        raise fail(
            "prefix_len needs prefix_group: name the group of requests that share these leading "
            "tokens, or drop prefix_len"
        )
    prefix_len = 0
    if group is not None:
        prefix_len = raw.get("prefix_len", prompt_len)
        if not _is_integer(prefix_len) or not 1 <= prefix_len <= prompt_len:
            raise fail(
                f"prefix_len must be an integer between 1 and the prompt length ({prompt_len}), "
                f"got {prefix_len!r}"
            )

    if "output_len" not in raw:
        raise fail("output_len is missing; give the exact number of tokens the request generates")
    output_len = raw["output_len"]
    if not _is_integer(output_len) or output_len < 1:
        raise fail(f"output_len must be an integer >= 1, got {output_len!r}")

    return TraceRequest(
        id=request_id,
        arrival_s=float(arrival),
        prompt_len=prompt_len,
        output_len=output_len,
        prompt_token_ids=token_ids,
        prefix_group=group,
        prefix_len=prefix_len,
    )


def _check_group_consistency(
    request: TraceRequest,
    group: str,
    index: int,
    parsed: list[TraceRequest],
    longest_member: dict[str, int],
    source: str,
) -> None:
    # Comparing with the member of longest prefix seen so far is enough: that member agrees with
    # every earlier one on their shorter prefixes, so agreement is transitive.
    if group not in longest_member:
        longest_member[group] = index
        return
    reference_index = longest_member[group]
    reference = parsed[reference_index]
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
        longest_member[group] = index


def _request_to_json(request: TraceRequest) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": request.id, "arrival_s": request.arrival_s}
    if request.prompt_token_ids is not None:
        obj["prompt_token_ids"] = list(request.prompt_token_ids)
    else:
        obj["prompt_len"] = request.prompt_len
    if request.prefix_group is not None:
        obj["prefix_group"] = request.prefix_group
        obj["prefix_len"] = request.prefix_len
    obj["output_len"] = request.output_len
    return obj


def _request_error(source: str, index: int, request_id: str | None, message: str) -> TraceError:
    label = f"request #{index}" if request_id is None else f"request #{index} (id {request_id!r})"
    return TraceError(f"{source}: {label}: {message}")


def _unknown_fields_message(unknown: list[str], allowed: tuple[str, ...]) -> str:
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), allowed, n=1)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
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
