"""Production traces in: Azure (2023, 2024), Mooncake (block hashes), BurstGPT; JSON Lines and gzip
as Zipage's own large-trace layout; block-level prefix identity in the schema."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zipage.core.block_manager import prompt_block_hashes
from zipage.errors import TraceError
from zipage.trace import Trace, TraceRequest, load_trace, parse_trace, prompt_block_keys, prompt_token_ids, save_trace
from zipage.trace_import import ImportOptions, detect_format, import_trace, load_trace_file, parse_window

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
AZURE_2023 = FIXTURES / "azure_conv_2023_excerpt.csv"
AZURE_2024 = FIXTURES / "azure_code_2024.csv"
BURSTGPT = FIXTURES / "burstgpt.csv"
MOONCAKE = FIXTURES / "mooncake.jsonl"
ARRIVAL_ATOL = 1e-6  # arrivals are rounded to the microsecond (ARRIVAL_DECIMALS)


def test_azure_2023_excerpt_imports_every_row_in_order():
    trace, report = import_trace("azure", AZURE_2023)
    assert report.rows == 200 and len(trace.requests) == 200 and not report.skipped
    assert trace.name == "azure_conv_2023_excerpt"
    first = trace.requests[0]
    # The file's first data row: 2023-11-16 18:15:46.6805900,374,44.
    assert (first.id, first.prompt_len, first.output_len) == ("azure-0", 374, 44)
    assert first.arrival_s == pytest.approx(0.0, abs=ARRIVAL_ATOL)
    # Second row 18:15:50.9951690: 4.314579 s after the first.
    assert trace.requests[1].arrival_s == pytest.approx(4.314579, abs=ARRIVAL_ATOL)
    arrivals = [request.arrival_s for request in trace.requests]
    assert arrivals == sorted(arrivals)


def test_azure_2024_zones_and_failed_rows_are_counted():
    trace, report = import_trace("azure", AZURE_2024)
    assert [request.id for request in trace.requests] == ["azure-0", "azure-2", "azure-4",
                                                          "azure-5"]
    assert report.skipped == {"no output tokens (a failed request in the source)": 1,
                              "no prompt tokens": 1}
    assert trace.requests[1].arrival_s == pytest.approx(1.012384, abs=ARRIVAL_ATOL)


def test_burstgpt_reads_its_columns_by_name():
    trace, report = import_trace("burstgpt", BURSTGPT)
    assert [(r.id, r.arrival_s, r.prompt_len, r.output_len) for r in trace.requests] == [
        ("burstgpt-0", 0.0, 472, 18), ("burstgpt-1", 40.0, 1087, 230),
        ("burstgpt-3", 114.0, 1360, 260), ("burstgpt-4", 195.5, 28, 1046)]
    assert report.skipped == {"no output tokens (a failed request in the source)": 1}


def test_mooncake_keeps_block_hashes_and_their_block_size():
    trace, report = import_trace("mooncake", MOONCAKE)
    assert report.rows == 6 and len(trace.requests) == 5
    first = trace.requests[0]
    assert first.block_hashes == (0, 1, 2) and first.hash_block_size == 512
    assert [r.arrival_s for r in trace.requests] == pytest.approx([0, 0, 0.25, 1.0, 2.5])
    assert "prompt blocks seen before" in "\n".join(report.lines())


def test_window_speedup_sample_and_max_model_len():
    full, _ = import_trace("azure", AZURE_2023)
    windowed, report = import_trace("azure", AZURE_2023,
                                    ImportOptions(window=(60.0, 120.0), speedup=4.0))
    expected = [r for r in full.requests if 60.0 <= r.arrival_s < 180.0]
    assert [r.id for r in windowed.requests] == [r.id for r in expected]
    assert [r.arrival_s for r in windowed.requests] == pytest.approx(
        [(r.arrival_s - 60.0) / 4.0 for r in expected], abs=2 * ARRIVAL_ATOL)
    assert report.skipped["outside --span"] == 200 - len(expected)

    sampled, report = import_trace("azure", AZURE_2023, ImportOptions(sample=0.5, seed=3))
    again, _ = import_trace("azure", AZURE_2023, ImportOptions(sample=0.5, seed=3))
    other, _ = import_trace("azure", AZURE_2023, ImportOptions(sample=0.5, seed=4))
    assert sampled == again and sampled != other
    assert 60 < len(sampled.requests) < 140
    assert report.skipped["not in the --sample"] == 200 - len(sampled.requests)

    capped, report = import_trace("azure", AZURE_2023, ImportOptions(max_model_len=1024))
    assert all(r.prompt_len + r.output_len <= 1024 for r in capped.requests)
    assert report.skipped["prompt + output longer than --max-model-len 1024"] == sum(
        r.prompt_len + r.output_len > 1024 for r in full.requests)


@pytest.mark.parametrize("text, expected", [
    ("0:3600", (0.0, 3600.0)), ("2h:30m", (7200.0, 1800.0)), ("90s:1.5m", (90.0, 90.0))])
def test_parse_window(text, expected):
    assert parse_window(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["3600", "a:b", "0:0", "-1:5", "1:2:3", "inf:5"])
def test_parse_window_refuses(text):
    with pytest.raises(TraceError, match="--span"):
        parse_window(text)


@pytest.mark.parametrize("fmt, content, expected", [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n",
     "line 2: TIMESTAMP 'yesterday' is not a date and time"),
    ("azure", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n",
     "line 1: missing column(s) GeneratedTokens"),
    ("burstgpt", "Timestamp,Request tokens,Response tokens\n1,2,-3\n",
     "line 2: Response tokens must be a token count"),
    ("mooncake", '{"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [1]}\n',
     "line 1: hash_ids must list 2 non-negative integers"),
    ("mooncake", '{"timestamp": 0, "input_length": 10\n', "line 1: not a JSON object"),
])
def test_bad_rows_name_the_line(tmp_path, fmt, content, expected):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(TraceError) as caught:
        import_trace(fmt, path)
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_formats_are_told_apart_by_content(tmp_path):
    assert detect_format(AZURE_2023) == "azure"
    assert detect_format(AZURE_2024) == "azure"
    assert detect_format(BURSTGPT) == "burstgpt"
    assert detect_format(MOONCAKE) == "mooncake"
    assert detect_format(Path(__file__).parents[1] / "traces" / "tiny.json") == "zipage"
    zipped = tmp_path / "moon.jsonl.gz"
    zipped.write_bytes(gzip.compress(MOONCAKE.read_bytes()))
    assert detect_format(zipped) == "mooncake"
    assert load_trace_file(zipped) == import_trace("mooncake", MOONCAKE)[0].__class__(
        name="moon", requests=import_trace("mooncake", MOONCAKE)[0].requests)
    unknown = tmp_path / "x.csv"
    unknown.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match="not a trace this Zipage reads"):
        detect_format(unknown)


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".jsonl.gz", ".json.gz"])
def test_saved_traces_round_trip_in_every_layout(tmp_path, suffix):
    trace, _ = import_trace("mooncake", MOONCAKE)
    path = tmp_path / f"day{suffix}"
    save_trace(trace, path)
    loaded = load_trace(path)
    assert loaded == Trace(name="mooncake", requests=trace.requests)
    assert load_trace_file(path) == loaded
    if suffix == ".jsonl":
        lines = path.read_text().splitlines()
        assert json.loads(lines[0]) == {"version": 1, "name": "mooncake", "hash_block_size": 512}
        assert len(lines) == 1 + len(trace.requests)


def test_jsonl_mistakes_name_the_request(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"version": 1}\n{"id": "a", "arrival_s": 0, "prompt_len": 3, '
                    '"output_len": 0}\n')
    with pytest.raises(TraceError, match=r"request #0 \(id 'a'\): output_len must be"):
        load_trace(path)
    path.write_text('{"version": 1}\n{"id": "a", "arrival_s": 0,\n')
    with pytest.raises(TraceError, match="line 2: not valid JSON"):
        load_trace(path)


def _hashed(request_id: str, hashes: list[int], prompt_len: int) -> dict:
    return {"id": request_id, "arrival_s": 0, "prompt_len": prompt_len, "block_hashes": hashes,
            "output_len": 4}


@pytest.mark.parametrize("raw, header, expected", [
    (_hashed("a", [1, 2], 40), {}, "block_hashes needs the trace's hash_block_size"),
    (_hashed("a", [1], 40), {"hash_block_size": 32}, "block_hashes must be a list of 2"),
    (_hashed("a", [1, -2], 40), {"hash_block_size": 32}, r"block_hashes\[1\] must be an integer"),
    ({**_hashed("a", [1, 2], 40), "prefix_group": "g"}, {"hash_block_size": 32},
     "give it with prompt_len alone"),
    (_hashed("a", [1, 2], 40), {"hash_block_size": 0}, "hash_block_size must be an integer"),
])
def test_block_hash_mistakes(raw, header, expected):
    with pytest.raises(TraceError, match=expected):
        parse_trace({"version": 1, **header, "requests": [raw]}, source="t.json")


def test_equal_hashes_mean_equal_blocks_and_the_chain_decides_sharing():
    trace = parse_trace({"version": 1, "hash_block_size": 32, "requests": [
        _hashed("a", [1, 2, 3], 80), _hashed("b", [1, 2, 4], 90), _hashed("c", [9, 2, 3], 96)]})
    a, b, c = (prompt_token_ids(request) for request in trace.requests)
    assert (len(a), len(b), len(c)) == (80, 90, 96)
    assert a[:64] == b[:64] and a[64:] != b[64:80]
    assert a[32:64] == c[32:64]  # hash 2 is the same block ...
    # ... but the prefix cache keys a block with everything before it: c shares nothing with a.
    hashes_a, hashes_b, hashes_c = (prompt_block_hashes(tokens, 16) for tokens in (a, b, c))
    assert hashes_a[:4] == hashes_b[:4] and hashes_a[4] != hashes_b[4]
    assert not set(hashes_a) & set(hashes_c)


def test_trace_import_cli_writes_and_replays(tmp_path):
    out = tmp_path / "moon.jsonl.gz"
    done = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "trace", "import", "mooncake", str(MOONCAKE), "-o",
         str(out), "--speedup", "2"], capture_output=True, text=True, check=True)
    assert "6 rows read, 5 requests imported" in done.stdout
    assert "skipped 1: no output tokens" in done.stdout
    assert [r.arrival_s for r in load_trace(out).requests] == pytest.approx(
        [0, 0, 0.125, 0.5, 1.25])
    for trace in (out, BURSTGPT):
        replayed = subprocess.run(
            [sys.executable, "-m", "zipage.cli", "replay", str(trace), "--json", "--model",
             "qwen3-0.6b", "--hardware", "h100"], capture_output=True, text=True, check=True)
        assert json.loads(replayed.stdout)["completed"] > 0
    moon = json.loads(subprocess.run(
        [sys.executable, "-m", "zipage.cli", "replay", str(MOONCAKE), "--json", "--model",
         "qwen3-0.6b", "--hardware", "h100", "--block-size", "256"],
        capture_output=True, text=True, check=True).stdout)
    assert moon["prefix_hit_tokens"] > 0


def test_trace_import_cli_refuses_bad_input_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "trace", "import", "azure", str(MOONCAKE), "-o",
         str(tmp_path / "x.json")], capture_output=True, text=True)
    assert done.returncode == 2 and "missing column(s)" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "trace", "import", "azure", str(AZURE_2023), "-o",
         str(tmp_path / "x.json"), "--sample", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "--sample" in done.stderr


def test_a_request_made_in_python_keeps_working_without_hashes():
    request = TraceRequest(id="x", arrival_s=0.0, prompt_len=5, output_len=1)
    assert request.block_hashes is None and len(prompt_token_ids(request)) == 5


def _equality_pattern(rows: list[list[int]]) -> list[list[int]]:
    """Each key replaced by the index of its first occurrence across all rows."""
    first: dict[int, int] = {}
    return [[first.setdefault(key, len(first)) for key in row] for row in rows]


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_block_keys_are_equal_exactly_where_the_tokens_are(data):
    """The simulator's block keys (no tokens) share exactly the blocks the engine's token hashes
    share, for prefix groups, hashed blocks of any alignment and plain prompts."""
    block_size = data.draw(st.sampled_from([4, 8, 16]))
    hash_block_size = data.draw(st.sampled_from([2, 4, 8, 16, 32, 6]))
    requests = []
    for index in range(data.draw(st.integers(1, 8))):
        prompt_len = data.draw(st.integers(1, 70))
        form = data.draw(st.sampled_from(["plain", "group", "hashed"]))
        raw = {"id": f"r{index}", "arrival_s": 0, "prompt_len": prompt_len, "output_len": 1}
        if form == "group":
            raw["prefix_group"] = data.draw(st.sampled_from(["g", "h"]))
            raw["prefix_len"] = data.draw(st.integers(1, prompt_len))
        elif form == "hashed":
            count = -(-prompt_len // hash_block_size)
            raw["block_hashes"] = data.draw(st.lists(st.integers(0, 3), min_size=count,
                                                     max_size=count))
        requests.append(raw)
    trace = parse_trace({"version": 1, "hash_block_size": hash_block_size, "requests": requests})
    by_tokens = [prompt_block_hashes(prompt_token_ids(r), block_size) for r in trace.requests]
    keys = [prompt_block_keys(r, block_size) for r in trace.requests]
    if any(key is None for key in keys):  # unaligned hashed blocks: only the tokens tell
        assert block_size % hash_block_size and hash_block_size % block_size
        return
    assert _equality_pattern(keys) == _equality_pattern(by_tokens)


def test_trace_make_restamps_a_trace_of_any_layout(tmp_path):
    out = tmp_path / "stamped.jsonl.gz"
    subprocess.run([sys.executable, "-m", "zipage.cli", "trace", "make", str(MOONCAKE), "--rate",
                    "5", "-o", str(out)], capture_output=True, text=True, check=True)
    stamped = load_trace(out)
    assert [r.block_hashes for r in stamped.requests] == [
        r.block_hashes for r in import_trace("mooncake", MOONCAKE)[0].requests]
    assert stamped.requests[-1].arrival_s > 0
