"""A profile re-scaled to another machine of its kind from a few anchor steps: the fit behind
`zipage calibrate --quick` (docs/cost_model.md, 'Quick correction').

A profile prices steps as they ran on the machine it was measured on. Another machine of the same
GPU model runs the same engine 5-15 % faster or slower, and not uniformly: its host may be faster
(Python work, kernel launches, sampling: every step's floor), its SM clocks higher (compute-bound
prefill), its HBM the same. So each step's time is split into three groups by the roofline of the
profile's GPU (`step_shares`):

- memory: the bytes the step streams (weights, KV entries) at the GPU's achievable bandwidth;
- compute: its FLOPs at the achievable throughput (the cube-norm of the analytic model decides
  which of the two a step's device time is);
- host: everything else the measured time holds: host work, launches, kernel latencies.

An anchor is a group of engine steps of one shape measured on this machine, with the profile's
prediction for each: its ratio r (median of measured / predicted) and the predicted time's group
shares. A correction is a scale per group, fitted by least squares to r = sum of share x scale
over the anchors, for the fewest groups the anchors need (`fit_correction`): one scale for all,
then host and device, then host, memory and compute, each taken only where the anchors can tell
its groups apart (their shares are not collinear) and it halves the residual of the smaller one.
The correction is refused (`Correction.refusal`) where no such scaling explains the anchors: a
scale outside [1 / MAX_SCALE, MAX_SCALE] (not a machine of the profile's kind), or an anchor the
scaled profile still misses by more than the limit (the profile's shape does not fit this
machine). One anchor may be left out (`Correction.left_out`): the one whose ratio is farthest
from the others', where the rest make a correction that stands and it is missed by more than the
limit under it (whether or not every anchor together made one). One step shape the profile
misprices is its shape's error, which it makes on its own machine too, not this machine's speed,
and must not pull every scale (a lone 64-token prefill priced at the profile's prefill floor
asked for a host scale of 0.47 on the very host the profile was measured on: docs/BENCHMARKS.md,
'Quick correction across H200s').
`apply_correction` re-scales every measured point of the profile by its own shares,
so the refitted model moves each term by its group's scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zipage.errors import ConfigError
from zipage.hardware import get_hardware
from zipage.profile import CORRECTION, COST_KNOBS, PROFILE_SECTIONS
from zipage.shape import ModelShape
from zipage.sim.analytic import (
    KERNEL_LATENCY_S,
    KERNELS_PER_LAYER,
    PER_SEQUENCE_OVERHEAD_S,
    ROOFLINE_SHARPNESS,
    AnalyticCostModel,
)
from zipage.sim.cost_model import StepWork

GROUPS = ("host", "memory", "compute")
# The nested models a correction chooses from, fewest scales first: each a partition of GROUPS.
MODELS = {
    "uniform": (GROUPS,),
    "host-device": (("host",), ("memory", "compute")),
    "host-memory-compute": (("host",), ("memory",), ("compute",)),
}
# A larger model replaces a smaller one only if the smaller one misses some anchor by more than
# this (below it, the anchors agree with one scale within the engine's own step-to-step spread of
# medians) and the larger one at least halves its RMS residual (a scale more must earn its place:
# with a few anchors, a spare parameter fits noise).
NOISE_FLOOR = 0.02
SPLIT_GAIN = 0.5
# The anchors tell groups apart only if their shares are far from collinear: the condition number
# of the share matrix at most this (a group no anchor gives a quarter of its time to has a near-zero
# column, and the number explodes: a CPU engine priced by a GPU's roofline is all host).
MAX_CONDITION = 10.0
# Machines of one kind differ by 5-15 % (docs/BENCHMARKS.md): a scale beyond 2x is another kind
# of machine, or another setup, which a scale does not correct.
MAX_SCALE = 2.0
# After scaling, no anchor may be missed by more than this. The shipped profiles' fits miss single
# steps by 5-7 % RMS, and a shape the fit has few points of by up to 10-15 % on their own machine
# (docs/BENCHMARKS.md, 'Twin fidelity': Full KV decode at ~1,400 entries a request, +9.3 % TPOT);
# an anchor is a median over tens of steps, so beyond this the profile's shape, not its speed,
# is what this machine disagrees with.
MAX_RESIDUAL = 0.15
# A correction needs at least this many anchors: with fewer, one scale fits them whatever they say.
MIN_ANCHORS = 3


@dataclass(frozen=True)
class Anchor:
    """Steps of one shape, measured here and predicted by the profile."""

    name: str  # e.g. "decode b16 ctx 300"
    kind: str  # decode, prefill, mixed, launch
    points: int  # how many steps
    measured_s: float  # their median time here
    predicted_s: float  # the profile's median prediction for them
    ratio: float  # median over the steps of measured / predicted
    shares: tuple[float, float, float]  # of the prediction: host, memory, compute

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "points": self.points,
                "measured_s": round(self.measured_s, 9), "predicted_s": round(self.predicted_s, 9),
                "ratio": round(self.ratio, 5),
                "shares": dict(zip(GROUPS, (round(share, 4) for share in self.shares)))}


@dataclass(frozen=True)
class Correction:
    """The scales of a correction, how well they explain the anchors, and the refusal (None: the
    correction stands)."""

    model: str  # a key of MODELS
    scales: dict[str, float]  # per group of GROUPS
    anchors: list[Anchor]
    residuals: list[float]  # per anchor: ratio / fitted ratio - 1
    refusal: str | None = None
    considered: dict[str, float | None] = field(default_factory=dict)  # model: RMS (None: not
    # identifiable on these anchors)
    left_out: tuple[tuple[Anchor, float], ...] = ()  # an anchor the fit left out, and what the
    # scaled profile still misses it by (module docstring)

    @property
    def worst(self) -> float:
        return max((abs(value) for value in self.residuals), default=0.0)

    def record(self) -> dict[str, Any]:
        """The profile's `correction` field (the caller adds source, machine and timing)."""
        return {"method": "quick", "model": self.model,
                "scales": {name: round(value, 5) for name, value in self.scales.items()},
                "worst_residual": round(self.worst, 5),
                "considered": {name: None if rms is None else round(rms, 5)
                               for name, rms in self.considered.items()},
                "anchors": [dict(anchor.record(), residual=round(residual, 5))
                            for anchor, residual in zip(self.anchors, self.residuals)],
                "left_out": [dict(anchor.record(), residual=round(residual, 5))
                             for anchor, residual in self.left_out]}


def roofline_model(header: dict[str, Any], shape: ModelShape) -> AnalyticCostModel | None:
    """The analytic model of the profile's GPU and knobs, whose roofline splits a step's time
    (None: the profile's knobs are none the analytic model takes; every step is then host)."""
    from zipage.dtypes import DTYPE_BYTES

    knobs = {name: header[name] for name in COST_KNOBS if name in header}
    try:
        return AnalyticCostModel(shape, get_hardware(header["gpu"]),
                                 dtype_bytes=DTYPE_BYTES[header.get("dtype", "bfloat16")],
                                 tensor_parallel=header.get("tensor_parallel", 1), **knobs)
    except (ConfigError, TypeError):
        return None


def device_seconds(model: AnalyticCostModel, work: StepWork) -> tuple[float, float]:
    """(memory, compute) seconds of a forward on the model's GPU: the analytic forward without
    its host and latency terms (the kernel chain, the step overhead, the per-sequence work),
    split between bandwidth and FLOPs as the roofline's cube-norm weighs them."""
    host = (model.shape.num_layers * KERNELS_PER_LAYER * KERNEL_LATENCY_S
            + model.gpu.step_overhead_s
            + (work.num_decode + work.num_prefill) * PER_SEQUENCE_OVERHEAD_S)
    device = max(0.0, model.forward_time_for(work) - host)
    kv_tokens = work.decode_context_tokens + work.cached_tokens + 2 * work.prefill_tokens
    memory = (model.weight_bytes + kv_tokens * model.kv_bytes_per_token) \
        / model.gpu.achievable_bandwidth
    rows = work.num_decode + work.prefill_tokens
    flops = (2 * model.weight_bytes / model.dtype_bytes * rows
             + 4 * model.shape.num_layers * model.q_heads * model.shape.head_dim
             * (work.attention_pairs + work.decode_context_tokens))
    compute = flops / model.gpu.achievable_flops
    power = ROOFLINE_SHARPNESS
    weight = memory ** power / (memory ** power + compute ** power) if memory or compute else 1.0
    return device * weight, device * (1.0 - weight)


def step_shares(model: AnalyticCostModel | None, work: StepWork | None,
                seconds: float) -> tuple[float, float, float]:
    """Host, memory and compute shares of a step of `seconds` (the device part capped at the
    whole); a step without a roofline (no model, or a compression batch: `work` None) is host."""
    if model is None or work is None or not seconds > 0:
        return 1.0, 0.0, 0.0
    memory, compute = device_seconds(model, work)
    device = memory + compute
    if device > seconds:
        memory, compute = memory * seconds / device, compute * seconds / device
    return 1.0 - (memory + compute) / seconds, memory / seconds, compute / seconds


def fit_correction(anchors: list[Anchor], *, max_residual: float = MAX_RESIDUAL,
                   max_scale: float = MAX_SCALE) -> Correction:
    """The fewest-scales correction that explains the anchors, with at most one anchor left out
    (module docstring), or a refusal."""
    if len(anchors) < MIN_ANCHORS:
        return Correction("uniform", dict.fromkeys(GROUPS, 1.0), anchors,
                          [0.0] * len(anchors),
                          f"only {len(anchors)} anchor(s) measured, {MIN_ANCHORS} needed: the "
                          "engine could not run the anchor steps this setup asks for")
    correction = _fit_all(anchors, max_residual, max_scale)
    if len(anchors) <= MIN_ANCHORS:
        return correction
    center = float(np.median([math.log(anchor.ratio) for anchor in anchors]))
    index = max(range(len(anchors)), key=lambda i: abs(math.log(anchors[i].ratio) - center))
    rest = _fit_all(anchors[:index] + anchors[index + 1:], max_residual, max_scale)
    outlier = anchors[index]
    missed = outlier.ratio / sum(share * rest.scales[group]
                                 for share, group in zip(outlier.shares, GROUPS)) - 1.0
    if rest.refusal is not None or abs(missed) <= max_residual:
        return correction  # not one shape's error: the fit (or refusal) of every anchor stands
    return Correction(rest.model, rest.scales, rest.anchors, rest.residuals,
                      considered=rest.considered, left_out=((outlier, missed),))


def _fit_all(anchors: list[Anchor], max_residual: float, max_scale: float) -> Correction:
    """The fewest-scales correction of every anchor given, judged."""
    ratios = np.array([anchor.ratio for anchor in anchors], dtype=float)
    shares = np.array([anchor.shares for anchor in anchors], dtype=float)
    chosen, considered = None, {}
    for name, partition in MODELS.items():
        fitted = _fit(shares, ratios, partition)
        considered[name] = None if fitted is None else fitted[2]
        if fitted is None:
            continue
        # The first model always fits (one column); a later one replaces it as above.
        if chosen is None or (_worst(chosen[2]) > NOISE_FLOOR
                              and fitted[2] <= SPLIT_GAIN * chosen[3]):
            chosen = (name, *fitted)
    name, scales, residuals, _ = chosen
    correction = Correction(name, scales, anchors, [float(value) for value in residuals],
                            considered=considered)
    return _judge(correction, max_residual, max_scale)


def _fit(shares: np.ndarray, ratios: np.ndarray, partition: tuple[tuple[str, ...], ...]):
    """(scales per group, residuals, RMS residual) of one model, or None where the anchors cannot
    tell its groups apart."""
    columns = np.column_stack([shares[:, [GROUPS.index(group) for group in part]].sum(axis=1)
                               for part in partition])
    if columns.shape[1] >= len(ratios) or np.linalg.cond(columns) > MAX_CONDITION:
        return None
    solution, *_ = np.linalg.lstsq(columns, ratios, rcond=None)
    fitted = columns @ solution
    if not np.all(fitted > 0):
        return None
    residuals = ratios / fitted - 1.0
    scales = {group: float(value) for part, value in zip(partition, solution) for group in part}
    return scales, residuals, float(np.sqrt(np.mean(residuals ** 2)))


def _worst(residuals: np.ndarray) -> float:
    return float(np.max(np.abs(residuals)))


def _judge(correction: Correction, max_residual: float, max_scale: float) -> Correction:
    """The correction, with its refusal where no scaling of this kind explains the anchors."""
    scales = correction.scales
    outside = {group: value for group, value in scales.items()
               if not 1.0 / max_scale <= value <= max_scale}
    if outside:
        group, value = next(iter(outside.items()))
        return _refused(correction, f"the anchors ask for a {group} scale of {value:.2f} (beyond "
                                    f"{1 / max_scale:.2f}-{max_scale:.2f}): not a machine of the "
                                    "profile's kind, or not its setup")
    if correction.worst > max_residual:
        index = int(np.argmax(np.abs(correction.residuals)))
        anchor = correction.anchors[index]
        return _refused(correction, f"anchor '{anchor.name}' is {correction.residuals[index]:+.1%} "
                                    f"off after scaling (limit {max_residual:.0%}; "
                                    f"{correction.model} scales "
                                    + ", ".join(f"{group} {value:.3f}" for group, value
                                                in scales.items())
                                    + "): this machine differs from the profile's in more than "
                                      "its speed")
    return correction


def _refused(correction: Correction, why: str) -> Correction:
    return Correction(correction.model, correction.scales, correction.anchors,
                      correction.residuals, why, correction.considered, correction.left_out)


def apply_correction(profile: dict, correction: Correction, model: AnalyticCostModel | None,
                     record: dict[str, Any]) -> dict:
    """A copy of `profile` whose every measured point is re-scaled by its own shares (a uniform
    correction scales each by the one factor), with `record` as its `correction` field."""
    if correction.refusal is not None:
        raise ValueError(f"a refused correction is not applied: {correction.refusal}")
    scales = np.array([correction.scales[group] for group in GROUPS])
    uniform = bool(np.allclose(scales, scales[0], rtol=0.0, atol=1e-12))
    out = {key: value for key, value in profile.items() if key not in PROFILE_SECTIONS}
    for section in PROFILE_SECTIONS:
        if section not in profile:
            continue
        rows = []
        for row in profile[section]:
            if uniform:
                factor = float(scales[0])
            else:
                shares = step_shares(model, point_work(section, row), row["time_s"])
                factor = float(np.dot(shares, scales))
            rows.append({**row, "time_s": row["time_s"] * factor})
        out[section] = rows
    # Keep the sections where they were (a profile's order is its diff's order).
    ordered = {key: out[key] for key in profile if key in out}
    ordered[CORRECTION] = record
    return ordered


def point_work(section: str, row: dict[str, Any]) -> StepWork | None:
    """The forward a profile point measured (None: a compression batch, no forward)."""
    if section == "compress":
        return None
    decodes = section != "prefill"
    prompts = section in ("prefill", "mixed")
    requests = int(row.get("requests", 1)) if prompts else 0
    new_tokens = row.get("new_tokens", 0)
    cached = row.get("cached_tokens", 0) or 0
    pairs = row.get("attention_pairs")
    if prompts and pairs is None:
        # Causal pairs of `requests` prompts of `new_tokens` after `cached` entries each.
        pairs = requests * (new_tokens * cached + new_tokens * (new_tokens + 1) / 2)
    return StepWork(num_decode=int(row["batch"]) if decodes else 0,
                    decode_context_tokens=int(row["context_tokens"]) if decodes else 0,
                    num_prefill=requests, num_sampled_prefill=requests,
                    prefill_tokens=round(requests * new_tokens) if prompts else 0,
                    cached_tokens=round(requests * cached) if prompts else 0,
                    attention_pairs=int(pairs or 0) if prompts else 0,
                    decode_max_context=int(row.get("max_context") or 0) if decodes else 0,
                    shared_kv_tokens=int(row.get("shared_tokens", 0)) if decodes else 0)


def scale_text(scales: dict[str, float]) -> str:
    """"host 0.912, memory 1.003, compute 1.003" (one number when uniform)."""
    values = list(scales.values())
    if all(math.isclose(value, values[0], rel_tol=0.0, abs_tol=1e-12) for value in values):
        return f"all {values[0]:.3f}"
    return ", ".join(f"{group} {value:.3f}" for group, value in scales.items())
