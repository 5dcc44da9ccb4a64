"""How far to trust a simulated figure, as the commands print it: beside each figure the validated
error band of the profile that priced it (`zipage replay`'s summary, `zipage plan`'s report), under
the figures the workload it was validated on and the model its calibration recommends; or, once,
that the figures carry no validated band and how to get one."""

from __future__ import annotations

from zipage.profile import ANALYTIC_MODEL, VALIDATION_METRICS
from zipage.sim.cost_model import ANALYTIC
from zipage.sim.slo import format_band

# A summary key with a validated metric -> that metric ("tps" -> "throughput").
BANDED_KEYS = {key: metric for metric, key in VALIDATION_METRICS.items() if key is not None}
# Rows the summary table adds under a validated profile, after the row named: the medians its
# validation measured, which the table otherwise gives only as means (a mean has no band).
VALIDATED_ROWS = {"mean_ttft_s": ("p50 TTFT (s)", "ttft_p50_s", "{:,.3f}"),
                  "mean_tpot_ms": ("p50 TPOT (ms)", "tpot_p50_ms", "{:.2f}")}


def band_of(validation: dict | None, key: str) -> float | None:
    """The validated band of a summary figure (None: no validation, no validated metric for
    the key, or the metric undefined on the validation workload)."""
    if validation is None or key not in BANDED_KEYS:
        return None
    return validation["bands"].get(BANDED_KEYS[key])


def band_note(validation: dict, key: str) -> str | None:
    """What the summary table prints beside a figure: '(±2.2 % on validation)', or None where
    the figure has no validated metric (a mean, a count)."""
    if key not in BANDED_KEYS:
        return None
    band = band_of(validation, key)
    return "(not validated)" if band is None else f"({format_band(band)} on validation)"


def summary_rows(rows: list[tuple[str, str, str]], summary: dict) -> list[tuple[str, str, str]]:
    """The summary table's rows, with VALIDATED_ROWS where the run was priced by a validated
    profile."""
    if not summary.get("validation"):
        return rows
    shown = []
    for row in rows:
        shown.append(row)
        if row[1] in VALIDATED_ROWS:
            shown.append(VALIDATED_ROWS[row[1]])
    return shown


def validation_lines(summary: dict) -> list[str]:
    """The lines under a simulated run's summary table (none for an engine run, whose summary has
    no `validation` key): where its bands come from, or that there are none."""
    if "validation" not in summary:
        return []
    validation = summary["validation"]
    if validation is None:
        return ["  " + no_band_line(summary["settings"]["cost_model"])]
    return ["  " + line for line in validated_lines(validation)]


def validated_lines(validation: dict) -> list[str]:
    """The source of the bands, the model calibrate recommends, and its warnings."""
    mape = validation["errors"].get("e2e_mape")
    recommended = ("the analytic model" if validation["recommended"] == ANALYTIC_MODEL
                   else "this profile")
    lines = [f"bands: the profile's errors on {validation['workload']} "
             f"({validation['requests']:,} requests, unseen by its fit"
             + (f"; per-request e2e latency {100 * mape:.1f} % off on average" if mape is not None
                else "") + f"); calibrate recommends {recommended}"]
    if validation["recommended"] == ANALYTIC_MODEL:
        lines.append("warning: the profile's own validation found the analytic model closer to "
                     "the engine; consider --cost-model analytic")
    lines += [f"validation warning: {warning}" for warning in validation["warnings"]]
    return lines


def no_band_line(cost_model: str) -> str:
    """One plain line: the figures carry no validated error band, and how to get one."""
    source = ("analytic cost model" if cost_model == ANALYTIC
              else f"profile {cost_model} has no validation record")
    return (f"no validated error band ({source}); `zipage calibrate --gpu` measures a profile "
            "and its error on held-out traffic")
