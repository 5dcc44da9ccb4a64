"""`zipage serve` over real HTTP on localhost: the SmolLM2 GGUF on the CPU engine, queried with the
openai client (and httpx where a test needs the raw stream).

One server for the module (`zipage serve` in a subprocess, its engine in a process of its own,
loading the model once) and one in-process `LLM` for the reference outputs. Covered: completion and
chat, streamed and not, equal to
each other and to `LLM.generate` under greedy sampling; a repeated chat's usage counts its prompt
blocks found in the prefix cache (`cached_tokens`); the same seed gives the same tokens; 16
concurrent streams complete; a disconnect mid-stream frees the request's blocks (seen in
/metrics); malformed JSON, a wrong type, a prompt that can never fit, a wrong API key and one
request over --max-waiting each get their status and a message naming the field, while a
concurrent request completes untouched; `zipage bench serve` of a small trace completes every
request with its token count.
Hostile input (issue #30): top_k 2**63 is a 400 and the engine lives on; a 50 MB body is a 413
before it is read while /health stays fast; the key (read from --api-key-file) is checked
before any body is parsed and its scheme is case-insensitive; unknown routes, malformed bodies
and lone surrogates get OpenAI's error body; a hypothesis fuzz over request bodies never gets a
500 or an error of another shape, and leaves the engine healthy.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("gguf")

from serve_helpers import start_server, stop_server, wait_healthy  # noqa: E402
from smollm2 import GGUF, needs_smollm2, reference_llm  # noqa: E402

API_KEY = "test-key"
# Small blocks and budget so a few dozen tokens already compress (N_max = 5 blocks of 16).
KNOBS = dict(block_size=16, kv_budget=64, window=4, max_model_len=2048, max_num_seqs=4)
MAX_WAITING = 16
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 2+2?"}]




pytestmark = needs_smollm2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server, started (`url` waits for it: the reference engine loads meanwhile)."""
    directory = tmp_path_factory.mktemp("serve")
    key_file = directory / "api-key"  # the key off the command line (ps shows arguments)
    key_file.write_text(API_KEY + "\n")
    flags = [f"--{name.replace('_', '-')}" if name != "kv_budget" else "--budget"
             for name in KNOBS]
    args = ["--model", str(GGUF), "--engine", "cpu", "--dtype", "float32", "--kv-memory-gb",
            "0.25", "--max-waiting", str(MAX_WAITING), "--api-key-file", str(key_file),
            "--served-model-name", "smollm2"]
    for flag, value in zip(flags, KNOBS.values()):
        args += [flag, str(value)]
    served = start_server(args, directory / "server.log")
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def llm(server):
    """The reference engine, loaded in this process while the server loads in its own."""
    return reference_llm(**KNOBS)


@pytest.fixture(scope="module")
def url(server, llm):
    wait_healthy(server, 240, poll_s=0.5, request_timeout=1)
    return server.url


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
    from zipage.core.sampling import SamplingParams

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


def test_kv_budget_per_request(llm, url):
    """A request's own kv_budget (an extension field) is its budget, as SamplingParams.kv_budget
    is LLM.generate's; a bad one is a 400 naming kv_budget."""
    from zipage.core.sampling import SamplingParams

    # 60 greedy tokens: compressed many times at a budget of 16 (N_max 2), differently from the
    # server's default 64.
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(url + "/v1/completions", headers=headers, timeout=120, json={
        "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "kv_budget": 16,
        "ignore_eos": True, "return_token_ids": True}).json()
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=60,
                                                     ignore_eos=True, kv_budget=16),
                            progress=False)[0]
    default = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=60,
                                                    ignore_eos=True), progress=False)[0]
    assert reply["choices"][0]["token_ids"] == expected.token_ids
    assert expected.token_ids != default.token_ids  # the budget really changed the cache
    for budget, message in ((40, "kv_budget: 40 must be a positive multiple of block_size 16"),
                            (0, "kv_budget: must be an integer between 1 and 2147483647"),
                            ("64", "kv_budget: must be an integer between")):
        bad = httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                         json={"prompt": PROMPT, "max_tokens": 4, "kv_budget": budget})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["message"].startswith(message) and error["param"] == "kv_budget"


def test_compress_scope_per_request(llm, url):
    """A request's own compress_scope (an extension field) is its scope, as
    SamplingParams.compress_scope is LLM.generate's; a bad one is a 400 naming the field."""
    from zipage.core.sampling import SamplingParams

    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(url + "/v1/completions", headers=headers, timeout=120, json={
        "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "kv_budget": 16,
        "compress_scope": "output", "ignore_eos": True, "return_token_ids": True}).json()
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=60,
                                                     ignore_eos=True, kv_budget=16,
                                                     compress_scope="output"),
                            progress=False)[0]
    assert reply["choices"][0]["token_ids"] == expected.token_ids
    bad = httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                     json={"prompt": PROMPT, "max_tokens": 4, "compress_scope": "prompt"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "compress_scope"


def test_chat_streamed_equals_non_streamed_equals_generate(client, llm):
    from zipage.core.sampling import SamplingParams

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


def test_a_repeated_chat_reads_its_prompt_from_the_prefix_cache(client):
    """usage.prompt_tokens_details.cached_tokens: the second of two identical chats (streamed,
    with usage) finds every full block of the prompt but the one holding its last token."""
    messages = [{"role": "user", "content": "Name three rivers of Europe and the seas they "
                                            "flow into, one line each, shortest first."}]
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2,
                                           temperature=0)
    prompt = first.usage.prompt_tokens
    assert prompt > 2 * KNOBS["block_size"]
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    block, cached = KNOBS["block_size"], usage.prompt_tokens_details.cached_tokens
    assert cached == (prompt - 1) // block * block
    assert first.usage.prompt_tokens_details.cached_tokens < cached


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


# ---------------------------------------------------------------- n, logprobs, echo (#35)

LOGPROB_ATOL = 1e-4  # the server and the in-process engine run the same float32 kernels; they
# differ only in batch composition (and so in summation order), by ~1e-6


def test_n_choices_streamed_and_not(client, llm):
    """n = 8 samples: eight choices, indexed, one usage; a stream of n = 3 interleaves the
    choices and each equals its non-streamed twin (same seed)."""
    prompt_len = len(llm.tokenizer.encode(PROMPT))
    reply = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, n=8,
                                      temperature=0.9, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [choice.index for choice in reply.choices] == list(range(8))
    assert len({choice.text for choice in reply.choices}) > 1  # each sample its own draws
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_len, 40)
    whole = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, n=3,
                                      temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    pieces = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, n=3,
                                           temperature=0.9, seed=11, stream=True,
                                           extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
    assert ["".join(pieces[index]) for index in range(3)] == \
        [choice.text for choice in whole.choices]
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, n=2,
                                          temperature=0)
    assert [choice.index for choice in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy


def test_completion_logprobs_and_echo_score_a_prompt(client, llm):
    """lm-evaluation-harness's log-likelihood request: echo, max_tokens 0 (or 1), logprobs; the
    prompt's log-probabilities are the engine's (checked against transformers in
    tests/test_engine_samples.py)."""
    from zipage.core.sampling import SamplingParams

    ids = llm.tokenizer.encode(PROMPT)
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                     prompt_logprobs=1), progress=False)[0]
    scored = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens) == PROMPT and logprobs.text_offset[0] == 0
    for got, entry in zip(logprobs.token_logprobs[1:], expected.prompt_logprobs[1:]):
        assert abs(got - entry.logprob) < LOGPROB_ATOL
    # max_tokens 1: the prompt, then the greedy token, each with its top alternative.
    one = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, echo=True,
                                    logprobs=1, temperature=0).choices[0]
    assert one.text == PROMPT + expected.text and len(one.logprobs.tokens) == len(ids) + 1
    top = one.logprobs.top_logprobs[-1]
    assert list(top) == [one.logprobs.tokens[-1]]  # greedy: the token is its own top
    assert abs(one.logprobs.token_logprobs[-1] - expected.logprobs[0].logprob) < LOGPROB_ATOL
    assert one.logprobs.text_offset[-1] == len(PROMPT)
    # Streamed: the echo leads the first chunk, the log-probabilities follow the tokens.
    chunks = [chunk.choices[0] for chunk in client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=3, echo=True, logprobs=2, temperature=0,
        stream=True) if chunk.choices]
    assert "".join(c.text for c in chunks).startswith(PROMPT)
    streamed = [value for c in chunks for value in c.logprobs.token_logprobs]
    assert len(streamed) == len(ids) + 3 and streamed[0] is None
    assert all(len(top) == 2 for c in chunks for top in c.logprobs.top_logprobs[1:]
               if top is not None)


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens  # no EOS: six tokens of text
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
        assert entry.bytes == list(entry.token.encode())
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6,
                                            temperature=0, logprobs=True, stream=True)
    streamed = [entry for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [entry.token for entry in streamed] == [entry.token for entry in content]
    assert all(entry.top_logprobs == [] for entry in streamed)  # top_logprobs not asked


def test_bad_samples_and_logprobs_fields_fail_alone(url):
    for body, field in (({"prompt": "hi", "n": 0}, "n"), ({"prompt": "hi", "n": 129}, "n"),
                        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
                        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "hi", "best_of": 3}, "best_of")):
        reply = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30, json=body)
        error = _assert_openai_error(reply, 400, f"{field}:")
        assert error["param"] == field, error
    for body, field in (({"top_logprobs": 2}, "top_logprobs"),
                        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs")):
        reply = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=30,
                           json={"messages": CHAT, **body})
        _assert_openai_error(reply, 400, f"{field}:")
    _health_ok(url)


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
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and [replica["status"] for replica in health["replicas"]] == ["ok"]


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
    from zipage.cli.parser import main
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


# ---------------------------------------------------------------- hostile input (issue #30)

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _assert_openai_error(reply, status: int, starts: str = "") -> dict:
    assert reply.status_code == status, (reply.status_code, reply.text[:500])
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and error["message"].startswith(starts), error
    return error


def _health_ok(url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"


def test_top_k_beyond_int64_is_a_400_and_the_engine_lives_on(url):
    body = b'{"prompt":"hi","max_tokens":4,"top_k":9223372036854775808}'  # the user's bytes
    reply = httpx.post(url + "/v1/completions", content=body, timeout=60,
                       headers={**AUTH, "content-type": "application/json"})
    error = _assert_openai_error(reply, 400, "top_k:")
    assert error["param"] == "top_k"
    _health_ok(url)
    reply = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": "hi", "max_tokens": 4, "top_k": 50, "seed": 1})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_nan_temperature_and_lone_surrogates_name_the_field(url):
    post = lambda body: httpx.post(url + "/v1/completions", content=body, timeout=60,  # noqa
                                   headers={**AUTH, "content-type": "application/json"})
    _assert_openai_error(post(b'{"prompt":"hi","temperature":NaN}'), 400,
                         "temperature: Input should be a finite number")
    _assert_openai_error(post(b'{"prompt":"\\ud800","max_tokens":2}'), 400,
                         "prompt: contains a lone UTF-16 surrogate")
    reply = httpx.post(url + "/v1/chat/completions", timeout=60,
                       headers={**AUTH, "content-type": "application/json"},
                       content=b'{"messages":[{"role":"user","content":"\\udc00"}]}')
    _assert_openai_error(reply, 400, "messages.0.content: contains a lone UTF-16 surrogate")
    _health_ok(url)


def test_unknown_routes_and_malformed_bodies_get_openai_errors(url):
    post = lambda body, **headers: httpx.post(  # noqa: E731
        url + "/v1/completions", content=body, timeout=60,
        headers={**AUTH, "content-type": "application/json", **headers})
    _assert_openai_error(httpx.get(url + "/v1/nothing", headers=AUTH), 404, "route: GET")
    _assert_openai_error(httpx.get(url + "/nothing"), 404, "route: GET")
    _assert_openai_error(httpx.delete(url + "/v1/models", headers=AUTH), 405, "route: DELETE")
    _assert_openai_error(httpx.get(url + "/v1/completions", headers=AUTH), 405, "route: GET")
    _assert_openai_error(post(b'{"prompt": "x",'), 400, "body: not valid JSON")
    _assert_openai_error(post(b'{"prompt": "\xff"}'), 400, "body: not valid UTF-8 (byte 12")
    _assert_openai_error(post(b"[" * 100_000 + b"]" * 100_000), 400,
                         "body: arrays or objects nested too deeply")
    _assert_openai_error(post(b'[1, 2]'), 400, "body:")
    _assert_openai_error(post(b'{"prompt": [1, ' + b"9" * 5000 + b"]}"), 400,
                         "body: a number longer than 4300 digits")
    _assert_openai_error(post(b'{"prompt": "x"}', **{"content-type": "text/plain"}), 400)
    # The model's name is never echoed whole: 1 MB in, a short message out.
    reply = post(json.dumps({"prompt": "x", "model": "m" * 2**20}).encode())
    error = _assert_openai_error(reply, 404, "model: 'mmm")
    assert len(reply.content) < 1000 and error["type"] == "model_not_found"
    _health_ok(url)


def test_the_key_comes_first_and_its_scheme_is_case_insensitive(url):
    body = {"prompt": "hi", "max_tokens": 2}
    for scheme in ("bearer", "BEARER", "Bearer"):
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": f"{scheme} {API_KEY}"})
        assert reply.status_code == 200, (scheme, reply.text)
    _assert_openai_error(httpx.get(url + "/v1/models"), 401, "api key: missing or wrong")
    _assert_openai_error(httpx.get(url + "/v1/models", headers={"Authorization": API_KEY}),
                         401)
    # Without the key nothing is parsed: malformed and oversized bodies are 401, not 400 / 413.
    reply = httpx.post(url + "/v1/completions", content=b'{"prompt": ',
                       headers={"content-type": "application/json"})
    _assert_openai_error(reply, 401)
    status, _, _ = _send_big_body(url, 50 * 2**20, chunked=False, headers={})
    assert status == 401


def _send_big_body(url: str, size: int, chunked: bool, headers: dict):
    """POST `size` bytes of JSON over a raw socket, the body sent on a thread while this one
    waits for the answer (a server that answers before reading the body closes the connection:
    a client that only reads after sending everything would see the reset, not the answer).
    (status, seconds from the headers to the answer's status line, body bytes sent by then)."""
    import threading

    host, port = url.removeprefix("http://").split(":")
    prefix = b'{"max_tokens": 1, "prompt": "'
    chunk = b"a" * 2**16
    lines = ["POST /v1/completions HTTP/1.1", f"Host: {host}",
             "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
    sock = socket.create_connection((host, int(port)))
    sent = [0]

    def send():
        try:
            pieces = [prefix] + [chunk] * ((size - len(prefix) - 2) // len(chunk))
            pieces.append(b"a" * (size - len(prefix) - 2 - sum(map(len, pieces[1:]))) + b'"}')
            for piece in pieces:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent[0] += len(piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: the rest is never read

    try:
        started = time.perf_counter()
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        answer = b""
        while b"\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
        elapsed = time.perf_counter() - started
        return int(answer.split()[1]), elapsed, sent[0]
    finally:
        sock.close()


def test_a_50_mb_body_is_a_fast_413_while_health_stays_fast(url):
    import threading

    latencies, stop = [], threading.Event()

    def poll():
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                assert client.get(url + "/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.2)
        size = 50 * 2**20
        status, seconds, sent = _send_big_body(url, size, chunked=False, headers=AUTH)
        chunked_status, chunked_seconds, chunked_sent = _send_big_body(url, size, chunked=True,
                                                                       headers=AUTH)
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    print(f"\n50 MiB body, Content-Length: {status} in {seconds * 1000:.1f} ms "
          f"({sent / 2**20:.1f} MiB sent by then); chunked: {chunked_status} in "
          f"{chunked_seconds * 1000:.1f} ms ({chunked_sent / 2**20:.1f} MiB sent); /health "
          f"under it: {len(latencies)} requests, median "
          f"{sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms, max "
          f"{max(latencies) * 1000:.1f} ms")
    assert status == 413 and seconds < 2.0 and sent < size // 2  # decided from the header
    assert chunked_status == 413 and chunked_sent < size // 2  # refused past the limit
    assert max(latencies) < 1.0
    _health_ok(url)


def test_fuzzed_bodies_never_500_and_the_engine_lives_on(url):
    """Hostile request bodies against the real server: every answer is a success or OpenAI's
    error body below 500, streams carry no error event, and the engine is healthy at the end."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis_profiles import examples

    huge_ints = st.sampled_from([0, -1, 1, 2, 64, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63,
                                 -2**63, 2**64, 10**30, -10**30])
    odd_floats = st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e-300,
                                  5e-324, 1e300, 0.5, 1.0, 2.5, -1.5])
    texts = st.one_of(st.text(max_size=30),  # every code point, lone surrogates included
                      st.sampled_from(["\ud800", "a\udfffb", "x" * 100_000, "", " "]))
    scalars = st.one_of(huge_ints, odd_floats, st.booleans(), st.none(), texts)
    garbage = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
    small = st.integers(1, 3)
    limit = st.one_of(small, huge_ints, odd_floats, st.booleans(), texts)  # never None: chat
    # without a limit generates up to the context
    optional = {
        "model": st.one_of(st.just("smollm2"), texts, garbage), "temperature": st.one_of(
            odd_floats, huge_ints, garbage), "top_p": st.one_of(odd_floats, garbage),
        "top_k": st.one_of(huge_ints, garbage), "seed": st.one_of(huge_ints, garbage),
        "stop": st.one_of(texts, st.lists(texts, max_size=20), garbage),
        "stream": st.one_of(st.booleans(), garbage), "n": st.one_of(huge_ints, garbage),
        "stream_options": st.one_of(st.fixed_dictionaries(
            {"include_usage": st.booleans()}), garbage),
        "ignore_eos": st.one_of(st.booleans(), garbage),
        "kv_budget": st.one_of(huge_ints, garbage), "logprobs": garbage,
        "best_of": garbage, "echo": garbage, "return_token_ids": garbage,
        "max_completion_tokens": limit, "unknown": garbage,
    }
    prompts = st.one_of(texts, st.lists(huge_ints, min_size=1, max_size=5),
                        st.lists(st.integers(0, 49151), min_size=1, max_size=20), garbage)
    messages = st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(
            ["user", "system", "assistant"]), texts, garbage)}, optional={
            "content": st.one_of(texts, garbage, st.lists(st.fixed_dictionaries({
                "type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=3))}),
            max_size=3), garbage)
    completion = st.fixed_dictionaries({"max_tokens": limit}, optional={
        "prompt": prompts, **optional})
    chat = st.fixed_dictionaries({"max_tokens": limit}, optional={
        "messages": messages, **optional})
    raw = st.one_of(st.binary(max_size=64), st.sampled_from([
        b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"prompt": "x",}', b"\xff\xfe",
        b'{"a":' * 5000 + b"1" + b"}" * 5000, b'{"prompt": "\\ud800"}', b"NaN"]))
    # Valid bodies with up to two fields made hostile: most reach the engine, and a hostile
    # value meets valid neighbours (a bad top_k beside a good stream, ...).
    plain = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)
    valid = {
        "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 80),
        "seed": st.integers(0, 2**32 - 1), "stop": st.lists(plain, max_size=3),
        "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
            {"include_usage": st.booleans()}), "ignore_eos": st.booleans(),
        "model": st.just("smollm2"), "kv_budget": st.sampled_from([64, 128]),
    }
    patches = st.dictionaries(st.sampled_from(sorted({*valid, "max_tokens", "prompt",
                                                      "messages", "n", "logprobs"})),
                              garbage, max_size=2)

    def patched(base: dict, patch: dict) -> dict:
        body = {**base, **patch}
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 2  # chat without a limit generates up to the context
        return body

    good_completion = st.builds(patched, st.fixed_dictionaries(
        {"prompt": st.one_of(plain, st.lists(st.integers(0, 49151), min_size=1, max_size=20)),
         "max_tokens": small}, optional=valid), patches)
    good_chat = st.builds(patched, st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": plain}),
                              min_size=1, max_size=2), "max_tokens": small},
        optional=valid), patches)
    requests = st.one_of(
        st.tuples(st.just("/v1/completions"), good_completion),
        st.tuples(st.just("/v1/chat/completions"), good_chat),
        st.tuples(st.just("/v1/completions"), completion),
        st.tuples(st.just("/v1/chat/completions"), chat),
        st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw))
    seen = {"statuses": {}}
    http = httpx.Client(base_url=url, timeout=120)

    @settings(max_examples=examples(200), deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def check(request):
        path, body = request
        content = body if isinstance(body, bytes) else json.dumps(body).encode(
            "utf-8", "surrogatepass")  # json.dumps escapes surrogates as \ud800: valid bytes
        with http.stream("POST", path, content=content,
                         headers={**AUTH, "content-type": "application/json"}) as reply:
            data = reply.read()
        status = reply.status_code
        seen["statuses"][status] = seen["statuses"].get(status, 0) + 1
        assert status < 500, (status, data[:300], content[:300])
        if status >= 400:
            error = json.loads(data)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
            assert isinstance(error["message"], str) and len(error["message"]) < 1000
        elif reply.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in event[:12]
                                                      for event in events[:-1]), events
        else:
            assert json.loads(data)["usage"]["completion_tokens"] >= 1

    try:
        check()
    finally:
        http.close()
    print(f"\nfuzzed statuses: {dict(sorted(seen['statuses'].items()))}")
    assert seen["statuses"].get(200, 0) >= 5  # the fuzz reached the engine, not only the door
    _health_ok(url)
    reply = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    _wait_idle(url)
