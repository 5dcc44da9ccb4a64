"""Fuzzing the trace loader: any input either loads or raises one `TraceError` line.

Hypothesis feeds `parse_trace_bytes` arbitrary bytes, valid traces with bytes flipped, inserted
or cut, arbitrary JSON values, and request-shaped objects whose fields hold arbitrary JSON values
(so the per-field checks, not only the top-level ones, are reached). Any other exception — a
traceback the user would see — fails the test. The example counts come from the hypothesis
profile (tests/conftest.py: `ci` is fixed and derandomized).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import event, given
from hypothesis import strategies as st

from zipage.errors import TraceError
from zipage.trace import MAX_ARRIVAL_S, MAX_LENGTH, REQUEST_FIELDS, Trace, parse_trace, parse_trace_bytes

SOURCE = "fuzz.json"

VALID = json.dumps({"version": 1, "name": "fuzz", "requests": [
    {"id": "a", "arrival_s": 0, "prompt_len": 40, "output_len": 8},
    {"id": "b", "arrival_s": 0.5, "prompt_len": 64, "prefix_group": "g", "prefix_len": 32,
     "output_len": 16},
    {"id": "c", "arrival_s": 1.0, "prompt_token_ids": [5, 6, 7], "output_len": 2},
]}).encode()

# Every code point, lone surrogates included (JSON can carry them as \ud800 escapes).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | any_text)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(any_text | st.sampled_from(REQUEST_FIELDS), children, max_size=5),
    max_leaves=12,
)
field_values = (json_values | st.integers(0, 2**40) | st.integers(2**31 - 2, 2**31 + 2)
                | st.just(2**63) | st.sampled_from(["a", "g", "\ud800", ""]))


def check_outcome(load) -> None:
    try:
        trace = load()
    except TraceError as error:
        message = str(error)
        assert message.startswith(f"{SOURCE}: ") and "\n" not in message, message
        assert len(message) < 1000, message
        event("TraceError")
        return
    event("loaded")
    # What loads is safe downstream: text that encodes (no lone surrogates) and bounded numbers.
    assert isinstance(trace, Trace) and trace.requests
    trace.name.encode("utf-8")
    for request in trace.requests:
        request.id.encode("utf-8")
        (request.prefix_group or "").encode("utf-8")
        assert 0 <= request.arrival_s <= MAX_ARRIVAL_S
        assert 1 <= request.prompt_len <= MAX_LENGTH and 1 <= request.output_len <= MAX_LENGTH
        assert all(0 <= token <= MAX_LENGTH for token in request.prompt_token_ids or [])
        assert request.kv_budget is None or 1 <= request.kv_budget <= MAX_LENGTH


@given(st.binary(max_size=300))
def test_arbitrary_bytes(data: bytes) -> None:
    check_outcome(lambda: parse_trace_bytes(data, source=SOURCE))


@given(st.lists(st.tuples(st.integers(0, len(VALID)), st.sampled_from(["flip", "insert", "cut"]),
                          st.binary(min_size=1, max_size=4)), min_size=1, max_size=4))
def test_valid_trace_with_damaged_bytes(edits: list[tuple[int, str, bytes]]) -> None:
    data = bytearray(VALID)
    for position, kind, chunk in edits:
        position = min(position, len(data))
        if kind == "flip":
            data[position:position + len(chunk)] = chunk
        elif kind == "insert":
            data[position:position] = chunk
        else:
            del data[position:position + len(chunk)]
    check_outcome(lambda: parse_trace_bytes(bytes(data), source=SOURCE))


@given(json_values)
def test_arbitrary_json_values(value: Any) -> None:
    data = json.dumps(value).encode()
    check_outcome(lambda: parse_trace_bytes(data, source=SOURCE))
    check_outcome(lambda: parse_trace(value, source=SOURCE))


def mostly(valid: st.SearchStrategy[Any],
           hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # One field in ten is hostile, so many whole traces are valid and the checks on what loads
    # (encodable ids, bounded numbers) are exercised as well as the error paths.
    return st.integers(0, 9).flatmap(lambda pick: hostile if pick == 0 else valid)


lengths = mostly(st.integers(1, 5000), field_values)
# Ids are well-formed text three times in four and otherwise hold a lone surrogate: the loader
# must refuse what no file or terminal could encode.
ids = st.one_of(st.text(min_size=1, max_size=6), st.text(min_size=1, max_size=6),
                st.text(min_size=1, max_size=6), st.sampled_from(["\ud800", "q\udbff7"]))
token_lists = mostly(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5), field_values)


@st.composite
def request_objects(draw: st.DrawFn) -> dict[str, Any]:
    request = {"id": draw(mostly(ids, field_values)),
               "arrival_s": draw(mostly(st.floats(0, 1e3) | st.integers(0, 10**9),
                                        field_values))}
    # Usually exactly one prompt form (a valid request), sometimes both or neither.
    forms = draw(mostly(st.sampled_from([("prompt_len",), ("prompt_token_ids",)]),
                        st.sampled_from([(), ("prompt_len", "prompt_token_ids")])))
    for form in forms:
        request[form] = draw(lengths if form == "prompt_len" else token_lists)
    if draw(st.booleans()):
        request["prefix_group"] = draw(mostly(st.sampled_from(["g", "h", "\udfff"]),
                                              field_values))
        if draw(st.booleans()):
            request["prefix_len"] = draw(mostly(st.integers(1, 3), field_values))
    request["output_len"] = draw(lengths)
    if draw(st.booleans()):
        request["kv_budget"] = draw(lengths)
    return request


@given(st.lists(request_objects(), min_size=1, max_size=4), st.sampled_from(["json", "object"]))
def test_request_objects_with_hostile_fields(requests: list[dict[str, Any]], route: str) -> None:
    obj = {"version": 1, "requests": requests}
    if route == "json":
        data = json.dumps(obj).encode()
        check_outcome(lambda: parse_trace_bytes(data, source=SOURCE))
    else:
        check_outcome(lambda: parse_trace(obj, source=SOURCE))
