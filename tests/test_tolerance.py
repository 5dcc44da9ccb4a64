"""The comparison helpers of tests/tolerance.py: a few ulps pass, a real change fails, and
everything that is not a float (keys, lengths, integers, strings, booleans) stays exact."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from tolerance import PINNED_RTOL, assert_close, assert_text_close, close, mismatches

ULP = 2.0**-52


def shifted(value: float, relative: float) -> float:
    return value * (1.0 + relative)


@dataclass
class Point:
    name: str
    count: int
    time_s: float


def structure(time: float) -> dict:
    return {"tps": 1234.5, "steps": 17, "label": "sim", "rows": [
        {"time_s": time, "ok": True, "reason": None}, (3, time * 2)],
        "point": Point("a", 2, time), "array": np.array([time, 0.5])}


def test_pinned_tolerance_sits_between_last_bits_and_real_changes():
    assert 1e3 * ULP < PINNED_RTOL < 1e-6


@pytest.mark.parametrize("ulps", [1, -1, 4, -16])
def test_last_bit_differences_pass(ulps):
    time = 0.010207972263753353
    assert shifted(time, ulps * ULP) != time  # deliberately exact: the bits did move
    assert shifted(time, ulps * ULP) == close(time)
    assert_close(structure(shifted(time, ulps * ULP)), structure(time))
    assert_text_close(f"step 3 time={shifted(time, ulps * ULP)!r} n=4\n",
                      f"step 3 time={time!r} n=4\n")


@pytest.mark.parametrize("relative", [1e-6, -1e-6, 1e-3])
def test_a_real_change_fails(relative):
    time = 0.010207972263753353
    assert shifted(time, relative) != close(time)
    with pytest.raises(AssertionError, match=r"time_s"):
        assert_close(structure(shifted(time, relative)), structure(time))
    with pytest.raises(AssertionError, match="line 1"):
        assert_text_close(f"time={shifted(time, relative)!r}\n", f"time={time!r}\n")


def test_zero_must_stay_zero():
    assert 0.0 == close(0.0)
    assert 1e-300 != close(0.0)
    assert mismatches(0.0, 1e-300)


@pytest.mark.parametrize("actual", [
    {"tps": 1234.5, "steps": 18},  # an integer off by one
    {"tps": 1234.5, "steps": 17, "extra": 1},  # a key more
    {"tps": 1234.5},  # a key fewer
    {"tps": 1234.5, "steps": True},  # a boolean for an integer
    {"tps": "1234.5", "steps": 17},  # a string for a float
    {"tps": None, "steps": 17},
])
def test_everything_but_floats_is_exact(actual):
    assert mismatches(actual, {"tps": 1234.5, "steps": 17})


def test_sequences_match_in_type_and_length():
    assert mismatches([1.0, 2.0], [1.0, 2.0, 3.0])
    assert mismatches((1.0, 2.0), [1.0, 2.0])
    assert mismatches(Point("a", 2, 1.0), Point("b", 2, 1.0))
    assert not mismatches(np.float64(0.5), 0.5)


def test_nan_and_infinity_match_only_themselves():
    assert not mismatches([math.nan, math.inf], [math.nan, math.inf])
    assert mismatches(math.inf, 1e308) and mismatches(math.nan, 0.0)
    assert mismatches(-math.inf, math.inf)


def test_text_keeps_integers_and_words_exact():
    expected = '{"id":"chat-7","arrival_s":9.949967,"prompt_len":2048}\n'
    assert_text_close(expected.replace("9.949967", "9.949967000000001"), expected)
    for changed in (expected.replace("2048", "2049"), expected.replace("chat-7", "chat-8"),
                    expected.replace('"prompt_len"', '"prompt_len "'), expected + "\n"):
        with pytest.raises(AssertionError):
            assert_text_close(changed, expected)
    # A float printed as an integer is a change of format, not of value.
    with pytest.raises(AssertionError):
        assert_text_close(expected.replace("9.949967", "10"), expected.replace("9.949967", "10.0"))


def test_close_says_what_it_does_with_every_kind_of_value():
    # A rejected request's first token is None: close() must compare it, not raise (pytest 9.2's
    # approx refuses None and strings outright).
    assert None == close(None)  # noqa: E711  # the matcher's own __eq__ is under test
    assert 0.5 != close(None) and None != close(0.5)  # noqa: E711
    assert [("r1", None, 2.0)] == [("r1", close(None), close(2.0 * (1 + ULP)))]
    assert "abc" == close("abc") and "abd" != close("abc")
    assert 3 == close(3) and 4 != close(3)
    assert 32.0 == close(32)
    flag = True
    assert flag != close(1)  # a bool is not the number 1
    assert {"a": [1.0, None]} == close({"a": [1.0 + ULP, None]})
    assert {"a": [1.0, None]} != close({"a": [1.0, 0.0]})
    assert math.nan == close(math.nan)
    assert np.float64(0.25) == close(0.25) and np.array([0.25, 0.5]) == close([0.25, 0.5])
    assert "rtol" in repr(close(1.0))
