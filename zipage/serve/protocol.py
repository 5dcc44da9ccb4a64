"""The OpenAI API's request bodies (the fields Zipage serves) and its error body.

Types are strict: a string where a number belongs is a 400 naming the field, not a silent
coercion. Fields the API has and Zipage does not implement are refused by name rather than
ignored (`n` above 1, `logprobs`, `echo`, `best_of`); fields unknown to the API are ignored, as
OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


class ServeError(Exception):
    """A request the server refuses: HTTP status, a message naming the field, the field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.status)


def error_body(message: str, kind: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share: sampling, limits, streaming."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # -1 (vLLM's "off") is accepted as 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension: generate through end-of-sequence tokens
    kv_budget: int | None = None  # extension: this request's KV budget (default: --budget)
    logprobs: Any = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise ServeError(400, f"n: got {self.n}; Zipage returns one choice per request, "
                                  "send n = 1 (or several requests)", "n")
        if self.best_of not in (None, 1):
            raise ServeError(400, "best_of: not supported; leave it out", "best_of")
        if self.logprobs not in (None, False):
            raise ServeError(400, "logprobs: not supported; leave it out", "logprobs")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Any
    echo: bool = False
    return_token_ids: bool = False  # extension: each choice also carries its output token ids

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        """Text or token ids; the API's batch forms only with exactly one prompt in them."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return prompt
        if (isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                        for t in prompt)):
            return prompt
        raise ValueError("expected non-empty text or a non-empty list of token ids (one prompt "
                         "per request)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The content; a list of parts must be text parts (no images here)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ServeError(400, "messages: only text content parts are supported",
                                 "messages")
            texts.append(part["text"])
        return "".join(texts)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages):
        if not messages:
            raise ValueError("expected at least one message")
        return messages

    def plain_messages(self) -> list[dict]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line naming the field from pydantic's errors (the first is enough to fix)."""
    error = errors[0]
    location = [part for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == "json_invalid":
        return f"body: not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})", None
    if not location:
        return f"body: {error.get('msg', 'invalid')}; send a JSON object", None
    field = str(location[0])
    path = ".".join(str(part) for part in location
                    if not (isinstance(part, str) and ("[" in part or part in _TYPE_NAMES)))
    message = error.get("msg", "invalid").removeprefix("Value error, ")
    return f"{path}: {message}", field


# Union members pydantic names in an error's location ("stop.str", "stop.list[str]").
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}
