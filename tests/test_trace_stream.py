"""The streamed JSON Lines reader (zipage/trace_stream.py): it yields what the whole-file loader
loads, checks each request with the loader's messages as it reaches it, refuses requests out of
arrival order, and `zipage replay` simulates a stream to the same run as the loaded trace, with
a mistake late in the file still one line and exit status 2 (and no run directory left). A
production file given to `zipage replay` is streamed too, to the same run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import zipage.sim.simulate as simulate_module
from zipage.cli.parser import main
from zipage.errors import TraceError
from zipage.trace import JSONL_CHUNK, Trace, load_trace, save_trace
from zipage.trace_import import import_trace, load_trace_file, stream_trace_file
from zipage.trace_stream import TraceStream, open_trace_stream

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "traces"


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
    import zipage.trace as module  # (the JSON Lines reader both the loader and a stream use)

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
    for name in ("steps.csv", "requests.csv", "decisions.log.gz"):
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


# ---------------------------------------------------------------- production files

PRODUCTION = [("azure", "azure_conv_2023_excerpt.csv"), ("azure", "azure_code_2024.csv"),
              ("burstgpt", "burstgpt.csv"), ("mooncake", "mooncake.jsonl")]


def gzipped(tmp_path: Path, name: str, reverse_rows: bool = False) -> Path:
    """A gzipped copy of a fixture, its data rows reversed if asked (out of time order)."""
    lines = (FIXTURES / name).read_bytes().splitlines(keepends=True)
    if reverse_rows:
        lines = lines[:1] + lines[:0:-1] if name.endswith(".csv") else lines[::-1]
    path = tmp_path / f"{name}.gz"
    path.write_bytes(gzip.compress(b"".join(lines)))
    return path


@pytest.mark.parametrize("fmt, name", PRODUCTION)
@pytest.mark.parametrize("compressed", [False, True])
def test_a_production_file_streams_its_requests_in_arrival_order(tmp_path, fmt, name,
                                                                  compressed):
    path = gzipped(tmp_path, name, reverse_rows=True) if compressed else FIXTURES / name
    stream = stream_trace_file(path)
    assert isinstance(stream, TraceStream) and not isinstance(stream, Trace)
    loaded = import_trace(fmt, path)[0]
    assert stream.name == loaded.name
    assert list(stream) == loaded.requests == list(stream)  # made anew each time


def test_replay_streams_a_production_file_to_the_loaded_trace_s_run(tmp_path, capsys,
                                                                    monkeypatch):
    given = []

    def recording(trace, *args, **kwargs):
        given.append(trace)
        return simulate(trace, *args, **kwargs)

    simulate = simulate_module.simulate
    monkeypatch.setattr(simulate_module, "simulate", recording)
    production = gzipped(tmp_path, "azure_conv_2023_excerpt.csv", reverse_rows=True)
    whole = tmp_path / "whole.json"  # a JSON trace: loaded whole
    save_trace(load_trace_file(production), whole)
    runs = {}
    for path in (production, whole):
        runs[path] = tmp_path / f"run-{path.name}"
        assert main(["replay", str(path), "--no-progress", "--out", str(runs[path])]) == 0
    capsys.readouterr()
    assert [isinstance(trace, TraceStream) for trace in given] == [True, False]
    for name in ("steps.csv", "requests.csv", "decisions.log.gz"):
        assert (runs[production] / name).read_bytes() == (runs[whole] / name).read_bytes(), name


def test_a_production_file_with_nothing_to_replay_is_refused_before_the_run(tmp_path, capsys):
    path = tmp_path / "failed.csv"
    path.write_text("Timestamp,Request tokens,Response tokens\n1,5,0\n2,0,7\n")
    out = tmp_path / "run"
    assert main(["replay", str(path), "--no-progress", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"zipage: error: {path}: no request left to import (2 rows read; 1 no output tokens (a "
        "failed request in the source); 1 no prompt tokens)")
    assert not out.exists()
