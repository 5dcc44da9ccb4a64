"""ServeGen's client pools in (zipage/servegen_import.py): two real DeepSeek-R1 clients and one
multimodal client of the release, pools written here whose distributions are known, so the
composed requests can be checked against them, and random pools (a property test)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zipage.errors import TraceError
from zipage.servegen_import import ServeGenStream, _read_pool
from zipage.trace import load_trace, save_trace
from zipage.trace_import import ImportOptions, detect_format, import_trace, stream_trace_file

R1 = Path(__file__).parent / "fixtures" / "servegen" / "deepseek-r1"
ARRIVAL_ATOL = 1e-6  # arrivals are rounded to the microsecond (ARRIVAL_DECIMALS)
WINDOW_S = 600.0


def _pmf(pairs: dict) -> str:
    return "{" + ", ".join(f"{value}: {weight}" for value, weight in pairs.items()) + "}"


def _pool(folder: Path, clients: dict[int, tuple[list[str], dict]]) -> Path:
    """A pool of clients, each (trace rows, {part start: {field: {value: probability}}})."""
    folder.mkdir(parents=True, exist_ok=True)
    for number, (rows, parts) in clients.items():
        (folder / f"chunk-{number}-trace.csv").write_text("\n".join(rows) + "\n")
        (folder / f"chunk-{number}-dataset.json").write_text(json.dumps(
            {str(start): {field: _pmf(pmf) for field, pmf in fields.items()}
             for start, fields in parts.items()}))
    return folder


KNOWN_INPUT = {100: 0.5, 300: 0.5}  # mean 200
KNOWN_OUTPUT = {1000: 0.25, 2000: 0.75}  # mean 1750
KNOWN_RATIO = {0.0: 0.2, 0.8: 0.8}  # thinking share of the output tokens: 0.64


def _known_pool(folder: Path, rate: float = 2.0, windows: int = 10) -> Path:
    parts = {0: {"input_tokens": KNOWN_INPUT, "output_tokens": KNOWN_OUTPUT,
                 "reason_ratio": KNOWN_RATIO}}
    gamma = [f"{int(i * WINDOW_S)},{rate},2.0,Gamma,0.25,2.0" for i in range(windows)]
    weibull = [f"{int(i * WINDOW_S)},{rate},1.5,Weibull,0.6,1.0" for i in range(windows)]
    return _pool(folder, {0: (gamma, parts), 1: (weibull, parts)})


def test_the_real_clients_compose_into_their_windows_and_distributions():
    trace, report = import_trace("servegen", R1)
    assert report.rows == 7 and not report.skipped  # 3 + 4 active windows
    active = {16: [47400, 48000, 48600], 58: [37800, 38400, 39000, 39600]}
    pool = {client.number: client for client in _read_pool(R1)}
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    for request in trace.requests:
        _, client, window, _ = request.id.split("-")
        client, window = int(client[1:]), int(window)
        assert window in active[client]
        assert window - ARRIVAL_ATOL <= request.arrival_s < window + WINDOW_S
        assert 0 <= request.reasoning_len <= request.output_len
        lengths = pool[client].lengths_at(window)
        for field, value in (("input_tokens", request.prompt_len),
                             ("output_tokens", request.output_len)):
            values, cumulative = lengths.fields[field]
            at = int(np.searchsorted(values, value))
            assert values[at] == value, (field, value)  # drawn from the published support
            assert cumulative[at] > (cumulative[at - 1] if at else 0.0)  # with weight > 0
    # Each client's count is Poisson about its windows' rate x 600 s (within 5 sigma).
    for client, windows in active.items():
        expected = sum(w.rate * w.size for w in pool[client].windows)
        got = sum(1 for r in trace.requests if r.id.startswith(f"servegen-c{client}-"))
        assert abs(got - expected) <= 5 * math.sqrt(expected), (client, got, expected)
    assert "thinking (reasoning_len)" in "\n".join(report.lines())


def test_draws_are_the_same_under_any_span_seed_by_seed():
    whole, _ = import_trace("servegen", R1)
    span, report = import_trace("servegen", R1, ImportOptions(window=(38000.0, 1300.0)))
    expected = [r for r in whole.requests if 38000.0 <= r.arrival_s < 39300.0]
    assert [r.id for r in span.requests] == [r.id for r in expected]
    assert [(r.prompt_len, r.output_len, r.reasoning_len) for r in span.requests] == [
        (r.prompt_len, r.output_len, r.reasoning_len) for r in expected]
    assert [r.arrival_s for r in span.requests] == pytest.approx(
        [r.arrival_s - 38000.0 for r in expected], abs=2 * ARRIVAL_ATOL)
    assert report.skipped["outside --span"] > 0
    again, _ = import_trace("servegen", R1)
    assert again.requests == whole.requests
    other, _ = import_trace("servegen", R1, ImportOptions(seed=1))
    assert [r.prompt_len for r in other.requests] != [r.prompt_len for r in whole.requests]


def test_a_known_pool_gives_its_rate_and_lengths(tmp_path):
    trace, report = import_trace("servegen", _known_pool(tmp_path / "pool"))
    requests = trace.requests
    expected = 2 * 10 * 2.0 * WINDOW_S  # two clients, ten windows, 2 requests/s
    assert abs(len(requests) - expected) <= 5 * math.sqrt(expected)
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    thinking = np.array([r.reasoning_len for r in requests])
    assert set(prompts.tolist()) == {100, 300} and set(outputs.tolist()) == {1000, 2000}
    # Sampling error of a mean over ~24,000 draws: well inside these tolerances.
    assert prompts.mean() == pytest.approx(200, rel=0.02)
    assert outputs.mean() == pytest.approx(1750, rel=0.02)
    assert thinking.sum() / outputs.sum() == pytest.approx(0.64, abs=0.02)
    assert set(np.unique(thinking / outputs).round(6).tolist()) == {0.0, 0.8}
    # Every window is filled by its own requests and no other.
    for request in requests:
        window = int(request.id.split("-")[2])
        assert window - ARRIVAL_ATOL <= request.arrival_s < window + WINDOW_S
    assert report.imported == len(requests)


def test_the_fit_sets_the_burstiness(tmp_path):
    """A Gamma fit of shape 0.04 (CV 5) gives far burstier gaps than one of shape 25 (CV 0.2)."""
    parts = {0: {"input_tokens": {10: 1.0}, "output_tokens": {10: 1.0}}}
    rows = {0: [f"{int(i * WINDOW_S)},1.0,5.0,Gamma,0.04,25.0" for i in range(5)],
            1: [f"{int(i * WINDOW_S)},1.0,0.2,Gamma,25.0,0.04" for i in range(5)]}
    trace, _ = import_trace("servegen", _pool(tmp_path / "pool", {
        number: (rows[number], parts) for number in rows}))
    cv = {}
    for number in rows:
        times = np.array([r.arrival_s for r in trace.requests
                          if r.id.startswith(f"servegen-c{number}-")])
        gaps = np.diff(times)
        cv[number] = gaps.std() / gaps.mean()
    assert cv[0] > 2.0 > 0.5 > cv[1]


def test_sample_speedup_and_max_model_len(tmp_path):
    pool = _known_pool(tmp_path / "pool", windows=2)
    whole, _ = import_trace("servegen", pool)
    fast, _ = import_trace("servegen", pool, ImportOptions(speedup=4.0))
    assert [r.arrival_s for r in fast.requests] == pytest.approx(
        [r.arrival_s / 4 for r in whole.requests], abs=2 * ARRIVAL_ATOL)
    sampled, report = import_trace("servegen", pool, ImportOptions(sample=0.25))
    assert {r.id for r in sampled.requests} < {r.id for r in whole.requests}
    assert len(sampled.requests) == pytest.approx(len(whole.requests) / 4, rel=0.15)
    assert report.skipped["not in the --sample"] == len(whole.requests) - len(sampled.requests)
    short, report = import_trace("servegen", pool, ImportOptions(max_model_len=1500))
    assert all(r.prompt_len + r.output_len <= 1500 for r in short.requests)
    assert report.skipped["prompt + output longer than --max-model-len 1500"] > 0


def test_a_part_of_the_day_applies_until_the_next_one(tmp_path):
    parts = {0: {"input_tokens": {7: 1.0}, "output_tokens": {5: 1.0}},
             1200: {"input_tokens": {}, "output_tokens": {9: 1.0}},  # empty: skipped, as ServeGen
             1800: {"input_tokens": {11: 1.0}, "output_tokens": {13: 1.0}}}
    rows = [f"{int(i * WINDOW_S)},0.5,1.0,Gamma,1.0,1.0" for i in range(4)]
    trace, _ = import_trace("servegen", _pool(tmp_path / "pool", {3: (rows, parts)}))
    for request in trace.requests:
        early = int(request.id.split("-")[2]) < 1800
        assert (request.prompt_len, request.output_len) == ((7, 5) if early else (11, 13))
        assert request.reasoning_len == 0  # no reason_ratio: a language pool


MM = Path(__file__).parent / "fixtures" / "servegen" / "mm-image"


def test_a_multimodal_prompt_is_its_text_and_its_media(tmp_path):
    """The real client: 52 text tokens and one image a request, the image's tokens drawn."""
    trace, _ = import_trace("servegen", MM)
    (client,) = _read_pool(MM)
    assert trace.requests
    for request in trace.requests:
        lengths = client.lengths_at(int(request.id.split("-")[2]))
        values, cumulative = lengths.fields["image_tokens"]
        image = request.prompt_len - 52
        at = int(np.searchsorted(values, image))
        assert values[at] == image and cumulative[at] > (cumulative[at - 1] if at else 0.0)
    # Two images, one audio clip, no video: text + 2 x image + audio, every request.
    parts = {0: {"text_tokens": {10: 1.0}, "output_tokens": {5: 1.0},
                 "image_count": {2: 1.0}, "image_tokens": {100: 1.0},
                 "audio_count": {1: 1.0}, "audio_tokens": {7: 1.0},
                 "video_count": {0: 1.0}, "video_tokens": {0: 1.0}}}
    rows = [f"{int(i * WINDOW_S)},0.5,1.0,Gamma,1.0,1.0" for i in range(2)]
    made, _ = import_trace("servegen", _pool(tmp_path / "pool", {0: (rows, parts)}))
    assert {r.prompt_len for r in made.requests} == {10 + 2 * 100 + 7}


def test_a_directory_is_told_apart_and_streams(tmp_path):
    assert detect_format(R1) == "servegen"
    stream = stream_trace_file(R1)
    assert isinstance(stream, ServeGenStream)
    assert list(stream) == list(stream) == import_trace("servegen", R1)[0].requests
    with pytest.raises(TraceError, match="not a ServeGen model directory"):
        detect_format(tmp_path)


@pytest.mark.parametrize("files, expected", [
    ({"chunk-1-trace.csv": "0,1,1,Gamma,1,1\n"}, "chunk-1-dataset.json are missing beside it"),
    ({"chunk-1-trace.csv": "0,1,1,Gamma,1\n", "chunk-1-dataset.json": "{}"},
     "chunk-1-trace.csv:1: expected 6 columns"),
    ({"chunk-1-trace.csv": "0,1,1,Poisson,1,1\n", "chunk-1-dataset.json": "{}"},
     "chunk-1-trace.csv:1: unknown arrival pattern 'Poisson'"),
    ({"chunk-1-trace.csv": "0,x,1,Gamma,1,1\n", "chunk-1-dataset.json": "{}"},
     "chunk-1-trace.csv:1: rate must be a number, got 'x'"),
    ({"chunk-1-trace.csv": "600,1,1,Gamma,1,1\n0,1,1,Gamma,1,1\n", "chunk-1-dataset.json": "{}"},
     "the window timestamps must increase"),
    ({"chunk-1-trace.csv": "0,1,1,Gamma,1,1\n",
      "chunk-1-dataset.json": '{"0": {"input_tokens": "{1: 1.0}"}}'},
     "part '0': no output_tokens distribution"),
    ({"chunk-1-trace.csv": "0,1,1,Gamma,1,1\n",
      "chunk-1-dataset.json": '{"0": {"input_tokens": "{1: 1.0}", "output_tokens": "{1: x}"}}'},
     "part '0', output_tokens: expected numbers"),
    ({"chunk-1-trace.csv": "0,1,1,Gamma,1,1\n",
      "chunk-1-dataset.json": '{"0": {"input_tokens": "{1.2.3: 1.0}", "output_tokens": "{1: 1}"}}'},
     "part '0', input_tokens: expected numbers"),
    ({"chunk-1-trace.csv": "0,1,1,Gamma,1,1\n",
      "chunk-1-dataset.json": '{"0": {"text_tokens": "{1: 1.0}", "output_tokens": "{1: 1.0}", '
                              '"image_count": "{0: 1.0}"}}'},
     "part '0': no image_tokens distribution"),
    ({"chunk-1-dataset.json": "{}"}, "no chunk-N-trace.csv in it"),
])
def test_a_malformed_pool_is_one_line_naming_the_file(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(TraceError) as caught:
        ServeGenStream(tmp_path)
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_cli_imports_replays_and_refuses_in_one_line(tmp_path):
    out = tmp_path / "r1.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "trace", "import", "servegen", str(R1), "-o",
         str(out), "--span", "10.5h:20m", "--speedup", "4"],
        capture_output=True, text=True, check=True)
    assert "servegen: 7 rows read" in done.stdout and "thinking" in done.stdout
    trace = load_trace(out)
    assert trace.requests and max(r.arrival_s for r in trace.requests) < 1200 / 4
    replayed = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "replay", str(out), "--json", "--model",
         "qwen3-0.6b", "--hardware", "h100", "--no-progress"],
        capture_output=True, text=True, check=True)
    assert json.loads(replayed.stdout)["completed"] == len(trace.requests)
    bad = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "trace", "import", "servegen", str(tmp_path), "-o",
         str(tmp_path / "x.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no chunk-N-trace.csv" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


@st.composite
def pools(draw):
    """Up to three clients, each up to five windows (some idle, some of rate 0), Gamma or Weibull
    fits of any shape, and one or two parts of the day of small distributions (with or without
    `reason_ratio`, text or multimodal); returns {client: (rows, parts)}."""
    clients = {}
    for number in draw(st.lists(st.integers(0, 99), min_size=1, max_size=3, unique=True)):
        rows = []
        for window in range(draw(st.integers(1, 5))):
            start = int(window * WINDOW_S)
            if draw(st.booleans()) and window:
                rows.append(f"{start},0,0,,0,0")  # idle
                continue
            pattern = draw(st.sampled_from(["Gamma", "Weibull"]))
            shape = draw(st.floats(0.01, 30.0))
            scale = draw(st.floats(0.001, 500.0))
            rate = draw(st.sampled_from([0.0, 0.01, 0.2, 1.0]))
            rows.append(f"{start},{rate},1.0,{pattern},{shape},{scale}")
        parts = {}
        for part in sorted(draw(st.sets(st.sampled_from([0, 600, 1200]), min_size=1,
                                        max_size=2))):
            fields = {name: {draw(st.integers(0, 3000)): draw(st.floats(0.01, 1.0))
                             for _ in range(draw(st.integers(1, 3)))}
                      for name in ("input_tokens", "output_tokens")}
            if draw(st.booleans()):
                fields["reason_ratio"] = {draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])): 1.0}
            if draw(st.booleans()):  # a multimodal part: text tokens, and images
                fields["text_tokens"] = fields.pop("input_tokens")
                fields["image_count"] = {draw(st.integers(0, 3)): 1.0, 1: 0.5}
                fields["image_tokens"] = {draw(st.integers(1, 2000)): 1.0}
            parts[part] = fields
        clients[number] = (rows, parts)
    return clients


@settings(max_examples=examples(60))
@given(clients=pools(), seed=st.integers(0, 3), start=st.floats(0, 2400),
       duration=st.floats(1, 3000), sample=st.sampled_from([1.0, 0.5]))
# A burst at the day's first microsecond and a span starting just after 0: the span must cut on
# the microsecond grid the whole day's arrivals are rounded to, or it keeps what the day puts at 0.
@example(clients={1: (["0,0.2,1.0,Gamma,0.015625,1.0"],
                      {0: {"input_tokens": {1: 1.0}, "output_tokens": {1: 1.0}}})},
         seed=0, start=2.1871064856194048e-57, duration=1.0, sample=1.0)
def test_any_pool_gives_a_valid_trace_the_same_under_spans(tmp_path_factory, clients, seed, start,
                                                           duration, sample):
    folder = _pool(tmp_path_factory.mktemp("pool"), clients)
    options = ImportOptions(seed=seed, sample=sample)
    try:
        whole, report = import_trace("servegen", folder, options)
    except TraceError as error:  # nothing to import: one line saying why
        assert "no request left to import" in str(error) and "\n" not in str(error)
        return
    requests = whole.requests
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert len({r.id for r in requests}) == len(requests)
    for request in requests:
        window = int(request.id.split("-")[2])
        assert window - ARRIVAL_ATOL <= request.arrival_s < window + WINDOW_S
        assert request.prompt_len >= 1 and request.output_len >= 1
        assert 0 <= request.reasoning_len <= request.output_len
    assert report.imported == len(requests)
    assert report.imported + sum(report.skipped.values()) >= len(requests)
    # A saved trace loads back the same, as the replay reads it.
    path = tmp_path_factory.mktemp("out") / "pool.jsonl"
    save_trace(whole, path)
    assert load_trace(path).requests == requests
    # A span holds exactly the whole day's requests in it, shifted to start at 0.
    try:
        span, _ = import_trace("servegen", folder, ImportOptions(
            seed=seed, sample=sample, window=(start, duration)))
        kept = span.requests
    except TraceError:
        kept = []
    expected = [r for r in requests if start <= r.arrival_s < start + duration]
    assert [r.id for r in kept] == [r.id for r in expected]
    assert [r.arrival_s for r in kept] == pytest.approx(
        [r.arrival_s - start for r in expected], abs=2 * ARRIVAL_ATOL)
