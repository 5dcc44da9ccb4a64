"""A request's sampling settings, checked on arrival: greedy, or temperature / top-k / top-p.

The core carries them on each `Sequence` without reading them (the engine's sampler does, in
`zipage/engine/sampler.py`); they live here, torch-free, so the simulator, the server's protocol
and the core can name the type without importing the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cached_property

from zipage import request_fields
from zipage.errors import FieldError

SEED_LIMIT = 2**32  # seed and token index are packed into one 64-bit generator seed
# Integer settings become int64 tensors or index math: anything past int32 is no real request and
# past int64 torch raises (top_k 2**63 was "Overflow" inside a step, which killed the engine).
MAX_INT = 2**31 - 1
# Logits are divided by the temperature in float32: a tiny one overflows them to inf (NaN
# probabilities), so below this a row is greedy, as vLLM treats it; above MAX_TEMPERATURE the
# distribution is uniform for any logits in float32 anyway.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit for chat's top_logprobs)
MAX_SAMPLES = 128  # n: samples of one prompt (each is a running request)
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty: OpenAI's range is [-2, 2]
# repetition_penalty: vLLM takes any positive value; past this every seen token is out anyway, and
# a bounded factor keeps the penalised float32 logits finite.
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # logit_bias values: OpenAI's range is [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024  # logit_bias entries (each is a scatter into the row's logits)
# Structured outputs: what a request's output must match (docs/serve.md, 'Structured outputs').
# json: any JSON object (OpenAI's json_object); json_schema: the schema as JSON text; regex; choice:
# one of a tuple of strings; grammar: an EBNF (GBNF) grammar whose start rule is `root`.
STRUCTURED_KINDS = ("json", "json_schema", "regex", "choice", "grammar")
MAX_CHOICES = 1024  # guided_choice alternatives


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the most likely tokens at its place
    (id, log-probability), most likely first (as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, token_id: int, entry) -> "TokenLogprob | None":
        """From the engine's (log-probability, top ids, top log-probabilities); None stays."""
        if entry is None:
            return None
        logprob, ids, values = entry
        return cls(token_id, logprob, tuple(zip(ids, values)))


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, as a plain spec: the engine compiles it
    (`zipage/engine/structured.py`), the core and the server only carry and check it. Frozen and
    hashable: the engine's compile cache is keyed by it. `value`: None for json, the schema's
    JSON text for json_schema (a dict is turned into it), the pattern for regex, a tuple of
    strings for choice, the grammar text for grammar."""

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind == "json_schema" and isinstance(self.value, dict):
            # Key order kept: the output's properties follow the schema's order.
            object.__setattr__(self, "value", json.dumps(self.value))
        elif self.kind == "choice" and isinstance(self.value, list):
            object.__setattr__(self, "value", tuple(self.value))
        self.check()

    def check(self) -> None:
        """Raise `FieldError` naming what is wrong with the spec's shape (whether a schema,
        pattern or grammar compiles is the engine's question: `engine/structured.py`)."""
        if self.kind not in STRUCTURED_KINDS:
            raise FieldError("structured_output", f"kind {_short(self.kind)} must be one of "
                                                  f"{', '.join(STRUCTURED_KINDS)}")
        if self.kind == "json":
            if self.value is not None:
                raise FieldError("structured_output", "json takes no value (any JSON object)")
        elif self.kind == "choice":
            if (not isinstance(self.value, tuple) or not 1 <= len(self.value) <= MAX_CHOICES
                    or not all(isinstance(item, str) and item for item in self.value)):
                raise FieldError("structured_output", f"choice {_short(self.value)} must be 1 to "
                                                      f"{MAX_CHOICES} non-empty strings")
        elif not isinstance(self.value, str) or not self.value:
            raise FieldError("structured_output", f"{self.kind} {_short(self.value)} must be a "
                                                  "non-empty string")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. temperature 0 = greedy; top_k 0 and top_p 1.0 = no filtering.

    `max_tokens` output tokens at most; `ignore_eos` keeps generating through end-of-sequence
    tokens (trace replays and benchmarks use it to get fixed output lengths);
    `skip_special_tokens` leaves special tokens (<|im_start|>, ...) out of the output text.
    `n` samples of the prompt: the prompt is computed once, the other n - 1 fork from it
    (docs/architecture.md, 'Samples of one prompt'); sample j > 0 draws with its own seed
    derived from `seed` (`for_sample`). `logprobs`: report each output token's log-probability
    and that many most likely alternatives (0: the token's alone; None: nothing);
    `prompt_logprobs` the same for every prompt token after the first (the prompt is then
    computed whole, without the prefix cache). Log-probabilities are the model's own
    log-softmax, before temperature and top-k / top-p (and before the penalties and bias below).
    Logit adjustments, as vLLM applies them (to greedy rows too, before the argmax):
    `logit_bias` ((token id, bias) pairs, bias in [-100, 100]) is added to those logits;
    `repetition_penalty` (> 0, 1.0: off; HF/vLLM semantics) divides the positive logits and
    multiplies the negative ones of every token in the prompt or the output so far;
    `frequency_penalty` and `presence_penalty` ([-2, 2], 0: off; OpenAI semantics) subtract
    penalty x count and penalty x (count > 0) of each token in the output so far. Then, for
    sampled rows only, after the temperature: `min_p` ([0, 1], 0: off) drops every token whose
    probability is below min_p x the most likely token's.
    `kv_budget` is the request's own KV budget (None: the engine's `kv_budget`); the core reads
    it from the request (`Sequence.kv_budget`), and refuses one that is not a multiple of the
    block size with the request's error. `compress_scope` is what its compressions may evict
    ("all" or "output"; None: the engine's `compress_scope`); `priority` its class in the
    waiting queue under the priority scheduling policy (lower first); `scoring` the eviction
    scoring policy of its compressions (a name of `zipage/scoring.py`; None: the engine's
    `scoring`). These four are declared in `zipage/request_fields.py`.
    `structured_output` constrains the output to a JSON schema, a regex, a choice or a grammar
    (`StructuredOutput`; the engine masks every other token before sampling, and forces the
    end-of-sequence token once the output is complete).
    Defaults are vLLM's sampling defaults except max_tokens; `zipage generate` uses its own
    (greedy, 128 tokens: see `zipage generate -h`).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    kv_budget: int | None = None
    compress_scope: str | None = None
    priority: int = 0
    scoring: str | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):  # OpenAI's shape, {token id: bias}: kept as pairs
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        self.check()

    def check(self) -> None:
        """Raise `FieldError` naming the first setting out of range. The engine process calls it
        again on what arrives over its socket (unpickling skips `__post_init__`), so a bad
        request fails alone instead of inside a step."""
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise FieldError("temperature",
                             f"{_short(self.temperature)} must be a finite number in "
                             f"[0, {MAX_TEMPERATURE:g}]; use 0 for greedy decoding")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT:
            raise FieldError("top_k", f"{_short(self.top_k)} must be an integer in [0, {MAX_INT}]; "
                                      "use 0 to keep every token")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"{_short(self.top_p)} must be a finite number in (0, 1]; "
                                      "use 1.0 to keep every token")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT:
            raise FieldError("max_tokens", f"{_short(self.max_tokens)} must be an integer in "
                                           f"[1, {MAX_INT}]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise FieldError("seed", f"{_short(self.seed)} must be an integer in [0, 2**32) or "
                                     "None")
        for field in request_fields.FIELDS:
            broken = field.rule_broken(getattr(self, field.name))
            if broken is not None:
                raise FieldError(field.name, broken)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise FieldError("n", f"{_short(self.n)} must be an integer in [1, {MAX_SAMPLES}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise FieldError(name, f"{_short(value)} must be an integer in "
                                       f"[0, {MAX_LOGPROBS}] or None")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"{_short(getattr(self, name))} must be true or false")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise FieldError(name, f"{_short(value)} must be a finite number in "
                                       f"[{-MAX_PENALTY:g}, {MAX_PENALTY:g}]; use 0 for none")
        if (not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty
                <= MAX_REPETITION_PENALTY):
            raise FieldError("repetition_penalty",
                             f"{_short(self.repetition_penalty)} must be a finite number in "
                             f"(0, {MAX_REPETITION_PENALTY:g}]; use 1.0 for none")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise FieldError("min_p", f"{_short(self.min_p)} must be a finite number in [0, 1]; "
                                      "use 0 to keep every token")
        if self.logit_bias is not None:
            self._check_logit_bias()
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise FieldError("structured_output", f"{_short(self.structured_output)} is not a "
                                                      "StructuredOutput")
            self.structured_output.check()
            if self.ignore_eos:  # the grammar's end (its forced end-of-sequence) ends the request
                raise FieldError("structured_output", "cannot be combined with ignore_eos; leave "
                                                      "ignore_eos out")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple):
            raise FieldError("logit_bias", f"{_short(bias)} is not a {{token id: bias}} dict or "
                                           "(token id, bias) pairs")
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise FieldError("logit_bias", f"must map at most {MAX_LOGIT_BIAS_TOKENS} token ids "
                                           "to biases")
        for entry in bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise FieldError("logit_bias", f"{_short(entry)} is not a (token id, bias) pair")
            token, value = entry
            if not _is_int(token) or not 0 <= token <= MAX_INT:
                raise FieldError("logit_bias", f"token id {_short(token)} must be an integer in "
                                               f"[0, {MAX_INT}]")
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise FieldError("logit_bias",
                                 f"bias {_short(value)} of token {token} must be a finite number "
                                 f"in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")

    def for_sample(self, index: int) -> "SamplingParams":
        """The settings of sample `index` of n: one sample each, no prompt log-probabilities
        but on sample 0 (they are the prompt's), and with a seed its own, mixed from the
        request's and the index (the sampler seeds by seed and token index, so seed + index
        would repeat another request's draws)."""
        if index == 0:
            return replace(self, n=1)
        seed = None if self.seed is None else _mix_seed(self.seed, index)
        return replace(self, n=1, seed=seed, prompt_logprobs=None)

    # Cached (the instance is frozen): the sampler asks these of every row, every step.
    @cached_property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @cached_property
    def penalized(self) -> bool:
        """A penalty needs the request's token counts (the sampler's `history`)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @cached_property
    def adjusts_logits(self) -> bool:
        """The logits change before the argmax or the draw (a penalty or a bias)."""
        return self.penalized or bool(self.logit_bias)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _short(value, limit: int = 40) -> str:
    """A value for an error message, cut: a message never carries unbounded input back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _mix_seed(seed: int, index: int) -> int:
    """A seed in [0, 2**32) for sample `index` of a request seeded `seed` (SplitMix64's
    finaliser over both)."""
    mask = 2**64 - 1
    value = (seed * 0x9E3779B97F4A7C15 + index) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return (value ^ (value >> 31)) % SEED_LIMIT
