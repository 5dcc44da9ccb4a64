"""Output text while tokens stream in: incremental detokenization and stop strings.

Decoding only the new token alone is wrong (SentencePiece drops its leading space, a byte-level BPE
token may hold half a UTF-8 character), and decoding the whole output every step costs O(n) per
token. So each step decodes a short window, the tokens since the last emitted boundary, and emits
what it adds to the text of that window without them; while the window ends inside a character
(the decode ends in U+FFFD) nothing is emitted and the window grows. When the request ends, the
whole output is decoded once and any tail the window held back is appended, so the streamed text
always equals the non-streamed one, which is `tokenizer.decode(output without its final EOS)`.

Stop strings: the text is cut before the first stop string (after it with `keep_stop`, vLLM's
`include_stop_str_in_output`) and the request ends with "stop"; a stream holds back the last
len(longest stop) - 1 characters until they cannot start a stop string.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str] | None = None, keep_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []  # the output tokens that make the text (no final EOS)
        self.generated = 0  # tokens the request generated, EOS included (usage counts them)
        self.text = ""
        self.stop = [s for s in (stop or []) if s]
        self.keep_stop = keep_stop  # the text ends after the stop string found, not before
        self.stopped = False  # a stop string was found; the text ends before it (or after)
        self._prefix = 0  # window start: tokens before it are in `text` for good
        self._read = 0  # tokens before it are in `text`
        self._sent = 0  # characters of `text` handed out by `new_text`
        self._searched = 0  # characters of `text` already searched for stop strings

    def add(self, token_ids: list[int]) -> None:
        if self.stopped or not token_ids:
            return
        self.token_ids.extend(token_ids)
        if self.tokenizer is None:
            return
        window = self.token_ids[self._prefix:]
        before = self._decode(self.token_ids[self._prefix:self._read])
        after = self._decode(window)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._append(after[len(before):])
            self._prefix, self._read = self._read, len(self.token_ids)

    def finish(self) -> None:
        """The request ended: decode the whole output once and add what the window held back."""
        if self.stopped or self.tokenizer is None:
            return
        whole = self._decode(self.token_ids)
        if whole.startswith(self.text) and len(whole) > len(self.text):
            self._append(whole[len(self.text):])
        self._prefix = self._read = len(self.token_ids)

    def new_text(self, final: bool = False) -> str:
        """Text not handed out yet; until `final`, minus what could still start a stop string."""
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end = max(self._sent, end - (max(map(len, self.stop)) - 1))
        piece = self.text[self._sent:end]
        self._sent = end
        return piece

    def _append(self, piece: str) -> None:
        self.text += piece
        if not self.stop:
            return
        start = max(0, self._searched - max(map(len, self.stop)) + 1)
        hits = [(index, -len(s), s) for s, index in ((s, self.text.find(s, start))
                                                     for s in self.stop) if index >= 0]
        if hits:
            index, _, found = min(hits)  # the first; of those starting there, the longest
            self.text = self.text[:index + len(found) if self.keep_stop else index]
            self.stopped = True
        self._searched = len(self.text)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if token_ids else ""
