"""The server's pure parts, without a model: incremental detokenization (split UTF-8 characters,
stop strings and their hold-back) and the one-line messages for invalid request bodies."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from pydantic import ValidationError  # noqa: E402

from zipage.serve.detokenize import IncrementalText  # noqa: E402
from zipage.serve.protocol import (  # noqa: E402
    ChatRequest, CompletionRequest, ServeError, validation_message,
)


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
    ({"prompt": ["a", "b"]}, "prompt: expected"),
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
    with pytest.raises(ServeError, match="^n: got 2"):
        CompletionRequest.model_validate({"prompt": "x", "n": 2}).check_unsupported()
    with pytest.raises(ServeError, match="^logprobs:"):
        CompletionRequest.model_validate({"prompt": "x", "logprobs": 3}).check_unsupported()


def test_malformed_json_message():
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate_json('{"prompt": ')
    message, field = validation_message(caught.value.errors())
    assert message.startswith("body: not valid JSON") and field is None
