"""The streamed JSON Lines reader (zipage/trace_stream.py): it yields what the whole-file loader
loads, checks each request with the loader's messages as it reaches it, refuses requests out of
arrival order, and `zipage replay` simulates a stream to the same run as the loaded trace, with
a mistake late in the file still one line and exit status 2 (and no run directory left)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from zipage.cli.parser import main
from zipage.errors import TraceError
from zipage.trace import JSONL_CHUNK, load_trace, save_trace
from zipage.trace_stream import open_trace_stream

ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, requests: list[dict], header: dict | None = None) -> Path:
    lines = [json.dumps(header or {"version": 1, "name": "t"})]
    lines += [json.dumps(request) for request in requests]
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def requests(count: int, **extra) -> list[dict]:
    return [{"id": f"r{i}", "arrival_s": i * 0.25, "prompt_len": 300 + i, "output_len": 5,
             **extra} for i in range(count)]


@pytest.mark.parametrize("name", ["mixture.json", "online-mixture.json", "rag.json"])
def test_a_stream_yields_what_the_loader_loads(tmp_path, name):
    trace = load_trace(ROOT / "traces" / name)
    ordered = sorted(trace.requests, key=lambda request: request.arrival_s)
    path = tmp_path / "t.jsonl.gz"
    save_trace(type(trace)(trace.name, ordered), path)
    stream = open_trace_stream(path)
    assert stream is not None and stream.name == trace.name
    assert list(stream) == ordered
    assert list(stream) == ordered  # each iteration reads the file again


def test_chunks_split_lines_anywhere(tmp_path, monkeypatch):
    import zipage.trace_stream as module

    path = write_jsonl(tmp_path / "t.jsonl", requests(50))
    expected = load_trace(path).requests
    for size in (1, 7, 64, JSONL_CHUNK):  # a chunk ends inside a line, or holds no line end
        monkeypatch.setattr(module, "JSONL_CHUNK", size)
        assert list(open_trace_stream(path)) == expected


def test_blank_lines_and_no_final_newline(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [json.dumps({"version": 1})] + [json.dumps(r) for r in requests(3)]
    path.write_text(lines[0] + "\n\n" + lines[1] + "\n   \n" + lines[2] + "\n" + lines[3])
    assert [r.id for r in open_trace_stream(path)] == ["r0", "r1", "r2"]
    assert open_trace_stream(path).name == "t"  # no name: the file's stem, as the loader


def test_not_json_lines_is_left_to_the_loader(tmp_path):
    assert open_trace_stream(ROOT / "traces" / "tiny.json") is None
    assert open_trace_stream(ROOT / "tests" / "fixtures" / "traces" / "mooncake.jsonl") is None
    assert open_trace_stream(tmp_path / "missing.jsonl") is None


def test_a_bad_header_is_refused_on_opening(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", requests(2), {"version": 1, "name": 3})
    with pytest.raises(TraceError, match="name must be a non-empty string"):
        open_trace_stream(path)


@pytest.mark.parametrize("bad, message", [
    ({"output_len": 0}, r"request #3 \(id 'r3'\): output_len must be an integer"),
    ({"id": "r0"}, r"request #3 \(id 'r0'\): id duplicates request #0"),
    ({"arrival_s": 0.1}, r"request #3 \(id 'r3'\): arrival_s 0.1 is earlier than request "
                         r"#2's 0.5: .* must be in arrival order"),
])
def test_mistakes_are_found_where_the_reader_reaches_them(tmp_path, bad, message):
    rows = requests(5)
    rows[3].update(bad)
    stream = open_trace_stream(write_jsonl(tmp_path / "t.jsonl.gz", rows))
    seen = []
    with pytest.raises(TraceError, match=message):
        for request in stream:
            seen.append(request.id)
    assert seen == ["r0", "r1", "r2"]


def test_bytes_mistakes_name_their_line(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", requests(3))
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"r2"', b'"r\xe92"'))
    with pytest.raises(TraceError, match=r"byte 0xe9 at line 4 column \d+ is not valid UTF-8"):
        list(open_trace_stream(path))
    path.write_bytes(data + b'{"id": "r3", "arrival_s": 5,\n')
    with pytest.raises(TraceError, match="line 5: not valid JSON"):
        list(open_trace_stream(path))
    zipped = write_jsonl(tmp_path / "t.jsonl.gz", requests(3))
    zipped.write_bytes(zipped.read_bytes()[:-12])
    with pytest.raises(TraceError, match="a damaged gzip file"):
        list(open_trace_stream(zipped))


def test_a_header_alone_is_an_empty_trace(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [])
    with pytest.raises(TraceError, match="requests is empty"):
        list(open_trace_stream(path))


def test_replay_of_a_stream_is_the_replay_of_the_loaded_trace(tmp_path, capsys):
    trace = load_trace(ROOT / "traces" / "online-mixture.json")
    streamed, whole = tmp_path / "t.jsonl.gz", tmp_path / "t.json"
    save_trace(trace, whole)
    save_trace(type(trace)(trace.name, sorted(trace.requests, key=lambda r: r.arrival_s)),
               streamed)
    runs = {}
    for path in (streamed, whole):
        out = tmp_path / f"run-{path.name}"
        assert main(["replay", str(path), "--json", "--no-progress", "--out", str(out)]) == 0
        runs[path] = out
    capsys.readouterr()
    for name in ("steps.csv", "requests.csv", "decisions.log"):
        assert (runs[streamed] / name).read_bytes() == (runs[whole] / name).read_bytes(), name


def test_replay_stops_at_a_late_mistake_with_one_line(tmp_path, capsys):
    rows = requests(40)
    rows[35]["arrival_s"] = 0.0
    path = write_jsonl(tmp_path / "late.jsonl", rows)
    out = tmp_path / "run"
    status = main(["replay", str(path), "--no-progress", "--out", str(out)])
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    assert "request #35 (id 'r35'): arrival_s 0.0 is earlier" in lines[0]
    assert not out.exists()
