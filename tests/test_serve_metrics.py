"""`zipage serve`'s metrics under vLLM's names, its access log and its stats line, over HTTP on
localhost (random weights, prompts as token ids: the server starts in seconds).

One module server (stats every 0.5 s): after a few requests, every mapped vLLM series carries
exactly our series' value, labelled `model_name` and `engine`; the counters advance by the
responses' usage (prompt, output and cached tokens), each histogram by one observation per
request, and the inter-token latency histogram by one per token after a request's first; KV
usage is a fraction, above 0 while a stream runs; a repeated prompt counts prefix-cache hits.
Every request is one access line with its status (200 with the response's id and tokens, 400,
404); the stats line comes while requests run and stops once the server is idle. A second
server with `--disable-uvicorn-access-log` (vLLM's name) and `--disable-log-stats` writes
neither.
"""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
from test_serve_process import _server, _wait_for  # noqa: E402

from zipage.serve.metrics import VLLM_NAMES  # noqa: E402

STATS_INTERVAL_S = 0.5
BLOCK = 16  # --block-size of test_serve_process.FLAGS
STATS = re.compile(r"zipage serve: Avg prompt throughput: [\d.]+ tokens/s, Avg generation "
                   r"throughput: [\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache "
                   r"usage: [\d.]+%, Prefix cache hit rate: ([\d.]+)%")
ACCESS = re.compile(r'zipage serve: [\d.]+:\d+ "(\w+) (\S+) HTTP/[\d.]+" (\d+) [\d.]+s '
                    r"id=(\S+) prompt_tokens=(\S+) completion_tokens=(\S+)")
SAMPLE = re.compile(r"^([\w:]+)\{([^}]*)\}\s+(\S+)$", re.M)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with _server(tmp_path_factory.mktemp("metrics"), "--log-stats-interval",
                 str(STATS_INTERVAL_S)) as (process, url, engine, log):
        yield url, log


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """(sample name, its labels as written) -> value, every sample of /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(name, labels): float(value) for name, labels, value in SAMPLE.findall(text)}


def _value(samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(value for (sample, written), value in samples.items()
               if sample == name and all(label in written.split(",") for label in wanted))


def _family(samples, name: str, rename: dict[str, str] | None = None) -> dict:
    """A family's samples: (suffix such as `_total` or `_bucket`, its labels as a set) ->
    value, each label's name renamed by `rename`."""
    found = {}
    for (sample, written), value in samples.items():
        suffix = sample[len(name):]
        if sample.startswith(name) and suffix in ("", "_total", "_count", "_sum", "_bucket"):
            labels = frozenset(
                (rename or {}).get(label.split("=")[0], label.split("=")[0]) + "="
                + label.split("=", 1)[1] for label in written.split(","))
            found[suffix, labels] = value
    return found


def _idle(url: str) -> dict:
    samples = {}

    def quiet() -> bool:
        nonlocal samples
        samples = _scrape(url)
        return (_value(samples, "vllm:num_requests_running")
                + _value(samples, "vllm:num_requests_waiting") == 0)

    _wait_for(quiet, 60, "the server to be idle")
    return samples


def _complete(url: str, prompt: list[int], max_tokens: int, stream: bool = False) -> dict:
    """A completion's usage (a stream's from its last chunk) and id."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if not stream:
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        return {**reply["usage"], "id": reply["id"]}
    body.update(stream=True, stream_options={"include_usage": True})
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(line)
    last = json.loads(chunks[-1].removeprefix("data: "))
    return {**last["usage"], "id": last["id"]}


def test_vllm_names_carry_the_requests_usage(served):
    url, log = served
    before = _idle(url)
    shared = list(range(100, 100 + 2 * BLOCK + 5))  # two whole blocks a repeat finds cached
    usages = [_complete(url, shared, 5), _complete(url, [7, 8, 9], 3),
              _complete(url, list(range(300, 320)), 4, stream=True),
              _complete(url, shared, 6)]  # the repeat
    after = _idle(url)

    def advanced(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    requests = len(usages)
    prompt = sum(usage["prompt_tokens"] for usage in usages)
    output = sum(usage["completion_tokens"] for usage in usages)
    cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in usages)
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    assert advanced("vllm:num_preemptions_total") == 0  # else a prompt counts its hits twice
    assert advanced("vllm:prompt_tokens_total") == prompt
    assert advanced("vllm:generation_tokens_total") == output
    assert advanced("vllm:request_success_total", finished_reason="length") == requests
    assert advanced("vllm:prefix_cache_hits_total") == cached
    assert advanced("vllm:prefix_cache_queries_total") == prompt  # computed + found, each once
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_time_per_output_token_seconds",
                      "request_prompt_tokens", "request_generation_tokens"):
        assert advanced(f"vllm:{histogram}_count") == requests, histogram
    assert advanced("vllm:request_prompt_tokens_sum") == prompt
    assert advanced("vllm:request_generation_tokens_sum") == output
    # Inter-token latency: one observation per token after each request's first, the gap
    # between their arrivals at the server (vLLM's old name carries the same series).
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert advanced(f"{name}_count") == output - requests, name
        assert advanced(f"{name}_sum") > 0
        assert advanced(f"{name}_bucket", le="+Inf") == output - requests
    # Latencies are positive and within what the requests took (generous: a busy machine).
    assert 0 < advanced("vllm:time_to_first_token_seconds_sum") < 120
    assert 0 <= advanced("vllm:request_queue_time_seconds_sum") < 120
    assert 0 <= _value(after, "vllm:kv_cache_usage_perc") <= 1

    # Both names of each series carry the same value, labelled as vLLM labels them.
    for ours, theirs in VLLM_NAMES.items():
        our_samples = _family(after, ours, rename={"replica": "engine"})
        assert our_samples, ours
        for name in theirs:
            their_samples = _family(after, name)
            assert their_samples.keys() == our_samples.keys(), name
            for key, value in their_samples.items():
                assert value == pytest.approx(our_samples[key], rel=1e-12, abs=1e-12), (name, key)
            assert all({'engine="0"', 'model_name="random:smollm2-135m"'} <= labels
                       for _, labels in their_samples), name

    # One access line per request, with its id, status and tokens.
    lines = [ACCESS.search(line) for line in log.read_text().splitlines()]
    completions = {match[4]: match for match in lines
                   if match is not None and match[2] == "/v1/completions"}
    for usage in usages:
        line = completions[usage["id"]]
        assert (line[1], line[3]) == ("POST", "200")
        assert (int(line[5]), int(line[6])) == (usage["prompt_tokens"],
                                                usage["completion_tokens"])


def test_kv_usage_is_above_zero_while_a_stream_runs(served):
    url, _ = served
    body = {"prompt": list(range(40)), "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        lines = reply.iter_lines()  # held: a dropped generator closes the stream
        next(lines)  # the request holds its blocks now
        samples = _scrape(url)
    assert _value(samples, "vllm:num_requests_running") == 1
    blocks = _value(samples, "zipage:kv_blocks_used") + _value(samples, "zipage:kv_blocks_free")
    usage = _value(samples, "vllm:kv_cache_usage_perc")
    assert 0 < usage <= 1
    assert usage == pytest.approx(_value(samples, "zipage:kv_blocks_used") / blocks, abs=1e-12)
    _idle(url)  # the stream's abort freed its blocks


def test_access_lines_name_the_status_of_failures(served):
    url, log = served
    bad = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": "many"})
    missing = httpx.get(url + "/v1/nothing")
    assert (bad.status_code, missing.status_code) == (400, 404)

    def logged() -> list[tuple]:  # (method, path, status, id, prompt, output tokens)
        return [match.groups() for match in map(ACCESS.search, log.read_text().splitlines())
                if match is not None]

    _wait_for(lambda: any(line[1] == "/v1/nothing" for line in logged()), 10, "the 404's line")
    lines = logged()
    assert ("POST", "/v1/completions", "400", "-", "-", "-") in lines
    assert any(line[:3] == ("GET", "/v1/nothing", "404") for line in lines)


def test_stats_line_while_busy_and_none_once_idle(served):
    url, log = served
    shared = list(range(500, 500 + 2 * BLOCK + 1))
    _complete(url, shared, 8)
    _complete(url, shared, 8)  # a stats line within its span sees its prefix-cache hits
    _wait_for(lambda: any(float(match[1]) > 0 for match in STATS.finditer(log.read_text())),
              10, "a stats line with prefix-cache hits")
    _idle(url)
    time.sleep(3 * STATS_INTERVAL_S)  # the line after the last tokens, then silence
    quiet = len(STATS.findall(log.read_text()))
    time.sleep(3 * STATS_INTERVAL_S)
    assert len(STATS.findall(log.read_text())) == quiet


def test_both_switches_turn_the_lines_off(tmp_path):
    with _server(tmp_path, "--disable-uvicorn-access-log", "--disable-log-stats",
                 "--log-stats-interval", "0.2") as (process, url, engine, log):
        assert _complete(url, [1, 2, 3], 3)["completion_tokens"] == 3
        time.sleep(1.0)  # five intervals: a stats line would be there
        text = log.read_text()
    assert "listening on" in text  # the server's own lines are there
    assert ACCESS.search(text) is None and STATS.search(text) is None


def test_disable_access_log_names_one_switch():
    from zipage.cli.parser import build_parser

    parser = build_parser()
    for flag in ("--disable-access-log", "--disable-uvicorn-access-log"):
        args = parser.parse_args(["serve", "--model", "m", flag])
        assert args.disable_access_log and not args.disable_log_stats
    args = parser.parse_args(["serve", "--model", "m"])
    assert not args.disable_access_log and args.log_stats_interval > 0


@pytest.mark.parametrize("amount", [0.0, 0.004, 0.01, 0.0100001, 0.3, 79.9, 80.0, 1e6])
def test_observe_times_is_that_many_observations(amount):
    """`observe_times` (the inter-token latencies of a step at once) leaves the histogram as
    `times` calls of `observe` would: every bucket count alike, the sum within float rounding.
    Bounds themselves (0.01, 80) count in their own bucket, past the last in +Inf."""
    from prometheus_client import CollectorRegistry, Histogram

    from zipage.serve.metrics import TPOT_BUCKETS, observe_times

    pages = []
    for batched in (False, True):
        registry = CollectorRegistry()
        histogram = Histogram("h", "h", ["replica"], buckets=TPOT_BUCKETS,
                              registry=registry).labels("0")
        if batched:
            observe_times(histogram, amount, 7)
            observe_times(histogram, 0.05, 2)
        else:
            for _ in range(7):
                histogram.observe(amount)
            histogram.observe(0.05)
            histogram.observe(0.05)
        samples = {(sample.name, sample.labels.get("le")): sample.value
                   for metric in registry.collect() for sample in metric.samples}
        pages.append(samples)
    plain, batched = pages
    assert plain.keys() == batched.keys()
    for key, value in plain.items():
        assert batched[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert plain[("h_count", None)] == 9
