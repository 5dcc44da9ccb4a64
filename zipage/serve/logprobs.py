"""Log-probabilities in OpenAI's response shapes.

The engine reports, per token, (its log-probability, the top ids, their log-probabilities)
(`zipage.engine.sampler.token_logprobs`): the model's own log-softmax, before temperature and
top-k / top-p. Here they become the legacy completions shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`; with `echo` the prompt's tokens come first, the first of them
with null) or the chat shape (`content`: one object per token with `token`, `logprob`, `bytes`
and `top_logprobs`). A token's text is the tokenizer's decoding of it alone, the same string in
`tokens` and as a key of `top_logprobs` (what lm-evaluation-harness compares to tell whether
the continuation was the greedy one).
"""

from __future__ import annotations

from collections.abc import Sequence


class TokenText:
    """Each token's text alone, cached (a server sees the same few thousand tokens again)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id]))
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def completion_logprobs(text_of: TokenText, token_ids: Sequence[int], entries: Sequence,
                        offset: int = 0) -> dict:
    """The legacy shape for `token_ids` (entries aligned; an entry None: no log-probability,
    the first prompt token). `offset`: the characters before the first token in the text."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = text_of(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        logprob, ids, values = entry
        token_logprobs.append(logprob)
        top = {}
        for top_id, value in zip(ids, values):
            top.setdefault(text_of(top_id), value)  # two ids of one text: the likelier
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def join_completion_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(text_of: TokenText, token_ids: Sequence[int], entries: Sequence) -> dict:
    """The chat shape: one object per token, its alternatives most likely first."""
    content = []
    for token_id, (logprob, ids, values) in zip(token_ids, entries):
        content.append({**_chat_token(text_of(token_id), logprob),
                        "top_logprobs": [_chat_token(text_of(top_id), value)
                                         for top_id, value in zip(ids, values)]})
    return {"content": content, "refusal": None}


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
