"""What crosses between `zipage serve`'s HTTP process and its engine process, pickled over one
socket pair (`multiprocessing.connection.Connection`; docs/serve.md, 'How it works').

HTTP -> engine: `Setup` once, then `Add`, `Abort` and `Stop`.
Engine -> HTTP: `Ready` or `StartupFailed` once, then one `StepUpdate` per step (and after aborts
or rejections that changed the engine's state between steps), and `EngineFailed` if a step
raised. A step's tokens travel as two flat lists, not an object per token: building and
pickling the message is host time every step of the engine pays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zipage.core.admission import PROMPT, Refusal

if TYPE_CHECKING:
    from zipage.config import ZipageConfig
    from zipage.core.deployment import ReplaySettings
    from zipage.core.memory import MemoryPlan
    from zipage.core.sampling import SamplingParams


@dataclass
class Setup:
    """How to build the engine (`zipage.engine.builder.build_engine`'s arguments)."""

    settings: ReplaySettings
    device: str  # "cuda" or "cpu"
    cuda_graphs: bool
    prefill_graphs: bool | None  # None: build_engine's default (on where graphs are captured)
    threads: int | None  # CPU: torch threads (`zipage.engine.threads`); None: its default
    # CPU under --data-parallel: the cores this replica's process may run on (its slot), so two
    # replicas' spinning OpenMP threads never fight over one core; None: the parent's.
    cpus: tuple[int, ...] | None = None
    # GPU under --data-parallel: the CUDA_VISIBLE_DEVICES of this replica's process (its GPUs,
    # seen as cuda:0..); None: the parent's.
    visible_devices: str | None = None
    # `zipage serve --simulate`: the live twin instead of the engine (sim/live.py), its GPU and
    # cost model those `settings` name; None: the real engine.
    simulate: Simulate | None = None


@dataclass
class Simulate:
    """The live twin's part of a `Setup` beyond the deployment's settings."""

    # Token ids the twin never generates: the tokenizer's special tokens (end-of-sequence among
    # them), so that every request runs to its max_tokens and its text has no control tokens.
    avoid_token_ids: frozenset[int] = frozenset()


@dataclass
class Ready:
    """The engine is built: what the HTTP side needs to admit, validate and report."""

    device: str
    config: ZipageConfig
    capacity: MemoryPlan
    vocab_size: int
    eos_token_ids: frozenset[int]
    threads: int | None  # torch threads on the CPU; None on a GPU


@dataclass
class StartupFailed:
    message: str
    user_error: bool  # a ZipageError (a bad model file, too little memory): one line says it all


@dataclass
class Add:
    """A request; with `sampling.n` > 1, its other samples' ids (`sample_ids`, n - 1 of them):
    the engine queues them behind it to fork from it (docs/architecture.md, 'Samples of one
    prompt'), in one message so that no step runs between them."""

    seq_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    sample_ids: list[str] = field(default_factory=list)


@dataclass
class Abort:
    seq_id: str


@dataclass
class Stop:
    pass


@dataclass(frozen=True)
class EngineStats:
    """The scheduler after the step, and totals since the engine started (updates that follow
    an abort rather than a step carry them unchanged)."""

    running: int
    waiting: int
    blocks_used: int
    compressions_total: int
    preemptions_total: int
    # Prompt tokens the engine needed KV for (computed, recomputation after a preemption
    # included, or found in the prefix cache), and those found in the prefix cache: the sums of
    # an offline run's `prefill_tokens` + `prefix_hit_tokens` and its `prefix_hit_tokens`.
    prefix_query_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    # Of those, found in the host tier's memory and copied back (`--host-kv-gb`).
    host_hit_tokens_total: int = 0
    # `--simulate`: seconds the twin's steps ended after their predicted end (the host fell
    # behind the cost model; sim/live.py); always 0 for the real engine.
    twin_lag_seconds_total: float = 0.0


IDLE = EngineStats(0, 0, 0, 0, 0)  # an engine before its first step


@dataclass
class StepUpdate:
    seq_ids: list[str]  # one entry per token the step produced, beside `tokens`
    tokens: list[int]
    finished: dict[str, str]  # request -> "stop" (end-of-sequence token) or "length"
    # request -> (why it was refused, the request field at fault or None): it never ran.
    rejected: dict[str, tuple[str, str | None]]
    stats: EngineStats
    # Beside `tokens` when a request of the step asked for log-probabilities (else None): per
    # token (log-probability, top ids, top log-probabilities) or None.
    logprobs: list | None = None
    # request -> (position of the first prompt token covered, entries): prompt log-probabilities.
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    # request -> its prompt tokens found in the prefix cache, for the requests first admitted in
    # the step (OpenAI's `usage.prompt_tokens_details.cached_tokens`).
    prefix_hits: dict[str, int] = field(default_factory=dict)
    # request -> seconds it waited in the engine's queue, from its arrival in the engine process
    # to the start of the step that first admitted it, for the requests first admitted in the
    # step (vLLM's `request_queue_time_seconds`).
    queued: dict[str, float] = field(default_factory=dict)


@dataclass
class EngineFailed:
    """A step raised (a bug): the engine process exits after sending this."""

    message: str


def refusal_words(refusal: Refusal) -> tuple[str, str]:
    """The core's admission refusal as the server's 400 says it, whichever process asked:
    "<field>: <why>" and the field as `param`; a refusal of the lengths is the prompt's, too long
    for this server, with the HTTP name of the output's length."""
    if refusal.field == PROMPT:
        why = refusal.why.replace("output_len", "max_tokens")
        return f"{PROMPT}: too long for this server: {why}", PROMPT
    return f"{refusal.field}: {refusal.why}", refusal.field
