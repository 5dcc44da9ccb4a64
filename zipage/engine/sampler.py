"""Picks each sequence's next token from its logits: greedy, or temperature / min-p / top-k / top-p
sampling, after the request's logit bias and penalties.

One call handles a whole batch with per-row settings. The order is vLLM's: the logits in float32,
`logit_bias` added, then the repetition, frequency and presence penalties (`adjust_logits`: only
the rows that ask, from each one's token counts; the other rows are not touched, so a batch
without any takes exactly the path it took before they existed); greedy rows take the argmax of
that; sampled rows divide by their temperature, drop what min-p drops, then top-k / top-p, and
draw. Log-probabilities (`token_logprobs`) read the model's logits, not these.
Greedy rows (temperature 0) take the argmax.
Sampled rows draw by the exponential race (argmax of probability / Exp(1) noise, which is a draw from
the distribution) so nothing waits on the host. A row with a seed draws its noise from a generator
seeded by (seed, index of the token being sampled): its tokens depend only on its own logits, not on
the batch around it, on the step it runs in, or on a preemption that recomputes it. Unseeded rows
share the global generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zipage.core.sampling import SEED_LIMIT, SamplingParams

# Row i's prompt + output token ids so far, and its prompt's length (the output starts there).
History = Sequence[tuple[Sequence[int], int]]


def sample(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int],
           history: History | None = None) -> torch.Tensor:
    """Next token ids int64 [num_seqs] for logits [num_seqs, vocab_size].

    `params[i]` is row i's settings; `token_indices[i]` the number of tokens row i has generated so far
    (seeds the row's generator, so the same request and seed always sample the same continuation).
    `history[i]`: row i's token ids and prompt length, read only for rows with a penalty
    (`SamplingParams.penalized`); None is fine when no row has one.
    """
    adjusted = [row for row, row_params in enumerate(params) if row_params.adjusts_logits]
    if adjusted:
        logits = adjust_logits(logits, params, adjusted, history)
    tokens = logits.argmax(dim=-1)
    sampled_rows = [row for row, row_params in enumerate(params) if not row_params.is_greedy]
    if not sampled_rows:
        return tokens
    device = logits.device
    rows = on_device(sampled_rows, device)
    row_params = [params[row] for row in sampled_rows]
    temperatures = on_device([p.temperature for p in row_params], device)
    scaled = logits[rows].float() / temperatures.unsqueeze(1)
    if any(p.min_p > 0 for p in row_params):
        scaled = _filter_min_p(scaled, on_device([p.min_p for p in row_params], device))
    if any(p.top_k > 0 or p.top_p < 1 for p in row_params):
        scaled = _filter_top_k_top_p(scaled, row_params)
    probabilities = torch.softmax(scaled, dim=-1)
    noise = _exponential_noise(probabilities.shape, row_params, [token_indices[row] for row in sampled_rows], device)
    return tokens.index_copy(0, rows, (probabilities / noise).argmax(dim=-1))


def on_device(values: list, device: torch.device) -> torch.Tensor:
    """A list of per-row settings as a tensor on `device`, copied from pinned memory without
    waiting: `torch.tensor(values, device=...)` copies from pageable memory, which waits for the
    stream's earlier work (under async scheduling, the step still running)."""
    tensor = torch.tensor(values)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], rows: list[int],
                  history: History | None) -> torch.Tensor:
    """The logits (float32, a new tensor: the model's stay as they were, for log-probabilities)
    with `rows`' logit bias added and then their penalties applied, as vLLM does both."""
    device = logits.device
    index = torch.tensor(rows, device=device)
    part = logits.index_select(0, index).float()
    vocab_size = part.shape[-1]
    row_params = [params[row] for row in rows]
    # Ids past the logits' width are no token (the server refuses them; the engine never dies
    # of one).
    bias = [(at, token, value) for at, p in enumerate(row_params)
            for token, value in (p.logit_bias or ()) if token < vocab_size]
    if bias:
        at, token, value = zip(*bias)
        part.index_put_((torch.tensor(at, device=device), torch.tensor(token, device=device)),
                        torch.tensor(value, dtype=part.dtype, device=device), accumulate=True)
    penalized = [at for at, p in enumerate(row_params) if p.penalized]
    if penalized:
        if history is None:
            raise ValueError("sample: a row has a penalty but no token history was given")
        chosen = torch.tensor(penalized, device=device)
        part = part.index_copy(0, chosen, apply_penalties(
            part.index_select(0, chosen), [row_params[at] for at in penalized],
            [history[rows[at]] for at in penalized]))
    return logits.float().index_copy(0, index, part)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    history: History) -> torch.Tensor:
    """vLLM's `apply_penalties` on float32 logits [rows, vocab]: the repetition penalty over the
    tokens of the prompt and the output (a seen token's logit divided by it if positive,
    multiplied if not), then OpenAI's frequency (x the token's count in the output) and presence
    (x whether it is in the output) penalties subtracted. The counts are built on the device
    from each row's ids in one scatter per kind."""
    device = logits.device
    rows, vocab_size = logits.shape
    counts = _token_counts([ids[prompt_len:] for ids, prompt_len in history], rows,
                           vocab_size, device)
    repetition = [p.repetition_penalty for p in params]
    if any(value != 1 for value in repetition):
        seen = (counts > 0) | (_token_counts([ids[:prompt_len] for ids, prompt_len in history],
                                             rows, vocab_size, device) > 0)
        factor = torch.where(seen, torch.tensor(repetition, device=device).unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
    presence = torch.tensor([p.presence_penalty for p in params], device=device)
    return (logits - frequency.unsqueeze(1) * counts
            - presence.unsqueeze(1) * (counts > 0).float())


def _token_counts(ids: list[Sequence[int]], rows: int, vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """float32 [rows, vocab_size]: how many times each token id is in each row's `ids` (ids
    past the vocabulary are left out)."""
    counts = torch.zeros(rows * vocab_size, device=device)
    lengths = [len(row_ids) for row_ids in ids]
    if not sum(lengths):
        return counts.view(rows, vocab_size)
    flat = torch.cat([torch.as_tensor(row_ids, dtype=torch.int64) for row_ids in ids])
    row_of = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths))
    keep = flat < vocab_size
    places = (row_of * vocab_size + flat)[keep].to(device)
    counts.index_add_(0, places, torch.ones(places.shape, device=device))
    return counts.view(rows, vocab_size)


def _filter_min_p(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p x the row's largest (vLLM's
    min-p, on the temperature-scaled logits); min_p 0 keeps the row whole."""
    probabilities = torch.softmax(scaled, dim=-1)
    threshold = probabilities.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1)
    return scaled.masked_fill(probabilities < threshold, float("-inf"))


def _filter_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf every logit outside each row's k most likely tokens, then outside the smallest set of
    those whose (renormalised) mass reaches top_p; the most likely token always survives."""
    vocab_size = scaled.shape[-1]
    device = scaled.device
    top_ks = on_device([p.top_k if p.top_k > 0 else vocab_size for p in params], device)
    top_ps = on_device([p.top_p for p in params], device)
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
