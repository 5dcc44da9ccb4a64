"""`zipage serve`'s two log lines on stderr: one per request (the access log) and, every few
seconds while the server works, the stats line vLLM prints (docs/serve.md, 'Logs').

- `AccessLog`, ASGI middleware outside every other: method, path, status, latency, and for the
  completion routes the response's id and its prompt and output tokens. It replaces uvicorn's
  access log (which knows neither the id nor the tokens, and is off at the server's log level).
  The routes name their answer through `note_answer` (a context variable: the middleware and the
  route run in one task), so no route passes anything down.
- `StatsLine`: throughput over the interval, the queues, KV use and the prefix-cache hit rate,
  read from the server's own metrics (`ServerMetrics.sums`), so the line and /metrics agree.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar

from zipage.serve.metrics import ServerMetrics

# The longest path an access line shows (a path is client input).
MAX_PATH_CHARS = 200


class _Access:
    """What a route tells the access log about its request."""

    __slots__ = ("rid", "usage")

    def __init__(self) -> None:
        self.rid: str | None = None
        self.usage: Callable[[], dict] | None = None  # the answer's `usage()`, read at the end


_current: ContextVar[_Access | None] = ContextVar("zipage_access", default=None)


def note_answer(rid: str, usage: Callable[[], dict]) -> None:
    """The request being served answers as `rid`; `usage()` gives its token counts once done."""
    access = _current.get()
    if access is not None:
        access.rid, access.usage = rid, usage


def _write(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class AccessLog:
    """One line per HTTP request once its response is over (a stream: after its last event):

        zipage serve: 127.0.0.1:50312 "POST /v1/completions HTTP/1.1" 200 0.412s
            id=cmpl-... prompt_tokens=5 completion_tokens=16

    (one line); `-` for what a request has not (an id and tokens before the body was valid)."""

    def __init__(self, app, write: Callable[[str], None] = _write) -> None:
        self.app = app
        self.write = write

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = None
        access = _Access()
        token = _current.set(access)

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except Exception:
            status = status or 500  # Starlette's outermost handler answers it after us
            raise
        finally:
            _current.reset(token)
            self.write(_line(scope, status, time.perf_counter() - start, access))


def _line(scope, status: int | None, seconds: float, access: _Access) -> str:
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    path = scope.get("path", "")
    query = scope.get("query_string", b"")
    if query:
        path += "?" + query.decode("latin-1")
    if len(path) > MAX_PATH_CHARS:
        path = path[:MAX_PATH_CHARS] + "..."
    prompt = output = "-"
    if access.usage is not None:
        usage = access.usage()
        prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
    return (f'zipage serve: {where} "{scope.get("method", "-")} {path} '
            f'HTTP/{scope.get("http_version", "1.1")}" {status or "-"} {seconds:.3f}s '
            f"id={access.rid or '-'} prompt_tokens={prompt} completion_tokens={output}")


class StatsLine:
    """vLLM's periodic stats line, for the whole server (every replica summed):

        zipage serve: Avg prompt throughput: 51.2 tokens/s, Avg generation throughput: 160.0
            tokens/s, Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit
            rate: 40.0%

    (one line). Throughputs and the hit rate are over the interval since the previous line
    (prompt tokens as `zipage:prompt_tokens_total` counts them, at each request's first token;
    hits over queries of `zipage:prefix_cache_*`); running, waiting and KV use are the latest
    step's. Printed only while there is activity: tokens in this interval or the one before (so
    the line after a burst shows it ending), or requests running or waiting."""

    def __init__(self, metrics: ServerMetrics, interval_s: float,
                 write: Callable[[str], None] = _write) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.write = write
        self._last = self._read()
        self._last_s = time.monotonic()
        self._moved_before = False

    def _read(self) -> dict[str, float]:
        sums = self.metrics.sums()
        return {key: sums.get(f"zipage:{key}", 0.0) for key in (
            "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total", "num_requests_running", "num_requests_waiting",
            "kv_blocks_used")}

    def line(self) -> str | None:
        """The line for the interval that ends now, or None when idle; starts the next one."""
        now, current = time.monotonic(), self._read()
        elapsed = max(now - self._last_s, 1e-9)
        delta = {key: current[key] - self._last[key] for key in current}
        self._last, self._last_s = current, now
        moved = delta["prompt_tokens_total"] > 0 or delta["generation_tokens_total"] > 0
        busy = current["num_requests_running"] + current["num_requests_waiting"] > 0
        moved_before, self._moved_before = self._moved_before, moved
        if not (moved or moved_before or busy):
            return None
        queries = delta["prefix_cache_queries_total"]
        hit_rate = delta["prefix_cache_hits_total"] / queries if queries > 0 else 0.0
        blocks = self.metrics.num_blocks * len(self.metrics.replicas)
        return (f"zipage serve: Avg prompt throughput: "
                f"{delta['prompt_tokens_total'] / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {delta['generation_tokens_total'] / elapsed:.1f} "
                f"tokens/s, Running: {current['num_requests_running']:.0f} reqs, "
                f"Waiting: {current['num_requests_waiting']:.0f} reqs, "
                f"KV cache usage: {100 * current['kv_blocks_used'] / blocks:.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%")

    async def run(self) -> None:
        """Write a line every interval while there is activity, until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            line = self.line()
            if line is not None:
                self.write(line)
