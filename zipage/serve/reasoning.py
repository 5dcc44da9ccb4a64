"""The reasoning of a thinking model's output apart from its answer (vLLM's `--reasoning-parser`
names).

`qwen3`: an output that starts with `<think>` reasons until `</think>`; any other output is all
answer. `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output reasons
from its first character (a `<think>` the model writes anyway is dropped) until `</think>`. Both:
an output cut off before `</think>` is all reasoning; whitespace around either part is dropped.

`split(text, final)` works as the tool parsers' `scan` (`tool_parsers.py`): without `final`,
`text` is the output so far and both parts are what is sure whatever follows (a tag that may be
arriving and whitespace that may end a part are held back), so each is a prefix of the final
split's.
"""

from __future__ import annotations

from typing import ClassVar

from zipage.serve.tool_parsers import held


class ReasoningParser:
    name: ClassVar[str]
    start, end = "<think>", "</think>"
    opened_by_prompt: ClassVar[bool]  # the template opened <think>: the output starts inside

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of the output `text`."""
        lead = text.lstrip()
        if lead.startswith(self.start):
            body = lead[len(self.start):]
        elif not final and self.start.startswith(lead):
            return "", ""  # <think> may be arriving (or nothing but whitespace yet)
        elif self.opened_by_prompt:
            body = text
        else:
            return "", text
        end = body.find(self.end)
        if end < 0:
            if not final:
                body = body[:len(body) - held(body, self.end)].rstrip()
            return body.strip(), ""
        answer = body[end + len(self.end):].lstrip()
        return body[:end].strip(), answer if final else answer.rstrip()


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    opened_by_prompt = False


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    opened_by_prompt = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3Parser, DeepSeekR1Parser)}
