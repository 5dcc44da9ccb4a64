"""The calibrated prefill model: host-bound or device-bound, whichever is longer.

A prefill step runs eagerly (no CUDA graph): the host enqueues a chain of kernels while the GPU
runs them, so the step lasts as long as the slower of the two. Short prompts are host-bound — a
flat time whatever their length (25-33 ms for Qwen3-8B on eager H200 runs: docs/BENCHMARKS.md,
'Changelog'); long prompts are device-bound — the weights' FLOPs per token and the attention
work per causal (query, key) pair. Building the step's inputs happens before the first kernel
can start, so its cost per prompt adds to either bound:

    time = per_sequence * requests + max(host, device + per_token * new_tokens
                                                + per_pair * attention_pairs)

A single line through both regimes (the version-2 fit) is flat where the profile's points are
short and extrapolates far too low for long prompts (docs/cost_model.md). Every coefficient is
a cost, so none may be negative: the fit is non-negative least squares in relative error.
`fit_host_or_device` is that fit for any such max; the mixed step's host bound
(sim/mixed_fit.py) is fitted with it too. `fit_prefill_points` fits a profile's prefill points
(docs/cost_model.md), those of profiles before version 3 as the one line they always were.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from zipage.core.step import causal_pairs
from zipage.errors import ConfigError
from zipage.prefill_buckets import padded_rows
from zipage.sim.linear_fit import fit_linear

# The alternating fit (assign each point to a regime, refit, reassign) stops when an assignment
# comes back (a fixed point or a cycle) or after this many rounds; it keeps the best model seen.
MAX_ROUNDS = 50
# Initial guesses of the regime boundary: the points above these quantiles of a step's size (new
# tokens for a prefill step) start device-bound, and a last start has every point device-bound
# (a profile without host-bound steps). A start with none device-bound would stay there: its
# device line is never fitted.
START_QUANTILES = (0.25, 0.5, 0.75)
# The per-sequence term needs steps of at least this many different prompt counts. Steps of one
# and two prompts only (a Qwen3-32B TP=2 online run: 54 and 5) fitted 11.7 ms per prompt and
# priced the headline's one step of 128 prompts at 1.76 s, 4.6x the 0.38 s measured.
MIN_PROMPT_COUNTS = 3
# A support of the non-negative least squares replaces the best one so far only when its squared
# residual is smaller by more than this fraction. Supports that fit equally well (collinear
# columns: three device-bound points of one prompt length cannot tell the constant from the
# per-token cost) differ only in rounding, and lstsq rounds differently on different CPUs (BLAS
# kernels chosen by CPU features); without the margin the last bit chose the model, and the
# fitted coefficients, the predictions and every simulated decision after them followed the CPU.
# With it the tie goes to the first support found, the one with the fewest columns.
NNLS_TIE_RTOL = 1e-9


@dataclass(frozen=True)
class PrefillFit:
    """A fitted prefill model (the formula in the module docstring).

    Profiles before version 3 are device-only lines without a per-sequence term (`host_s` and
    `per_sequence_s` are 0), fitted as they always were, so their predictions are unchanged.
    """

    device_coefficients: tuple[float, float, float]  # constant, per new token, per pair
    host_s: float  # the host-bound time of a step
    per_sequence_s: float  # input building per prompt (or chunk)
    relative_rms_error: float  # over the profile points it was fitted to
    num_points: int
    floor_s: float  # fastest measured time: a prediction below it is clamped to it

    def device_time(self, new_tokens: float, attention_pairs: float) -> float:
        constant, per_token, per_pair = self.device_coefficients
        return constant + (per_token * new_tokens + per_pair * attention_pairs)

    def predict(self, new_tokens: float, attention_pairs: float, requests: float) -> float:
        value = self.bound(self.device_time(new_tokens, attention_pairs), requests)
        return max(value, self.floor_s)

    def bound(self, device_s: float, requests: float) -> float:
        """A step whose GPU work takes `device_s`: the host bound and the per-prompt cost."""
        return self.per_sequence_s * requests + max(self.host_s, device_s)

    def describe(self) -> str:
        constant, per_token, per_pair = self.device_coefficients
        device = f"{constant:.3g} + {per_token:.3g} * new_tokens + {per_pair:.3g} * attention_pairs"
        if not self.host_s and not self.per_sequence_s:
            return device
        return f"{self.per_sequence_s:.3g} * requests + max({self.host_s:.3g}, {device})"


def nonnegative_least_squares(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ||matrix x - target|| over x >= 0, for a handful of columns.

    Some optimum is the plain least-squares solution on its support (the columns whose
    coefficient is positive), so trying every subset of columns and keeping the best solution
    that is non-negative is exact; with at most five columns that is 31 small solves. Subsets
    within NNLS_TIE_RTOL of each other are a tie, which the smallest (first) subset wins.
    """
    columns = matrix.shape[1]
    best, best_residual = np.zeros(columns), float(target @ target)
    for size in range(1, columns + 1):
        for support in itertools.combinations(range(columns), size):
            part = matrix[:, support]
            solution, *_ = np.linalg.lstsq(part, target, rcond=None)
            if (solution < 0).any():
                continue
            residual = part @ solution - target
            if residual @ residual < best_residual * (1.0 - NNLS_TIE_RTOL):
                best_residual = float(residual @ residual)
                best = np.zeros(columns)
                best[list(support)] = solution
    return best


def fit_prefill(new_tokens, attention_pairs, requests, times) -> PrefillFit:
    """The host-or-device model of the points, in relative error (short steps count as much as
    long ones), every coefficient >= 0. The per-sequence term is fitted only when the points
    hold MIN_PROMPT_COUNTS different numbers of prompts per step; otherwise it cannot be told
    from the constants (0)."""
    tokens, pairs = np.asarray(new_tokens, float), np.asarray(attention_pairs, float)
    prompts, time = np.asarray(requests, float), np.asarray(times, float)
    with_prompts = len(np.unique(prompts)) >= MIN_PROMPT_COUNTS
    fit = fit_host_or_device(
        time, inner=np.column_stack([np.ones_like(time), tokens, pairs]),
        outer=(prompts if with_prompts else np.zeros_like(prompts))[:, None], sizes=tokens,
        floor=float(time.min()))
    (per_sequence,), (constant, per_token, per_pair) = fit.outer, fit.inner
    return PrefillFit((constant, per_token, per_pair), fit.host_s, per_sequence,
                      fit.relative_rms_error, len(time), float(time.min()))


@dataclass(frozen=True)
class HostOrDeviceFit:
    """time = outer offset + outer . x + max(host_s, inner offset + inner . y), fitted."""

    host_s: float
    outer: tuple[float, ...]  # x: the coefficients of the columns outside the max
    inner: tuple[float, ...]  # y: the coefficients of the device columns
    device: np.ndarray  # the points the fitted model prices device-bound (inner above host_s)
    relative_rms_error: float  # of the model as it predicts (the max and the floor included)


def fit_host_or_device(time: np.ndarray, inner: np.ndarray, outer: np.ndarray,
                       sizes: np.ndarray, *, inner_offset: np.ndarray | None = None,
                       outer_offset: np.ndarray | None = None,
                       floor: float = 0.0) -> HostOrDeviceFit:
    """Fit time = outer_offset + outer . x + max(host, inner_offset + inner . y) (x, y, host
    >= 0; the offsets are parts of each point's time that other fits already explain) in
    relative error, predictions clamped at `floor`; shared by the prefill fit and the mixed
    step's (sim/mixed_fit.py).

    The max is fitted by alternating: each point is assigned to the bound its current prediction
    says, the coefficients are refitted with the assignment fixed, until an assignment comes
    back (a fixed point or a cycle), from several starts: the points above START_QUANTILES of
    `sizes` device-bound (a device time grows with them), and all of them. The best model seen
    is kept."""
    best: HostOrDeviceFit | None = None
    seen: set[bytes] = set()  # assignments fitted already: from there the path is known
    starts = [sizes > np.quantile(sizes, q) for q in START_QUANTILES]
    starts.append(np.ones(len(time), dtype=bool))
    for device in starts:
        for _ in range(MAX_ROUNDS):
            if device.tobytes() in seen:
                break
            seen.add(device.tobytes())
            fit = _fit_assignment(time, inner, outer, device, inner_offset, outer_offset, floor)
            if best is None or fit.relative_rms_error < best.relative_rms_error:
                best = fit
            device = fit.device
    return best


def _fit_assignment(time, inner, outer, device, inner_offset, outer_offset,
                    floor) -> HostOrDeviceFit:
    """Non-negative least squares with each point in the regime `device` assigns it to."""
    host = ~device
    design = np.column_stack([host, outer, device[:, None] * inner]).astype(float)
    weighted = design / time[:, None]
    target = np.ones(len(time))
    if inner_offset is not None or outer_offset is not None:
        # In relative error what the offsets explain leaves 1 - offset / time to fit (the
        # inner offset only where the point is device-bound: a host-bound one is the host time).
        count = len(time)
        known = _offset(outer_offset, count) + np.where(device, _offset(inner_offset, count), 0)
        target = 1.0 - known / time
    # Columns span orders of magnitude (pairs vs 1): scale them for the solves.
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    solution = nonnegative_least_squares(weighted / scale, target) / scale
    host_s = float(solution[0])
    outer_x = tuple(float(value) for value in solution[1:1 + outer.shape[1]])
    inner_y = tuple(float(value) for value in solution[1 + outer.shape[1]:])
    device_s = _combine(inner_offset, inner, inner_y)
    predicted = np.maximum(_combine(outer_offset, outer, outer_x) + np.maximum(host_s, device_s),
                           floor)
    error = float(np.sqrt(np.mean((predicted / time - 1.0) ** 2)))
    return HostOrDeviceFit(host_s, outer_x, inner_y, device_s > host_s, error)


def _offset(offset: np.ndarray | None, count: int) -> np.ndarray:
    return np.zeros(count) if offset is None else np.asarray(offset, float)


def _combine(offset: np.ndarray | None, columns: np.ndarray,
             coefficients: tuple[float, ...]) -> np.ndarray:
    """offset + columns . coefficients, summed in the order the prefill fit always summed it
    (constant + (per_token * tokens + per_pair * pairs)), so its results stay bit for bit."""
    if not coefficients:
        return _offset(offset, len(columns))
    first = columns[:, 0] * coefficients[0]
    rest = None
    for index in range(1, len(coefficients)):
        term = coefficients[index] * columns[:, index]
        rest = term if rest is None else rest + term
    total = first if rest is None else first + rest
    return total if offset is None else np.asarray(offset, float) + total


# Optional fields of a prefill or mixed point: the prompt chunks of the step.
PREFILL_DEFAULTS = {"cached_tokens": 0, "requests": 1, "attention_pairs": None}
PREFILL_FEATURES = ("new_tokens", "attention_pairs")


def padded_tokens(new_tokens: int, decodes: int, buckets: tuple[int, ...]) -> int:
    """The prompt rows a padded step computes: its bucket's rows less its decode rows (a padding
    row costs what a prompt row does in the GEMMs; it adds no attention pairs)."""
    return padded_rows(new_tokens + decodes, buckets) - decodes


def fit_prefill_points(source: str, version: int, rows: list[dict[str, Any]],
                       buckets: tuple[int, ...] = ()) -> PrefillFit:
    """The model of a profile's prefill points. Version 3: host- or device-bound with a
    per-sequence term, non-negative (`fit_prefill`). Before it: one unconstrained line in tokens
    and pairs, exactly as those profiles were always read (their predictions must not change).
    With `buckets`, each point's tokens are its padded rows."""
    tokens = [padded_tokens(row["requests"] * row["new_tokens"], 0, buckets) if buckets
              else row["requests"] * row["new_tokens"] for row in rows]
    pairs = [prefill_pairs(row) for row in rows]
    times = [row["time_s"] for row in rows]
    if version < 3:
        line = fit_linear(source, "prefill", PREFILL_FEATURES, list(map(list, zip(tokens, pairs))),
                          times)
        return PrefillFit(line.coefficients, 0.0, 0.0, line.relative_rms_error,
                          line.num_points, line.floor_s)
    requests = [row["requests"] for row in rows]
    unknowns = 5 if len(set(requests)) > 1 else 4
    if len(rows) < unknowns + 1:
        raise ConfigError(f"{source}: prefill: {len(rows)} point(s) cannot fit "
                          f"{unknowns} coefficients; measure at least {unknowns + 1}")
    return fit_prefill(tokens, pairs, requests, times)


def prefill_pairs(row: dict) -> float:
    """The attention pairs of a prefill or mixed point. A point measured on one request shape
    gives (new, cached, requests); a point taken from a run's step (mixed prompt lengths) gives
    its attention pairs directly."""
    if row["attention_pairs"] is not None:
        return row["attention_pairs"]
    return row["requests"] * causal_pairs(row["new_tokens"], row["cached_tokens"])

