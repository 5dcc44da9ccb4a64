"""The server's pure parts, without a model: incremental detokenization (split UTF-8 characters,
stop strings and their hold-back) and the one-line messages for invalid request bodies."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from pydantic import ValidationError  # noqa: E402

from zipage.serve.detokenize import IncrementalText  # noqa: E402
from zipage.serve.protocol import ChatMessage, ChatRequest, CompletionRequest, ServeError, validation_message  # noqa: E402


class ByteTokenizer:
    """One token per UTF-8 byte, as a byte-level BPE can split a character."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "héllo wörld – ✓ done"


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_streamed_pieces_add_up_to_the_whole_text(step):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    text = IncrementalText(tokenizer)
    pieces = []
    for start in range(0, len(ids), step):
        text.add(ids[start:start + step])
        pieces.append(text.new_text())
    text.finish()
    pieces.append(text.new_text(final=True))
    assert "".join(pieces) == TEXT == text.text
    assert not any("\ufffd" in piece for piece in pieces)  # half characters are held back


def test_unfinished_character_at_the_end_is_kept_as_decode_shows_it():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ok ✓")[:-1]  # the request ended inside the last character
    text = IncrementalText(tokenizer)
    text.add(ids)
    text.finish()
    assert text.text == tokenizer.decode(ids)


def test_stop_string_cuts_the_text_and_is_never_streamed():
    tokenizer = ByteTokenizer()
    text = IncrementalText(tokenizer, stop=["wör"])
    pieces = []
    for token in tokenizer.encode(TEXT):
        text.add([token])
        pieces.append(text.new_text())
        if text.stopped:
            break
    pieces.append(text.new_text(final=True))
    assert text.stopped and text.text == "héllo "
    assert "".join(pieces) == "héllo "
    text.add(tokenizer.encode("more"))  # tokens after the stop change nothing
    assert text.text == "héllo "


def test_no_tokenizer_keeps_only_ids():
    text = IncrementalText(None)
    text.add([5, 6])
    text.finish()
    assert text.text == "" and text.token_ids == [5, 6]


def _message(model, body: dict) -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    message, _ = validation_message(caught.value.errors())
    return message


@pytest.mark.parametrize("body, start", [
    ({"prompt": "x", "max_tokens": "12"}, "max_tokens:"),  # strict: no silent coercion
    ({"prompt": "x", "temperature": "hot"}, "temperature:"),
    ({"prompt": "x", "stream": "yes"}, "stream:"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": ""}, "prompt: expected non-empty text"),
    ({"prompt": [1, "a"]}, "prompt: expected"),
    ({"prompt": ["a", [1]]}, "prompt: expected"),  # a list of prompts: all of one kind
    ({"prompt": ["a", ""]}, "prompt: expected"),
    ({"prompt": [[1], []]}, "prompt: expected"),
    ({"prompt": ["a"] * 1025}, "prompt: expected"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias: keys are token ids"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias: keys are token ids"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5: Input should be less than"),
    ({"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias.5: Input should be a valid number"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty: Input should be less than"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty: Input should be greater"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty: Input should be greater"),
    ({"prompt": "x", "min_p": 1.1}, "min_p: Input should be less than"),
    ({"prompt": "x", "include_stop_str_in_output": "yes"}, "include_stop_str_in_output:"),
    ({}, "prompt:"),
])
def test_invalid_completion_bodies_name_the_field(body, start):
    assert _message(CompletionRequest, body).startswith(start)


def test_one_prompt_in_a_list_is_that_prompt():
    assert CompletionRequest.model_validate({"prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).prompt == [1, 2]


def test_chat_bodies():
    assert _message(ChatRequest, {"messages": []}).startswith("messages:")
    assert _message(ChatRequest, {"messages": [{"content": "hi"}]}).startswith("messages.0.role")
    body = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7})
    assert body.plain_messages() == [{"role": "user", "content": "ab"}]
    assert body.output_limit == 7


def test_unsupported_fields_are_refused_by_name():
    with pytest.raises(ServeError, match="^best_of:"):
        CompletionRequest.model_validate({"prompt": "x", "best_of": 2}).check_unsupported()


CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model, field, value", [
    (CompletionRequest, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (CompletionRequest, "tool_choice", "auto"),
    (CompletionRequest, "parallel_tool_calls", True),
    (ChatRequest, "functions", [{"name": "f"}]),
    (ChatRequest, "function_call", "auto"),
    (ChatRequest, "echo", True),
    (ChatRequest, "continue_final_message", True),
    (ChatRequest, "chat_template", "{{ x }}"),
    (ChatRequest, "add_special_tokens", True),
    (ChatRequest, "return_token_ids", True),
    (CompletionRequest, "add_special_tokens", False),
    (CompletionRequest, "suffix", "end"),
    (CompletionRequest, "guided_decoding_backend", "outlines"),
    (CompletionRequest, "stop_token_ids", [2]),
    (CompletionRequest, "min_tokens", 3),
    (CompletionRequest, "use_beam_search", True),
    (CompletionRequest, "skip_special_tokens", False),
    (CompletionRequest, "prompt_logprobs", 1),
    (CompletionRequest, "allowed_token_ids", [1, 2]),
    (CompletionRequest, "length_penalty", 2.0),
    (CompletionRequest, "min_tokens", True),  # true is not 0's neutral value
])
def test_known_but_unserved_fields_are_a_400_naming_them(model, field, value):
    base = CHAT_BODY if model is ChatRequest else {"prompt": "x"}
    body = model.model_validate({**base, field: value})
    with pytest.raises(ServeError) as caught:
        body.check_unsupported()
    error = caught.value
    assert (error.status, error.param) == (400, field)
    assert error.message.startswith(f"{field}: not supported by this server")


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "text"}), ("response_format", None), ("tools", []),
    ("tool_choice", "none"), ("length_penalty", 1), ("min_tokens", 0),
    ("skip_special_tokens", True), ("user", "u-1"), ("metadata", {"a": "b"}), ("store", True),
    ("service_tier", "auto"), ("some_vendor_field", {"x": 1}),
])
def test_neutral_values_no_ops_and_unknown_fields_are_accepted(field, value):
    ChatRequest.model_validate({**CHAT_BODY, field: value}).check_unsupported()
    CompletionRequest.model_validate({"prompt": "x", field: value}).check_unsupported()


@pytest.mark.parametrize("field, value", [  # tool_calls, tool_call_id, name: test_serve_tools.py
    ("function_call", {"name": "f", "arguments": "{}"}),
])
def test_message_fields_the_template_would_need_are_a_400_naming_them(field, value):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", field: value}]
    body = ChatRequest.model_validate({"messages": messages})
    with pytest.raises(ServeError) as caught:
        body.check_unsupported()
    assert (caught.value.status, caught.value.param) == (400, f"messages[1].{field}")
    assert caught.value.message.startswith(f"messages[1].{field}: not supported by this server")


def test_neutral_message_fields_are_accepted():
    messages = [{"role": "assistant", "content": "a", "tool_calls": [], "refusal": None}]
    ChatRequest.model_validate({"messages": messages}).check_unsupported()


def test_docs_list_every_refused_field():
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "serve.md").read_text()
    section = docs[docs.index("### Fields served, refused and ignored"):]
    for field in {**ChatRequest.refused, **CompletionRequest.refused, **ChatMessage.refused}:
        assert f"`{field}`" in section, field


def test_continuous_usage_stats_is_refused():
    body = CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    with pytest.raises(ServeError, match="^stream_options.continuous_usage_stats: not supported"):
        body.check_unsupported()


def test_a_list_of_prompts_is_several_prompts():
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": "a"}).prompts == ["a"]
    CompletionRequest.model_validate({"prompt": ["a"] * 8, "n": 128}).check_unsupported()
    with pytest.raises(ServeError, match="^prompt: 9 prompts x n 128 = 1152 choices"):
        CompletionRequest.model_validate({"prompt": ["a"] * 9, "n": 128}).check_unsupported()


def test_penalties_bias_and_min_p_reach_the_body():
    body = CompletionRequest.model_validate({
        "prompt": "x", "presence_penalty": -2, "frequency_penalty": 1.5,
        "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"7": 100, "12": -100.0},
        "include_stop_str_in_output": True})
    body.check_unsupported()
    assert body.logit_bias_pairs == ((7, 100.0), (12, -100.0))
    assert (body.presence_penalty, body.frequency_penalty, body.repetition_penalty,
            body.min_p, body.include_stop_str_in_output) == (-2, 1.5, 1.2, 0.1, True)


def test_a_stop_string_can_stay_in_the_text():
    """vLLM's include_stop_str_in_output: the text ends after the stop string, streamed or not."""
    tokenizer = ByteTokenizer()
    for keep, expected in ((False, "héllo "), (True, "héllo wör")):
        text = IncrementalText(tokenizer, stop=["wör", "wörld"], keep_stop=keep)
        pieces = []
        for token in tokenizer.encode(TEXT):
            text.add([token])
            pieces.append(text.new_text())
        text.finish()
        pieces.append(text.new_text(final=True))
        assert text.stopped and text.text == expected == "".join(pieces)


def test_samples_logprobs_and_echo_fields():
    body = CompletionRequest.model_validate({"prompt": "x", "n": 8, "logprobs": 3,
                                             "echo": True, "max_tokens": 0})
    body.check_unsupported()
    assert (body.n, body.output_logprobs, body.prompt_logprobs) == (8, 3, 3)
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 0}).prompt_logprobs \
        is None  # the prompt's only with echo
    with pytest.raises(ServeError, match="^max_tokens: 0 is allowed only with echo"):
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0}).check_unsupported()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 5}) \
        .output_logprobs == 5
    assert ChatRequest.model_validate({**chat, "logprobs": True}).output_logprobs == 0
    assert ChatRequest.model_validate(chat).output_logprobs is None
    with pytest.raises(ServeError, match="^top_logprobs: needs logprobs=true"):
        ChatRequest.model_validate({**chat, "top_logprobs": 2}).check_unsupported()
    for value in (-1, 21, 2.0, True, "3"):
        assert _message(ChatRequest, {**chat, "logprobs": True, "top_logprobs": value}) \
            .startswith("top_logprobs:")
    for value in (1, "yes", None):
        assert _message(ChatRequest, {**chat, "logprobs": value}).startswith("logprobs:")


def test_malformed_json_message():
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate_json('{"prompt": ')
    message, field = validation_message(caught.value.errors())
    assert message.startswith("body: not valid JSON") and field is None


# ---------------------------------------------------------------- every field's range

HUGE = 2**63  # issue #30: top_k 2**63 reached the sampler and killed the engine


@pytest.mark.parametrize("field, good, bad", [
    ("max_tokens", [0, 1, 2**31 - 1, None], [-1, 2**31, HUGE, 1.5, True, "4"]),
    ("temperature", [0, 0.0, 0.7, 2, 100.0], [-0.1, 100.5, float("nan"), float("inf"),
                                               float("-inf"), "1", None]),
    ("top_p", [1e-9, 0.5, 1, 1.0], [0, 0.0, -0.5, 1.01, float("nan"), float("inf"), None]),
    ("top_k", [-1, 0, 1, 50, 2**31 - 1], [-2, 2**31, HUGE, -HUGE, 2.0, False, None]),
    ("seed", [0, 2**32 - 1, None], [-1, 2**32, HUGE, 1.0, "7"]),
    ("n", [1, 8, 128], [0, -1, 129, HUGE, 1.0]),
    ("logprobs", [0, 5, 20, None], [-1, 21, HUGE, 1.0, True, "2"]),
    ("echo", [True, False], [1, "true", None]),
    ("best_of", [1, None], [0, HUGE]),
    ("kv_budget", [16, 2**31 - 1, None], [0, -16, 2**31, HUGE, 16.0, True]),
    ("compress_scope", ["all", "output", None], ["prompt", "", 1, True, ["all"]]),
    ("stop", ["x", ["a", "b"], ["s"] * 16, "y" * 1000, None],
     ["", [""], ["s"] * 17, "y" * 1001, [1], {"a": 1}]),
    ("ignore_eos", [True, False], [1, "true", None]),
    ("stream", [True, False], [0, "yes"]),
])
def test_every_sampling_field_has_its_range(field, good, bad):
    for value in good:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    for value in bad:
        message = _message(CompletionRequest, {"prompt": "x", field: value})
        assert message.startswith(f"{field}:"), (value, message)
        assert len(message) < 200


def test_chat_output_limit_has_its_range():
    for value in (0, 2**31, HUGE, 1.0):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": value}
        assert _message(ChatRequest, body).startswith("max_completion_tokens:")


def test_nan_temperature_says_finite_not_negative():
    message = _message(CompletionRequest, {"prompt": "x", "temperature": float("nan")})
    assert message == "temperature: Input should be a finite number"


def test_prompt_token_ids_are_bounded():
    assert _message(CompletionRequest, {"prompt": [1, 2**31]}).startswith("prompt: expected")
    assert _message(CompletionRequest, {"prompt": [1, HUGE]}).startswith("prompt: expected")


@pytest.mark.parametrize("body, path", [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": ["\udfff"]}, "prompt.0"),
    ({"prompt": "x", "stop": ["ok", "\ud800"]}, "stop.1"),
    ({"prompt": "x", "model": "\ud83d"}, "model"),
    ({"prompt": "x", "unknown": {"deep": ["\ud800"]}}, "unknown.deep.0"),
    ({"prompt": "x", "\ud800": 1}, "body (a key)"),
    ({"prompt": "x", "a": [{"\ud800": 1}]}, "a.0 (a key)"),
])
def test_lone_surrogates_are_a_400_naming_where(body, path):
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate(body)
    message, field = validation_message(caught.value.errors())
    assert message.startswith(f"{path}: contains a lone UTF-16 surrogate")
    message.encode("utf-8")  # the message itself can be written back


def test_chat_surrogates_are_a_400():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}
    assert _message(ChatRequest, body).startswith("messages.0.content.0.text: contains a lone")
    # A surrogate pair (how JSON escapes a character outside the BMP) is valid text.
    assert CompletionRequest.model_validate_json('{"prompt": "\\ud83d\\ude00"}').prompt == "😀"


def test_error_body_is_cut_and_always_utf8():
    from zipage.serve.protocol import MESSAGE_LIMIT, error_body

    body = error_body("m: " + "x" * 10**6 + "\ud800", "invalid_request_error", "p\ud800", 400)
    error = body["error"]
    assert len(error["message"]) <= MESSAGE_LIMIT + 3 and error["code"] == 400
    error["message"].encode("utf-8")
    body = error_body("bad \ud800", "invalid_request_error", "p\ud800", 400)["error"]
    assert body["message"] == "bad \\ud800" and body["param"] == "p\\ud800"


def test_an_unknown_model_name_is_cut_in_its_message():
    from types import SimpleNamespace

    from zipage.serve.app import Server

    server = SimpleNamespace(model_name="smollm2")
    with pytest.raises(ServeError) as caught:
        Server.check(server, CompletionRequest.model_validate({"prompt": "x",
                                                               "model": "m" * 10**6}))
    assert caught.value.status == 404 and len(caught.value.message) < 200
    assert caught.value.message.startswith("model: 'mmm")


# ---------------------------------------------------------------- the API key

@pytest.mark.parametrize("header, key", [
    ("Bearer k1", "k1"), ("bearer k1", "k1"), ("BEARER  k1 ", "k1"), ("Basic k1", None),
    ("k1", None), ("", None), (None, None), ("Bearerk1", None),
])
def test_the_bearer_scheme_is_case_insensitive(header, key):
    from zipage.serve.app import _bearer_key

    assert _bearer_key(header) == key


def _serve_args(*flags):
    import argparse

    from zipage.cli.serve import add_parser as add_serve_commands

    parser = argparse.ArgumentParser()
    add_serve_commands(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_api_key_from_flag_file_or_environment(tmp_path):
    from zipage.cli.serve import api_key_from
    from zipage.errors import ZipageError

    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    environ = {"ZIPAGE_API_KEY": "from-env"}
    assert api_key_from(_serve_args(), {}) is None
    assert api_key_from(_serve_args(), environ) == "from-env"
    assert api_key_from(_serve_args("--api-key", "flag"), environ) == "flag"
    assert api_key_from(_serve_args("--api-key-file", str(key_file)), environ) == "from-file"
    with pytest.raises(ZipageError, match="^--api-key and --api-key-file: give one"):
        api_key_from(_serve_args("--api-key", "a", "--api-key-file", str(key_file)), {})
    with pytest.raises(ZipageError, match="^--api-key-file: cannot read"):
        api_key_from(_serve_args("--api-key-file", str(tmp_path / "none")), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ZipageError, match="^--api-key-file: .* is empty"):
        api_key_from(_serve_args("--api-key-file", str(tmp_path / "empty")), {})
    with pytest.raises(ZipageError, match="^ZIPAGE_API_KEY: empty"):
        api_key_from(_serve_args(), {"ZIPAGE_API_KEY": " "})


def test_max_body_bytes_flag_and_its_one_default():
    from zipage.serve import DEFAULT_MAX_BODY_BYTES

    assert _serve_args().max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert _serve_args("--max-body-bytes", "1000").max_body_bytes == 1000


# ---------------------------------------------------------------- the engine's own check

class _FakeLoop:
    def __init__(self):
        self.tokens, self.added = {}, []

    def now(self):
        return 0.0

    def add(self, seq):
        self.added.append(seq.seq_id)
        return True


def _core():
    pytest.importorskip("torch")
    from zipage.serve.engine_process import EngineCore

    core = EngineCore.__new__(EngineCore)  # no engine: `_add` needs the loop and the vocabulary
    core.loop, core.vocab_size, core.rejected, core.changed = _FakeLoop(), 100, {}, False
    return core


def test_engine_refuses_a_bad_request_alone():
    """Defense in depth: settings that bypassed the HTTP checks (unpickling skips
    `__post_init__`) or token ids outside the vocabulary fail their request, not the engine."""
    from zipage.core.sampling import SamplingParams
    from zipage.serve.wire import Add

    core = _core()
    bad = SamplingParams(temperature=1.0, max_tokens=4)
    object.__setattr__(bad, "top_k", HUGE)  # as if it arrived so over the socket
    core._add(Add("bad", [1, 2], bad))
    core._add(Add("outside", [1, 100], SamplingParams(max_tokens=4)))
    core._add(Add("good", [1, 2], SamplingParams(max_tokens=4)))
    assert core.loop.added == ["good"]
    assert set(core.rejected) == {"bad", "outside"} and core.changed
    message, param = core.rejected["bad"]  # the field named, as the HTTP side names it
    assert message.startswith("top_k: 9223372036854775808 must be an integer") and param == "top_k"
    message, param = core.rejected["outside"]
    assert message.startswith("prompt: token ids must be in 0..99") and param == "prompt"


class _SchedulerLoop(_FakeLoop):
    """A loop whose `add` is the core's: `Scheduler.add`, its admission rule and all."""

    def __init__(self, config):
        from zipage.core.scheduler import Scheduler

        super().__init__()
        self.scheduler = Scheduler(config, num_blocks=64, num_query_slots=8)

    def add(self, seq):
        added = self.scheduler.add(seq)
        if added:
            self.added.append(seq.seq_id)
        return added


def test_the_engine_process_words_an_admission_refusal_as_the_http_side_does():
    """The HTTP side asks the admission rule first, so the engine process refusing by it is rare
    (a request sent before a restart changed the deployment); when it does, the 400 is the
    same: "<field>: <why>" with `param` the field, and the prompt's lengths as the prompt's."""
    from zipage.config import ZipageConfig
    from zipage.core.admission import Admission
    from zipage.core.sampling import SamplingParams
    from zipage.serve.app import admission_error
    from zipage.serve.wire import Add

    config = ZipageConfig(block_size=16, window=4, kv_budget=64, max_model_len=64)
    core = _core()
    core.loop = _SchedulerLoop(config)
    requests = {"budget": ([1, 2], SamplingParams(max_tokens=4, kv_budget=100)),
                "long": ([1, 2], SamplingParams(max_tokens=63)),
                "good": ([1, 2], SamplingParams(max_tokens=4))}
    for seq_id, (prompt, sampling) in requests.items():
        core._add(Add(seq_id, prompt, sampling))
    assert core.loop.added == ["good"] and set(core.rejected) == {"budget", "long"}
    admission = Admission(config, 64)
    for seq_id in ("budget", "long"):
        prompt, sampling = requests[seq_id]
        http = admission_error(admission, len(prompt), sampling)
        assert core.rejected[seq_id] == (http.message, http.param)
    assert core.rejected["budget"][1] == "kv_budget"
    assert core.rejected["budget"][0].startswith("kv_budget: 100 must be a positive multiple")
    assert core.rejected["long"] == ("prompt: too long for this server: prompt_len + max_tokens "
                                     "= 65 exceeds max_model_len 64; shorten the request or "
                                     "raise --max-model-len", "prompt")


# ---------------------------------------------------------------- one error body for everything

def test_an_unexpected_exception_is_a_500_in_openai_shape():
    """The catch-all handler, in process (no engine: a stand-in with what `Server` reads). A bug
    in a route answers OpenAI's body, not Starlette's plain text, and is still raised to the
    server's log."""
    pytest.importorskip("fastapi")
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from zipage.serve.app import build_app

    info = SimpleNamespace(capacity=SimpleNamespace(num_blocks=4), eos_token_ids=frozenset(),
                           config=SimpleNamespace(max_model_len=64))
    engine = SimpleNamespace(info=info, attach=lambda metrics: None, close=lambda: None,
                             stop_process=lambda: None, alive=True, replicas=1)
    app = build_app(engine, None, "m", api_key="k")

    @app.get("/v1/boom")
    async def boom():
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        reply = client.get("/v1/boom", headers={"Authorization": "bearer k"})
        assert reply.status_code == 500
        assert reply.json() == {"error": {
            "message": "internal error: RuntimeError; the server's log has the traceback",
            "type": "server_error", "param": None, "code": 500}}
        reply = client.get("/v1/boom", headers={"Authorization": "Bearer wrong"})
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        reply = client.post("/v1/nowhere", headers={"Authorization": "Bearer k"})
        assert reply.status_code == 404 and reply.json()["error"]["message"].startswith(
            "route: POST '/v1/nowhere' does not exist")


# ---------------------------------------------------------------- the prefix cache's figures

def _plan(step_id: int, hits: int, *items):
    """A stand-in `StepPlan`: (request, first admitted step, cached, computed) per prefill item."""
    from types import SimpleNamespace

    prefill = [SimpleNamespace(seq=SimpleNamespace(seq_id=seq_id, first_admitted_step=admitted,
                                                   arrival_s=1.0),
                               num_cached_tokens=cached, num_new_tokens=computed)
               for seq_id, admitted, cached, computed in items]
    return SimpleNamespace(step_id=step_id, prefix_hit_tokens=hits, host_hit_tokens=0,
                           prefill=prefill)


def test_cached_tokens_reach_the_first_token_of_a_chunked_prompt_and_the_counters():
    """A 70-token prompt with 32 tokens in the cache, computed in two chunks: the admission's
    step reports its hits, the HTTP side holds them until the first token (next step), whose
    delta carries them; the counters advance by the hits and every prompt token."""
    pytest.importorskip("prometheus_client")
    from types import SimpleNamespace

    from zipage.config import ZipageConfig
    from zipage.core.memory import MemoryPlan
    from zipage.core.sampling import SamplingParams
    from zipage.serve.engine_client import EngineClient
    from zipage.serve.engine_process import EngineCore
    from zipage.serve.metrics import ServerMetrics
    from zipage.serve.wire import EngineStats, Ready, StepUpdate

    core = EngineCore.__new__(EngineCore)
    core.prefix_queries = core.prefix_hits = core.host_hits = 0
    core.step_started, core.queued = 1.25, {}  # the stand-in requests arrived at 1.0
    info = Ready("cpu", ZipageConfig(block_size=16, kv_budget=64, window=4),
                 MemoryPlan(1024, 64, 1, 1, 1024), 256, frozenset(), 1)
    client = EngineClient(SimpleNamespace(poll=lambda: None),
                          SimpleNamespace(send=lambda message: None, closed=False), info)
    metrics = ServerMetrics("m", 1024)
    client.metrics = metrics.replica(0)
    handle = client.submit(list(range(70)), SamplingParams(max_tokens=2))[0]
    rid = handle.seq_id

    def step(plan, seq_ids, tokens):
        hits = core._count_prompt_tokens(plan)
        stats = EngineStats(1, 0, 5, 0, 0, core.prefix_queries, core.prefix_hits)
        client._receive(StepUpdate(seq_ids, tokens, {}, {}, stats, None, {}, hits,
                                   queued=core.queued))
        core.queued = {}
        return [handle.deltas.get_nowait() for _ in tokens]

    assert step(_plan(3, 32, (rid, 3, 32, 16)), [], []) == []  # admitted: 32 hit, 16 computed
    assert handle.cached_tokens == 32
    first, = step(_plan(4, 0, (rid, 3, 48, 22)), [rid], [7])  # the last chunk samples
    assert first.cached_tokens == 32
    assert first.queued_s == pytest.approx(0.25, abs=1e-12)  # admission's step start - arrival
    second, = step(_plan(5, 0), [rid], [8])
    assert second.cached_tokens is None
    text = metrics.exposition().decode()
    assert 'zipage:prefix_cache_hits_total{model_name="m",replica="0"} 32.0' in text
    assert 'zipage:prefix_cache_queries_total{model_name="m",replica="0"} 70.0' in text
    assert 'zipage:request_queue_time_seconds_count{model_name="m",replica="0"} 1.0' in text


def test_prefix_cache_counters_are_per_replica_and_survive_a_restart():
    """Each replica's counters follow its engine's totals; a new engine process counts from
    zero again, and its replica's counter goes on from where it was."""
    pytest.importorskip("prometheus_client")
    from zipage.serve.metrics import ServerMetrics
    from zipage.serve.wire import EngineStats

    metrics = ServerMetrics("m", 64, replicas=2)
    zero, one = metrics.replica(0), metrics.replica(1)
    zero.engine_stats(EngineStats(0, 0, 0, 0, 0, 40, 16), 0)
    one.engine_stats(EngineStats(0, 0, 0, 0, 0, 10, 0), 0)
    zero.engine_stats(EngineStats(0, 0, 0, 0, 0, 91, 48), 0)
    zero.engine_restarted()
    zero.engine_stats(EngineStats(0, 0, 0, 0, 0, 5, 0), 0)
    text = metrics.exposition().decode()
    for replica, queries, hits in (("0", 96.0, 48.0), ("1", 10.0, 0.0)):
        labels = f'{{model_name="m",replica="{replica}"}}'
        assert f"zipage:prefix_cache_queries_total{labels} {queries}" in text
        assert f"zipage:prefix_cache_hits_total{labels} {hits}" in text
