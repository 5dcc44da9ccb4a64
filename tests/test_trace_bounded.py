"""Reading any trace or production file holds bounded memory (docs/traces.md, "Bounded reading").

A damaged or hostile file — a gzip bomb inflating to one endless line, a JSON document of a
gigabyte, a row that never ends — is refused in one line naming the file and the line, after at
most the reader's bound of it is read; `zipage replay` and `zipage trace import` print that line
and exit 2. An import keeps a few numbers a row, not the rows' text, and writes its requests as it
makes them, so its memory follows the row count at a few tens of bytes a row; a replay of a
production file makes them as the simulator asks. A save writes beside its output under a name of
its own, so a failed one leaves nothing, and a pipe is fed in place. The bombs here are
concatenated gzip members (one compressed piece repeated): a few hundred KB on disk, built in
milliseconds, inflating to far more than any bound.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import tracemalloc
from pathlib import Path

import pytest

import zipage.production_rows as production_rows
import zipage.trace as trace_module
from zipage.cli.parser import main
from zipage.core.deployment import iter_trace_sequences
from zipage.errors import TraceError
from zipage.trace import (
    MAX_JSON_TRACE_BYTES,
    MAX_LINE_BYTES,
    load_trace,
    parse_trace_bytes,
    save_trace,
    save_trace_stream,
)
from zipage.trace_import import ImportOptions, import_trace, import_trace_file, stream_trace_file
from zipage.trace_stream import open_trace_stream

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "traces"
MIB = 1 << 20
HEADER = b'{"version": 1, "name": "bomb"}\n'
AZURE_HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"


def bomb(path: Path, head: bytes, filler: bytes, mib: int, tail: bytes = b"") -> Path:
    """A gzip file of `head`, then `mib` MiB of `filler` repeated, then `tail`, without ever
    holding the inflated bytes: gzip members concatenated inflate to their contents joined."""
    piece = gzip.compress(filler * (MIB // len(filler)), compresslevel=9, mtime=0)
    path.write_bytes(gzip.compress(head, mtime=0) + piece * mib + gzip.compress(tail, mtime=0))
    return path


@pytest.fixture
def reads_at_most(monkeypatch):
    """Fail the test once more than `limit` inflated bytes are read from any gzip file: a reader
    that goes on past its bound is caught at once instead of running out of memory or time."""
    def install(limit: int) -> None:
        total = [0]
        for method in ("read", "readline"):
            original = getattr(gzip.GzipFile, method)

            def counted(self, *args, _original=original):
                data = _original(self, *args)
                total[0] += len(data)
                assert total[0] <= limit, f"read {total[0]:,} inflated bytes, past {limit:,}"
                return data

            monkeypatch.setattr(gzip.GzipFile, method, counted)
    return install


def peak_bytes(work) -> int:
    """The most memory Python held while `work()` ran (tracemalloc's peak)."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def refusal(work) -> str:
    with pytest.raises(TraceError) as caught:
        work()
    message = str(caught.value)
    assert "\n" not in message and len(message) < 600, message
    return message


def one_error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zipage: error: "), captured.err
    return lines[0]


LINE_TOO_LONG = f"is longer than {MAX_LINE_BYTES >> 20} MiB, the most one line of a trace may hold"


# ---------------------------------------------------------------- one endless line


def test_a_gzip_bomb_line_is_refused_at_the_line_bound_in_bounded_memory(tmp_path,
                                                                        reads_at_most):
    path = bomb(tmp_path / "bomb.jsonl.gz", HEADER, b"a", 64)
    reads_at_most(MAX_LINE_BYTES + 8 * MIB)
    messages = []
    peak = peak_bytes(lambda: messages.append(refusal(lambda: load_trace(path))))
    assert peak < MAX_LINE_BYTES + 24 * MIB
    (message,) = messages
    assert message.startswith(f"{path}: line 2 {LINE_TOO_LONG}") and "one request a line" in message


def test_a_stream_stops_at_the_line_bound_instead_of_rejoining_its_tail(tmp_path,
                                                                        reads_at_most):
    # An endless line (a gigabyte here) was re-joined with every read, for ever; now the reader
    # holds the line's pieces and gives up at the bound.
    path = bomb(tmp_path / "bomb.jsonl.gz", HEADER, b"a", 1024)
    reads_at_most(MAX_LINE_BYTES + 8 * MIB)
    stream = open_trace_stream(path)
    assert stream is not None
    assert refusal(lambda: list(stream)).startswith(f"{path}: line 2 {LINE_TOO_LONG}")


def test_the_line_bound_names_the_line_after_ordinary_ones(tmp_path, reads_at_most):
    ordinary = b"".join(json.dumps({"id": f"r{i}", "arrival_s": i, "prompt_len": 3,
                                    "output_len": 2}).encode() + b"\n" for i in range(3))
    path = bomb(tmp_path / "late.jsonl.gz", HEADER + ordinary, b"a", 1024)
    reads_at_most(MAX_LINE_BYTES + 8 * MIB)
    assert f"line 5 {LINE_TOO_LONG}" in refusal(lambda: list(open_trace_stream(path)))


def test_a_line_at_the_bound_loads(tmp_path):
    # A request that lists its prompt's token ids is the longest legitimate line: 2^20 tokens
    # of 6-digit ids (~7 MB) still load.
    ids = list(range(100_000, 100_000 + (1 << 20)))
    line = json.dumps({"id": "long", "arrival_s": 0, "prompt_token_ids": ids, "output_len": 1})
    assert 4 * MIB < len(line) < MAX_LINE_BYTES
    path = tmp_path / "long.jsonl"
    path.write_text(HEADER.decode() + line + "\n")
    (request,) = load_trace(path).requests
    assert request.prompt_len == 1 << 20


def test_replay_and_import_refuse_a_bomb_in_one_line(tmp_path, capsys, reads_at_most):
    reads_at_most(2 * (MAX_LINE_BYTES + 8 * MIB))  # two commands, each stopped at the bound
    jsonl = bomb(tmp_path / "bomb.jsonl.gz", HEADER, b"a", 64)
    line = one_error_line(capsys, ["replay", str(jsonl), "--json", "--no-progress"])
    assert f"{jsonl}: line 2 {LINE_TOO_LONG}" in line
    csv = bomb(tmp_path / "bomb.csv.gz", AZURE_HEADER, b"7", 64)
    line = one_error_line(capsys, ["trace", "import", "azure", str(csv), "-o",
                                   str(tmp_path / "out.jsonl.gz")])
    assert f"{csv}: line 2 {LINE_TOO_LONG}" in line
    assert not (tmp_path / "out.jsonl.gz").exists()


# ---------------------------------------------------------------- the JSON document


def test_a_json_document_past_its_bound_is_refused_before_it_is_parsed(tmp_path,
                                                                       reads_at_most):
    head = b'{"version": 1, "requests": [{"id": "a", "arrival_s": 0, "prompt_len": 1, ' \
           b'"output_len": 1}], "name": "'
    path = bomb(tmp_path / "one-line.json.gz", head, b"n", 96, tail=b'"}')
    reads_at_most(MAX_JSON_TRACE_BYTES + 8 * MIB)
    message = refusal(lambda: load_trace(path))
    assert message.startswith(f"{path}: over {MAX_JSON_TRACE_BYTES >> 20} MiB as one JSON "
                              f"document, the most a JSON trace may be")
    assert "JSON Lines" in message and ".jsonl.gz" in message


def test_the_json_bound_holds_for_plain_files_and_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_module, "MAX_JSON_TRACE_BYTES", 4096)
    small = ROOT / "traces" / "tiny.json"  # 1.5 KB: loads
    assert len(load_trace(small).requests) == 18
    big = ROOT / "traces" / "rag.json"  # 12 KB: past the lowered bound
    assert "as one JSON document" in refusal(lambda: load_trace(big))
    assert "as one JSON document" in refusal(lambda: parse_trace_bytes(big.read_bytes()))


def test_save_refuses_a_json_file_the_loader_would_refuse(tmp_path, monkeypatch):
    trace = load_trace(ROOT / "traces" / "rag.json")
    monkeypatch.setattr(trace_module, "MAX_JSON_TRACE_BYTES", 4096)
    message = refusal(lambda: save_trace(trace, tmp_path / "rag.json"))
    assert message.startswith(f"{tmp_path / 'rag.json'}: over 4,096 bytes as one JSON document")
    assert ".jsonl" in message
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
    save_trace(trace, tmp_path / "rag.jsonl")  # JSON Lines has no such bound
    assert load_trace(tmp_path / "rag.jsonl").requests == trace.requests


# ---------------------------------------------------------------- streamed writing


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".jsonl.gz", ".json.gz"])
@pytest.mark.parametrize("source", ["mixture.json", "mooncake"])
def test_a_streamed_save_writes_the_bytes_save_trace_writes(tmp_path, suffix, source):
    if source == "mooncake":
        trace, _ = import_trace("mooncake", FIXTURES / "mooncake.jsonl")
        block = 512
    else:
        trace, block = load_trace(ROOT / "traces" / source), 0
    whole, streamed = tmp_path / f"whole{suffix}", tmp_path / f"streamed{suffix}"
    save_trace(trace, whole)
    assert save_trace_stream(iter(trace.requests), streamed, trace.name, block) == len(
        trace.requests)
    assert streamed.read_bytes() == whole.read_bytes()


def test_a_streamed_save_checks_each_request_and_leaves_nothing_behind(tmp_path):
    trace = load_trace(ROOT / "traces" / "tiny.json")
    bad = [*trace.requests[:5], type(trace.requests[0])(id="x", arrival_s=2e9, prompt_len=1,
                                                        output_len=1)]
    message = refusal(lambda: save_trace_stream(iter(bad), tmp_path / "t.jsonl", "t"))
    assert "request #5 (id 'x'): arrival_s must be a number between 0 and" in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["t.jsonl", "t.json.gz"])
def test_a_failed_save_leaves_nothing_beside_its_output(tmp_path, name):
    # What was there stays as it was: the old output, and another writer's file under the name
    # a fixed staging scheme would pick.
    before = {name: b"the old trace", f"{name}.partial": b"another writer's"}
    for file, data in before.items():
        (tmp_path / file).write_bytes(data)
    trace = load_trace(ROOT / "traces" / "tiny.json")
    bad = [*trace.requests[:5], type(trace.requests[0])(id="x", arrival_s=2e9, prompt_len=1,
                                                        output_len=1)]
    refusal(lambda: save_trace_stream(iter(bad), tmp_path / name, "t"))
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_a_save_feeds_a_pipe_in_place_and_writes_through_a_link(tmp_path):
    trace = load_trace(ROOT / "traces" / "tiny.json")
    expected = tmp_path / "expected.jsonl"
    save_trace(trace, expected)
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # open first, so the writer never waits
    try:
        save_trace(trace, pipe)  # a few KB: within the pipe's buffer
        fed = os.read(reader, 1 << 20)
    finally:
        os.close(reader)
    assert fed == expected.read_bytes() and stat.S_ISFIFO(pipe.lstat().st_mode)
    target, link = tmp_path / "target.jsonl", tmp_path / "link.jsonl"
    link.symlink_to(target.name)
    save_trace(trace, link)
    assert link.is_symlink() and target.read_bytes() == expected.read_bytes()
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "expected.jsonl", "link.jsonl", "pipe.jsonl", "target.jsonl"]


# ---------------------------------------------------------------- imports


def azure_csv(path: Path, rows: int) -> Path:
    with path.open("w") as file:
        file.write(AZURE_HEADER.decode())
        for row in range(rows):
            seconds, micros = divmod(row * 37_000, 1_000_000)
            minutes, seconds = divmod(seconds, 60)
            file.write(f"2024-05-10 00:{minutes:02d}:{seconds:02d}.{micros:06d}+00:00,"
                       f"{100 + row % 3000},{1 + row % 400}\n")
    return path


def test_an_import_holds_a_few_numbers_a_row(tmp_path, capsys, monkeypatch):
    # Small chunks of lines, so what is measured is what the import keeps a row.
    monkeypatch.setattr(production_rows, "JSONL_CHUNK", 1 << 16)
    rows = 15_000
    source = azure_csv(tmp_path / "azure.csv", rows)
    out = tmp_path / "azure.jsonl.gz"
    peak = peak_bytes(lambda: main(["trace", "import", "azure", str(source), "-o", str(out)]))
    assert f"{rows:,} rows read, {rows:,} requests imported" in capsys.readouterr().out
    # ~900 bytes a row when the whole text and a record a row were held; ~60 now (the columns,
    # the sort order, the sample draws, the statistics), plus ~3 MB however many rows.
    assert peak < rows * 100 + 4 * MIB, f"{peak / rows:.0f} bytes a row"
    assert [r.id for r in load_trace(out).requests[:2]] == ["azure-0", "azure-1"]


def test_a_replayed_production_file_holds_a_few_numbers_a_row(tmp_path, monkeypatch):
    # What the simulator holds of the trace: the rows' numbers, each request made on arrival.
    monkeypatch.setattr(production_rows, "JSONL_CHUNK", 1 << 16)
    rows = 20_000
    source = azure_csv(tmp_path / "azure.csv", rows)

    def replay_the_trace() -> None:
        for _ in iter_trace_sequences(stream_trace_file(source), 32_000, need_tokens=False,
                                      in_arrival_order=True):
            pass

    # Loaded whole, the requests take ~350 bytes a row; streamed, ~32 (three numbers, the order).
    peak = peak_bytes(replay_the_trace)
    assert peak < rows * 60 + MIB, f"{peak / rows:.0f} bytes a row"


def test_an_import_writes_what_import_trace_makes(tmp_path):
    options = ImportOptions(window=(1.0, 3600.0), speedup=2.0, sample=0.7, seed=5)
    for fmt, name in [("azure", "azure_conv_2023_excerpt.csv"), ("mooncake", "mooncake.jsonl"),
                      ("burstgpt", "burstgpt.csv")]:
        trace, report = import_trace(fmt, FIXTURES / name, options)
        out = tmp_path / f"{fmt}.jsonl"
        streamed = import_trace_file(fmt, FIXTURES / name, out, options)
        assert load_trace(out).requests == trace.requests
        assert streamed.lines() == report.lines()


@pytest.mark.parametrize("fmt, header, row", [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens", "2024-05-10 00:00:00,5,7,9"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens, Timestamp", "3,ChatGPT,5,7,9"),
])
def test_a_column_named_twice_is_refused(tmp_path, capsys, fmt, header, row):
    # It was read as its last value, silently: 9 here, or a timestamp of 9 s.
    path = tmp_path / "twice.csv"
    path.write_text(f"{header}\n{row}\n")
    column = header.split(",")[-1].strip()
    message = refusal(lambda: import_trace(fmt, path))
    assert message.startswith(f"{path}: line 1: column {column} is named 2 times in the header")
    line = one_error_line(capsys, ["trace", "import", fmt, str(path), "-o",
                                   str(tmp_path / "out.jsonl")])
    assert f"column {column} is named 2 times" in line


def test_a_column_the_import_ignores_may_repeat(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Model\n3,a,5,7,b\n")
    trace, _ = import_trace("burstgpt", path)
    assert [(r.prompt_len, r.output_len) for r in trace.requests] == [(5, 7)]


@pytest.mark.parametrize("content, expected", [
    (AZURE_HEADER + b"2024-05-10 00:00:00,5,\xe97\n",
     "line 2 column 23: byte 0xe9 is not UTF-8 text"),
    (AZURE_HEADER + b'2024-05-10 00:00:00,"5' + b"9" * 200_000 + b'",7\n',
     "line 2: not a CSV row: field larger than field limit"),
])
def test_unreadable_rows_are_one_line(tmp_path, content, expected):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    assert expected in refusal(lambda: import_trace("azure", path))


def test_a_damaged_gzip_body_is_one_line(tmp_path):
    trace = load_trace(ROOT / "traces" / "tiny.json")
    path = tmp_path / "t.jsonl.gz"
    save_trace(trace, path)
    data = bytearray(path.read_bytes())
    data[30:40] = b"\xff" * 10  # inside the deflate stream: zlib's own error, not a gzip one
    path.write_bytes(bytes(data))
    assert "a damaged gzip file" in refusal(lambda: load_trace(path))
    assert "a damaged gzip file" in refusal(lambda: parse_trace_bytes(bytes(data)))
