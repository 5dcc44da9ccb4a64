"""Picks each sequence's next token from its logits: greedy, or temperature / top-k / top-p sampling.

One call handles a whole batch with per-row settings. Greedy rows (temperature 0) take the argmax.
Sampled rows draw by the exponential race (argmax of probability / Exp(1) noise, which is a draw from
the distribution) so nothing waits on the host. A row with a seed draws its noise from a generator
seeded by (seed, index of the token being sampled): its tokens depend only on its own logits, not on
the batch around it, on the step it runs in, or on a preemption that recomputes it. Unseeded rows
share the global generator.
"""

from __future__ import annotations

import torch

from zipage.core.sampling import SEED_LIMIT, SamplingParams


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
        generator = torch.Generator(device=device).manual_seed(_mix(row_params.seed * SEED_LIMIT + token_index))
        noise[row].exponential_(generator=generator)
    # A zero draw would turn a filtered-out token's 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   tops: list[int]) -> list[tuple[float, list[int], list[float]]]:
    """Per row: the log-probability of `tokens[row]` under the log-softmax of the row's logits
    (the model's own distribution, before temperature or top-k / top-p, as vLLM and OpenAI
    report it), and the `tops[row]` most likely token ids with theirs, most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.view(-1, 1).long()).view(-1).tolist()
    most = max(tops, default=0)
    top_values, top_ids = (logprobs.topk(most, dim=-1) if most else (None, None))
    top_values = top_values.tolist() if most else None
    top_ids = top_ids.tolist() if most else None
    return [(chosen[row], top_ids[row][:k] if k else [], top_values[row][:k] if k else [])
            for row, k in enumerate(tops)]
