"""The OpenAI API's request bodies (the fields Zipage serves) and its error body.

Types are strict: a string where a number belongs is a 400 naming the field, not a silent
coercion. Every number has its range here (`Field` bounds, finite floats), the same ranges
`SamplingParams.check` enforces in the engine: a value the sampler or torch cannot take is a 400
at the door, never an error inside an engine step. Text anywhere in the body must be valid
Unicode (a lone UTF-16 surrogate such as "\\ud800" cannot be tokenized or written back as UTF-8).
The rule for fields (issue #48): a field OpenAI's API or vLLM's server has, that would change
the output there and that Zipage does not implement, is a 400 naming it (`REFUSED`: `best_of`
above 1, `functions`, `guided_decoding_backend`, ...) when it carries anything
but its neutral value; fields with no effect on the output by nature (`user`, `metadata`,
`store`, `service_tier`, `request_id`, ...) and fields unknown to both APIs (another vendor's)
are ignored, as vLLM ignores unknown fields. The models keep the unknown fields
(`extra="allow"`) only so that `check_unsupported` can find the refused ones among them.
`n`, `logprobs` (completions: an integer, the alternatives per token; chat: a boolean with
`top_logprobs`), `echo` (completions), `presence_penalty`, `frequency_penalty`, `logit_bias` and
a list of prompts (completions) are served; so are vLLM's `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos` and `include_stop_str_in_output`. Chat serves tools: `tools`,
`tool_choice` "auto" or "none", `parallel_tool_calls`, and messages' `tool_calls`,
`tool_call_id` and `name` (rendered by the chat template; the calls parsed from the output by
the server's --tool-call-parser); `tool_choice` "required" or a named function constrains the
output to the calls' JSON instead (`ChatRequest.structured_output`). Structured outputs, both
endpoints: `response_format` (json_object, json_schema) and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`, one per request
(`structured_output()`; the spec is checked by `zipage.engine.structured.check_spec` in
`Server.prepare`). Extensions: `kv_budget`, `compress_scope`, `scoring`,
`session_id` (both endpoints: the conversation or agent run a request belongs to, which a router
keeps on one replica) and `return_token_ids` (completions: each choice carries its output ids).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from zipage import request_fields
from zipage.core.sampling import (
    MAX_INT,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SAMPLES,
    MAX_TEMPERATURE,
    SEED_LIMIT,
    StructuredOutput,
)
from zipage.errors import ConfigError

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1000  # characters; each decoded piece is searched for every stop string
MESSAGE_LIMIT = 500  # characters of an error message: user input in it is cut to fit
MAX_SESSION_ID = 256  # characters of a `session_id`: a name, not a payload
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (a list of prompts)

# Fields of OpenAI's API or vLLM's server that change the output there and that Zipage does not
# implement: field -> the values that change nothing (null, and these), which are accepted.
# Anything else is a 400 naming the field. ChatRequest and CompletionRequest add their own.
REFUSED: dict[str, tuple] = {
    # OpenAI
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    # vLLM's extra sampling and request fields
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "stop_token_ids": ([],),
    "min_tokens": (0,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "guided_decoding_backend": (),  # one backend here (xgrammar): naming one changes nothing
    "guided_whitespace_pattern": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "prompt_embeds": (),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "mm_processor_kwargs": (),
}
# Accepted and ignored by nature (no effect on the output), for the docs and the tests: unknown
# fields are ignored anyway.
NO_OPS = ("user", "metadata", "store", "service_tier", "request_id", "prompt_cache_key",
          "safety_identifier")


def short(value: Any, limit: int = 60) -> str:
    """`repr` of user input for a message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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
    """OpenAI's error body. The message is cut and made valid UTF-8 whatever went into it (an
    exception's text can quote the request), so writing the error can never fail too."""
    message = str(message)
    if len(message) > MESSAGE_LIMIT:
        message = message[:MESSAGE_LIMIT] + "..."
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = str(param)[:64].encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def not_utf8_message(head: bytes, more: bool) -> str | None:
    """Why a JSON body starting with `head` is refused as not UTF-8 (RFC 8259: JSON between
    systems is UTF-8), or None; `more`: the body goes on past `head`. Python's JSON reader would
    take UTF-16 and UTF-32 by their byte-order marks and zero bytes, and other servers do not: a
    client must not come to rely on it here."""
    if len(head) < 4 and more:
        return None  # too little to tell yet
    encoding = json.detect_encoding(head)
    if encoding in ("utf-8", "utf-8-sig"):  # a UTF-8 byte-order mark is still UTF-8
        return None
    return (f"body: {encoding.upper()} text (by its first bytes); encode the JSON as UTF-8, "
            "as RFC 8259 requires")


def unparsable_body_message(cause: BaseException | None) -> str:
    """The message for a body the JSON reader failed on with `cause` (not a syntax error:
    those are `validation_message`'s)."""
    if isinstance(cause, RecursionError):
        return ("body: arrays or objects nested too deeply for the JSON reader; the API's bodies "
                "need a few levels of nesting, send one of those")
    if isinstance(cause, UnicodeDecodeError):
        return (f"body: not valid UTF-8 (byte {cause.start}: {cause.reason}); encode the JSON as "
                "UTF-8")
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return (f"body: a number longer than {sys.get_int_max_str_digits()} digits; send "
                "numbers in range (the fields' ranges are in docs/serve.md)")
    return "body: could not be parsed as JSON; send a JSON object encoded as UTF-8"


def _unicode_problem(value: Any, path: str, depth: int = 0) -> str | None:
    """The path of the first string (key or value) in a JSON value that is not valid Unicode."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        return None
    if depth > 64:  # the JSON parser bounds nesting too; this bounds the walk on its own
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if _unicode_problem(key, path) is not None:
                return f"{path or 'body'} (a key)"
            found = _unicode_problem(item, f"{path}.{key}" if path else str(key), depth + 1)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _unicode_problem(item, f"{path}.{index}", depth + 1)
            if found is not None:
                return found
    return None


Float = Annotated[float, Field(allow_inf_nan=False)]
Bias = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


def _neutral(value: Any, accepted: tuple) -> bool:
    """`value` is null or one of `accepted` (JSON's true is not 1 here, nor 1 true)."""
    if value is None:
        return True
    for neutral in accepted:
        if isinstance(value, bool) or isinstance(neutral, bool):
            if value is neutral:
                return True
        elif value == neutral:
            return True
    return False


def _refusal(field: str, accepted: tuple) -> ServeError:
    allowed = "" if not accepted else " (only " + " or ".join(
        json.dumps(value) for value in accepted) + " is accepted)"
    return ServeError(400, f"{field}: not supported by this server{allowed}; leave it out "
                           "(docs/serve.md lists the fields served)", field)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (refused)


class SamplingFields(BaseModel):
    """What both endpoints share: sampling, limits, streaming."""

    model_config = ConfigDict(strict=True, extra="allow")
    # This endpoint's refused fields and their neutral values (`REFUSED`, module docstring).
    refused: ClassVar[dict[str, tuple]] = REFUSED

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: Float = Field(1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_INT)  # -1 (vLLM's "off") is accepted as 0
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    ignore_eos: bool = False  # vLLM's extension: generate through end-of-sequence tokens
    # Extensions checked by their one declaration (zipage/request_fields.py, `_request_field`):
    kv_budget: int | None = None  # this request's KV budget
    # Extension: the session (chat, agent run) the request is a turn of; a router keeps a
    # session's turns on one replica, whose prefix cache holds their history. None: none.
    session_id: str | None = None
    # Extension: what this request's compressions may evict ("all" or "output"; None: the
    # server's --compress-scope).
    compress_scope: str | None = None
    # vLLM's: the request's class under --scheduling-policy priority (lower first).
    priority: int = 0
    # Extension: the eviction scoring policy of this request's compressions (a --scoring name;
    # None: the server's --scoring).
    scoring: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_INT)
    # Penalties, bias and min-p: SamplingParams' meaning (OpenAI's and vLLM's).
    presence_penalty: Float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: Float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: Float = Field(1.0, gt=0, le=MAX_REPETITION_PENALTY)  # vLLM's
    min_p: Float = Field(0.0, ge=0, le=1)  # vLLM's
    logit_bias: dict[str, Bias] | None = None  # token id (as a string) -> bias
    include_stop_str_in_output: bool = False  # vLLM's: a stop string found stays in the text
    # Structured outputs (docs/serve.md, 'Structured outputs'): OpenAI's response_format and
    # vLLM's names, each mapped to one `StructuredOutput` by `structured_output()`.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        path = _unicode_problem(data, "") if isinstance(data, dict) else None
        if path is not None:
            raise PydanticCustomError(
                "invalid_unicode", "{path}: contains a lone UTF-16 surrogate (such as \\ud800), "
                "which is not valid Unicode; send valid UTF-8 text", {"path": path})
        return data

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"got {len(strings)} stop strings, at most {MAX_STOP_STRINGS}")
        if any(not text or len(text) > MAX_STOP_LENGTH for text in strings):
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_LENGTH} characters")
        return stop

    @field_validator(*request_fields.NAMES, mode="before")
    @classmethod
    def _request_field(cls, value, info):
        broken = request_fields.BY_NAME[info.field_name].rule_broken(value)
        if broken is None:
            return value
        raise ValueError(broken)

    @field_validator("session_id", mode="before")
    @classmethod
    def _session_name(cls, session_id):
        if session_id is None or (isinstance(session_id, str)
                                  and 1 <= len(session_id) <= MAX_SESSION_ID):
            return session_id
        raise ValueError(f"expected a string of 1 to {MAX_SESSION_ID} characters naming the "
                         f"conversation or agent run, got {short(session_id)}")

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        if bias is None:
            return bias
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"got {len(bias)} token ids, at most {MAX_LOGIT_BIAS_TOKENS}")
        for key in bias:
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT):
                raise ValueError(f"keys are token ids, integers in 0..{MAX_INT} written as "
                                 f"strings; got {short(key)}")
        return bias

    def check_unsupported(self) -> None:
        """A 400 naming the first field sent that this server does not implement."""
        if self.best_of not in (None, 1):
            raise ServeError(400, "best_of: not supported; leave it out (n samples: n)",
                             "best_of")
        for field, value in (self.model_extra or {}).items():
            accepted = self.refused.get(field)
            if accepted is not None and not _neutral(value, accepted):
                raise _refusal(field, accepted)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise _refusal("stream_options.continuous_usage_stats", (False,))

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The request's output constraint and the field that set it ((None, None): none); a
        400 naming the field for a malformed one, or for two constraints at once."""
        found = []
        if self.response_format is not None:
            spec = _response_format(self.response_format)
            if spec is not None:
                found.append(("response_format", spec))
        for field, kind in GUIDED_FIELDS.items():
            value = getattr(self, field)
            if value is not None:
                found.append((field, _structured(field, kind, value)))
        if self.structured_outputs is not None:
            found.extend(_structured_outputs(self.structured_outputs))
        if len(found) > 1:
            (first, _), (second, _) = found[:2]
            raise ServeError(400, f"{second}: a request takes one structured-output constraint "
                                  f"and {first} already sets one; send only one", second)
        return found[0][::-1] if found else (None, None)

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...] | None:
        """`logit_bias` as SamplingParams takes it: (token id, bias) pairs."""
        if not self.logit_bias:
            return None
        return tuple((int(key), float(value)) for key, value in self.logit_bias.items())

    # Per endpoint: alternatives per output token (None: no log-probabilities), and per prompt
    # token (completions' echo).
    @property
    def output_logprobs(self) -> int | None:
        return None

    @property
    def prompt_logprobs(self) -> int | None:
        return None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    # Tools are chat's (ChatRequest serves them); a completion has no template to render them.
    refused: ClassVar[dict[str, tuple]] = {**REFUSED, "add_special_tokens": (True,),
                                           "tools": ([],), "tool_choice": ("none",),
                                           "parallel_tool_calls": ()}
    prompt: Any
    # 0 only with echo: the prompt scored, nothing generated (lm-evaluation-harness).
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    echo: bool = False  # the prompt before each choice's text (and its log-probabilities)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False  # extension: each choice also carries its output token ids

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if len(self.prompts) * self.n > MAX_PROMPTS:
            raise ServeError(400, f"prompt: {len(self.prompts)} prompts x n {self.n} = "
                                  f"{len(self.prompts) * self.n} choices, at most {MAX_PROMPTS} "
                                  "in one request; send fewer prompts or samples", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise ServeError(400, "max_tokens: 0 is allowed only with echo=true (score the "
                                  "prompt); send at least 1", "max_tokens")

    @property
    def output_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt):
        """Text or token ids, or a list of either (several prompts); a list of one prompt is
        that prompt."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if _one_prompt(prompt):
            return prompt
        if (isinstance(prompt, list) and 1 < len(prompt) <= MAX_PROMPTS
                and (all(isinstance(item, str) for item in prompt)
                     or all(isinstance(item, list) for item in prompt))
                and all(_one_prompt(item) for item in prompt)):
            return prompt
        raise ValueError(f"expected non-empty text or a non-empty list of token ids in "
                         f"0..{MAX_INT}, or a list of 2 to {MAX_PROMPTS} of either (all texts "
                         "or all token lists)")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or several (a batch)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


# vLLM's guided decoding fields -> the kind of constraint each sets; `structured_outputs`
# takes the same under these keys.
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex",
                 "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                           "grammar": "grammar"}
# structured_outputs' options whose values here change nothing (a single backend, and the
# defaults): any other value is refused by name.
STRUCTURED_OUTPUTS_NEUTRAL = {"disable_fallback": (True, False), "disable_any_whitespace": (False,),
                              "disable_additional_properties": (False,),
                              "whitespace_pattern": (), "structural_tag": (), "json_object": (False,)}


def _response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's response_format: text (None), json_object, or json_schema with its schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json")
    if kind != "json_schema":
        raise ServeError(400, f"response_format: {short(value)} is not a response format; send "
                              '{"type": "text"}, {"type": "json_object"} or {"type": '
                              '"json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                         "response_format")
    wrapper = value.get("json_schema")
    schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
    if not isinstance(schema, dict):
        raise ServeError(400, "response_format.json_schema.schema: required, the JSON schema "
                              "(an object) the output must match", "response_format")
    return _structured("response_format", "json_schema", schema)


def _structured(field: str, kind: str, value: Any) -> StructuredOutput:
    """A `StructuredOutput` of `kind` from a request field's value (a schema may come as JSON
    text, as vLLM takes it); its shape checked, a 400 naming `field` if it is wrong."""
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if kind == "json_schema" and not isinstance(value, dict):
        raise ServeError(400, f"{field}: expected a JSON schema (an object, or its JSON text)",
                         field.split(".")[0])
    try:
        return StructuredOutput(kind, value)
    except ConfigError as error:
        raise ServeError(400, str(error).replace("structured_output", field, 1),
                         field.split(".")[0]) from None


def _structured_outputs(value: Any) -> list[tuple[str, StructuredOutput]]:
    """vLLM's structured_outputs object: json, regex, choice, grammar or json_object."""
    if not isinstance(value, dict):
        raise ServeError(400, "structured_outputs: expected an object such as {\"json\": {...}}, "
                              '{"regex": "..."}, {"choice": [...]} or {"grammar": "..."}',
                         "structured_outputs")
    found = []
    for key, item in value.items():
        field = f"structured_outputs.{key}"
        if key in STRUCTURED_OUTPUTS_KEYS:
            if item is not None:
                found.append((field, _structured(field, STRUCTURED_OUTPUTS_KEYS[key], item)))
        elif key == "json_object" and item is True:
            found.append((field, StructuredOutput("json")))
        elif key in STRUCTURED_OUTPUTS_NEUTRAL:
            if not _neutral(item, STRUCTURED_OUTPUTS_NEUTRAL[key]):
                refusal = _refusal(field, STRUCTURED_OUTPUTS_NEUTRAL[key])
                refusal.param = "structured_outputs"
                raise refusal
        else:
            raise ServeError(400, f"{field}: not a structured_outputs option; use json, regex, "
                                  "choice, grammar or json_object", "structured_outputs")
    return found


def _one_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT
                    for t in prompt))


# The roles of OpenAI's chat API (vLLM takes the same): another is a client's mistake, which a
# chat template would render as some text or refuse with a message of its own.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str  # JSON text of an object, as OpenAI's API sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments):
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"expected the JSON text of an object, got {short(arguments)}")
        return arguments


class ToolCall(BaseModel):
    """A call an assistant message made (its result comes back in a `tool` message)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # OpenAI's rule
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


TOOL_CHOICES = ("none", "auto", "required")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    # A message's fields the chat template would need but this server does not render (the
    # deprecated function_call): refused, never dropped without a word.
    refused: ClassVar[dict[str, tuple]] = {"function_call": ()}
    role: str
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a participant's (or a tool's) name, for the template

    @field_validator("role")
    @classmethod
    def _known_role(cls, role):
        if role not in CHAT_ROLES:
            raise ValueError(f"{short(role)} is not a chat role; use one of "
                             f"{', '.join(CHAT_ROLES)}")
        return role

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
    # vLLM's chat fields that change the prompt or the answer.
    refused: ClassVar[dict[str, tuple]] = {
        **REFUSED, "echo": (False,), "add_generation_prompt": (True,),
        "continue_final_message": (False,), "add_special_tokens": (False,),
        "chat_template": (), "chat_template_kwargs": ({},), "documents": (),
        "return_token_ids": (False,)}
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)  # max_tokens' newer name
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tool calling (docs/serve.md, 'Tool calling and reasoning').
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # false: only the first call is kept

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice):
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            raise ValueError(f"expected one of {', '.join(map(repr, TOOL_CHOICES))} or "
                             f'{{"type": "function", "function": {{"name": ...}}}}, got '
                             f"{short(choice)}")
        return choice

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for index, message in enumerate(self.messages):
            for field, value in (message.model_extra or {}).items():
                accepted = ChatMessage.refused.get(field)
                if accepted is not None and not _neutral(value, accepted):
                    raise _refusal(f"messages[{index}].{field}", accepted)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ServeError(400, "tool_choice: needs tools; send the functions in `tools`, or "
                                  "leave tool_choice out", "tool_choice")
        named = self.named_tool
        if named is not None and named not in {tool.function.name for tool in self.tools}:
            raise ServeError(400, f"tool_choice: names the function {short(named)}, which is "
                                  "not among `tools`; name one of them, or send it in `tools`",
                             "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ServeError(400, "top_logprobs: needs logprobs=true", "top_logprobs")

    @property
    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice forces (None: none is named)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.get("name", "")
        return None

    @property
    def forces_tools(self) -> bool:
        """tool_choice "required" or a named function: the output is constrained to the calls'
        JSON (vLLM's way), which is parsed as such, with no tool-call parser."""
        return self.tool_choice == "required" or self.named_tool is not None

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """A forced tool choice is the request's constraint; it takes no other."""
        spec, field = super().structured_output()
        if not self.forces_tools:
            return spec, field
        if spec is not None:
            raise ServeError(400, f"{field}: a request takes one structured-output constraint "
                                  "and tool_choice already sets one (the calls' JSON); send "
                                  "only one", field.split(".")[0])
        return _structured("tool_choice", "json_schema", self._calls_schema()), "tool_choice"

    def _calls_schema(self) -> dict:
        """vLLM's schemas: a named function's arguments; for "required", an array of one or
        more {"name", "parameters"} objects, one shape per tool (one item at most with
        parallel_tool_calls false: the model stops after it instead of being cut)."""
        parameters = {tool.function.name: tool.function.parameters
                      or {"type": "object", "properties": {}} for tool in self.tools}
        named = self.named_tool
        if named is not None:
            return parameters[named]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
             "required": ["name", "parameters"]} for name, schema in parameters.items()]}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages):
        if not messages:
            raise ValueError("expected at least one message")
        return messages

    def plain_messages(self) -> list[dict]:
        """The messages as a chat template takes them; a call's arguments as an object (the
        templates write them with `tojson`, vLLM hands them over the same way)."""
        plain = []
        for message in self.messages:
            item = {"role": message.role, "content": message.text()}
            if message.tool_calls:
                item["tool_calls"] = [
                    {"id": call.id, "type": call.type, "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments)}}
                    for call in message.tool_calls]
            for field in ("tool_call_id", "name"):
                if getattr(message, field) is not None:
                    item[field] = getattr(message, field)
            plain.append(item)
        return plain

    @property
    def tool_dicts(self) -> list[dict] | None:
        """The tools as a chat template takes them (None: no tools)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def parses_tools(self) -> bool:
        """The output is searched for tool calls by the server's parser (tool_choice "auto";
        "none" renders the tools but never parses, as vLLM does; a forced choice's output is
        the calls' JSON, read without the parser)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

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
    if error.get("type") == "invalid_unicode":
        path = error["ctx"]["path"]
        return error["msg"], None if path.startswith("body") else path.split(".")[0]
    if not location:
        return f"body: {error.get('msg', 'invalid')}; send a JSON object", None
    field = str(location[0])
    path = ".".join(str(part) for part in location
                    if not (isinstance(part, str) and ("[" in part or part in _TYPE_NAMES)))
    message = error.get("msg", "invalid").removeprefix("Value error, ")
    return f"{path}: {message}", field


# Union members pydantic names in an error's location ("stop.str", "stop.list[str]").
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}
