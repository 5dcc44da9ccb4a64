"""The HTTP server: OpenAI's completions and chat completions over the real engine.

FastAPI on uvicorn, as vLLM and SGLang serve: an ASGI event loop holds thousands of idle streams
for the cost of a coroutine each, FastAPI's pydantic models validate the request bodies (a wrong
type is a 400 naming the field), and the OpenAI clients already speak its server-sent events.

Each request: the API key and the body's size (`_Gate`, before a byte of the body is parsed) ->
validate -> tokens (on a worker thread: a long prompt never holds the event loop) ->
`SamplingParams` -> the core's own admission check (`admission_error`: a request it refuses is a
400 naming the field) -> the waiting cap (429) -> the engine process (`engine_client`). Every error, whoever
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

from zipage import request_fields
from zipage.core.admission import Admission
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.errors import FieldError
from zipage.serve import DEFAULT_MAX_BODY_BYTES
from zipage.serve.chat_output import ChatOutput, ChatSettings, ForcedCalls
from zipage.serve.detokenize import IncrementalText
from zipage.serve.engine_client import Delta, EngineStopped, RequestHandle
from zipage.serve.logprobs import TokenText, chat_logprobs, completion_logprobs, join_completion_logprobs
from zipage.serve.logs import AccessLog, StatsLine, note_answer
from zipage.serve.metrics import CONTENT_TYPE, ServerMetrics
from zipage.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    ServeError,
    error_body,
    not_utf8_message,
    short,
    unparsable_body_message,
    validation_message,
)
from zipage.serve.replicas import ReplicaSet
from zipage.serve.text_bound import max_prompt_tokens, max_token_bytes, too_long_reason
from zipage.serve.wire import refusal_words

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class Server:
    """What the routes share: the engine processes (one, or several under --data-parallel),
    the tokenizer, the waiting cap, the API key."""

    def __init__(self, engine: ReplicaSet, tokenizer, model_name: str,
                 max_waiting: int | None = None, api_key: str | None = None,
                 chat: ChatSettings = ChatSettings()) -> None:
        self.engine = engine
        self.chat = chat  # tool calling, reasoning, the chat template (chat_output.py)
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.api_key = api_key
        self.metrics = ServerMetrics(model_name, engine.info.capacity.num_blocks,
                                     engine.replicas, engine.info.config.max_model_len)
        self.eos = engine.info.eos_token_ids
        self.max_model_len = engine.info.config.max_model_len
        self.created = int(time.time())
        # One thread: tokenizers are not all safe to call from several threads at once, and
        # what matters is that the event loop (streams, /health) never waits for one.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="zipage-tokenize")
        self.token_text = TokenText(tokenizer)  # each token's text alone (log-probabilities)
        # A text too long to ever fit is refused before it is tokenized (text_bound.py).
        self.token_bytes = max_token_bytes(tokenizer)
        self.prompt_tokens = (None if self.token_bytes is None else
                              max_prompt_tokens(engine.admission))

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
                default_max_tokens: int) -> list[RequestHandle]:
        """Sampling settings, the core's admission check, the waiting cap; then submit. One
        handle per sample (`n`)."""
        limit = body.output_limit if isinstance(body, ChatRequest) else body.max_tokens
        if limit == 0:  # echo alone: one token is generated and left out of the answer
            limit = 1
        structured, field = body.structured_output()
        if structured is not None:
            self.check_structured(structured, field, body)
        try:
            sampling = SamplingParams(
                temperature=body.temperature, top_p=body.top_p,
                top_k=0 if body.top_k == -1 else body.top_k, seed=body.seed,
                max_tokens=default_max_tokens if limit is None else limit,
                ignore_eos=body.ignore_eos, kv_budget=body.kv_budget,
                compress_scope=body.compress_scope, priority=body.priority,
                scoring=body.scoring, n=body.n,
                logprobs=body.output_logprobs, prompt_logprobs=body.prompt_logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, min_p=body.min_p,
                logit_bias=body.logit_bias_pairs, structured_output=structured)
        except FieldError as error:
            raise ServeError(400, str(error), error.field) from None
        vocab = self.engine.info.vocab_size
        if sampling.logit_bias and max(token for token, _ in sampling.logit_bias) >= vocab:
            token = max(token for token, _ in sampling.logit_bias)
            raise ServeError(400, f"logit_bias: token id {token} is outside the vocabulary "
                                  f"(0..{vocab - 1})", "logit_bias")
        refusal = admission_error(self.engine.admission, len(prompt_ids), sampling)
        if refusal is not None:
            if refusal.param == "prompt":  # the counter's meaning (docs/serve.md): too long
                self.metrics.rejected.inc()
            raise refusal
        waiting = self.engine.num_waiting
        if self.max_waiting is not None and waiting >= self.max_waiting:
            self.metrics.rejected.inc()
            raise ServeError(429, f"server busy: {waiting} requests are waiting "
                                  f"(--max-waiting {self.max_waiting}); retry later",
                             None, "rate_limit_exceeded")
        try:
            # The session (`session_id`) goes to the router: session affinity keeps its turns
            # on one replica, where the prefix cache holds their history.
            return self.engine.submit(prompt_ids, sampling, session=body.session_id)
        except EngineStopped as error:
            raise ServeError(503, str(error), None, "server_error") from None

    def check_structured(self, spec, field: str, body: SamplingFields) -> None:
        """A 400 naming `field` for a constraint the engine could not compile: a schema,
        pattern or grammar that does not parse (parsed here, in milliseconds, without the
        tokenizer's mask tables), a model without a tokenizer, the extra not installed."""
        param = field.split(".")[0]
        if body.ignore_eos:
            raise ServeError(400, f"{field}: cannot be combined with ignore_eos (the end of the "
                                  "grammar ends the output); leave ignore_eos out", param)
        if self.tokenizer is None:
            raise ServeError(400, f"{field}: this model has no tokenizer (random weights) to "
                                  "build a grammar over; leave it out", param)
        try:  # the engine's module: torch, absent on a `--simulate` host (its twin refuses)
            from zipage.engine.structured import StructuredOutputError, check_spec
        except ImportError:
            return
        try:
            check_spec(spec)
        except StructuredOutputError as error:
            if field == "tool_choice":  # the schema is built from the tools' parameters
                raise ServeError(400, f"tools: a function's parameters (which tool_choice "
                                      f"forces) are {error}", "tools") from None
            raise ServeError(400, f"{field}: {error}", param) from None

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
        self.refuse_if_too_long(prompt, "prompt")
        try:
            return list(self.tokenizer.encode(prompt))
        except Exception as error:  # noqa: BLE001 - the text is what it refused
            raise ServeError(400, f"prompt: the tokenizer refused it: {error}",
                             "prompt") from None

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        """The model's own chat template (GGUF files and HF directories both carry one), or
        --chat-template's."""
        template = self.chat.chat_template
        if self.tokenizer is None or not (template or getattr(self.tokenizer, "chat_template",
                                                                None)):
            raise ServeError(400, "messages: this model has no chat template; use "
                                  "/v1/completions", "messages")
        if body.parses_tools and not (self.chat.auto_tool_choice and self.chat.tool_parser):
            raise ServeError(400, "tools: tool_choice \"auto\" needs the server's tool-call "
                                  "parser; start it with --enable-auto-tool-choice "
                                  "--tool-call-parser NAME (or send tool_choice \"none\")",
                             "tools")
        messages = body.plain_messages()
        try:
            # The text is checked against the bound, then tokenized as
            # apply_chat_template(tokenize=True) does (no special tokens added).
            text = self._render(messages, body.tool_dicts, template)
            self._refuse_dropped_tools(text, messages, body, template)
            self.refuse_if_too_long(text, "messages")
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except ServeError:
            raise
        except Exception as error:  # the template's own complaint (roles, order)
            raise ServeError(400, f"messages: the chat template refused them: {error}",
                             "messages") from None
        return list(ids)

    def _refuse_dropped_tools(self, text: str, messages: list[dict], body: ChatRequest,
                              template: str | None) -> None:
        """A 400 for `tools`, or for a message's `tool_calls`, that the template drops (the
        prompt is the same without them). One more render, however many calls the
        conversation holds: rendering once more per call made an agent's session quadratic.

        That render has no tools, and each message's calls carry a mark of their own after
        their names. A mark that does not show is a message whose calls the template dropped;
        with the marks taken out, the text is the prompt without tools (names are written
        as they are, and the marks are letters and digits, which no escaping changes)."""
        called = [index for index, message in enumerate(messages) if message.get("tool_calls")]
        if not body.tools and not called:
            return
        nonce = secrets.token_hex(4)  # no text of the request can hold a mark by chance
        marks = {index: f"zpg{nonce}m{index}e" for index in called}
        probe = [message if index not in marks else {**message, "tool_calls": [
            {**call, "function": {**call["function"],
                                  "name": call["function"]["name"] + marks[index]}}
            for call in message["tool_calls"]]} for index, message in enumerate(messages)]
        marked = self._render(probe, None, template)
        unmarked = marked
        for mark in marks.values():
            unmarked = unmarked.replace(mark, "")
        if body.tools and text == unmarked:
            raise ServeError(400, "tools: this model's chat template does not render tools; "
                                  "serve it with one that does (zipage serve --chat-template "
                                  "FILE)", "tools")
        for index in called:
            if marks[index] not in marked:
                raise ServeError(400, f"messages[{index}].tool_calls: this model's chat "
                                      "template does not render tool calls; serve it with one "
                                      "that does (zipage serve --chat-template FILE)",
                                 f"messages[{index}].tool_calls")

    def _render(self, messages: list[dict], tools: list[dict] | None,
                template: str | None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                                  add_generation_prompt=True, tokenize=False)

    def refuse_if_too_long(self, text: str, field: str) -> None:
        """A 400 for a text that is over the longest prompt whatever its tokens."""
        reason = too_long_reason(text, self.token_bytes, self.prompt_tokens)
        if reason is not None:
            self.metrics.rejected.inc()
            raise ServeError(400, reason.replace("prompt:", f"{field}:", 1), field)

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

    def absorb(self, choice: Choice, batch: list[Delta]) -> str | None:
        """Feed a batch of deltas to the choice's text; the finish reason, if the request ended
        (a stop string ends it here: the engine drops it before its next step)."""
        handle, text = choice.handle, choice.text
        tokens = [token for delta in batch for token in delta.token_ids]
        last = batch[-1]
        if last.error is not None:
            raise ServeError(last.status, last.error, last.param,
                             "invalid_request_error" if last.status < 500 else "server_error")
        if batch[0].cached_tokens is not None:  # the request's first token leads its first batch
            choice.cached_tokens = batch[0].cached_tokens
        finish = last.finish_reason
        if choice.echo_only:  # max_tokens 0 with echo: the one token generated is no answer
            if finish is not None:
                text.finish()
            return None if finish is None else "length"
        for delta in batch:
            if delta.logprobs is not None:
                choice.entries.extend(delta.logprobs)
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


class Choice:
    """One sample of a request as the HTTP side builds it: its handle, text and the
    log-probabilities of its tokens (one entry per generated token, if asked for)."""

    def __init__(self, server: Server, handle: RequestHandle, index: int, stop: list[str],
                 echo_only: bool = False, keep_stop: bool = False, prompt: int = 0) -> None:
        self.handle = handle
        self.index = index
        self.prompt = prompt  # which of the request's prompts it samples (a list of prompts)
        self.text = IncrementalText(server.tokenizer, stop, keep_stop)
        self.entries: list = []
        self.finish: str | None = None
        self.echo_only = echo_only
        self.sent_tokens = 0  # tokens whose ids and log-probabilities a stream has sent
        self.sent_chars = 0  # characters a stream has sent (text_offset)
        self.started = False  # a stream sent this choice's first chunk
        self.cached_tokens = 0  # its prompt tokens found in the prefix cache

    def new_tokens(self) -> tuple[list[int], list]:
        """The text's tokens not sent yet, and their log-probability entries."""
        end = len(self.text.token_ids)
        ids = self.text.token_ids[self.sent_tokens:end]
        entries = self.entries[self.sent_tokens:end]
        self.sent_tokens = end
        return ids, entries


def _choices(server: Server, groups: list[list[RequestHandle]], body: SamplingFields,
             echo_only: bool = False) -> list[Choice]:
    """One choice per handle; `groups[i]` are prompt i's n samples, so prompt i's sample j is
    choice i * n + j (OpenAI's order for a list of prompts)."""
    return [Choice(server, handle, len(group) * prompt + sample, body.stop_strings, echo_only,
                   body.include_stop_str_in_output, prompt)
            for prompt, group in enumerate(groups) for sample, handle in enumerate(group)]


async def _merged(server: Server, choices: list[Choice]) -> AsyncIterator[tuple[Choice, str]]:
    """(choice, finish reason or None) as each choice's deltas arrive, the choices interleaved;
    the first error of any choice is raised (and every choice aborted). However it ends, every
    request still running is aborted."""
    if len(choices) == 1:
        choice = choices[0]
        async with aclosing(server.deltas(choice.handle)) as deltas:
            async for batch in deltas:
                choice.finish = server.absorb(choice, batch)
                yield choice, choice.finish
                if choice.finish is not None:
                    return
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async with aclosing(server.deltas(choice.handle)) as deltas:
                async for batch in deltas:
                    choice.finish = server.absorb(choice, batch)
                    queue.put_nowait((choice, None))
                    if choice.finish is not None:
                        break
        except ServeError as error:
            queue.put_nowait((choice, error))
        queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
                continue
            choice, error = item
            if error is not None:
                raise error
            yield choice, choice.finish
    finally:
        for task in tasks:
            task.cancel()
        for choice in choices:
            server.engine.abort(choice.handle)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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


def build_app(engine: ReplicaSet, tokenizer, model_name: str, *,
              max_waiting: int | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, access_log: bool = False,
              log_stats_s: float | None = None,
              chat: ChatSettings = ChatSettings()) -> FastAPI:
    """The routes over started engine processes (`ReplicaSet.start`); the app's shutdown stops
    them. `access_log`: a line per request; `log_stats_s`: the stats line every so many seconds
    (None: none); both on stderr (zipage/serve/logs.py). `chat`: tool calling, reasoning and
    the chat template (chat_output.py)."""
    server = Server(engine, tokenizer, model_name, max_waiting, api_key, chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(server.metrics)
        stats = (None if log_stats_s is None else
                 asyncio.get_running_loop().create_task(
                     StatsLine(server.metrics, log_stats_s).run()))
        yield
        if stats is not None:
            stats.cancel()
        engine.close()
        server.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(engine.stop_process)

    app = FastAPI(title="Zipage", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_Gate, api_key=api_key, max_body_bytes=max_body_bytes)
    if access_log:  # outside the gate: its 401s and 413s are logged too
        app.add_middleware(AccessLog)

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
            message = unparsable_body_message(error.__cause__)
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
        # 200 while any replica serves: the router skips those that are down.
        replicas = engine.health()
        if not engine.alive:
            return JSONResponse({"status": "error",
                                 "error": engine.error or "the engine process stopped",
                                 "replicas": replicas}, 503)
        up = sum(replica["status"] == "ok" for replica in replicas)
        return {"status": "ok" if up == len(replicas) else "degraded", "replicas": replicas}

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
        server.check(body)
        prompts = [await server.tokens(server.encode, prompt) for prompt in body.prompts]
        groups: list[list[RequestHandle]] = []
        try:
            for prompt_ids in prompts:  # each prompt is n requests of its own
                groups.append(server.prepare(body, prompt_ids, DEFAULT_COMPLETION_TOKENS))
        except ServeError:  # one prompt refused: the request is, and none of it runs
            for handle in (handle for group in groups for handle in group):
                server.engine.abort(handle)
            raise
        choices = _choices(server, groups, body, echo_only=body.max_tokens == 0)
        answer = CompletionAnswer(server, body, f"cmpl-{uuid.uuid4().hex}", prompts, choices)
        if body.stream:
            return _stream(server, choices, answer.events())
        return await _cancel_on_disconnect(request, answer.whole())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        server.check(body)
        prompt_ids = await server.tokens(server.chat_prompt, body)
        handles = server.prepare(body, prompt_ids, server.default_output_limit(len(prompt_ids)))
        choices = _choices(server, [handles], body)
        answer = ChatAnswer(server, body, f"chatcmpl-{uuid.uuid4().hex}", [prompt_ids], choices)
        if body.stream:
            return _stream(server, choices, answer.events())
        return await _cancel_on_disconnect(request, answer.whole())

    return app


def admission_error(admission: Admission, prompt_len: int,
                    sampling: SamplingParams) -> ServeError | None:
    """The core's own admission rule (`Admission.rejection_reason`), asked before a request is
    sent, as the 400 every refused field gets: "<field>: <why>; <fix>", `param` the field.

    The one path for a request the rule refuses, whichever field it refuses for: the rule names
    the field (`Refusal.field`), and `refusal_words` words it as the engine process does when the
    rule refuses there."""
    seq = Sequence("request", None, sampling.max_tokens, prompt_len=prompt_len)
    request_fields.copy_fields(seq, sampling)
    refusal = admission.refusal(seq)
    return None if refusal is None else ServeError(400, *refusal_words(refusal))


_KINDS = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}
_ENCODING_BYTES = 4  # JSON's first 4 bytes tell UTF-8 from UTF-16 and UTF-32 (RFC 4627)


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
        head = b""  # the body's first bytes, until they tell its encoding

        async def counted():
            nonlocal received, head
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                # FastAPI re-raises its own HTTPException from a body read: the handler above
                # answers it.
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large(), headers={"Connection": "close"})
                if len(head) < _ENCODING_BYTES:
                    head += chunk[:_ENCODING_BYTES - len(head)]
                    problem = not_utf8_message(head, more=message.get("more_body", False))
                    if problem is not None:
                        raise HTTPException(400, problem)
            return message

        await self.app(scope, counted, send)


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


def _stream(server: Server, choices: list[Choice], events: AsyncIterator[str]) -> _EventStream:
    def abort_all() -> None:
        for choice in choices:
            server.engine.abort(choice.handle)

    return _EventStream(events, abort_all)


class _Answer:
    """One response to a request of n choices, whole or as server-sent events."""

    object_whole = object_chunk = ""

    def __init__(self, server: Server, body: SamplingFields, rid: str,
                 prompts: list[list[int]], choices: list[Choice]) -> None:
        self.server = server
        self.body = body
        self.rid = rid
        self.prompts = prompts  # each prompt's token ids (completions take several)
        self.choices = choices
        # Each prompt's first sample: it computed the prompt (its cached tokens, its
        # prompt log-probabilities); the others fork from it.
        self.leaders = [next(choice for choice in choices if choice.prompt == prompt)
                        for prompt in range(len(prompts))]
        self.text_of = server.token_text
        self.logprobs = body.output_logprobs is not None
        self.created = int(time.time())  # one for the whole response, as OpenAI's chunks have it
        note_answer(rid, self.usage)  # the access log's id and tokens

    def envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": kind, "created": self.created,
                "model": self.server.model_name, "choices": choices}

    def usage(self) -> dict:
        # Each prompt counts once, as its first sample computed it (the others fork from it).
        return _usage(sum(map(len, self.prompts)),
                      sum(choice.text.generated for choice in self.choices),
                      sum(leader.cached_tokens for leader in self.leaders))

    async def whole(self) -> JSONResponse:
        async with aclosing(_merged(self.server, self.choices)) as updates:
            async for _ in updates:
                pass
        reply = self.envelope(self.object_whole, [self.whole_choice(choice)
                                                  for choice in self.choices])
        reply["usage"] = self.usage()
        return JSONResponse(reply)

    async def events(self) -> AsyncIterator[str]:
        # Every chunk's envelope is the same text around its one choice: encoded once, the
        # choice alone each token (JSON was a tenth of the HTTP process's time at 16k streamed
        # tokens a second).
        empty = _sse(self.envelope(self.object_chunk, []))
        head, tail = empty[:-len("]}\n\n")], empty[-len("]}\n\n"):]
        try:
            async with aclosing(_merged(self.server, self.choices)) as updates:
                async for choice, finish in updates:
                    yield head + json.dumps(self.chunk(choice, finish), separators=(",", ":")) + tail
        except ServeError as error:
            yield _sse(error.body())
        if self.body.include_usage:
            reply = self.envelope(self.object_chunk, [])
            reply["usage"] = self.usage()
            yield _sse(reply)
        yield _sse("[DONE]")


class CompletionAnswer(_Answer):
    object_whole = object_chunk = "text_completion"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        body, server = self.body, self.server
        self.want_ids = body.return_token_ids or server.tokenizer is None
        self.echo = [""] * len(self.prompts)  # each prompt's echoed text
        if body.echo:
            self.echo = [prompt if isinstance(prompt, str)
                         else server.tokenizer.decode(ids) if server.tokenizer is not None
                         else "" for prompt, ids in zip(body.prompts, self.prompts)]

    def prompt_logprobs(self, prompt: int) -> dict:
        """An echoed prompt's log-probabilities (its first sample's request computed them)."""
        ids = self.prompts[prompt]
        entries = self.leaders[prompt].handle.prompt_logprobs
        entries = list(entries) + [None] * (len(ids) - len(entries))
        return completion_logprobs(self.text_of, ids, entries)

    def whole_choice(self, choice: Choice) -> dict:
        logprobs = None
        echo = self.echo[choice.prompt]
        if self.logprobs:
            logprobs = completion_logprobs(self.text_of, choice.text.token_ids, choice.entries,
                                           len(echo))
            if self.body.echo:
                logprobs = join_completion_logprobs(self.prompt_logprobs(choice.prompt),
                                                    logprobs)
        reply = {"index": choice.index, "text": echo + choice.text.text,
                 "logprobs": logprobs, "finish_reason": choice.finish}
        if self.want_ids:
            reply["token_ids"] = choice.text.token_ids
        return reply

    def chunk(self, choice: Choice, finish: str | None) -> dict:
        piece = choice.text.new_text(final=finish is not None)
        ids, entries = choice.new_tokens()
        logprobs = None
        echo = self.echo[choice.prompt]
        if self.logprobs:
            logprobs = completion_logprobs(self.text_of, ids, entries,
                                           len(echo) + choice.sent_chars)
        choice.sent_chars += len(piece)
        if not choice.started:  # the echoed prompt leads the choice's first chunk
            choice.started = True
            if self.body.echo:
                piece = echo + piece
                if self.logprobs:
                    logprobs = join_completion_logprobs(self.prompt_logprobs(choice.prompt),
                                                        logprobs)
        reply = {"index": choice.index, "text": piece, "logprobs": logprobs,
                 "finish_reason": finish}
        if self.want_ids:
            reply["token_ids"] = ids
        return reply


class ChatAnswer(_Answer):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        # Each choice's reasoning and tool-call parsers (None: its text is the content), and
        # the text its stream has released (stop strings held back) for them to scan.
        self.outputs = {choice.index: self.output() for choice in self.choices}
        self.released = {choice.index: "" for choice in self.choices}

    def output(self) -> ChatOutput | ForcedCalls | None:
        body, chat = self.body, self.server.chat
        if body.forces_tools:  # the output is the calls' JSON (its constraint's)
            return ForcedCalls(body.named_tool, chat.reasoning_parser is not None)
        return chat.output(body.parses_tools, body.parallel_tool_calls is False)

    def whole_choice(self, choice: Choice) -> dict:
        logprobs = (chat_logprobs(self.text_of, choice.text.token_ids, choice.entries)
                    if self.logprobs else None)
        output, finish = self.outputs[choice.index], choice.finish
        if output is None:
            message = {"role": "assistant", "content": choice.text.text}
        else:
            message = output.message(choice.text.text)
            finish = output.finish_reason(finish, "tool_calls" in message)
        return {"index": choice.index, "message": message, "logprobs": logprobs,
                "finish_reason": finish}

    def chunk(self, choice: Choice, finish: str | None) -> dict:
        piece = choice.text.new_text(final=finish is not None)
        ids, entries = choice.new_tokens()
        output = self.outputs[choice.index]
        if output is None:
            delta = {"content": piece}
        else:
            self.released[choice.index] += piece
            delta = output.delta(self.released[choice.index], final=finish is not None)
            if finish is not None:
                finish = output.finish_reason(finish, output.called)
        if not choice.started:
            choice.started = True
            delta = {"role": "assistant", **delta}
        logprobs = chat_logprobs(self.text_of, ids, entries) if self.logprobs else None
        return {"index": choice.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish}
