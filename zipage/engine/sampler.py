"""Picks each sequence's next token from its logits: greedy, or temperature / top-k / top-p sampling.

One call handles a whole batch with per-row settings. Greedy rows (temperature 0) take the argmax.
Sampled rows draw by the exponential race (argmax of probability / Exp(1) noise, which is a draw from
the distribution) so nothing waits on the host. A row with a seed draws its noise from a generator
seeded by (seed, index of the token being sampled): its tokens depend only on its own logits, not on
the batch around it, on the step it runs in, or on a preemption that recomputes it. Unseeded rows
share the global generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zipage.errors import ConfigError

_SEED_LIMIT = 2**32  # seed and token index are packed into one 64-bit generator seed
# Integer settings become int64 tensors or index math: anything past int32 is no real request and
# past int64 torch raises (top_k 2**63 was "Overflow" inside a step, which killed the engine).
MAX_INT = 2**31 - 1
# Logits are divided by the temperature in float32: a tiny one overflows them to inf (NaN
# probabilities), so below this a row is greedy, as vLLM treats it; above MAX_TEMPERATURE the
# distribution is uniform for any logits in float32 anyway.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. temperature 0 = greedy; top_k 0 and top_p 1.0 = no filtering.

    `max_tokens` output tokens at most; `ignore_eos` keeps generating through end-of-sequence
    tokens (trace replays and benchmarks use it to get fixed output lengths);
    `skip_special_tokens` leaves special tokens (<|im_start|>, ...) out of the output text.
    `kv_budget` is the request's own KV budget (None: the engine's `kv_budget`); the core reads
    it from the request (`Sequence.kv_budget`), and refuses one that is not a multiple of the
    block size with the request's error.
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

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise `ConfigError` naming the first setting out of range. The engine process calls it
        again on what arrives over its socket (unpickling skips `__post_init__`), so a bad
        request fails alone instead of inside a step."""
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ConfigError(f"temperature: {_short(self.temperature)} must be a finite number in "
                              f"[0, {MAX_TEMPERATURE:g}]; use 0 for greedy decoding")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT:
            raise ConfigError(f"top_k: {_short(self.top_k)} must be an integer in [0, {MAX_INT}]; "
                              "use 0 to keep every token")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: {_short(self.top_p)} must be a finite number in (0, 1]; use "
                              "1.0 to keep every token")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT:
            raise ConfigError(f"max_tokens: {_short(self.max_tokens)} must be an integer in "
                              f"[1, {MAX_INT}]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _SEED_LIMIT):
            raise ConfigError(f"seed: {_short(self.seed)} must be an integer in [0, 2**32) or None")
        if self.kv_budget is not None and (not _is_int(self.kv_budget)
                                           or not 1 <= self.kv_budget <= MAX_INT):
            raise ConfigError(f"kv_budget: {_short(self.kv_budget)} must be a positive integer (KV "
                              "entries the request keeps, a multiple of the block size) or None "
                              "for the engine's default")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: {_short(getattr(self, name))} must be true or false")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _short(value, limit: int = 40) -> str:
    """A value for an error message, cut: a message never carries unbounded input back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def sample(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]) -> torch.Tensor:
    """Next token ids int64 [num_seqs] for logits [num_seqs, vocab_size].

    `params[i]` is row i's settings; `token_indices[i]` the number of tokens row i has generated so far
    (seeds the row's generator, so the same request and seed always sample the same continuation).
    """
    tokens = logits.argmax(dim=-1)
    sampled_rows = [row for row, row_params in enumerate(params) if not row_params.is_greedy]
    if not sampled_rows:
        return tokens
    device = logits.device
    rows = torch.tensor(sampled_rows, device=device)
    row_params = [params[row] for row in sampled_rows]
    temperatures = torch.tensor([p.temperature for p in row_params], device=device)
    scaled = logits[rows].float() / temperatures.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1 for p in row_params):
        scaled = _filter_top_k_top_p(scaled, row_params)
    probabilities = torch.softmax(scaled, dim=-1)
    noise = _exponential_noise(probabilities.shape, row_params, [token_indices[row] for row in sampled_rows], device)
    return tokens.index_copy(0, rows, (probabilities / noise).argmax(dim=-1))


def _filter_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf every logit outside each row's k most likely tokens, then outside the smallest set of
    those whose (renormalised) mass reaches top_p; the most likely token always survives."""
    vocab_size = scaled.shape[-1]
    device = scaled.device
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
    top_ps = torch.tensor([p.top_p for p in params], device=device)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=device)
    dropped = ranks.unsqueeze(0) >= top_ks.unsqueeze(1)
    sorted_probabilities = torch.softmax(sorted_logits.masked_fill(dropped, float("-inf")), dim=-1)
    mass_before = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities
    dropped |= mass_before >= top_ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(dropped, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def _mix(value: int) -> int:
    """SplitMix64 finaliser: spreads every input bit over all 64 output bits. Needed because the CPU
    generator keeps only the low 32 bits of its seed, which would drop the request's seed entirely."""
    mask = 2**64 - 1
    value = (value + 0x9E3779B97F4A7C15) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return value ^ (value >> 31)


def _exponential_noise(
    shape: torch.Size, params: list[SamplingParams], token_indices: list[int], device: torch.device
) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for row, (row_params, token_index) in enumerate(zip(params, token_indices)):
        if row_params.seed is None:
            continue
        generator = torch.Generator(device=device).manual_seed(_mix(row_params.seed * _SEED_LIMIT + token_index))
        noise[row].exponential_(generator=generator)
    # A zero draw would turn a filtered-out token's 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
