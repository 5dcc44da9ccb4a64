"""What the HTTP client library costs a streaming benchmark client: the same trace streamed from one
server by a bare httpx client and a bare aiohttp client (what `zipage bench serve` and `vllm bench
serve` use), each in a fresh process, printing each one's mean TTFT and its CPU
seconds. Neither does more per chunk than find the first token, so the difference is the library's.

    zipage serve --simulate --model random:qwen3-8b --hardware h200 --kv-memory-gb 6 \
        --block-size 64 --budget 512 --cost-model qwen3-8b-h200-b64-k512-zipage --data-parallel 2 &
    python bench/http_client_cost.py TRACE --url http://127.0.0.1:8000 [--repeat 2]

TRACE is any trace `zipage replay` reads (its prompts sent as token ids, its arrivals kept). The
server's own mean TTFT over each run (its /metrics histogram) is printed beside: what a client
measures beyond it is the HTTP path's. httpx comes with the openai client (the serve extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
import urllib.request

from zipage.serve.bench import server_ttft_mean, ttft_histogram


def server_ttft(url: str) -> dict[str, float]:
    return ttft_histogram(urllib.request.urlopen(url + "/metrics").read().decode())


async def replay(library: str, url: str, requests: list, model: str) -> list[float]:
    ttfts: list[float] = []
    start = time.perf_counter() + 0.5

    async def one(client, request) -> None:
        due = start + request.arrival_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        body = {"model": model, "prompt": list(request.prompt_token_ids),
                "max_tokens": request.max_output_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        first = None
        if library == "httpx":
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data:") and '"choices":[{' in line:
                        first = time.perf_counter()
        else:
            async with client.post(url + "/v1/completions", json=body) as response:
                async for line in response.content:
                    if first is None and line.startswith(b"data:") and b'"choices":[{' in line:
                        first = time.perf_counter()
        ttfts.append(first - due)

    if library == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            await asyncio.gather(*(one(client, request) for request in requests))
    else:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                         connector=connector) as client:
            await asyncio.gather(*(one(client, request) for request in requests))
    return ttfts


def child(library: str, trace_path: str, url: str, model: str) -> None:
    from zipage.core.deployment import trace_sequences
    from zipage.trace import DEFAULT_VOCAB_SIZE
    from zipage.trace_import import load_trace_file

    requests = trace_sequences(load_trace_file(trace_path), DEFAULT_VOCAB_SIZE, need_tokens=True)
    ttfts = asyncio.run(replay(library, url, requests, model))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"mean_ttft_s": sum(ttfts) / len(ttfts),
                      "cpu_s": usage.ru_utime + usage.ru_stime, "requests": len(ttfts)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        args.model = json.loads(urllib.request.urlopen(args.url + "/v1/models").read())["data"][0]["id"]
    if args.child:
        child(args.child, args.trace, args.url, args.model)
        return 0
    print("| client | mean TTFT ms | server's mean TTFT ms | client CPU s |")
    print("|---|---|---|---|")
    for _ in range(args.repeat):
        for library in ("httpx", "aiohttp"):
            before = server_ttft(args.url)
            out = subprocess.run([sys.executable, __file__, args.trace, "--url", args.url,
                                  "--model", args.model, "--child", library],
                                 capture_output=True, text=True, check=True).stdout
            after = server_ttft(args.url)
            result = json.loads(out.strip().splitlines()[-1])
            server = server_ttft_mean(before, after)
            server_ms = "-" if server is None else f"{1000 * server:.1f}"
            print(f"| {library} | {1000 * result['mean_ttft_s']:.1f} | {server_ms} | "
                  f"{result['cpu_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
