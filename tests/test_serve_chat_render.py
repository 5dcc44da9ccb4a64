"""The chat template's renders per request (zipage/serve/app.py, `Server.chat_prompt`).

A request renders its template at most twice, however many tool calls its conversation holds
(an agent's session used to render once more per call: quadratic over the session), and gives
what the earlier per-call check gave: the same prompt tokens, and the same 400 naming `tools` or
`messages[i].tool_calls` where the template drops them. The earlier check is kept here, only
as the reference, and run over templates that render both, neither, tools only, calls only,
and calls only when the message has no content.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
jinja2_sandbox = pytest.importorskip("jinja2.sandbox")

from zipage.serve.app import Server  # noqa: E402
from zipage.serve.chat_output import ChatSettings  # noqa: E402
from zipage.serve.protocol import ChatRequest, ServeError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HERMES = (ROOT / "tests" / "fixtures" / "chat_templates" / "chatml_tools.jinja").read_text()
# ChatML as SmolLM2 writes it: no tools, no calls.
PLAIN = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
         "{% endif %}")
CALL_LOOP = ("{%- for call in message.tool_calls or [] -%}\n<tool_call>{\"name\": \"{{ "
             "call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
             "</tool_call>\n{%- endfor %}")
assert CALL_LOOP in HERMES  # the variants below edit the fixture's own call loop
TEMPLATES = {
    "hermes": HERMES,
    "plain": PLAIN,
    "tools only": HERMES.replace(CALL_LOOP, ""),
    "calls only": HERMES.replace("{%- if tools -%}", "{%- if false -%}"),
    # An assistant's calls written only when it has no content of its own.
    "calls without content": HERMES.replace(
        CALL_LOOP, "{%- if not message.content -%}" + CALL_LOOP + "{%- endif -%}"),
}


class JinjaTokenizer:
    """A tokenizer's chat-template side as transformers renders it (a sandboxed Jinja with
    trim_blocks and lstrip_blocks, `tojson` as json.dumps), one token per UTF-8 byte, and a
    count of the renders."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.renders = 0
        self.environment = jinja2_sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.environment.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent)

    def apply_chat_template(self, messages, tools=None, chat_template=None,
                            add_generation_prompt=False, tokenize=True):
        assert not tokenize
        self.renders += 1
        return self.environment.from_string(chat_template or self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


def _server(template: str) -> Server:
    """The parts of a server chat_prompt reads (no engine, no text bound)."""
    server = Server.__new__(Server)
    server.chat = ChatSettings(tool_parser="hermes", auto_tool_choice=True)
    server.tokenizer = JinjaTokenizer(template)
    server.token_bytes = server.prompt_tokens = None
    return server


def old_chat_prompt(server: Server, body: ChatRequest) -> list[int]:
    """The check before: the template rendered again without the tools, and again without each
    message's calls (2 + N renders)."""
    messages, template = body.plain_messages(), server.chat.chat_template
    text = server._render(messages, body.tool_dicts, template)
    if body.tools and text == server._render(messages, None, template):
        raise ServeError(400, "tools: this model's chat template does not render tools; serve "
                              "it with one that does (zipage serve --chat-template FILE)",
                         "tools")
    for index, message in enumerate(messages):
        if message.get("tool_calls") and text == server._render(
                [*messages[:index], {**message, "tool_calls": None}, *messages[index + 1:]],
                body.tool_dicts, template):
            raise ServeError(400, f"messages[{index}].tool_calls: this model's chat template "
                                  "does not render tool calls; serve it with one that does "
                                  "(zipage serve --chat-template FILE)",
                             f"messages[{index}].tool_calls")
    return list(server.tokenizer.encode(text, add_special_tokens=False))


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def _call(index: int, city: str) -> dict:
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def _history(calls: int, content_at: int | None = None) -> list[dict]:
    """A user's question, then `calls` rounds of an assistant's call and the tool's answer (the
    call at `content_at` has content beside it), then a question."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in the cities, please."}]
    for index in range(calls):
        messages.append({"role": "assistant", "tool_calls": [_call(index, f"city {index}")],
                         "content": "Looking." if index == content_at else None})
        messages.append({"role": "tool", "tool_call_id": f"call_{index}",
                         "content": f"{index} C"})
    return [*messages, {"role": "user", "content": "And now?"}]


CONVERSATIONS = {
    "no tools": {"messages": _history(0)},
    "tools": {"messages": _history(0), "tools": TOOLS},
    "tools and calls": {"messages": _history(3), "tools": TOOLS},
    "calls, one with content": {"messages": _history(3, content_at=1), "tools": TOOLS,
                                "tool_choice": "none"},
    "calls without tools": {"messages": _history(2)},
}


def _outcome(prompt, server: Server, body: ChatRequest):
    try:
        return prompt(server, body)
    except ServeError as error:
        return error.status, error.param, error.message


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_same_prompt_and_same_refusals_as_the_per_call_check(template, conversation):
    server = _server(TEMPLATES[template])
    body = ChatRequest.model_validate(CONVERSATIONS[conversation])
    expected = _outcome(old_chat_prompt, server, body)
    assert _outcome(Server.chat_prompt, server, body) == expected


def test_the_cases_reach_each_outcome():
    """The comparison above covers prompts and both refusals, the per-message one too."""
    outcomes = set()
    for template in TEMPLATES.values():
        for conversation in CONVERSATIONS.values():
            outcome = _outcome(old_chat_prompt, _server(template),
                               ChatRequest.model_validate(conversation))
            outcomes.add(outcome[1] if isinstance(outcome, tuple) else "prompt")
    assert outcomes == {"prompt", "tools", "messages[2].tool_calls", "messages[4].tool_calls"}


@pytest.mark.parametrize("template", ["hermes", "tools only", "calls without content"])
def test_a_conversation_of_many_tool_calls_renders_the_template_at_most_twice(template):
    server = _server(TEMPLATES[template])
    body = ChatRequest.model_validate({"messages": _history(40, content_at=30), "tools": TOOLS})
    old = _outcome(old_chat_prompt, server, body)
    if template == "hermes":  # the count sees every render: each call's, when none is refused
        assert server.tokenizer.renders == 42
    server.tokenizer.renders = 0
    assert _outcome(Server.chat_prompt, server, body) == old
    assert server.tokenizer.renders <= 2
