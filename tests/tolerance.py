"""How the tests compare computed floats: within a stated relative tolerance, never with `==`.

The same float computation can round differently in its last bits on two x86-64 CPUs: glibc
picks its pow, exp and log (and numpy its exp and log, OpenBLAS its kernels behind
numpy.linalg) by the CPU's features (FMA, AVX2, AVX-512), and those implementations are not
correctly rounded, so they disagree in the last bit or two. A cost model's step time goes through
pow (the roofline's soft maximum), a calibrated model's coefficients through lstsq, and whatever
is derived from them (simulated times, summaries, plans) carries the difference along. A number
pinned on one machine is therefore compared within PINNED_RTOL, far above those few ulps (about
1e-16 each) and far below any change a test means to catch (1e-6 and up). Integers, counts,
strings and decisions stay exact. A tolerance cannot help where the last bit decides between
two results (a tie); the product code breaks such ties with a margin of its own (the fits'
NNLS_TIE_RTOL in sim/prefill_fit.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

# Relative tolerance of a computed float against a pinned or separately computed value: about
# four million ulps of float64, so libm's and BLAS's last-bit differences between CPUs (and what
# a few hundred roundings after them add) pass, while any real change of a prediction or a
# summary (1e-6 relative and up) fails.
PINNED_RTOL = 1e-9


def close(expected: Any, rel: float = PINNED_RTOL) -> "Close":
    """A value that compares equal to `expected` as `assert_close` does: floats within `rel`
    relative and no absolute slack (an expected 0.0 must come out exactly 0.0), everything else
    (None, ints, bools, strings, and the keys and lengths of nested structures) exactly.

    Our own matcher, not pytest.approx: approx refuses an expected None or string outright
    (pytest 9.2: "expected value must support abs(...)"), and a rejected request's times are
    None, so a comparison helper must say what it does with every kind of value itself."""
    return Close(expected, rel)


class Close:
    """`actual == close(expected)`: see `close`. Numpy defers to it (`__array_ufunc__ = None`),
    so a numpy scalar or array on the left compares as one value, not element by element."""

    __array_ufunc__ = None
    __hash__ = None  # type: ignore[assignment]  # equality is not exact, so no hash

    def __init__(self, expected: Any, rel: float) -> None:
        self.expected, self.rel = expected, rel

    def __eq__(self, actual: object) -> bool:
        return not mismatches(actual, self.expected, self.rel)

    def __ne__(self, actual: object) -> bool:
        return not self == actual

    def __repr__(self) -> str:
        return f"{self.expected!r} (floats within rtol {self.rel:g})"


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as Python values, so one comparison handles both."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _is_float(value: Any) -> bool:
    return isinstance(value, float)


def floats_close(actual: float, expected: float, rtol: float = PINNED_RTOL) -> bool:
    """Equal within `rtol` relative; infinities and NaNs must match exactly (NaN equals NaN)."""
    if math.isnan(actual) or math.isnan(expected):
        return math.isnan(actual) and math.isnan(expected)
    return math.isclose(actual, expected, rel_tol=rtol, abs_tol=0.0)


def mismatches(actual: Any, expected: Any, rtol: float = PINNED_RTOL,
               path: str = "value") -> list[str]:
    """Where two nested structures (dataclasses, dicts, lists, tuples, numpy arrays) differ:
    floats beyond `rtol` relative, anything else (keys, lengths, ints, bools, strings, None)
    at all."""
    actual, expected = _plain(actual), _plain(expected)
    if isinstance(actual, bool) or isinstance(expected, bool):
        same = type(actual) is type(expected) and actual == expected
        return [] if same else [f"{path}: {actual!r} != {expected!r}"]
    if _is_float(actual) or _is_float(expected):
        if not (isinstance(actual, (int, float)) and isinstance(expected, (int, float))):
            return [f"{path}: {actual!r} != {expected!r}"]
        if floats_close(float(actual), float(expected), rtol):
            return []
        return [f"{path}: {actual!r} != {expected!r} (rtol {rtol:g})"]
    if dataclasses.is_dataclass(actual) and not isinstance(actual, type):
        if type(actual) is not type(expected):
            return [f"{path}: {type(actual).__name__} != {type(expected).__name__}"]
        found = []
        for field in dataclasses.fields(actual):
            found += mismatches(getattr(actual, field.name), getattr(expected, field.name),
                                rtol, f"{path}.{field.name}")
        return found
    if isinstance(actual, dict) and isinstance(expected, dict):
        if actual.keys() != expected.keys():
            return [f"{path}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"]
        found: list[str] = []
        for key in expected:
            found += mismatches(actual[key], expected[key], rtol, f"{path}[{key!r}]")
        return found
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return [f"{path}: {type(actual).__name__} of {len(actual)} != "
                    f"{type(expected).__name__} of {len(expected)}"]
        found = []
        for index, (left, right) in enumerate(zip(actual, expected)):
            found += mismatches(left, right, rtol, f"{path}[{index}]")
        return found
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def assert_close(actual: Any, expected: Any, rtol: float = PINNED_RTOL, what: str = "value"):
    """Assert two nested structures are equal, their floats within `rtol` relative."""
    found = mismatches(actual, expected, rtol, what)
    assert not found, "\n".join(found[:20]) + (f"\n... {len(found) - 20} more"
                                                 if len(found) > 20 else "")


# A number in text: an optional sign, digits with an optional fraction, an optional exponent.
# A token with a fraction or an exponent is a float (compared within the tolerance); one without
# is an integer (compared exactly), as is everything between the numbers.
_NUMBER = re.compile(r"[-+]?\d+(\.\d+)?([eE][-+]?\d+)?")


def text_mismatches(actual: str, expected: str, rtol: float = PINNED_RTOL) -> list[str]:
    """Where two texts (logs, JSON or CSV files) differ: numbers with a fraction or an exponent
    beyond `rtol` relative, any other character at all; reported by line."""
    actual_lines, expected_lines = actual.split("\n"), expected.split("\n")
    if len(actual_lines) != len(expected_lines):
        return [f"{len(actual_lines)} lines != {len(expected_lines)} lines"]
    found = []
    for number, (left, right) in enumerate(zip(actual_lines, expected_lines), start=1):
        if left == right:
            continue
        left_numbers, right_numbers = list(_NUMBER.finditer(left)), list(_NUMBER.finditer(right))
        same = (_NUMBER.sub("#", left) == _NUMBER.sub("#", right)
                and len(left_numbers) == len(right_numbers))
        for one, other in zip(left_numbers, right_numbers) if same else ():
            is_float = bool(one.group(1) or one.group(2))
            if is_float != bool(other.group(1) or other.group(2)):
                same = False  # an integer printed where a float was: a change of format
            elif is_float:
                same = floats_close(float(one.group()), float(other.group()), rtol)
            else:
                same = one.group() == other.group()
            if not same:
                break
        if not same:
            found.append(f"line {number}: {left!r} != {right!r}")
    return found


def assert_text_close(actual: str, expected: str, rtol: float = PINNED_RTOL, what: str = "text"):
    """Assert two texts are equal but for floats within `rtol` relative (text_mismatches)."""
    found = text_mismatches(actual, expected, rtol)
    assert not found, f"{what} differs:\n" + "\n".join(found[:20])
