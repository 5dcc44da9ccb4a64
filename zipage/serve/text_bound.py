"""Refusing a prompt that cannot fit before paying to tokenize it.

Tokenizing is the costliest thing a request can make the HTTP process do before the engine sees
it: the SmolLM2 tokenizer takes ~3 s of CPU a megabyte, so a 7.9 MB prompt cost 6-15 s only to be
refused as too long. No token stands for more text than the longest string of the vocabulary, so
a text of `n` bytes is at least `n / max_token_bytes` tokens, and one whose floor is over the
longest prompt the server can take is refused at once, with the numbers that prove it.

Why the bound holds: a vocabulary entry covers at most its own UTF-8 bytes of input (byte-level
BPE writes each input byte as one character of one or two bytes; SentencePiece writes a space,
one byte, as the three-byte "▁"; byte-fallback entries such as "<0xE4>" stand for one byte). That
needs a tokenizer that keeps every byte of its input in some token: one whose normalizer drops,
merges or folds text (whitespace collapsed, accents stripped, NFC composition), or that maps runs
of unknown characters to one token, does not. `max_token_bytes` takes the bound only from a
tokenizer that gives back a probe of exactly those cases unchanged (decode of encode), and none
otherwise: then every prompt is tokenized, as before.
"""

from __future__ import annotations

from zipage.core.admission import Admission
from zipage.core.sequence import Sequence

# Whitespace runs, tabs and line ends, case, composed and decomposed accents, a ligature NFKC
# would fold, CJK, an emoji, a control character, a no-break space, and a run of rare symbols an
# <unk> could swallow.
PROBE = ("Hello  World\t\ttabs\r\n\n  CAPS lower é e\u0301 \ufb01 \u6f22\u5b57 \U0001f600 \x07 "
         "\u00a0 \u2fd5\u2fd4\u2fd3 end  ")


def max_token_bytes(tokenizer) -> int | None:
    """The most bytes of input one token of `tokenizer` can stand for; None where no such bound
    holds (see the module docstring)."""
    if tokenizer is None or not _keeps_every_byte(tokenizer):
        return None
    strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(text.encode("utf-8")) for text in strings if text), default=None)


def _keeps_every_byte(tokenizer) -> bool:
    try:
        ids = tokenizer.encode(PROBE, add_special_tokens=False)
        return tokenizer.decode(ids, skip_special_tokens=False,
                                clean_up_tokenization_spaces=False) == PROBE
    except Exception:  # noqa: BLE001 - a tokenizer that cannot even say: no bound
        return False


def max_prompt_tokens(admission: Admission, limit: int = 2**31 - 1) -> int:
    """The longest prompt `admission` (the core's own rule, not a copy of it) accepts with one
    output token and the deployment's budget: the rule refuses longer prompts from some length
    on, so a binary search over `rejection_reason` finds it in ~31 questions."""
    low, high = 0, limit  # low is accepted (or nothing is), high + 1 is refused
    while low < high:
        middle = (low + high + 1) // 2
        if admission.rejection_reason(Sequence("bound", None, 1, prompt_len=middle)) is None:
            low = middle
        else:
            high = middle - 1
    return low


def too_long_reason(text: str, token_bytes: int | None, prompt_tokens: int | None) -> str | None:
    """Why `text` can never fit, from its length alone; None when it might (then tokenize)."""
    if token_bytes is None or 4 * len(text) <= token_bytes * prompt_tokens:
        return None  # at most 4 bytes a character: within the bound whatever the text holds
    size = len(text.encode("utf-8", "surrogatepass"))
    floor = -(-size // token_bytes)
    if floor <= prompt_tokens:
        return None
    return (f"prompt: too long for this server: {size} bytes of text are at least {floor} "
            f"tokens (no token of this model stands for more than {token_bytes} bytes), and a "
            f"prompt here has at most {prompt_tokens} tokens; shorten it")
