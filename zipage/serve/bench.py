"""`zipage bench serve TRACE --url URL`: replay a trace against any OpenAI-compatible server.

Each request is sent at its `arrival_s` (real time from the start) to /v1/completions, with its
prompt as token ids (`zipage.trace.prompt_token_ids`: the very ids `zipage replay` feeds the engine),
`max_tokens` = its `output_len`, `ignore_eos` and greedy sampling, streamed. TTFT, TPOT and the
finish time are measured from the stream on this side; the output length is the server's usage
count. The result is a run like `zipage replay`'s: the same summary keys (`--json`) and the same
`requests.csv` columns, so `zipage compare` sets a served run beside an offline replay or a
simulation of the same trace. What only the server knows (steps, decisions, the config,
per-request compressions) is left out: the run's "kind" is "served", its steps.csv is empty and
it has no decisions.log, and `zipage compare` compares its requests only. Against `zipage serve`,
the run's compressions and preemptions come from its /metrics.

The client is httpx with a hand-read event stream (not the openai package): at hundreds of
concurrent streams the client's own per-chunk cost must stay far below the server's.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace

import httpx

from zipage.core.metrics import summarize
from zipage.errors import ZipageError
from zipage.records import RequestRecord
from zipage.rundir import SERVED
from zipage.trace import DEFAULT_VOCAB_SIZE, Trace, TraceRequest, prompt_token_ids

# What a client cannot see: per-step records and the server's per-request bookkeeping.
SERVER_ONLY_KEYS = ("peak_running", "mean_running", "max_blocks_after_compress", "steps",
                    "n_max", "max_concurrency", "num_blocks")
_COUNTER = re.compile(r"^zipage:(compressions|preemptions)_total\{[^}]*\}\s+(\S+)$", re.M)
_ROUTED = re.compile(r'^zipage:requests_routed_total\{[^}]*replica="(\d+)"[^}]*\}\s+(\S+)$', re.M)


async def bench_serve(trace: Trace, url: str, model: str | None = None, *,
                      api_key: str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                      progress: bool = False) -> tuple[dict, list[RequestRecord]]:
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=None,
                                 limits=limits) as client:
        model = model or await _served_model(client, base)
        counters_before = await _server_counters(client)
        bar = None
        if progress:
            from zipage.core.recorder import progress_bar

            bar = progress_bar(len(trace.requests), "requests", "req")
        started = time.perf_counter()
        records = await asyncio.gather(*(
            _one_request(client, request, model, vocab_size, started, bar)
            for request in trace.requests))
        wall = time.perf_counter() - started
        if bar is not None:
            bar.close()
        counters_after = await _server_counters(client)
    summary = _summary(list(records), counters_before, counters_after)
    summary.update(wall_s=wall, driver="served", kind=SERVED, url=base, model=model,
                   settings={})
    return summary, list(records)


async def _one_request(client: httpx.AsyncClient, request: TraceRequest, model: str,
                       vocab_size: int, started: float, bar) -> RequestRecord:
    prompt = prompt_token_ids(request, vocab_size=vocab_size)
    body = {"model": model, "prompt": prompt, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    await asyncio.sleep(max(0.0, started + request.arrival_s - time.perf_counter()))
    first = finish = None
    chunks = 0
    output_len = None
    error = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {_error_message(text)}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = _error_message(data)
                        break
                    if chunk.get("choices"):
                        now = time.perf_counter() - started
                        first = now if first is None else first
                        finish = now
                        chunks += 1
                    if chunk.get("usage"):
                        output_len = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if bar is not None:
        bar.update(1)
    if error is None and first is None:
        error = "the stream ended without a token"
    return RequestRecord(
        id=request.id, arrival=request.arrival_s, first_token=first,
        finish=finish if error is None else None, prompt_len=len(prompt),
        output_len=output_len if output_len is not None else chunks,
        n_preempted=None, n_compressions=None, max_blocks_held_after_first_compression=None,
        status="finished" if error is None else "failed", error=error)


def _summary(records: list[RequestRecord], before: dict | None, after: dict | None) -> dict:
    # The shared summary over records whose server-side counts are unknown (zero for the sum).
    known = [replace(record, n_preempted=0, n_compressions=0,
                     max_blocks_held_after_first_compression=0) for record in records]
    summary = summarize([], known)
    for key in SERVER_ONLY_KEYS:
        summary[key] = None
    for key in ("compressions", "preemptions"):
        summary[key] = (int(after[key] - before[key])
                        if before is not None and after is not None else None)
    # Beside `zipage plan --replicas N --routing P`'s own key of that name: how the server's
    # router spread this trace (a replicated Zipage server; None elsewhere).
    summary["requests_per_replica"] = None
    if before is not None and after is not None and after["routed"]:
        summary["requests_per_replica"] = [
            int(after["routed"][replica] - before["routed"].get(replica, 0.0))
            for replica in sorted(after["routed"], key=int)]
    return summary


async def _served_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise ZipageError(f"--url: no model list at {base}/v1/models ({error}); check the URL "
                          "or pass --model NAME") from None


async def _server_counters(client: httpx.AsyncClient) -> dict | None:
    """Compressions and preemptions so far, and the requests routed to each replica, from a
    Zipage server's /metrics (None elsewhere)."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    found: dict = {}
    for name, value in _COUNTER.findall(response.text):  # one series per replica: their sum
        found[name] = found.get(name, 0.0) + float(value)
    if len(found) != 2:
        return None
    found["routed"] = {replica: float(value) for replica, value in _ROUTED.findall(response.text)}
    return found


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]
