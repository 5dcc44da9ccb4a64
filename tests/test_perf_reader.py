"""The streamed reader's fast path for plain request lines (zipage.trace.plain_requests) against
the JSON decoder and `RequestChecker` it stands in for: a line it takes gives the request the
decoder and checker give, to the last bit of arrival_s; a line it does not take goes the full way,
so a stream yields the same requests, or stops at the same request with the same message, with
the fast path as without it. Requests are compared by repr, which shows every float exactly (and
tells 0.0 from -0.0, which == does not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import zipage.trace as trace_module
from zipage.errors import TraceError
from zipage.trace import RequestChecker, _decode_json, plain_requests
from zipage.trace_stream import open_trace_stream

HEADER = '{"version": 1, "name": "t"}'


def line(request_id: str = '"x"', arrival: str = "0.5", prompt_len: str = "1085",
         output_len: str = "168") -> str:
    """A request line in `save_trace`'s layout with these JSON texts as its values."""
    return (f'{{"id":{request_id},"arrival_s":{arrival},"prompt_len":{prompt_len},'
            f'"output_len":{output_len}}}')


def full_way(text: str) -> str:
    """What the decoder and checker make of one line: the request's repr, or the error."""
    try:
        return repr(RequestChecker("t", 0).check(_decode_json(text, "t")))
    except TraceError as error:
        return f"error: {error}"


# Lines the fast path takes: each must give what the full way gives.
PLAIN = [
    line(),
    line('"c0"', "0.0"),
    line('"ü€😀\u2028\x7f"'),  # raw non-ASCII, a line separator, DEL: JSON string characters
    line('"a,b:c}{[] \'"'),  # JSON's punctuation inside the id
    line(arrival="3"),  # an integer arrival is a float request
    line(arrival="0"),
    line(arrival="1000000000"),
    line(arrival="1e3"),
    line(arrival="1E+2"),
    line(arrival="5e-1"),
    line(arrival="0e0"),
    line(arrival="0.1000000000000000055511151231257827"),  # rounded once, the same way
    line(arrival="999999999.99999999999"),  # rounds to 1e9 exactly
    line(arrival="2.5e-324"),  # rounds to the smallest subnormal
    line(arrival="1e-400"),  # underflows to 0.0
    line(prompt_len="2147483647", output_len="1"),
]

# Lines the fast path leaves to the full way: escapes, other layouts, and every invalid value.
NOT_PLAIN = [
    line('"c\\u0030"'), line('"c\\"q"'), line('"a\\\\b"'), line('"\\ud800"'),
    line('"tab\there"'), line('""'), line("7"), line("null"),
    line(arrival="00.5"), line(arrival="01"), line(arrival="-0"), line(arrival="-0.0"),
    line(arrival="-1"), line(arrival=".5"), line(arrival="1."), line(arrival="1e"),
    line(arrival="1e400"), line(arrival="1000000000.5"), line(arrival="1000000001"),
    line(arrival="1" * 5000), line(arrival="NaN"), line(arrival="Infinity"), line(arrival='"1"'),
    line(arrival="true"),
    line(prompt_len="0"), line(prompt_len="0100"), line(prompt_len="2147483648"),
    line(prompt_len="9999999999"), line(prompt_len="99999999999"),
    line(prompt_len="1" * 5000), line(prompt_len="1085.0"),
    line(prompt_len="1e3"), line(prompt_len="-5"), line(output_len="0"),
    line(output_len="2147483648"), line(output_len="1" * 5000),
    line()[:-1] + ',"output_len":7}',  # a duplicated key
    line()[:-1] + ',"kv_budget":16}',  # a further field
    line()[:-1] + ',"prefix_group":"g","prefix_len":4}',
    '{"arrival_s":0.5,"id":"x","prompt_len":1085,"output_len":168}',  # another key order
    '{"id": "x", "arrival_s": 0.5, "prompt_len": 1085, "output_len": 168}',  # json.dumps' spaces
    " " + line(), line() + " ", line() + "\r", "\t" + line(), line().replace(",", " ,"),
    line()[:-1], line() + "}", "[" + line() + "]", line() + line(),
]


@pytest.mark.parametrize("text", PLAIN)
def test_a_plain_line_is_what_the_decoder_and_checker_make_of_it(text):
    requests = plain_requests(text + "\n")
    assert requests is not None, text
    assert [repr(request) for request in requests] == [full_way(text)]
    assert type(requests[0].arrival_s) is float
    assert plain_requests(text) is not None  # the last line of a file may lack its newline


@pytest.mark.parametrize("text", NOT_PLAIN)
def test_any_other_line_is_left_to_the_decoder(text):
    assert plain_requests(text + "\n") is None
    assert plain_requests(line() + "\n" + text + "\n" + line('"y"') + "\n") is None


def test_a_chunk_is_plain_only_when_every_line_is():
    lines = [line(f'"r{i}"', str(i)) for i in range(4)]
    assert [r.id for r in plain_requests("\n".join(lines) + "\n")] == ["r0", "r1", "r2", "r3"]
    for blank in ("", " "):  # a blank line: the full way skips it, and names the lines after
        assert plain_requests("\n".join(lines[:2] + [blank] + lines[2:]) + "\n") is None
    assert plain_requests("\n\n") is None


def read(path: Path, fast: bool, monkeypatch) -> tuple[list[str], str | None]:
    """The stream's requests (as reprs) and the message it stopped with, if any."""
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(trace_module, "plain_requests", lambda text: None)
        seen: list[str] = []
        try:
            for request in open_trace_stream(path):
                seen.append(repr(request))
        except TraceError as error:
            return seen, str(error)
        return seen, None


def write(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_text(HEADER + "\n" + "\n".join(lines) + end, encoding="utf-8")
    return path


def plain_lines(count: int, start: int = 0) -> list[str]:
    return [line(f'"r{i}"', f"{i * 0.25}", str(300 + i), "5") for i in range(start, start + count)]


@pytest.mark.parametrize("odd", PLAIN + NOT_PLAIN + [
    "", "   ", "not json", "{", "[]", "7",
    line('"r1"', "100"),  # an id seen before
    line('"new"', "0.0"),  # earlier than the request before it
    line('"new"', "1.0"),  # as early as the request before it: in order
])
@pytest.mark.parametrize("chunk", [1 << 22, 64])  # one chunk, or a chunk a line or two
def test_a_stream_reads_the_same_with_the_fast_path_as_without(tmp_path, monkeypatch, odd, chunk):
    monkeypatch.setattr(trace_module, "JSONL_CHUNK", chunk)
    path = write(tmp_path / "t.jsonl", plain_lines(5) + [odd] + plain_lines(5, start=400))
    assert read(path, True, monkeypatch) == read(path, False, monkeypatch)


def test_the_fast_path_reads_a_plain_trace(tmp_path, monkeypatch):
    calls = []

    def counted(text):
        calls.append(plain_requests(text))
        return calls[-1]

    path = write(tmp_path / "t.jsonl", plain_lines(50), end="")  # no final newline
    monkeypatch.setattr(trace_module, "plain_requests", counted)
    fast = [repr(request) for request in open_trace_stream(path)]
    assert calls and all(requests is not None for requests in calls)
    assert (fast, None) == read(path, False, monkeypatch)


@pytest.mark.parametrize("lines, message", [
    (plain_lines(3) + plain_lines(1, start=1), r"request #3 \(id 'r1'\): id duplicates request #1"),
    (plain_lines(3) + [line('"r9"', "0.1")], r"request #3 \(id 'r9'\): arrival_s 0.1 is earlier"),
    (plain_lines(3) + [line(prompt_len="2147483648")], r"request #3 \(id 'x'\): prompt_len must"),
])
def test_a_plain_chunk_with_a_mistake_stops_where_the_full_way_does(tmp_path, monkeypatch,
                                                                       lines, message):
    path = write(tmp_path / "t.jsonl", lines)
    seen, error = read(path, True, monkeypatch)
    assert len(seen) == 3 and error is not None
    with pytest.raises(TraceError, match=message):
        raise TraceError(error)


# Lines near the plain layout, built from JSON-ish pieces: a taken line is the full way's request.
ids = st.text(st.characters(codec="utf-8"), max_size=6).map(json.dumps) | st.text(
    st.characters(codec="utf-8", exclude_characters='"\\'), max_size=6).map(lambda s: f'"{s}"')
numbers = st.from_regex(r"\A-?[0-9]{1,4}(\.[0-9]{0,4})?([eE][-+]?[0-9]{1,4})?\Z", fullmatch=True)


@given(ids, numbers, numbers, numbers)
def test_a_taken_line_is_always_the_full_ways_request(request_id, arrival, prompt_len, output_len):
    text = line(request_id, arrival, prompt_len, output_len)
    requests = plain_requests(text + "\n")
    event("taken" if requests is not None else "left to the decoder")
    if requests is not None:
        assert [repr(request) for request in requests] == [full_way(text)]
