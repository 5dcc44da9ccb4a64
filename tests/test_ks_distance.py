"""The two-sample Kolmogorov-Smirnov distance `zipage compare` and `zipage fidelity` report for the
TTFT and TPOT distributions of two runs (analysis/compare.py, `ks_distance`): on samples whose
distance is worked out by hand, and its properties on any samples."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zipage.analysis.compare import ks_distance

EXACT = 1e-12  # a distance is a difference of two count ratios: exact but for its last bits


def distance(first, second) -> float | None:
    return ks_distance(np.asarray(first, dtype=float), np.asarray(second, dtype=float))


@pytest.mark.parametrize("first, second, expected", [
    ([1.0, 2.0, 3.0], [3.0, 1.0, 2.0], 0.0),  # the same values in another order
    ([1.0, 2.0], [1.0, 1.0, 2.0, 2.0], 0.0),  # the same distribution, twice the sample
    ([1.0, 2.0, 3.0], [4.0, 5.0], 1.0),  # disjoint: every value of one below the other's
    ([4.0, 5.0], [1.0, 2.0, 3.0], 1.0),
    # Shifted: at x = 4, F1 = 4/4 and F2 = 2/3 (1.5, 2 <= 4, 10 > 4); every other pooled value
    # gives a smaller gap (1: 1/4, 1.5: 1/12, 2: 1/6, 3: 1/12, 10: 0).
    ([1.0, 2.0, 3.0, 4.0], [1.5, 2.0, 10.0], 1 / 3),
    ([1.0, 2.0, 3.0, 4.0], [2.5, 3.5, 4.5, 5.5], 0.5),  # shifted by 1.5: two values apart
])
def test_distance_of_hand_made_samples(first, second, expected):
    assert abs(distance(first, second) - expected) <= EXACT


@pytest.mark.parametrize("first, second", [([], [1.0]), ([1.0], []), ([], [])])
def test_an_empty_sample_has_no_distance(first, second):
    assert distance(first, second) is None


def same_distribution(first: list[int], second: list[int]) -> bool:
    """Whether every value has the same share of both samples (integer arithmetic: exact)."""
    count_first, count_second = Counter(first), Counter(second)
    return all(count_first[value] * len(second) == count_second[value] * len(first)
               for value in set(first) | set(second))


# Few distinct values, so that ties and equal distributions are drawn often.
SAMPLES = st.lists(st.integers(0, 4), min_size=1, max_size=12)


@given(SAMPLES, SAMPLES)
@settings(max_examples=examples(300))
def test_symmetric_bounded_and_zero_only_for_one_distribution(first, second):
    there, back = distance(first, second), distance(second, first)
    assert abs(there - back) <= EXACT
    assert 0.0 <= there <= 1.0
    # A nonzero distance is at least 1 / (n1 * n2) (a difference of two count ratios), so a
    # 1e-12 threshold separates it from zero.
    assert (there <= EXACT) == same_distribution(first, second)


@given(SAMPLES, st.integers(1, 4), st.randoms(use_true_random=False))
@settings(max_examples=examples(100))
def test_repeating_and_shuffling_a_sample_keeps_its_distribution(sample, copies, random):
    repeated = sample * copies
    random.shuffle(repeated)
    assert distance(sample, repeated) <= EXACT
