"""The calibrated decode step's host floor: max(h, device line), where the points determine it.

A decode step replays a CUDA graph, but the engine's loop around it (scheduling, building the
step's inputs, sampling, bookkeeping) runs on the host every step. When that host time is longer
than the GPU's work, the step lasts the host time whatever its batch and context: a small model
(Qwen3-0.6B on an H200: 2.6-2.8 ms from batch 1 to ~12) is host-bound at small and medium batches
and device-bound above. One line through both regimes has to rise through the flat part to reach
the large batches, so it prices the flat part high (and the large batches low). The host-or-device
form fits them apart:

    time = max(h, a + b * batch + c * context_tokens [+ d * longest_excess] [+ e * shared_tokens])

(or d * partition_excess, the excess over the step's decode partitions, for a profile of
decode_excess "per_partition": one more column, fitted here as any other cost)

with the line's own terms (sim/calibrated.py decides which), fitted like the prefill's bound
(`fit_host_or_device`: non-negative, relative error; the shared term, a saving, enters negated).
It replaces the line only where the points determine it: at least MIN_REGIME_POINTS on each side
of the bound, and a smaller relative error than the line's. A profile of a few grid points (or
one that is never host-bound) keeps its line, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zipage.sim.linear_fit import LinearFit
from zipage.sim.prefill_fit import fit_host_or_device

# Each regime needs this many points before the bound is taken as determined. A few points on
# one side fit h (or the device line) to their own noise; a profile measured through the engine
# loop holds hundreds on each side, a grid profile a dozen points in all.
MIN_REGIME_POINTS = 32
# The term that is a saving (a shared entry costs c + e, e < 0): fitted negated so that every
# coefficient of the non-negative fit is a cost.
SAVINGS = ("shared_tokens",)


@dataclass(frozen=True)
class DecodeFit(LinearFit):
    """A decode model: `coefficients` is its device line (clamped at `floor_s` as a LinearFit
    is) and the step costs max(host_s, that line); host_s is 0 for a line-only fit."""

    host_s: float = 0.0

    def predict(self, *features: float) -> float:
        return max(super().predict(*features), self.host_s)

    def describe(self) -> str:
        line = super().describe()
        return f"max({self.host_s:.3g}, {line})" if self.host_s else line


def fit_host_floor(line: LinearFit, features: np.ndarray, times: np.ndarray) -> LinearFit:
    """`line` (a decode line fitted to `features` (one column per term after the constant) and
    `times`), or the host-or-device model of the same terms when the points determine its
    bound and it fits them better (module docstring)."""
    time = np.asarray(times, dtype=float)
    if len(time) < 2 * MIN_REGIME_POINTS:
        return line
    names = line.feature_names[1:]
    signs = np.array([-1.0 if name in SAVINGS else 1.0 for name in names])
    inner = np.column_stack([np.ones(len(time)), np.asarray(features, float) * signs])
    # A point's device time grows with what the line charges it: the regimes split by that.
    sizes = inner[:, 1:] @ (np.asarray(line.coefficients[1:]) * signs)
    floor = float(time.min())
    fit = fit_host_or_device(time, inner=inner, outer=np.empty((len(time), 0)), sizes=sizes,
                             floor=floor)
    device_points = int(fit.device.sum())
    if min(device_points, len(time) - device_points) < MIN_REGIME_POINTS:
        return line
    coefficients = (fit.inner[0],) + tuple(float(value) for value in
                                           np.asarray(fit.inner[1:]) * signs)
    terms = dict(zip(names, coefficients[1:]))
    # A shared entry may be cheaper than an unshared one, not free (as the line's rule says).
    if any(-terms[name] > terms["context_tokens"] for name in SAVINGS if name in terms):
        return line
    if fit.relative_rms_error >= _clamped_error(line, features, time):
        return line
    return DecodeFit(line.feature_names, coefficients, fit.relative_rms_error, len(time), floor,
                     host_s=fit.host_s)


def _clamped_error(line: LinearFit, features: np.ndarray, time: np.ndarray) -> float:
    """The line's relative RMS error as it predicts (clamped at its floor), like the bound's."""
    predicted = np.maximum(line.coefficients[0] + np.asarray(features, float)
                           @ np.asarray(line.coefficients[1:]), line.floor_s)
    return float(np.sqrt(np.mean((predicted / time - 1.0) ** 2)))
