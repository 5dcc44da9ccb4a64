"""Per-request state as the scheduler sees it.

A `Sequence` knows its prompt, how many output tokens it must produce, its block table, how many
KV entries it has cached (`kv_len`, smaller than its token count once compressed), its query slot
and its bookkeeping for metrics. It never stores output token ids: the core only needs counts
(drivers that need the tokens keep them), and only prompt blocks enter the prefix index.

Steady decoding is lazy. While a request decodes one token per decode step with no decision to
make, its counters are not touched step by step: it records the decode clock when it became
steady and its counters are derived from the clock. The scheduler settles it (writes the counters
back) whenever a decision is due. This is what lets the simulator replay 1,280 long reasoning
requests in seconds: per step, the core only touches requests that have an event.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from zipage.core.sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"  # the client went away (Scheduler.abort); its blocks are freed


# Bound once: an Enum class's attribute is read through EnumType.__getattr__ (4x a plain read).
WAITING = SequenceStatus.WAITING


class Turn(NamedTuple):
    """A request's place in a session (docs/architecture.md, 'Sessions'): what the arrival rule
    and a router read, and what a driver that computes tokens builds a follow-up's prompt from."""

    session: str
    follows: str | None = None  # the request it follows; None: the session's first turn
    after_s: float = 0.0  # sent this long after its predecessor's last token
    shared_len: int = 0  # prompt tokens that are the predecessor's history
    reasoning_len: int = 0  # its own first output tokens the next turn does not see


class DecodeClock:
    """Number of decode steps finished so far; shared by the scheduler and its sequences."""

    __slots__ = ("ticks",)

    def __init__(self) -> None:
        self.ticks = 0


class Sequence:
    __slots__ = (
        "seq_id", "arrival_s", "prompt_token_ids", "prompt_len", "max_output_tokens",
        "prompt_block_hashes", "status", "block_table", "query_slot", "num_compressions",
        "compressing", "running_rank", "error",
        "settled_kv_len", "settled_output_tokens", "_clock", "steady_since", "steady_epoch",
        "first_admitted_step", "first_token_time", "finish_time", "num_preemptions",
        "max_blocks_after_first_compression", "sampling", "kv_budget", "n_max", "slot_blocks",
        "kept_tokens", "kept_budget", "fork_of", "prompt_logits", "turn", "compress_scope",
        "pinned", "priority", "queue_key", "scoring",
    )

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int] | None,
        max_output_tokens: int,
        arrival_s: float = 0.0,
        prompt_len: int | None = None,
        sampling: SamplingParams | None = None,
        kv_budget: int | None = None,
    ) -> None:
        if prompt_token_ids is None and prompt_len is None:
            raise ValueError("a Sequence needs prompt_token_ids or prompt_len")
        self.seq_id = seq_id
        self.arrival_s = arrival_s
        self.prompt_token_ids = prompt_token_ids
        self.prompt_len = len(prompt_token_ids) if prompt_token_ids is not None else prompt_len
        self.max_output_tokens = max_output_tokens
        self.prompt_block_hashes: list[int] = []
        self.status = WAITING
        self.block_table: list[int] = []
        self.query_slot: int | None = None
        self.num_compressions = 0
        self.compressing = False  # a compression job holds this request (sync or async)
        self.running_rank = -1  # position key in the running queue (admission order)
        self.error: str | None = None
        # The counters as of the last settle: `kv_len` and `num_output_tokens` themselves while
        # the request is not steady, which the scheduler reads where it knows that (a plain
        # read, not a property's call: these run several times a request).
        self.settled_kv_len = 0
        self.settled_output_tokens = 0
        self._clock: DecodeClock | None = None
        self.steady_since: int | None = None  # the decode tick it became steady at; None: not
        # Bumps whenever the request leaves steady decoding: a due-list entry made in a steady
        # run (with that run's epoch) is live exactly while the epoch is unchanged.
        self.steady_epoch = 0
        self.first_admitted_step: int | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.max_blocks_after_first_compression = 0
        # The request's sampling settings; the core never reads them, the driver that computes
        # tokens does.
        self.sampling = sampling
        # Its own KV budget (None: the configured default, filled in when the scheduler adds
        # the request) and the N_max it gives, the floor of its cap (docs/architecture.md,
        # 'Per-request and elastic budgets').
        self.kv_budget = kv_budget
        self.n_max: int | None = None
        self.slot_blocks = 0  # the blocks its query slot reserves (set with n_max)
        # KV entries its compressions kept, summed; and, once finished, the budget it kept on
        # average (None if no budget ever bound it).
        self.kept_tokens = 0
        self.kept_budget: float | None = None
        # Another sample of `fork_of`'s prompt (a request with n > 1): queued right behind it,
        # it may be forked from it when it samples its first token, sharing its computed prompt
        # instead of prefilling (docs/architecture.md, 'Samples of one prompt'). The driver
        # sets it; the scheduler clears it once the chance has passed.
        self.fork_of: Sequence | None = None
        # The driver needs the logits of every prompt position (prompt log-probabilities): the
        # prompt is computed whole, never taken from the prefix cache.
        self.prompt_logits = False
        # Its place in a session; None for a request on its own. Only the arrival rule
        # (zipage/core/arrivals.py) and routers read it.
        self.turn: Turn | None = None
        # What its compressions may evict ("all" or "output"; None: the deployment's), and the
        # leading blocks none of them touches (its whole prompt under "output"), set when the
        # scheduler adds it (docs/architecture.md, 'Compression scope').
        self.compress_scope: str | None = None
        self.pinned = 0
        # Its class under the priority policy (lower first; zipage/request_fields.py), and its
        # place in the waiting queue, fixed when first queued (zipage/core/waiting.py).
        self.priority = 0
        self.queue_key: tuple | None = None
        # The eviction scoring policy its compressions use (zipage/scoring.py; None: the
        # deployment's --scoring). Only the drivers that score and price compressions read it;
        # admission refuses one that needs state the deployment did not allocate.
        self.scoring: str | None = None

    # ---- counters (derived from the decode clock while steady) ----

    @property
    def kv_len(self) -> int:
        """KV entries cached for this request (the slot index the next token is written to)."""
        if self.steady_since is None:
            return self.settled_kv_len
        return self.settled_kv_len + self._clock.ticks - self.steady_since

    @property
    def num_output_tokens(self) -> int:
        if self.steady_since is None:
            return self.settled_output_tokens
        return self.settled_output_tokens + self._clock.ticks - self.steady_since

    # `num_tokens` repeats `num_output_tokens`'s two lines rather than read it: a property read
    # is a call (a hot one: it runs several times a request and a step).

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (the last generated one has no KV entry yet)."""
        if self.steady_since is None:
            return self.prompt_len + self.settled_output_tokens
        return self.prompt_len + self.settled_output_tokens + self._clock.ticks - self.steady_since

    @property
    def position(self) -> int:
        """True position of the token decoded next: unchanged by compression (docs/architecture.md, 'Rules', rule 4)."""
        return self.num_tokens - 1

    def set_counters(self, kv_len: int, num_output_tokens: int) -> None:
        assert self.steady_since is None, "settle a steady sequence before changing it"
        self.settled_kv_len = kv_len
        self.settled_output_tokens = num_output_tokens

    def join_steady(self, clock: DecodeClock) -> None:
        self._clock = clock
        self.steady_since = clock.ticks

    def settle(self) -> None:
        """Leave steady decoding: write the clock-derived counters back."""
        if self.steady_since is None:
            return
        decoded = self._clock.ticks - self.steady_since
        self.settled_kv_len += decoded
        self.settled_output_tokens += decoded
        self.steady_since = None
        self.steady_epoch += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.value}, kv_len={self.kv_len}, "
                f"out={self.num_output_tokens}/{self.max_output_tokens}, "
                f"blocks={self.block_table}, slot={self.query_slot})")
