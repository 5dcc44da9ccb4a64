"""Real HTTP servers on localhost for the tests of `zipage bench serve`'s client: a recording
proxy in front of a real server, and a stand-in that answers like a server. Each is an aiohttp
application served by its own event loop in a thread, so a test can run the client with
`asyncio.run` beside it; both see the client's requests over real sockets, as a server would.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import aiohttp
from aiohttp import web


class Background:
    """An aiohttp application on a free localhost port, served in a thread while entered."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        if not self.ready.wait(30):
            raise AssertionError("the localhost stand-in did not start in 30 s")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        self.port = runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()


class RecordingProxy(Background):
    """Forwards every request to `upstream` and streams each response back as its bytes come.
    Each completion exchange (a path ending in "completions") is recorded, in the order the
    requests reached the proxy: `sent` (when it reached it: after the client sent it), `body`,
    `status`, `raw` (the response's bytes) and `ended` (when its last bytes were passed on: before
    the client could have read them). So each exchange's [sent, ended] lies inside the client's
    own span of that request."""

    def __init__(self, upstream: str) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_cleanup.append(self._close)
        super().__init__(app)
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[SimpleNamespace] = []
        self.session: aiohttp.ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.read()
        exchange = None
        if request.path.endswith("completions"):
            exchange = SimpleNamespace(sent=arrived, body=json.loads(body), status=None, raw=b"",
                                       ended=None)
            self.exchanges.append(exchange)
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=None))
        headers = {name: value for name, value in request.headers.items()
                   if name.lower() in ("content-type", "authorization")}
        async with self.session.request(request.method, self.upstream + request.path_qs,
                                        data=body, headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.headers["Content-Type"] = upstream.headers.get("Content-Type",
                                                                    "application/octet-stream")
            await response.prepare(request)
            raw, last = bytearray(), arrived
            try:
                async for data in upstream.content.iter_any():
                    raw += data
                    last = time.perf_counter()
                    await response.write(data)
                await response.write_eof()
            except ConnectionResetError:  # the client left before the end: what came is kept
                pass
        if exchange is not None:
            exchange.status, exchange.raw, exchange.ended = upstream.status, bytes(raw), last
        return response

    async def _close(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()


class StandInServer(Background):
    """Answers like a server: one model, "m", at /v1/models; each /v1/completions streamed as one
    chunk of two tokens (with `token_ids` where given), the usage and [DONE]; anything else a
    404. The completion request bodies go to `bodies`, the client's address of each request to
    `peers` (one a connection)."""

    def __init__(self, token_ids: list[int] | None) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        super().__init__(app)
        self.token_ids = token_ids
        self.bodies: list[dict] = []
        self.peers: list[tuple] = []

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.peers.append(request.transport.get_extra_info("peername"))
        choice = {"index": 0, "text": "hi", "finish_reason": "length"}
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
        usage = {"choices": [], "usage": {"completion_tokens": 2}}
        # Streamed as a server streams: chunked, each event written as it is made, the stream's
        # end a moment after [DONE].
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in ({"choices": [choice]}, usage):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.02)
        await response.write_eof()
        return response
