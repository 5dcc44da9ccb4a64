"""The sampler: greedy rows, temperature / top-k / top-p filtering, per-request seeds, parameter checks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from zipage.engine.sampler import SamplingParams, sample  # noqa: E402
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
