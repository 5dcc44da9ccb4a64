"""The sampler: greedy rows, temperature / top-k / top-p filtering, per-request seeds, parameter checks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from zipage.core.sampling import SamplingParams  # noqa: E402
from zipage.engine.sampler import sample  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits_row: torch.Tensor, params: SamplingParams, count: int) -> list[int]:
    """`count` tokens sampled for one row, each with a different token index (so a fresh draw)."""
    return [sample(logits_row.unsqueeze(0), [params], [index]).item() for index in range(count)]


def test_greedy_is_argmax_for_every_row() -> None:
    logits = _logits(6)
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 6, [0] * 6)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0, seed=1)] * 2
    for index in range(20):
        tokens = sample(logits, params, [index] * 4)
        assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    logits = _logits(3) / 3  # flatter: many plausible tokens
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in (11, 12, 13)]
    alone = [sample(logits[1:2], [params[1]], [index]).item() for index in range(30)]
    batched = [sample(logits, params, [index] * 3)[1].item() for index in range(30)]
    reordered = [sample(logits.flip(0), params[::-1], [index] * 3)[1].item() for index in range(30)]
    assert alone == batched == reordered
    assert len(set(alone)) > 3  # each token index gives a fresh draw, not the same token over and over


def test_different_seeds_give_different_streams() -> None:
    row = _logits(1)[0] / 3  # flatter: many plausible tokens
    first = _draws(row, SamplingParams(temperature=1.0, seed=1), 40)
    second = _draws(row, SamplingParams(temperature=1.0, seed=2), 40)
    assert first != second


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5)
    torch.manual_seed(0)
    draws = sample(logits.expand(20000, -1), [params] * 20000, [0] * 20000)
    frequencies = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(frequencies, torch.softmax(logits[0] / 0.5, dim=-1), atol=0.01, rtol=0)


def test_top_k_restricts_to_the_k_most_likely() -> None:
    row = _logits(1)[0] / 3
    allowed = set(row.topk(3).indices.tolist())
    draws = _draws(row, SamplingParams(temperature=2.0, top_k=3, seed=5), 200)
    assert set(draws) == allowed
    assert set(_draws(row, SamplingParams(temperature=2.0, top_k=1, seed=5), 20)) == {row.argmax().item()}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probabilities = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = probabilities.log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the first two tokens survive, never the tail.
    assert set(_draws(row, SamplingParams(temperature=1.0, top_p=0.7, seed=3), 200)) == {0, 1}
    # The most likely token survives even when it alone exceeds top_p.
    assert set(_draws(row, SamplingParams(temperature=1.0, top_p=0.1, seed=3), 20)) == {0}


def test_top_k_and_top_p_combine_per_row() -> None:
    probabilities = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probabilities.log().expand(2, -1)
    params = [SamplingParams(temperature=1.0, top_k=2, seed=1), SamplingParams(temperature=1.0, top_p=0.85, seed=2)]
    seen: list[set[int]] = [set(), set()]
    for index in range(300):
        for row, token in enumerate(sample(logits, params, [index, index]).tolist()):
            seen[row].add(token)
    assert seen == [{0, 1}, {0, 1, 2}]


@pytest.mark.parametrize(
    "changes, field",
    [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed"), ({"seed": 2**32}, "seed")],
)
def test_invalid_params_name_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:"):
        SamplingParams(**changes)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("nan"), "temperature: nan must be a finite number in [0, 100]"),
    ("temperature", float("inf"), "temperature: inf must be a finite number"),
    ("temperature", -1.0, "temperature: -1.0 must be a finite number"),
    ("temperature", 101.0, "temperature: 101.0 must be a finite number in [0, 100]"),
    ("top_k", 2**63, "top_k: 9223372036854775808 must be an integer in [0, 2147483647]"),
    ("top_k", -1, "top_k: -1 must be an integer"),
    ("top_k", 2.0, "top_k: 2.0 must be an integer"),
    ("top_p", float("nan"), "top_p: nan must be a finite number in (0, 1]"),
    ("top_p", 0.0, "top_p: 0.0 must be"),
    ("max_tokens", 2**31, "max_tokens: 2147483648 must be an integer in [1, 2147483647]"),
    ("max_tokens", 0, "max_tokens: 0 must be"),
    ("seed", 2**32, "seed: 4294967296 must be an integer in [0, 2**32)"),
    ("seed", -1, "seed: -1 must be"),
    ("kv_budget", 2**31, "kv_budget: must be an integer between 1 and 2147483647 (the KV "),
    ("compress_scope", "prompt", "compress_scope: must be one of 'all', 'output'"),
    ("priority", 1.5, "priority: must be an integer between -1000000 and 1000000"),
    ("priority", True, "priority: must be an integer"),
    ("ignore_eos", 1, "ignore_eos: 1 must be true or false"),
])
def test_every_setting_out_of_range_is_refused_by_name(field, value, message) -> None:
    with pytest.raises(ConfigError) as caught:
        SamplingParams(**{field: value})
    assert str(caught.value).startswith(message)


def test_huge_values_are_cut_in_the_message() -> None:
    with pytest.raises(ConfigError) as caught:
        SamplingParams(top_k=10**1000)
    assert len(str(caught.value)) < 200


def test_top_k_that_torch_cannot_hold_never_reaches_a_step() -> None:
    """The reproduction of issue #30: top_k 2**63 raised 'Overflow' inside `sample`, in the
    middle of an engine step. It is refused when the settings are made."""
    with pytest.raises(ConfigError, match="^top_k:"):
        SamplingParams(temperature=1.0, top_k=2**63)
    # The largest accepted top_k samples like no filtering at all.
    params = SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=3)
    assert _draws(_logits(1)[0], params, 5) == _draws(
        _logits(1)[0], SamplingParams(temperature=1.0, seed=3), 5)


def test_tiny_temperature_is_greedy_not_nan() -> None:
    """Logits divided by 1e-40 or 1e-50 in float32 overflow to inf (NaN probabilities, a token
    that is not even the likeliest): such a row is greedy."""
    logits = _logits(2)
    for temperature in (1e-40, 1e-50):
        tokens = sample(logits, [SamplingParams(temperature=temperature)] * 2, [0, 0])
        assert torch.equal(tokens, logits.argmax(dim=-1))


# ---------------------------------------------------------------- penalties, logit bias, min-p (#48)

from zipage.engine.sampler import adjust_logits, apply_penalties  # noqa: E402

ATOL = 1e-5


def _reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int],
                         presence: float, frequency: float, repetition: float) -> torch.Tensor:
    """One row the plain way, token by token: HF's repetition penalty over prompt + output,
    then OpenAI's frequency and presence penalties over the output."""
    row = logits.clone().float()
    for token in set(prompt) | set(output):
        row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return row


@pytest.mark.parametrize("presence, frequency, repetition", [
    (0.5, 0.0, 1.0), (0.0, 1.5, 1.0), (0.0, 0.0, 1.3), (-0.7, 0.4, 0.8), (2.0, -2.0, 1.7)])
def test_penalties_match_a_plain_torch_reference(presence, frequency, repetition) -> None:
    logits = _logits(3, seed=4)
    histories = [([1, 2, 3, 4], 2), ([5, 5, 5, 7, 8, 8, 9], 3), ([0, 49, 49], 3)]  # last: no output
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                             repetition_penalty=repetition)] * 3
    got = apply_penalties(logits.clone(), params, histories)
    for row, (ids, prompt_len) in enumerate(histories):
        expected = _reference_penalties(logits[row], ids[:prompt_len], ids[prompt_len:],
                                        presence, frequency, repetition)
        torch.testing.assert_close(got[row], expected, atol=ATOL, rtol=0)


def test_only_rows_that_ask_are_adjusted_and_the_models_logits_stay() -> None:
    logits = _logits(4, seed=6)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, frequency_penalty=1.0),
              SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0, logit_bias=((7, 5.0), (9, -3.0)))]
    history = [([1, 2], 1)] * 4
    adjusted = adjust_logits(logits, params, [1, 3], history)
    torch.testing.assert_close(logits, before, atol=0, rtol=0)  # untouched: logprobs read it
    torch.testing.assert_close(adjusted[[0, 2]], logits[[0, 2]], atol=0, rtol=0)
    expected = logits[1].clone()
    expected[2] -= 1.0
    torch.testing.assert_close(adjusted[1], expected, atol=ATOL, rtol=0)
    expected = logits[3].clone()
    expected[7] += 5.0
    expected[9] -= 3.0
    torch.testing.assert_close(adjusted[3], expected, atol=ATOL, rtol=0)


def test_greedy_applies_bias_and_penalties_before_the_argmax() -> None:
    logits = _logits(2, seed=8)
    best = logits[0].argmax().item()
    target = (best + 1) % VOCAB
    biased = SamplingParams(temperature=0.0, logit_bias=((target, 100.0),))
    assert sample(logits[:1], [biased], [0]).item() == target
    # A strong frequency penalty on the argmax token (generated 3 times) moves greedy off it.
    penalized = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    top_two = logits[1].topk(2).indices.tolist()
    gap = (logits[1, top_two[0]] - logits[1, top_two[1]]).item()
    history = [([0], 1), ([0] + [top_two[0]] * (int(gap / 2.0) + 1), 1)]
    tokens = sample(logits, [SamplingParams(temperature=0.0), penalized], [0, 0], history)
    assert tokens.tolist() == [best, top_two[1]]


def test_logit_bias_past_the_vocabulary_is_ignored_not_fatal() -> None:
    logits = _logits(1)
    params = SamplingParams(temperature=0.0, logit_bias=((VOCAB + 5, 100.0),))
    assert sample(logits, [params], [0]).item() == logits.argmax().item()


def test_a_penalty_without_history_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="history"):
        sample(_logits(1), [SamplingParams(presence_penalty=1.0)], [0])


def test_min_p_keeps_tokens_above_its_share_of_the_top() -> None:
    probabilities = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = probabilities.log()
    # Threshold 0.4 x 0.5 = 0.2: tokens 0 and 1 survive.
    assert set(_draws(row, SamplingParams(temperature=1.0, min_p=0.4, seed=3), 300)) == {0, 1}
    # min_p 1.0 keeps only the most likely token: greedy.
    assert set(_draws(row, SamplingParams(temperature=1.0, min_p=1.0, seed=3), 50)) == {0}
    # After the temperature, as vLLM: at temperature 2 the probabilities are flatter
    # (~0.37, 0.29, 0.20, 0.12), so 0.4 x 0.37 keeps three tokens.
    assert set(_draws(row, SamplingParams(temperature=2.0, min_p=0.4, seed=3), 400)) == {0, 1, 2}


def test_min_p_follows_the_renormalised_softmax() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0]])
    torch.manual_seed(0)
    draws = sample(logits.expand(20000, -1), [SamplingParams(min_p=0.3)] * 20000, [0] * 20000)
    probabilities = torch.softmax(logits[0], dim=-1)
    kept = probabilities >= 0.3 * probabilities.max()
    expected = torch.where(kept, probabilities, 0.0)
    frequencies = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(frequencies, expected / expected.sum(), atol=0.01, rtol=0)


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty: 2.5 must be a finite number in [-2, 2]"),
    ("frequency_penalty", -2.01, "frequency_penalty: -2.01 must be a finite number in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty: nan must be"),
    ("repetition_penalty", 0.0, "repetition_penalty: 0.0 must be a finite number in (0, 100]"),
    ("repetition_penalty", -1.0, "repetition_penalty: -1.0 must be"),
    ("min_p", 1.5, "min_p: 1.5 must be a finite number in [0, 1]"),
    ("min_p", -0.1, "min_p: -0.1 must be"),
    ("logit_bias", ((3, 101.0),), "logit_bias: bias 101.0 of token 3 must be a finite number "
                                  "in [-100, 100]"),
    ("logit_bias", ((-1, 1.0),), "logit_bias: token id -1 must be an integer"),
    ("logit_bias", ((1.5, 1.0),), "logit_bias: token id 1.5 must be an integer"),
    ("logit_bias", [1, 2], "logit_bias: [1, 2] is not a {token id: bias} dict"),
    ("logit_bias", tuple((token, 1.0) for token in range(1025)), "logit_bias: must map at most"),
])
def test_new_settings_out_of_range_are_refused_by_name(field, value, message) -> None:
    with pytest.raises(ConfigError) as caught:
        SamplingParams(**{field: value})
    assert str(caught.value).startswith(message)


def test_logit_bias_takes_openais_dict_shape() -> None:
    assert SamplingParams(logit_bias={7: 5.0, 9: -3.0}).logit_bias == ((7, 5.0), (9, -3.0))
