"""`zipage serve --async-scheduling` over real HTTP on localhost: the SmolLM2 GGUF on the CPU engine,
each step planned while the one before runs (docs/architecture.md, 'Async scheduling').

Greedy completions, streamed and not, and a chat that stops at its end-of-sequence token (one
step late inside the engine, its extra token dropped) equal a synchronous in-process `LLM`'s;
eight concurrent streams complete with their token counts, and afterwards the server is idle,
every block free, with each step counted once in /metrics. The served twin refuses the flag.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("gguf")

from serve_helpers import start_server, stop_server, wait_healthy  # noqa: E402
from smollm2 import GGUF, needs_smollm2, reference_llm  # noqa: E402

KNOBS = dict(block_size=16, kv_budget=64, window=4, max_model_len=2048, max_num_seqs=4)
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]

pytestmark = needs_smollm2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve-async")
    args = ["--model", str(GGUF), "--engine", "cpu", "--dtype", "float32", "--kv-memory-gb",
            "0.25", "--served-model-name", "smollm2", "--async-scheduling",
            "--block-size", "16", "--budget", "64", "--window", "4", "--max-model-len", "2048",
            "--max-num-seqs", "4"]
    served = start_server(args, directory / "server.log")
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def llm(server):
    """The synchronous reference, loaded in this process while the server loads."""
    return reference_llm(**KNOBS)


@pytest.fixture(scope="module")
def client(server, llm):
    wait_healthy(server, 240, poll_s=0.5, request_timeout=1)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {name: float(value) for name, value in
            re.findall(r"^(zipage:\w+)(?:\{[^}]*\})?\s+(\S+)$", text, re.M)}


def test_greedy_completions_equal_the_synchronous_engine(client, llm):
    from zipage.core.sampling import SamplingParams

    # Up to 80 tokens: past the budget of 64 where a request runs that long (it compresses on
    # the way), or to its end-of-sequence token.
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=80),
                            progress=False)
    for prompt, reference in zip(PROMPTS, expected):
        reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=80,
                                          temperature=0)
        stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=80,
                                           temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert reply.choices[0].text == streamed == reference.text
        assert reply.choices[0].finish_reason == reference.finish_reason
        assert reply.usage.completion_tokens == len(reference.token_ids)
    assert any(len(reference.token_ids) > 64 for reference in expected)


def test_a_chat_stops_where_the_synchronous_engine_stops(client, llm):
    from zipage.core.sampling import SamplingParams

    messages = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=64,
                                           temperature=0)
    expected = llm.chat([messages], SamplingParams(temperature=0, max_tokens=64),
                        progress=False)[0]
    assert (reply.choices[0].finish_reason, reply.choices[0].message.content) == (
        expected.finish_reason, expected.text)
    assert expected.finish_reason == "stop"
    assert reply.usage.completion_tokens == len(expected.token_ids)


def test_concurrent_streams_complete_and_leave_the_server_idle(client, server):
    before = metrics(server.url)

    async def one(async_client, index: int) -> int:
        stream = await async_client.completions.create(
            model="smollm2", prompt=f"{index} little pigs", max_tokens=24 + index,
            temperature=0.8, seed=index, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.prompt_tokens, usage.completion_tokens

    async def all_of_them():
        async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                          max_retries=0)
        return await asyncio.gather(*(one(async_client, i) for i in range(8)))

    usages = asyncio.run(all_of_them())
    assert [completion for _, completion in usages] == [24 + i for i in range(8)]
    deadline = time.monotonic() + 30
    while True:
        after = metrics(server.url)
        if after["zipage:num_requests_running"] == 0 and after["zipage:kv_blocks_used"] == 0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    # Every prompt token counted once (a step counts when it settles, not also when it is
    # launched), and again only where a preemption recomputed it.
    prompts = sum(prompt for prompt, _ in usages)
    counted = (after["zipage:prefix_cache_queries_total"]
               - before["zipage:prefix_cache_queries_total"])
    if after["zipage:preemptions_total"] == before["zipage:preemptions_total"]:
        assert counted == prompts
    else:
        assert prompts <= counted < 2 * prompts


def test_the_served_twin_refuses_async_scheduling():
    result = subprocess.run([sys.executable, "-m", "zipage.cli", "serve", "--simulate",
                             "--model", "qwen3-8b", "--async-scheduling"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--async-scheduling" in result.stderr and len(result.stderr.strip().splitlines()) == 1
