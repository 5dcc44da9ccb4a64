"""The prompts of a session's turns (docs/traces.md, 'Sessions').

A follow-up's prompt is the first `prefix_len` tokens of its predecessor's history (the
predecessor's prompt, then its output less the first `reasoning_len` tokens), then tokens of its
own. The engine builds it from the tokens its predecessor really produced (`follow_up_tokens`);
the simulator needs only which prompt blocks are equal, and `SessionKeys` says so without a
token: equal keys exactly where the engine's blocks would hold equal tokens, so the prefix cache
hits identically in both twins.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import xxhash

from zipage.trace import SYNTHETIC_TOKEN_HIGH, TraceRequest, token_stream


def own_tokens(request: TraceRequest, vocab_size: int) -> list[int]:
    """A follow-up's own tokens, after the history it shares: drawn from the request's stream,
    as a request on its own draws its prompt."""
    return token_stream("request", request.id, request.prompt_len - request.prefix_len,
                        min(vocab_size, SYNTHETIC_TOKEN_HIGH))


def follow_up_tokens(history: list[int], predecessor_prompt_len: int, reasoning_len: int,
                     shared_len: int, own: list[int]) -> list[int]:
    """A follow-up's prompt: `history` is its predecessor's prompt + output token ids; the next
    turn sees them without the first `reasoning_len` output tokens, and keeps `shared_len` of
    them (fewer if the predecessor stopped early), then its `own` tokens."""
    seen = history[:predecessor_prompt_len] + history[predecessor_prompt_len + reasoning_len:]
    return seen[:shared_len] + own


class _Turn(NamedTuple):
    predecessor: _Turn | None
    id: str
    prompt_len: int
    shared_len: int  # tokens of the predecessor's history its prompt begins with
    root: TraceRequest | None  # the first turn's request (whose keys are computed as any one's)


class SessionKeys:
    """The prompt-block keys of every request of a trace, in file order, for blocks of
    `block_size` tokens; `root_keys(request)` gives those of a request that follows none.

    Block j of a follow-up is its predecessor's block j while that block lies in the
    predecessor's prompt and in the shared history; a block after that, still inside the shared
    history, holds the predecessor's prompt tail and output: it is keyed by the predecessor
    (`o`) and equal in every turn that follows it, however many; the rest are the request's own
    (`r`). Keys of the last two kinds are consecutive integers from a hash of the name (one hash
    a turn, as `prompt_block_keys` keys a request's own stream): unchained, because the block's
    owner and index already name everything before it. What it keeps per turn of a session:
    five fields (its predecessor, id, lengths), ~150 bytes."""

    def __init__(self, block_size: int, root_keys: Callable[[TraceRequest], list[int]]) -> None:
        self.block_size = block_size
        self.root_keys = root_keys
        self._turns: dict[str, _Turn] = {}

    def note(self, request: TraceRequest) -> _Turn:
        """Read `request` (every request of a session, in file order, whether or not its keys
        are wanted: a later turn may follow it)."""
        if request.after is None:
            turn = _Turn(None, request.id, request.prompt_len, 0, request)
        else:
            turn = _Turn(self._turns[request.after], request.id, request.prompt_len,
                         request.prefix_len, None)
        if request.session is not None or request.after is not None:
            self._turns[request.id] = turn
        return turn

    def keys(self, turn: _Turn) -> list[int]:
        """The keys of a noted turn's full prompt blocks."""
        return self._prefix_keys(turn, turn.prompt_len // self.block_size)

    def _prefix_keys(self, turn: _Turn, count: int) -> list[int]:
        """The first `count` block keys of `turn`'s prompt: walk back to the first turn, then
        build forward, each turn adding the blocks that are not its predecessor's."""
        block_size = self.block_size
        segments = []  # (predecessor, shared blocks, own start), from the latest turn back
        while turn.predecessor is not None and count:
            predecessor = turn.predecessor
            shared = min(turn.shared_len // block_size, count)
            inherited = min(shared, predecessor.prompt_len // block_size)
            segments.append((predecessor.id, inherited, shared, turn.id, count))
            turn, count = predecessor, inherited
        keys = self.root_keys(turn.root)[:count] if turn.root is not None and count else []
        for predecessor_id, inherited, shared, turn_id, end in reversed(segments):
            keys += _run("o", predecessor_id, inherited, shared)
            keys += _run("r", turn_id, shared, end)
        return keys


def _run(kind: str, name: str, start: int, end: int) -> list[int]:
    """Keys of blocks start..end of the stream `kind` of `name`: negative (never a chained key),
    2^32 apart per name (as `zipage.trace.prompt_block_keys` keys a request's own blocks)."""
    if start >= end:
        return []
    base = -((xxhash.xxh64_intdigest(f"{kind}\0{name}".encode("utf-8"), 1) + 1) << 32)
    return list(itertools.islice(itertools.count(base + start), end - start))
