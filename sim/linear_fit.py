"""A line fitted to measured step times in relative error: the calibrated cost model's decode,
compression and (before profile version 3) prefill fits, and the mixed step's constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zipage.errors import ConfigError


@dataclass(frozen=True)
class LinearFit:
    """time_s = sum(coefficients[i] * feature_i), feature 0 being the constant 1."""

    feature_names: tuple[str, ...]
    coefficients: tuple[float, ...]
    relative_rms_error: float  # over the profile points it was fitted to
    num_points: int
    floor_s: float  # fastest measured time: a prediction below it is clamped to it

    def predict(self, *features: float) -> float:
        value = self.coefficients[0] + sum(c * f for c, f in zip(self.coefficients[1:], features))
        return max(value, self.floor_s)

    def describe(self) -> str:
        return " + ".join([f"{self.coefficients[0]:.3g}"] + [
            f"{c:.3g} * {name}" for c, name in zip(self.coefficients[1:], self.feature_names[1:])])


def fit_linear(source: str, section: str, names: tuple[str, ...], features: list[list[float]],
               times: list[float], offsets: np.ndarray | None = None,
               proportional_if_uniform: bool = False) -> LinearFit:
    """Least squares in relative error, so short steps are fitted as well as long ones.

    time = offset + constant + sum(coefficient * feature): `offsets` are the parts of each
    point's time that other fits already explain (default none). With
    `proportional_if_uniform`, points that all have the same features (every compression batch
    of a run the same size) cannot separate the constant from the slope: the time is then taken
    as proportional to the first feature, which is what a compression's cost mostly is."""
    unknowns = len(names) + 1
    time = np.asarray(times, dtype=float)
    offset = np.zeros(len(times)) if offsets is None else np.asarray(offsets, dtype=float)
    rows = np.asarray(features, dtype=float)
    if proportional_if_uniform and len(times) >= 1 and rows.size and (rows == rows[0]).all() \
            and rows[0][0] > 0:
        slope = float(np.median(time - offset)) / rows[0][0]
        predicted = offset + slope * rows[:, 0]
        return LinearFit(
            feature_names=("constant",) + names,
            coefficients=(0.0, slope) + (0.0,) * (len(names) - 1),
            relative_rms_error=float(np.sqrt(np.mean((predicted / time - 1.0) ** 2))),
            num_points=len(times), floor_s=float(time.min()))
    if len(times) < unknowns + 1:
        raise ConfigError(f"{source}: {section}: {len(times)} point(s) cannot fit "
                          f"{' + '.join(('constant',) + names)}; measure at least {unknowns + 1}")
    design = np.column_stack([np.ones(len(times)), rows])
    # Columns span orders of magnitude (tokens vs 1): scale them before judging the rank.
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    weighted = design / scale / time[:, None]
    if np.linalg.matrix_rank(weighted) < unknowns:
        raise ConfigError(f"{source}: {section}: the points do not vary "
                          f"{' and '.join(names)} independently, so their effects cannot be "
                          "separated; measure more varied points")
    solution, *_ = np.linalg.lstsq(weighted, 1.0 - offset / time, rcond=None)
    coefficients = solution / scale
    relative = (offset + design @ coefficients) / time - 1.0
    return LinearFit(
        feature_names=("constant",) + names,
        coefficients=tuple(float(value) for value in coefficients),
        relative_rms_error=float(np.sqrt(np.mean(relative**2))),
        num_points=len(times),
        floor_s=float(time.min()),
    )
