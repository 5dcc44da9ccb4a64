"""Tool calls in a model's output text, one parser per model family (vLLM's
`--tool-call-parser` names).

`hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
block per call, text around them. `llama3_json` (Llama 3.1 and 3.2 JSON calls): the output is
`{"name": ..., "parameters": {...}}` objects separated by `;`, optionally after
`<|python_tag|>` (text before the tag is content).

A parser has one method, `scan(text, final)`. With `final` it is the parse of a whole output.
Without, `text` is the output so far and the scan says only what is sure whatever follows: text
that may still become a tag, or whitespace that may still touch a call, is held back, and a call
appears once its name is known, its arguments as far as they have arrived. So every field of a
scan of a prefix is a prefix of the same field of the final parse (for well-formed calls), and a
stream is the differences between successive scans (`chat_output.py`). Arguments are the JSON
text of the object as the model wrote it (a client `json.loads` it), never re-serialised, which
is what lets a stream send them as they arrive.

Text outside the calls is the content, less the whitespace that touches a call. A block that is
not a call (not JSON, no string `name`, arguments not an object) stays in the content as text,
tags and all, as vLLM's parsers leave it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from json.decoder import scanstring
from typing import ClassVar

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object ("" while none of it has arrived)


@dataclass
class Scan:
    content: str  # text outside the calls
    calls: list[Call] = field(default_factory=list)


def held(text: str, tag: str) -> int:
    """Characters at the end of `text` that may be the start of `tag` (held back in a stream)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _skip(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


def _members(text: str) -> list[tuple[str, object, int, int | None]]:
    """The top-level members of the JSON object at the start of `text`, as far as the text
    goes: (key, value, value start, value end); value end is None (and value None) for the last
    member while its value may be incomplete."""
    members: list = []
    index = _skip(text, 0)
    if index >= len(text) or text[index] != "{":
        return members
    index += 1
    while True:
        index = _skip(text, index)
        if index < len(text) and text[index] == "," and members:
            index = _skip(text, index + 1)
        if index >= len(text) or text[index] != '"':
            return members  # the end, "}", or not a key yet
        try:
            key, index = scanstring(text, index + 1)
        except ValueError:
            return members  # the key is still arriving
        index = _skip(text, index)
        if index >= len(text) or text[index] != ":":
            return members
        start = _skip(text, index + 1)
        try:
            value, end = _DECODER.raw_decode(text, start)
        except ValueError:
            members.append((key, None, start, None))
            return members
        if end == len(text) and not isinstance(value, (dict, list, str)):
            members.append((key, None, start, None))  # a number or literal may go on
            return members
        members.append((key, value, start, end))
        index = end


def call_of(body: str, final: bool, keys: tuple[str, ...] = ("arguments",)) -> Call | None:
    """The call one JSON object `body` is. Final: None unless `body` is exactly one object with a
    string `name` and, if any, an object under one of `keys`. Not final: None until the name is
    known (only a call whose name comes first streams; any other waits for its end)."""
    if final:
        try:
            whole = json.loads(body)
        except ValueError:
            return None
        if not isinstance(whole, dict) or not isinstance(whole.get("name"), str):
            return None
        key = next((key for key in keys if key in whole), None)
        if key is None:
            return Call(whole["name"], "{}")
        if not isinstance(whole[key], dict):
            return None
        # The text of the member json.loads kept (the last, should a key repeat).
        _, _, start, end = [member for member in _members(body) if member[0] == key][-1]
        return Call(whole["name"], body[start:end])
    members = _members(body)
    if not members or members[0][0] != "name" or not isinstance(members[0][1], str):
        return None
    for key, _, start, end in members[1:]:
        if key in keys:
            if start < len(body) and body[start] != "{":
                return Call(members[0][1], "")  # not an object: the final parse decides
            return Call(members[0][1], body[start:len(body) if end is None else end])
    return Call(members[0][1], "")


def _content(segments: list[str], final: bool) -> str:
    """The text between calls: whitespace touching a call dropped, and while not final, the
    last segment's trailing whitespace held (a call may follow)."""
    parts = []
    for index, segment in enumerate(segments):
        if index > 0:
            segment = segment.lstrip()
        if index < len(segments) - 1 or not final:
            segment = segment.rstrip()
        parts.append(segment)
    return "".join(parts)


class ToolParser:
    name: ClassVar[str]

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        segments, calls = [], []
        segment_start = search = 0
        while True:
            start = text.find(self.start, search)
            if start < 0:
                tail = text[segment_start:]
                segments.append(tail if final else tail[:len(tail) - held(tail, self.start)])
                break
            body_start = start + len(self.start)
            end = text.find(self.end, body_start)
            if end < 0 and not final:  # a call arriving: held back, its call streams
                segments.append(text[segment_start:start])
                body = text[body_start:]
                call = call_of(body[:len(body) - held(body, self.end)], final=False)
                calls.extend([call] if call is not None else [])
                return Scan(_content(segments, final), calls)
            call = call_of(text[body_start:len(text) if end < 0 else end], final=True)
            if call is None:  # not a call: its text stays in the content
                search = body_start
                continue
            segments.append(text[segment_start:start])
            calls.append(call)
            if end < 0:  # the output ended inside its last call (no closing tag)
                segments.append("")
                break
            segment_start = search = end + len(self.end)
        return Scan(_content(segments, final), calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"
    keys = ("parameters", "arguments")

    def scan(self, text: str, final: bool) -> Scan:
        tag = text.find(self.tag)
        if tag >= 0:
            head, region = text[:tag], text[tag + len(self.tag):]
        elif text.lstrip().startswith("{"):
            head, region = "", text.lstrip()
        elif final:
            return Scan(text)
        else:  # content, unless the tag is arriving
            return Scan(text[:len(text) - held(text, self.tag)].rstrip())
        calls = self._calls(region, final)
        if final and not calls:  # not calls after all: the whole output is content
            return Scan(text)
        return Scan(head.rstrip(), calls or [])

    def _calls(self, region: str, final: bool) -> list[Call] | None:
        """The calls of `obj; obj; ...`; final: None unless all of it is calls."""
        calls: list[Call] = []
        index = _skip(region, 0)
        while index < len(region):
            try:
                _, end = _DECODER.raw_decode(region, index)
            except ValueError:
                if final:
                    return None
                call = call_of(region[index:], final=False, keys=self.keys)
                return calls + ([call] if call is not None else [])
            call = call_of(region[index:end], final=True, keys=self.keys)
            if call is None:
                return None if final else calls
            calls.append(call)
            index = _skip(region, end)
            if index < len(region):
                if region[index] != ";":
                    return None if final else calls
                index = _skip(region, index + 1)
        return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser)}
