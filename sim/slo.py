"""Latency SLOs and their verdicts: does a simulated deployment meet them, and how sure is that?

A figure the simulator predicts is only as good as its cost model. A validated profile says how
far its figures were off on a held-out workload (`zipage.profile.Validation`: the band b of a
metric, the size of its relative error (simulated - engine) / engine there). Assuming this
traffic's error is no larger, the engine's value x of a predicted x_sim lies within
x_sim / (1 + b) .. x_sim / (1 - b), so against a target T ("x must not exceed T") a verdict is:

    meets      x_sim <= T * (1 - b)          (even x_sim / (1 - b) is within T)
    misses     x_sim >  T * (1 + b)          (even x_sim / (1 + b) is beyond T)
    uncertain  T * (1 - b) < x_sim <= T * (1 + b)

With no band (the analytic model, an unvalidated profile, a metric the validation left
undefined) b is 0: meets when x_sim <= T, misses otherwise, never uncertain. The band is
symmetric on purpose: the sign of an error on one workload did not carry over to others
(docs/cost_model.md). docs/planning.md states the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

MEETS, UNCERTAIN, MISSES = "meets", "uncertain", "misses"


def verdict(predicted: float, target: float, band: float | None) -> str:
    """MEETS, UNCERTAIN or MISSES: the rule of the module docstring."""
    band = band or 0.0
    if predicted <= target * (1.0 - band):
        return MEETS
    if predicted > target * (1.0 + band):
        return MISSES
    return UNCERTAIN


def format_band(band: float) -> str:
    """A band as printed beside a figure: 0.021 -> '±2.1 %'."""
    return f"±{100 * band:.1f} %"


@dataclass(frozen=True)
class Verdict:
    """One SLO target judged against one prediction."""

    name: str  # "TTFT p90"
    predicted: float
    target: float
    unit: str  # "s" or "ms"
    band: float | None  # the validated band of the metric (None: none)
    verdict: str

    def describe(self) -> str:
        """'TTFT p99 1.86 s > 1 s' (missed, no band: as before bands existed), 'TTFT p99 1.86 s
        > 1 s beyond its ±11.0 % band', 'TTFT p99 1.05 s within the ±11.0 % band of 1 s'
        (uncertain)."""
        figure = f"{self.name} {self.predicted:.3g} {self.unit}"
        if self.verdict == UNCERTAIN:
            return f"{figure} within the {format_band(self.band)} band of {self.target:g} {self.unit}"
        relation = "<=" if self.verdict == MEETS else ">"
        text = f"{figure} {relation} {self.target:g} {self.unit}"
        if not self.band:
            return text
        if self.verdict == MEETS:
            return f"{text} even off by its {format_band(self.band)} band"
        return f"{text} beyond its {format_band(self.band)} band"


@dataclass(frozen=True)
class Target:
    """One kind of SLO target: what it bounds and how it is named."""

    name: str  # "TTFT p90", as verdicts and reports print it
    key: str  # the `SLO` field and the summary key it bounds
    metric: str  # the validation metric whose band applies ("ttft_p90")
    unit: str  # "s" or "ms"
    flag: str  # `zipage plan`'s flag

    def bad_value(self, value) -> str:
        """The one-line refusal of a target that is not a number > 0."""
        unit = "seconds" if self.unit == "s" else "milliseconds"
        return f"{self.flag}: got {value!r}, expected a number of {unit} > 0"


# In the order verdicts and reports list them. A follow-up turn's TTFT (a session's turn after
# its first, timed from when it came due) takes the band of TTFT over all turns: validation
# measures no follow-up-only error, and a follow-up's TTFT is made of the same queueing and
# prefill as any turn's.
TARGETS = (
    Target("TTFT p90", "ttft_p90_s", "ttft_p90", "s", "--slo-ttft-p90"),
    Target("TTFT p99", "ttft_p99_s", "ttft_p99", "s", "--slo-ttft-p99"),
    Target("follow-up TTFT p90", "followup_ttft_p90_s", "ttft_p90", "s",
           "--slo-followup-ttft-p90"),
    Target("TPOT p99", "tpot_p99_ms", "tpot_p99", "ms", "--slo-tpot-p99"),
)
FOLLOWUP_TTFT_P90 = TARGETS[2]


@dataclass(frozen=True)
class SLO:
    """Latency targets; None means no target. TTFT in seconds, TPOT in milliseconds. A
    follow-up target bounds the TTFT of sessions' follow-up turns only (`followup_ttft_p90_s`,
    sim/cluster.py): a trace without follow-ups has none to bound."""

    ttft_p90_s: float | None = None
    tpot_p99_ms: float | None = None
    ttft_p99_s: float | None = None
    followup_ttft_p90_s: float | None = None

    @property
    def active(self) -> bool:
        return any(getattr(self, target.key) is not None for target in TARGETS)

    def set_targets(self) -> list[tuple[Target, float]]:
        """The targets set, with their values, in `TARGETS` order."""
        return [(target, getattr(self, target.key)) for target in TARGETS
                if getattr(self, target.key) is not None]

    def describe(self) -> str:
        """'TTFT p90 <= 2 s, TPOT p99 <= 50 ms'."""
        return ", ".join(f"{target.name} <= {value:g} {target.unit}"
                         for target, value in self.set_targets())

    def verdicts(self, metrics: dict, bands: dict[str, float | None] | None = None
                 ) -> list[Verdict]:
        """Each target's verdict on `metrics` (a summary's keys), with `bands` the validated
        bands by validation metric ("ttft_p90", ...; `Validation.bands()`), None: no band."""
        bands = bands or {}
        found = []
        for target, value in self.set_targets():
            band = bands.get(target.metric)
            predicted = metrics[target.key]
            found.append(Verdict(target.name, predicted, value, target.unit, band,
                                 verdict(predicted, value, band)))
        return found

    def violations(self, metrics: dict, bands: dict[str, float | None] | None = None
                   ) -> list[str]:
        """The targets `metrics` surely miss, described."""
        return [item.describe() for item in self.verdicts(metrics, bands)
                if item.verdict == MISSES]

    def meets(self, metrics: dict, bands: dict[str, float | None] | None = None) -> bool:
        """Whether `metrics` surely meet every target."""
        return all(item.verdict == MEETS for item in self.verdicts(metrics, bands))
