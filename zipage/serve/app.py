"""The HTTP server: OpenAI's completions and chat completions over the real engine.

FastAPI on uvicorn, as vLLM and SGLang serve: an ASGI event loop holds thousands of idle streams
for the cost of a coroutine each, FastAPI's pydantic models validate the request bodies (a wrong
type is a 400 naming the field), and the OpenAI clients already speak its server-sent events.

Each request: the API key and the body's size (`_Gate`, before a byte of the body is parsed) ->
validate -> tokens (on a worker thread: a long prompt never holds the event loop) ->
`SamplingParams` -> the core's own admission check (a prompt that can never fit is a 400 naming
the limit) -> the waiting cap (429) -> the engine process (`engine_client`). Every error, whoever
raises it (a route, FastAPI, Starlette's router, a bug), leaves as OpenAI's error body. Token ids
come back after every step, are detokenized here and sent as they come (`stream: true`) or at
the end. A client that disconnects aborts its request at once: the engine frees its blocks
before its next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from zipage.core.sampling import SamplingParams
from zipage.errors import ZipageError
from zipage.serve import DEFAULT_MAX_BODY_BYTES
from zipage.serve.detokenize import IncrementalText
from zipage.serve.engine_client import Delta, EngineClient, EngineStopped, RequestHandle
from zipage.serve.metrics import CONTENT_TYPE, ServerMetrics
from zipage.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    ServeError,
    error_body,
    short,
    validation_message,
)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class Server:
    """What the routes share: the engine process, the tokenizer, the waiting cap, the API key."""

    def __init__(self, engine: EngineClient, tokenizer, model_name: str,
                 max_waiting: int | None = None, api_key: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.api_key = api_key
        self.metrics = ServerMetrics(model_name, engine.info.capacity.num_blocks)
        self.eos = engine.info.eos_token_ids
        self.max_model_len = engine.info.config.max_model_len
        self.created = int(time.time())
        # One thread: tokenizers are not all safe to call from several threads at once, and
        # what matters is that the event loop (streams, /health) never waits for one.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="zipage-tokenize")

    # ---------------------------------------------------------------- admission

    def check(self, body: SamplingFields) -> None:
        """What needs no tokens: refused fields and the model's name (cut in the message)."""
        body.check_unsupported()
        if body.model is not None and body.model != self.model_name:
            raise ServeError(404, f"model: {short(body.model)} is not served here; use "
                                  f"{self.model_name!r} (GET /v1/models)", "model",
                             "model_not_found")

    async def tokens(self, work, *args) -> list[int]:
        """Run a tokenizing call on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work, *args)

    def prepare(self, body: SamplingFields, prompt_ids: list[int],
                default_max_tokens: int) -> RequestHandle:
        """Sampling settings, the core's admission check, the waiting cap; then submit."""
        limit = body.output_limit if isinstance(body, ChatRequest) else body.max_tokens
        try:
            sampling = SamplingParams(
                temperature=body.temperature, top_p=body.top_p,
                top_k=0 if body.top_k == -1 else body.top_k, seed=body.seed,
                max_tokens=default_max_tokens if limit is None else limit,
                ignore_eos=body.ignore_eos, kv_budget=body.kv_budget)
        except ZipageError as error:
            raise ServeError(400, str(error), str(error).split(":")[0]) from None
        budget_reason = self.engine.admission.budget_reason(body.kv_budget)
        if budget_reason is not None:
            raise ServeError(400, budget_reason.replace("kv_budget ", "kv_budget: ", 1),
                             "kv_budget")
        reason = self.engine.rejection_reason(len(prompt_ids), sampling.max_tokens,
                                              body.kv_budget)
        if reason is not None:
            self.metrics.rejected.inc()
            reason = reason.split(": ", 1)[-1].replace("output_len", "max_tokens")
            raise ServeError(400, f"prompt: too long for this server: {reason}", "prompt")
        waiting = self.engine.num_waiting
        if self.max_waiting is not None and waiting >= self.max_waiting:
            self.metrics.rejected.inc()
            raise ServeError(429, f"server busy: {waiting} requests are waiting "
                                  f"(--max-waiting {self.max_waiting}); retry later",
                             None, "rate_limit_exceeded")
        try:
            handle = self.engine.submit(prompt_ids, sampling)
        except EngineStopped as error:
            raise ServeError(503, str(error), None, "server_error") from None
        return handle

    def default_output_limit(self, prompt_len: int) -> int:
        """Chat's default max_tokens: whatever the context and memory leave (vLLM's rule)."""
        scheduler = self.engine.admission
        limit = (self.max_model_len or 2**31) - prompt_len
        if not scheduler.compress:  # Full KV: the request's KV must fit the pool
            limit = min(limit, scheduler.block_manager.num_blocks * scheduler.block_size
                        - prompt_len + 1)
        return max(1, limit)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            vocab = self.engine.info.vocab_size
            if max(prompt) >= vocab:
                raise ServeError(400, f"prompt: token id {max(prompt)} is outside the "
                                      f"vocabulary (0..{vocab - 1})", "prompt")
            return list(prompt)
        if self.tokenizer is None:
            raise ServeError(400, "prompt: this model has no tokenizer (random weights); send "
                                  "token ids", "prompt")
        try:
            return list(self.tokenizer.encode(prompt))
        except Exception as error:  # noqa: BLE001 - the text is what it refused
            raise ServeError(400, f"prompt: the tokenizer refused it: {error}",
                             "prompt") from None

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        """The model's own chat template (GGUF files and HF directories both carry one)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ServeError(400, "messages: this model has no chat template; use "
                                  "/v1/completions", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(body.plain_messages(),
                                                     add_generation_prompt=True, tokenize=True)
        except Exception as error:  # the template's own complaint (roles, order)
            raise ServeError(400, f"messages: the chat template refused them: {error}",
                             "messages") from None
        if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # ---------------------------------------------------------------- running a request

    async def deltas(self, handle: RequestHandle) -> AsyncIterator[list[Delta]]:
        """The request's deltas, as they arrive; several at once when the reader lagged. Close
        it (`aclosing`) or cancel it, and the request is aborted unless it had ended."""
        try:
            while True:
                batch = [await handle.deltas.get()]
                while not handle.deltas.empty():
                    batch.append(handle.deltas.get_nowait())
                yield batch
                if batch[-1].finish_reason is not None or batch[-1].error is not None:
                    return
        finally:
            self.engine.abort(handle)  # a no-op once the engine reported the end

    def absorb(self, handle: RequestHandle, text: IncrementalText,
               batch: list[Delta]) -> str | None:
        """Feed a batch of deltas to the text; the finish reason, if the request ended (a stop
        string ends it here: the engine drops it before its next step)."""
        tokens = [token for delta in batch for token in delta.token_ids]
        last = batch[-1]
        if last.error is not None:
            raise ServeError(last.status, last.error, None,
                             "invalid_request_error" if last.status < 500 else "server_error")
        finish = last.finish_reason
        text_tokens = tokens
        if finish == "stop" and tokens and tokens[-1] in self.eos:
            text_tokens = tokens[:-1]  # the EOS that ended the request is not text
        text.add(text_tokens)
        if finish is not None:
            text.finish()
        elif text.stopped:
            finish = "stop"
            self.engine.abort(handle, finish)
        text.generated += len(tokens)
        return finish


def _completion_chunk(server: Server, rid: str, text: str, finish: str | None,
                      token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": [choice]}


def _chat_chunk(server: Server, rid: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": server.model_name,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict | str) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n"


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, work):
    """Run `work` (a coroutine); if the client disconnects first, cancel it (its `finally`
    aborts the request in the engine). Streaming responses get this from Starlette."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task not in done:
        task.cancel()
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


def build_app(engine: EngineClient, tokenizer, model_name: str, *,
              max_waiting: int | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The routes over a started engine process (`EngineClient.start`); the app's shutdown stops
    that process."""
    server = Server(engine, tokenizer, model_name, max_waiting, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(server.metrics)
        yield
        engine.close()
        server.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(engine.stop_process)

    app = FastAPI(title="Zipage", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_Gate, api_key=api_key, max_body_bytes=max_body_bytes)

    # One error body for everything: OpenAI's clients read `error.message`, and docs/serve.md
    # promises that shape for every status.
    @app.exception_handler(ServeError)
    async def serve_error(request: Request, error: ServeError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        message, field = validation_message(error.errors())
        return _error(400, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        status = error.status_code
        if status == 404:
            message = (f"route: {request.method} {short(request.url.path)} does not exist; the "
                       "routes are /v1/completions, /v1/chat/completions, /v1/models, /health, "
                       "/metrics")
        elif status == 405:
            message = (f"route: {request.method} is not allowed on {short(request.url.path)} "
                       f"(allowed: {error.headers.get('Allow', '?') if error.headers else '?'})")
        elif error.detail == "There was an error parsing the body":  # FastAPI's, not JSON
            message = ("body: could not be parsed (not UTF-8, or a number too long for JSON); "
                       "send a JSON object")
        else:
            message = str(error.detail)
        return _error(status, message, None, headers=error.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        # Starlette re-raises after this response is sent, so uvicorn logs the traceback.
        return _error(500, f"internal error: {type(error).__name__}; the server's log has the "
                           "traceback", None)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "error",
                                 "error": engine.error or "the engine process stopped"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": server.created,
            "owned_by": "zipage", "max_model_len": server.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.echo:
            raise ServeError(400, "echo: not supported; leave it out", "echo")
        server.check(body)
        prompt_ids = await server.tokens(server.encode, body.prompt)
        handle = server.prepare(body, prompt_ids, DEFAULT_COMPLETION_TOKENS)
        rid = f"cmpl-{uuid.uuid4().hex}"
        want_ids = body.return_token_ids or server.tokenizer is None
        text = IncrementalText(server.tokenizer, body.stop_strings)
        if body.stream:
            return _stream(server, handle, _completion_stream(
                server, handle, rid, text, len(prompt_ids), want_ids, body.include_usage))
        return await _cancel_on_disconnect(request, _complete(
            server, handle, text, lambda finish: {
                "id": rid, "object": "text_completion", "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "text": text.text, "logprobs": None,
                             "finish_reason": finish,
                             **({"token_ids": text.token_ids} if want_ids else {})}],
                "usage": _usage(len(prompt_ids), text.generated)}))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        server.check(body)
        prompt_ids = await server.tokens(server.chat_prompt, body)
        handle = server.prepare(body, prompt_ids, server.default_output_limit(len(prompt_ids)))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        text = IncrementalText(server.tokenizer, body.stop_strings)
        if body.stream:
            return _stream(server, handle, _chat_stream(
                server, handle, rid, text, len(prompt_ids), body.include_usage))
        return await _cancel_on_disconnect(request, _complete(
            server, handle, text, lambda finish: {
                "id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text.text},
                             "logprobs": None, "finish_reason": finish}],
                "usage": _usage(len(prompt_ids), text.generated)}))

    return app


_KINDS = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}


def _error(status: int, message: str, param: str | None, headers=None) -> JSONResponse:
    kind = _KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, kind, param, status), status, headers=headers)


def _bearer_key(header: str | None) -> str | None:
    """The key of an 'Authorization: Bearer KEY' header; the scheme is case-insensitive
    (RFC 7235), so 'bearer KEY' is the same header."""
    scheme, _, key = (header or "").strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


class _Gate:
    """ASGI middleware in front of the routes, run before a byte of the body is read: the API key
    (so a client without it cannot make the server read or parse anything), then the body's size.
    A Content-Length over the limit is a 413 at once; a body without one (chunked) is counted as
    it arrives and refused once it passes the limit, so no request makes the server hold more
    than `max_body_bytes` of body."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> str:
        return (f"body: larger than this server's limit of {self.max_body_bytes} bytes "
                "(zipage serve --max-body-bytes)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            key = _bearer_key(headers.get("authorization"))
            if key is None or not secrets.compare_digest(key.encode(), self.api_key.encode()):
                response = _error(401, "api key: missing or wrong; send the header "
                                       "'Authorization: Bearer KEY' with the server's key",
                                  None, headers={"Connection": "close"})
                await response(scope, receive, send)
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            # The body is never read: the connection closes after the answer.
            await _error(413, self._too_large(), None,
                         headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # FastAPI re-raises its own HTTPException from a body read: the handler
                    # above answers it.
                    raise HTTPException(413, self._too_large(), headers={"Connection": "close"})
            return message

        await self.app(scope, counted, send)


async def _complete(server: Server, handle: RequestHandle, text: IncrementalText, respond):
    finish = None
    async with aclosing(server.deltas(handle)) as deltas:
        async for batch in deltas:
            finish = server.absorb(handle, text, batch)
            if finish is not None:
                break
    return JSONResponse(respond(finish))


class _EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends, even when the
    client left before the first event (the event generator then never starts)."""

    def __init__(self, events: AsyncIterator[str], on_close) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _stream(server: Server, handle: RequestHandle, events: AsyncIterator[str]) -> _EventStream:
    return _EventStream(events, lambda: server.engine.abort(handle))


async def _completion_stream(server, handle, rid, text, prompt_len, want_ids, include_usage):
    sent_ids = 0
    try:
        async with aclosing(server.deltas(handle)) as deltas:
            async for batch in deltas:
                finish = server.absorb(handle, text, batch)
                piece = text.new_text(final=finish is not None)
                ids = None
                if want_ids:
                    ids, sent_ids = text.token_ids[sent_ids:], len(text.token_ids)
                yield _sse(_completion_chunk(server, rid, piece, finish, ids))
                if finish is not None:
                    break
    except ServeError as error:
        yield _sse(error.body())
    if include_usage:
        yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": server.model_name, "choices": [],
                    "usage": _usage(prompt_len, text.generated)})
    yield _sse("[DONE]")


async def _chat_stream(server, handle, rid, text, prompt_len, include_usage):
    first = True
    try:
        async with aclosing(server.deltas(handle)) as deltas:
            async for batch in deltas:
                finish = server.absorb(handle, text, batch)
                piece = text.new_text(final=finish is not None)
                delta = {"role": "assistant", "content": piece} if first else {"content": piece}
                first = False
                yield _sse(_chat_chunk(server, rid, delta, finish))
                if finish is not None:
                    break
    except ServeError as error:
        yield _sse(error.body())
    if include_usage:
        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": server.model_name, "choices": [],
                    "usage": _usage(prompt_len, text.generated)})
    yield _sse("[DONE]")
