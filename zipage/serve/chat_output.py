"""The assistant's message from a chat output's text: the reasoning (`--reasoning-parser`), then
the tool calls in what follows it (`--tool-call-parser`), whole or as stream deltas in OpenAI's
and vLLM's shapes.

A stream scans the text released so far after each engine update and sends what the scan added
to the last one (`reasoning_content`, `content`, and per call: its index, id and name first,
then its arguments as they arrive); the parsers' scans only grow (tool_parsers.py), so the
deltas add up to the whole message. A malformed call the stream had begun cannot be taken back:
what was sent of it stands.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from zipage.serve.reasoning import REASONING_PARSERS, ReasoningParser
from zipage.serve.tool_parsers import TOOL_PARSERS, Call, ToolParser, _skip


@dataclass(frozen=True)
class ChatSettings:
    """The server's chat settings (zipage serve's flags, docs/serve.md 'Tool calling and
    reasoning')."""

    tool_parser: str | None = None  # --tool-call-parser: a TOOL_PARSERS name
    auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" is served
    reasoning_parser: str | None = None  # --reasoning-parser: a REASONING_PARSERS name
    chat_template: str | None = None  # --chat-template: Jinja text that replaces the model's

    def output(self, parse_tools: bool, first_call_only: bool) -> ChatOutput | None:
        """A choice's parsers (None: its text is the content, as it is)."""
        reasoning = (REASONING_PARSERS[self.reasoning_parser]()
                     if self.reasoning_parser is not None else None)
        tools = TOOL_PARSERS[self.tool_parser]() if parse_tools else None
        if reasoning is None and tools is None:
            return None
        return ChatOutput(reasoning, tools, first_call_only)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _added(now: str, sent: str) -> str:
    """What `now` adds to `sent` (nothing when it does not extend it)."""
    return now[len(sent):] if now.startswith(sent) else ""


class ChatOutput:
    """One choice's parsers and what its stream has sent."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 first_call_only: bool = False) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.first_call_only = first_call_only  # parallel_tool_calls: false
        self.sent_reasoning = self.sent_content = ""
        self.sent_calls: list[tuple[str, Call]] = []  # (id, the call as sent so far)

    def parts(self, text: str, final: bool) -> tuple[str, str, list[Call]]:
        """(reasoning, content, calls) of the output `text` (so far, unless `final`)."""
        reasoning, answer = (self.reasoning.split(text, final) if self.reasoning is not None
                             else ("", text))
        if self.tools is None:
            return reasoning, answer, []
        scan = self.tools.scan(answer, final)
        return reasoning, scan.content, scan.calls[:1] if self.first_call_only else scan.calls

    def message(self, text: str) -> dict:
        """The whole message of a finished output."""
        reasoning, content, calls = self.parts(text, final=True)
        message: dict = {"role": "assistant",
                         "content": content or (None if reasoning or calls else "")}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [_call(call_id(), call) for call in calls]
        return message

    def delta(self, text: str, final: bool) -> dict:
        """What the text released so far adds to what was sent: a delta's fields."""
        reasoning, content, calls = self.parts(text, final)
        delta: dict = {}
        piece = _added(reasoning, self.sent_reasoning)
        if piece:
            delta["reasoning_content"] = piece
            self.sent_reasoning = reasoning
        piece = _added(content, self.sent_content)
        if piece:
            delta["content"] = piece
            self.sent_content = content
        pieces = []
        for index, call in enumerate(calls):
            if index == len(self.sent_calls):
                identifier = call_id()
                self.sent_calls.append((identifier, call))
                pieces.append({"index": index, **_call(identifier, call)})
                continue
            identifier, sent = self.sent_calls[index]
            if call.name != sent.name:
                continue  # a call that turned out malformed: what was sent stands
            piece = _added(call.arguments, sent.arguments)
            if piece:
                self.sent_calls[index] = (identifier, call)
                pieces.append({"index": index, "function": {"arguments": piece}})
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    def finish_reason(self, reason: str, called: bool) -> str:
        """An answer of calls finishes with "tool_calls" (vLLM's and OpenAI's reason)."""
        return "tool_calls" if called else reason

    @property
    def called(self) -> bool:
        """The stream sent a tool call (its finish reason is "tool_calls")."""
        return bool(self.sent_calls)


class ForcedCalls:
    """A choice whose output was constrained to its tool calls' JSON (tool_choice "required"
    or a named function), read as vLLM reads it: no tool-call parser, and no reasoning (the
    constraint holds from the first token). Named (`name`): the whole text is the function's
    arguments, streamed as they arrive. "required" (`name` None): a JSON array of {"name",
    "parameters"}; each element becomes a call once it is complete (whole in the stream too),
    its arguments the parameters re-serialised. An output cut before any complete element has
    no calls: its text is the content."""

    def __init__(self, name: str | None, reasoning: bool = False) -> None:
        self.name = name
        self.reasoning = reasoning  # the server has a reasoning parser: the field is sent
        self.sent_calls: list[tuple[str, Call]] = []
        self.sent_content = False

    def calls(self, text: str) -> list[Call]:
        if self.name is not None:
            return [Call(self.name, text)]
        return [Call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for item in _complete_items(text)
                if isinstance(item, dict) and isinstance(item.get("name"), str)
                and isinstance(item.get("parameters"), dict)]

    def message(self, text: str) -> dict:
        calls = self.calls(text)
        message: dict = {"role": "assistant", "content": None if calls else text}
        if self.reasoning:
            message["reasoning_content"] = None
        if calls:
            message["tool_calls"] = [_call(call_id(), call) for call in calls]
        return message

    def delta(self, text: str, final: bool) -> dict:
        calls = self.calls(text)
        pieces = []
        for index, call in enumerate(calls):
            if index == len(self.sent_calls):
                self.sent_calls.append((call_id(), call))
                pieces.append({"index": index, **_call(self.sent_calls[index][0], call)})
                continue
            identifier, sent = self.sent_calls[index]
            piece = _added(call.arguments, sent.arguments)  # named: the arguments grow
            if piece:
                self.sent_calls[index] = (identifier, call)
                pieces.append({"index": index, "function": {"arguments": piece}})
        if pieces:
            return {"tool_calls": pieces}
        if final and not self.sent_calls and text and not self.sent_content:
            self.sent_content = True  # no complete call: the text is the content, as whole
            return {"content": text}
        return {}

    def finish_reason(self, reason: str, called: bool) -> str:
        """vLLM's: "tool_calls" for "required" when the output ended by itself; a named call
        keeps the engine's reason ("stop"), as OpenAI's API does."""
        return "tool_calls" if called and self.name is None and reason == "stop" else reason

    @property
    def called(self) -> bool:
        return bool(self.sent_calls)


def _complete_items(text: str) -> list:
    """The complete elements at the start of a JSON array's text (which may be cut short)."""
    decoder, items = json.JSONDecoder(), []
    index = _skip(text, 0)
    if not text.startswith("[", index):
        return items
    index += 1
    while True:
        try:
            item, index = decoder.raw_decode(text, _skip(text, index))
        except ValueError:
            return items
        items.append(item)
        index = _skip(text, index)
        if not text.startswith(",", index):
            return items
        index += 1


def _call(identifier: str, call: Call) -> dict:
    return {"id": identifier, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
