"""The calibrated mixed step's model (chunked prefill: decodes and prompt chunks in one forward)
and its fit to a profile's "mixed" points (docs/cost_model.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zipage.sim.linear_fit import LinearFit, fit_linear
from zipage.sim.prefill_fit import (
    MIN_PROMPT_COUNTS,
    PREFILL_FEATURES,
    PrefillFit,
    fit_host_or_device,
    padded_tokens,
    prefill_pairs,
)

# The mixed fit's own coefficients (version 3): its host bound h_m and its constant m. Like every
# section it needs a point more than those; and each is taken as determined only when that many
# points fall in its regime: one point alone would set it to that point's time, noise included.
MIXED_UNKNOWNS = 2
MIN_REGIME_POINTS = 2
# From this many mixed points that vary their chunk rows (a profile fitted from runs through the
# engine loop: hundreds), the mixed step fits its own slopes, every one non-negative, instead of
# borrowing the pure fits': a running engine's mixed steps cost what its pure prefill steps
# (whole long prompts, or none) cannot tell.
OWN_SLOPE_POINTS = 64


@dataclass(frozen=True)
class MixedFit(LinearFit):
    """A mixed step's model: `coefficients` is its device line (m and the pure fits' slopes,
    clamped at `floor_s` as a LinearFit is), and the step costs
    per_sequence_s * requests + max(host_s, that line).

    `host_s` is the mixed points' own host bound h_m (version 3, when they determine it:
    `host_fitted`), else the prefill's h; `per_sequence_s` is the prefill's s either way."""

    host_s: float = 0.0
    per_sequence_s: float = 0.0
    host_fitted: bool = False

    def step_time(self, batch: float, context_tokens: float, new_tokens: float,
                  attention_pairs: float, requests: float, longest_decode: float = 0.0) -> float:
        features = (batch, context_tokens, new_tokens, attention_pairs)
        if len(self.coefficients) > 5:  # padded steps: the longest decode row's serial walk
            features += (longest_decode,)
        device = self.predict(*features)
        return self.per_sequence_s * requests + max(self.host_s, device)

    def describe(self) -> str:
        line = super().describe()
        if not self.host_s and not self.per_sequence_s:
            return line
        return f"{self.per_sequence_s:.3g} * requests + max({self.host_s:.3g}, {line})"


def fit_mixed_points(source: str, version: int, decode: LinearFit, prefill: PrefillFit,
                     rows: list[dict[str, Any]], buckets: tuple[int, ...] = ()) -> MixedFit:
    """A mixed step costs the decode fit's per-request and per-context-token terms plus the
    prefill fit's per-token and per-pair terms, and one constant m: a single forward reads the
    weights and pays the host's step overhead once, not once per part. It runs the prefill
    path, so it is host-bound or device-bound like a prefill step, and pays the
    prefill's per-chunk cost s. Version 3 fits its host bound h_m and m to the mixed points
    (host-or-device, non-negative, relative error: sim/prefill_fit.py), falling back to the
    prefill's h with m fitted alone when the points do not determine h_m; before version 3, and
    in that fallback, m is fitted as one constant through every point (in relative error, like
    every fit), as it always was. A profile without mixed points (version 1) gets the larger of
    the two constants, the one-forward assumption, and the prefill's h (docs/cost_model.md).
    With `buckets` (a padded engine) the tokens are padded rows and the longest decode's walk is
    fitted too (below)."""
    # The decode's batch and context slopes; not its longest-request term: in an eager mixed
    # step the prompt chunk, not one long decode, sets its length (host-bound or prefill-bound).
    names = decode.feature_names[1:3] + PREFILL_FEATURES
    slopes = decode.coefficients[1:3] + prefill.device_coefficients[1:]
    bounds = {"host_s": prefill.host_s, "per_sequence_s": prefill.per_sequence_s}
    one_forward = max(decode.coefficients[0], prefill.device_coefficients[0])
    if not rows:
        return MixedFit(("constant",) + names, (one_forward,) + slopes,
                        relative_rms_error=float("nan"), num_points=0,
                        floor_s=max(decode.floor_s, prefill.floor_s), **bounds)
    features = np.array([[row["batch"], row["context_tokens"],
                          padded_tokens(row["requests"] * row["new_tokens"], row["batch"], buckets)
                          if buckets else row["requests"] * row["new_tokens"],
                          prefill_pairs(row)]
                         for row in rows], dtype=float)
    # A padded step's decode rows are one-token sequences of the prefill launch, each walked by
    # one program per KV head (no split-K): the longest one is a serial walk the chunk's tiles
    # may not hide (Full KV, one decode of 8k entries beside a 128-token chunk: 15.1 against
    # 8.1 ms at 513 entries, Qwen3-8B on an H200). Fitted as one more device term.
    longest = np.array([row.get("max_context") or row["context_tokens"] / row["batch"]
                        for row in rows], dtype=float)
    # Only where the points vary it: otherwise the constant already holds it.
    extra = ("longest_decode",) if buckets and np.ptp(longest) > 0 else ()
    time = np.array([row["time_s"] for row in rows], dtype=float)
    chunks = np.array([row["requests"] for row in rows], dtype=float)
    if version >= 3 and len(rows) >= OWN_SLOPE_POINTS and np.ptp(features[:, 2]) > 0:
        return _own_slopes(names + extra, features, longest if extra else None, time, chunks,
                           prefill)
    slope_part = features @ np.asarray(slopes)  # v: what the pure fits' slopes charge
    offsets = slope_part
    if prefill.per_sequence_s:
        offsets = offsets + prefill.per_sequence_s * chunks
    if version >= 3 and len(rows) >= MIXED_UNKNOWNS + 1:
        # Known: v inside the max, s * chunks outside it; fitted: h_m and m. A point's device
        # time grows with v, so the regimes split the points by v.
        inner = np.column_stack([np.ones(len(rows))] + ([longest] if extra else []))
        fit = fit_host_or_device(time, inner=inner,
                                 outer=np.empty((len(rows), 0)), sizes=slope_part,
                                 inner_offset=slope_part,
                                 outer_offset=prefill.per_sequence_s * chunks)
        host_points = int((~fit.device).sum())
        if host_points >= MIN_REGIME_POINTS:
            constant = fit.inner[0]
            if len(rows) - host_points < MIN_REGIME_POINTS:
                # (Nearly) every point is host-bound: they bound m from above only. Take the
                # one-forward assumption, as without mixed points.
                constant = one_forward
            # The fitted host bound is the floor: the device line may fall below it (the
            # decode's slopes are not constrained), never the step.
            mixed = MixedFit(("constant",) + names + extra,
                             (constant,) + slopes + tuple(fit.inner[1:]), 0.0, len(rows),
                             fit.host_s, host_s=fit.host_s,
                             per_sequence_s=prefill.per_sequence_s, host_fitted=True)
            return replace(mixed, relative_rms_error=_mixed_error(mixed, features, chunks,
                                                                  time, longest))
    constant = fit_linear(source, "mixed", extra, [[value] for value in longest] if extra
                          else [[] for _ in rows], time.tolist(), offsets=offsets)
    mixed = MixedFit(("constant",) + names + extra,
                     constant.coefficients[:1] + slopes + constant.coefficients[1:],
                     constant.relative_rms_error, constant.num_points, constant.floor_s,
                     **bounds)
    if version < 3:
        return mixed
    # Points that leave h_m open are device-bound (or too few), so the fastest of them says
    # nothing about a small mixed step, which the prefill's h bounds: the device line is only
    # kept above the fastest decode step measured. The error is the model's as it predicts,
    # with the host bound, which the constant was fitted without.
    mixed = replace(mixed, floor_s=decode.floor_s)
    return replace(mixed, relative_rms_error=_mixed_error(mixed, features, chunks, time, longest))


def _own_slopes(names: tuple[str, ...], features: np.ndarray, longest: np.ndarray | None,
                time: np.ndarray, chunks: np.ndarray, prefill: PrefillFit) -> MixedFit:
    """s * chunks + max(h_m, m + b B + c C + t T + p A [+ l longest]), h_m and every coefficient
    fitted (non-negative, relative error; s too where the points hold MIN_PROMPT_COUNTS
    different chunk counts, else the prefill's). Points that leave h_m open (fewer than
    MIN_REGIME_POINTS host-bound) take the prefill's h, as the shared-slope fit does."""
    columns = [np.ones(len(time)), features] + ([longest] if longest is not None else [])
    own = len(np.unique(chunks)) >= MIN_PROMPT_COUNTS
    fit = fit_host_or_device(time, inner=np.column_stack(columns),
                             outer=chunks[:, None] if own else np.empty((len(time), 0)),
                             sizes=features[:, 2],
                             outer_offset=None if own else prefill.per_sequence_s * chunks)
    per_sequence_s = fit.outer[0] if own else prefill.per_sequence_s
    fitted = int((~fit.device).sum()) >= MIN_REGIME_POINTS
    host = fit.host_s if fitted else prefill.host_s
    mixed = MixedFit(("constant",) + names, tuple(fit.inner), 0.0, len(time),
                     fit.host_s if fitted else float(time.min()), host_s=host,
                     per_sequence_s=per_sequence_s, host_fitted=fitted)
    walks = longest if longest is not None else np.zeros(len(time))
    return replace(mixed, relative_rms_error=_mixed_error(mixed, features, chunks, time, walks))


def _mixed_error(fit: MixedFit, features: np.ndarray, chunks: np.ndarray,
                 time: np.ndarray, longest: np.ndarray) -> float:
    predicted = np.array([fit.step_time(*point, count, length)
                          for point, count, length in zip(features, chunks, longest)])
    return float(np.sqrt(np.mean((predicted / time - 1.0) ** 2)))
