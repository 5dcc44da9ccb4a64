"""`zipage compare RUN_A RUN_B`: how closely a simulated run reproduces a real one.

Both directories hold runs of one trace with the same flags, typically the simulator twin and the
real engine, but any two runs compare; the report names each by its driver (simulator,
engine-cuda, ...), or A and B when both have the same. In the results the first run sits under
"sim" and the second under "real". `compare_runs` measures (a) scheduling agreement: `decisions.log` line by line, which
must be identical with synchronous compression since both drivers run the same core; (b) the cost
model's accuracy: relative error of every step's duration, overall and per step kind, and of the
total time; (c) per-request errors of TTFT, TPOT and finish time; (d) the summaries side by side;
(e) run-level errors: of the summaries' percentiles, and the Kolmogorov-Smirnov distance of each
run's TTFT and TPOT distribution (`ks_distance`: the shape, not three points of it); (f) where
each run's time went: steps and seconds per step kind (compressing steps apart) and the host gaps
between steps, which attribute a makespan error to its parts even when the two runs' steps differ
(step-by-step matching in (b) compares different steps once decisions drift).
Errors are always sim against real: (sim - real) / real, so a positive bias means the simulator
is slow. `format_report` turns the result into the text the CLI prints.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from zipage.errors import ZipageError
from zipage.rundir import ENGINE, SERVED, decisions_absent_reason, load_run, read_decisions, run_kind  # noqa: F401 - read_decisions: callers import it from here
from zipage.sim.profile_from_runs import unsynced_chunk_steps

SUMMARY_KEYS = ("tps", "makespan_s", "mean_tpot_ms", "steps", "preemptions", "compressions",
                "prefix_hit_tokens", "first_hit_tokens")
# Capacity the run was planned with: when these differ, the schedules cannot agree.
CAPACITY_KEYS = ("n_max", "max_concurrency", "num_blocks")
FINISHED = "finished"
_STEP_ID = re.compile(r"step (\d+)\b")
# The first difference of two decision lines is shown this many characters either side of the
# first character that differs: a line of a big step lists hundreds of requests.
DIFFERENCE_CONTEXT = 60


def run_labels(sim_summary: dict, real_summary: dict) -> tuple[str, str]:
    """Names of the two runs in the report: their drivers, or A and B when those agree."""
    first, second = sim_summary.get("driver"), real_summary.get("driver")
    if first and second and first != second:
        return first, second
    return "A", "B"


def excerpt(line: str | None, other: str | None, context: int = DIFFERENCE_CONTEXT) -> str:
    """`line` cut to the neighbourhood of its first difference from `other`."""
    if line is None:
        return "<end of log>"
    if other is None:
        start = 0
    else:
        start = next((i for i, (a, b) in enumerate(zip(line, other)) if a != b),
                     min(len(line), len(other)))
    first, last = max(0, start - context), min(len(line), start + context)
    return ("..." if first else "") + line[first:last] + ("..." if last < len(line) else "")


def compare_decisions(sim_lines: list[str], real_lines: list[str]) -> dict:
    """Line-by-line agreement of two decision logs; nothing is ignored."""
    identical_lines = sum(sim == real for sim, real in zip(sim_lines, real_lines))
    result = {
        "identical": sim_lines == real_lines,
        "lines": {"sim": len(sim_lines), "real": len(real_lines)},
        "identical_lines": identical_lines,
        # Over the longer log, so a log that stops early does not look like full agreement.
        "identical_fraction": identical_lines / max(len(sim_lines), len(real_lines), 1),
        "first_difference": None,
    }
    for index in range(max(len(sim_lines), len(real_lines))):
        sim = sim_lines[index] if index < len(sim_lines) else None
        real = real_lines[index] if index < len(real_lines) else None
        if sim != real:
            match = _STEP_ID.match(sim if sim is not None else real)
            result["first_difference"] = {"line": index + 1,
                                          "step": int(match.group(1)) if match else None,
                                          "sim": sim, "real": real}
            break
    return result


def error_stats(sim: pd.Series, real: pd.Series) -> dict:
    """Errors of `sim` against `real`, matched by position.

    `median`, `p90` and `mape` are of the absolute relative error |sim - real| / real (fractions);
    `bias` is the median signed relative error; `median_abs` the median absolute error in the
    metric's own unit. Rows where the real value is missing or not positive have no relative error:
    they count in `excluded`.
    """
    sim_values = sim.to_numpy(dtype=float)
    real_values = real.to_numpy(dtype=float)
    valid = np.isfinite(sim_values) & np.isfinite(real_values) & (real_values > 0)
    relative = (sim_values[valid] - real_values[valid]) / real_values[valid]
    if relative.size == 0:
        return {"count": 0, "excluded": int((~valid).sum()), "median": None, "p90": None,
                "mape": None, "bias": None, "median_abs": None}
    absolute_relative = np.abs(relative)
    return {
        "count": int(relative.size),
        "excluded": int((~valid).sum()),
        "median": float(np.median(absolute_relative)),
        "p90": float(np.quantile(absolute_relative, 0.9)),
        "mape": float(absolute_relative.mean()),
        "bias": float(np.median(relative)),
        "median_abs": float(np.median(np.abs(sim_values[valid] - real_values[valid]))),
    }


def _relative_error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or not real:
        return None
    return (sim - real) / real


# The kind under which `compare_step_times` reports an engine run's unsynced chunk steps.
UNSYNCED = "chunks+next"


def compare_step_times(sim_steps: pd.DataFrame, real_steps: pd.DataFrame, chunked: bool = False) -> dict:
    """Step durations joined on step_id, grouped by the real run's step kind. `chunked`: the
    real run chunked its prompts, so its prompt chunks that sample nothing recorded their launch
    only and the step after each carries their forward (`unsynced_chunk_steps`): each stretch of
    such steps is compared as one, summed on both sides, under UNSYNCED, and left out of its kind."""
    joined = (sim_steps.merge(real_steps, on="step_id", suffixes=("_sim", "_real"))
              .sort_values("step_id", ignore_index=True))
    sim_duration = joined["t_end_sim"] - joined["t_start_sim"]
    real_duration = joined["t_end_real"] - joined["t_start_real"]
    unsynced = (unsynced_chunk_steps(joined["kind_real"], real_duration, joined.get("n_sampled_real"))
                if chunked else pd.Series(False, index=joined.index))
    own = ~unsynced
    by_kind = {
        str(kind): error_stats(sim_duration[own & (joined["kind_real"] == kind)],
                               real_duration[own & (joined["kind_real"] == kind)])
        for kind in sorted(joined.loc[own, "kind_real"].unique())
    }
    # Each stretch of flagged steps: one unit, its durations summed (its first flagged step
    # starts a new unit).
    stretch = (unsynced & ~unsynced.shift(1, fill_value=False)).cumsum()[unsynced]
    sim_units = sim_duration[unsynced].groupby(stretch).sum()
    real_units = real_duration[unsynced].groupby(stretch).sum()
    if len(real_units):
        by_kind[UNSYNCED] = error_stats(sim_units, real_units)
    every_sim = pd.concat([sim_duration[own], sim_units], ignore_index=True)
    every_real = pd.concat([real_duration[own], real_units], ignore_index=True)

    def span(steps: pd.DataFrame) -> float | None:
        return float(steps["t_end"].max() - steps["t_start"].min()) if len(steps) else None

    sim_span, real_span = span(sim_steps), span(real_steps)
    return {
        "matched_steps": len(joined),
        "sim_only_steps": len(sim_steps) - len(joined),
        "real_only_steps": len(real_steps) - len(joined),
        "kind_mismatches": int((joined["kind_sim"] != joined["kind_real"]).sum()),
        "duration": {"all": error_stats(every_sim, every_real), **by_kind},
        "total_time": {"sim": sim_span, "real": real_span,
                       "relative_error": _relative_error(sim_span, real_span)},
    }


NO_TIME = {"steps": 0, "seconds": 0.0, "mean_ms": 0.0}  # a step kind one run never ran


def step_kind_label(kind: str, n_compress: int) -> str:
    """A step's kind, with "+compress" when it runs or launches compressions."""
    return f"{kind}+compress" if n_compress else kind


def time_by_kind(steps: pd.DataFrame) -> dict:
    """Steps, seconds and mean ms per step kind, and the host gaps between steps (the time from a
    step's end to the next step's start), of one run."""
    duration = steps["t_end"] - steps["t_start"]
    labels = [step_kind_label(kind, count) for kind, count in zip(steps["kind"], steps["n_compress"])]
    kinds = {}
    for label, group in duration.groupby(labels):
        kinds[label] = {"steps": int(group.size), "seconds": float(group.sum()),
                        "mean_ms": float(1000 * group.mean())}
    gaps = (steps["t_start"].shift(-1) - steps["t_end"]).dropna()
    kinds["host gaps"] = {"steps": int(gaps.size), "seconds": float(gaps.clip(lower=0).sum()),
                          "mean_ms": float(1000 * gaps.mean()) if gaps.size else 0.0}
    return kinds


def compare_time_by_kind(sim_steps: pd.DataFrame, real_steps: pd.DataFrame) -> dict:
    """Both runs' `time_by_kind` and, per kind, the seconds the first run spends more, as a share
    of the second run's total time: the parts of the makespan error."""
    sim, real = time_by_kind(sim_steps), time_by_kind(real_steps)
    span = float(real_steps["t_end"].max() - real_steps["t_start"].min()) if len(real_steps) else 0
    share = {kind: (sim.get(kind, NO_TIME)["seconds"] - real.get(kind, NO_TIME)["seconds"]) / span
             if span else None for kind in sorted(set(sim) | set(real))}
    return {"sim": sim, "real": real, "share_of_real_time": share}


def request_latencies(requests: pd.DataFrame, suffix: str = "") -> dict[str, pd.Series]:
    """TTFT, TPOT and finish time (from arrival) of each row of `requests`, read from the columns
    named with `suffix` ("_sim" in a joined frame)."""
    arrival = requests[f"arrival{suffix}"]
    first_token = requests[f"first_token{suffix}"]
    finish = requests[f"finish{suffix}"]
    output_len = requests[f"output_len{suffix}"]
    # TPOT is undefined for one-token outputs (docs/architecture.md, 'Traces and metrics'): NaN, hence excluded.
    decode_tokens = (output_len - 1).where(output_len > 1)
    return {"ttft": first_token - arrival, "tpot": (finish - first_token) / decode_tokens,
            "finish": finish - arrival}


def ks_distance(first: np.ndarray, second: np.ndarray) -> float | None:
    """The two-sample Kolmogorov-Smirnov distance of two samples without NaN: the largest gap
    max |F1(x) - F2(x)| between their empirical CDFs, in [0, 1] (0: the same distribution of
    values, 1: every value of one below every value of the other). None when a sample is empty.

    A step function changes only at its sample's values, so the gap is largest at one of the
    pooled values; `searchsorted(side="right")` counts the values <= x of each sorted sample."""
    if len(first) == 0 or len(second) == 0:
        return None
    first, second = np.sort(first), np.sort(second)
    pooled = np.concatenate([first, second])
    cdf_first = np.searchsorted(first, pooled, side="right") / first.size
    cdf_second = np.searchsorted(second, pooled, side="right") / second.size
    return float(np.max(np.abs(cdf_first - cdf_second)))


def compare_distributions(sim_requests: pd.DataFrame, real_requests: pd.DataFrame) -> dict:
    """The KS distance of each run's TTFT and TPOT distribution, over every request it finished
    (not only those finished in both: a request one run never finished still shapes the other's
    distribution), and how many values each side had (a one-token output has no TPOT)."""
    def values(requests: pd.DataFrame) -> dict[str, np.ndarray]:
        latencies = request_latencies(requests[requests["status"] == FINISHED])
        return {metric: latencies[metric].dropna().to_numpy(dtype=float)
                for metric in DISTRIBUTED}

    sim, real = values(sim_requests), values(real_requests)
    return {metric: {"ks": ks_distance(sim[metric], real[metric]),
                     "n": {"sim": len(sim[metric]), "real": len(real[metric])}}
            for metric in DISTRIBUTED}


def compare_request_times(sim_requests: pd.DataFrame, real_requests: pd.DataFrame) -> dict:
    """TTFT, TPOT and finish time (from arrival) of the requests finished in both runs."""
    joined = sim_requests.merge(real_requests, on="id", suffixes=("_sim", "_real"))
    finished = joined[(joined["status_sim"] == FINISHED) & (joined["status_real"] == FINISHED)]
    sim, real = request_latencies(finished, "_sim"), request_latencies(finished, "_real")
    return {
        "matched_requests": len(joined),
        "sim_only_requests": len(sim_requests) - len(joined),
        "real_only_requests": len(real_requests) - len(joined),
        "status_mismatches": int((joined["status_sim"] != joined["status_real"]).sum()),
        "finished_in_both": len(finished),
        **{metric: error_stats(sim[metric], real[metric]) for metric in ("ttft", "tpot", "finish")},
    }


# Run-level latency and throughput errors `zipage compare --max-error METRIC=PCT` can gate on:
# name -> the summary key compared (relative error of A against B), or a per-request statistic.
GATED_SUMMARY_KEYS = {
    "makespan": "makespan_s", "tps": "tps",
    **{f"{metric}_p{p}": f"{metric}_p{p}_{unit}" for metric, unit in (("ttft", "s"), ("tpot", "ms"))
       for p in (50, 90, 99)},
}
# Per-request metrics whose distributions are compared, each by its KS distance `ks_<metric>`.
DISTRIBUTED = ("ttft", "tpot")
KS_METRICS = tuple(f"ks_{metric}" for metric in DISTRIBUTED)
GATED_METRICS = (*GATED_SUMMARY_KEYS, *KS_METRICS, "e2e_mape", "decisions")


def latency_errors(comparison: dict, sim_summary: dict, real_summary: dict) -> dict:
    """Relative errors (fractions) of the run-level numbers, the KS distances of the TTFT and
    TPOT distributions, per-request end-to-end MAPE and the share of decision lines that
    differ."""
    errors = {name: _relative_error(sim_summary.get(key), real_summary.get(key))
              for name, key in GATED_SUMMARY_KEYS.items()}
    errors.update({f"ks_{metric}": distance["ks"]
                   for metric, distance in comparison["distributions"].items()})
    errors["e2e_mape"] = comparison["request_time"]["finish"]["mape"]
    decisions = comparison["decisions"]  # None when a run wrote no decision log
    errors["decisions"] = None if decisions is None else 1.0 - decisions["identical_fraction"]
    return errors


def finish_order_correlation(sim_requests: pd.DataFrame, real_requests: pd.DataFrame) -> float | None:
    """Spearman rank correlation of finish times over the requests finished in both runs: 1 when
    the simulator finishes requests in the engine's order."""
    joined = sim_requests.merge(real_requests, on="id", suffixes=("_sim", "_real"))
    done = joined[(joined["status_sim"] == FINISHED) & (joined["status_real"] == FINISHED)]
    if len(done) < 2:
        return None
    sim_rank = done["finish_sim"].rank().to_numpy()
    real_rank = done["finish_real"].rank().to_numpy()
    if sim_rank.std() == 0 or real_rank.std() == 0:
        return None
    return float(np.corrcoef(sim_rank, real_rank)[0, 1])


def parse_max_errors(items: list[str]) -> dict[str, float]:
    """`["ttft_p90=10", "tps=3"]` -> {"ttft_p90": 0.10, "tps": 0.03} (percent in, fractions out)."""
    limits = {}
    for item in items:
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in GATED_METRICS:
            raise ZipageError(f"--max-error: unknown metric {name!r}; one of "
                              f"{', '.join(GATED_METRICS)} (e.g. --max-error ttft_p90=10)")
        try:
            percent = float(value)
        except ValueError:
            raise ZipageError(f"--max-error {item}: expected METRIC=PERCENT, e.g. tps=3") from None
        if not percent >= 0:
            raise ZipageError(f"--max-error {item}: the percentage must be >= 0")
        limits[name] = percent / 100
    return limits


def exceeded(errors: dict, limits: dict[str, float]) -> list[str]:
    """One line per gated metric whose |error| exceeds its limit (or cannot be measured)."""
    lines = []
    for name, limit in limits.items():
        value = errors.get(name)
        if value is None:
            lines.append(f"{name}: not measurable in these runs (limit {100 * limit:.4g}%)")
        elif abs(value) > limit:
            lines.append(f"{name}: error {100 * value:+.2f}% exceeds {100 * limit:.4g}%")
    return lines


def widened(limits: dict[str, float], spread: dict) -> dict[str, float]:
    """Each gate's limit, or the reference run's own difference from a second run of it
    (`spread`: errors of that run against the reference) where that is larger: no model of a
    run can be asked to be nearer than the run is to itself."""
    return {name: max(limit, abs(spread[name])) if spread.get(name) is not None else limit
            for name, limit in limits.items()}


def format_spread(errors: dict, spread: dict, a: str, b: str, c: str) -> str:
    """A's run-level errors against B beside C's (a second run of B's kind on the same trace):
    where A is within that spread, B's own run-to-run difference, not A, sets the error."""
    lines = [f"(g) {a} against {b}, beside {b}'s own spread ({c} against {b}):",
             f"    {'metric':<10} {a:>12} {'spread':>12}  within"]
    within = 0
    names = [name for name in GATED_METRICS if name != "decisions"
             and errors.get(name) is not None and spread.get(name) is not None]
    for name in names:
        show = (_distance if name in KS_METRICS
                else _percent if name == "e2e_mape" else lambda value: _percent(value, signed=True))
        inside = abs(errors[name]) <= abs(spread[name])
        within += inside
        lines.append(f"    {name:<10} {show(errors[name]):>12} {show(spread[name]):>12}  "
                     + ("yes" if inside else "no"))
    lines.append(f"  {within} of {len(names)} within the spread")
    return "\n".join(lines) + "\n"


def compare_summaries(sim_summary: dict, real_summary: dict, both_only: bool = False) -> dict:
    """Each headline number of both runs and their ratio sim / real (None where undefined);
    `both_only`: only the numbers both runs recorded (a served run has no step count)."""
    side_by_side = {}
    for key in SUMMARY_KEYS:
        sim, real = sim_summary.get(key), real_summary.get(key)
        if both_only and (sim is None or real is None):
            continue
        ratio = sim / real if sim is not None and real else None
        side_by_side[key] = {"sim": sim, "real": real, "ratio": ratio}
    return side_by_side


def _flatten(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def setup_differences(sim_summary: dict, real_summary: dict) -> dict:
    """Planned capacity, settings (flattened, "config.hybrid") and graphed steps that differ
    between the runs."""
    sim = {**{key: sim_summary.get(key) for key in CAPACITY_KEYS},
           **_flatten(sim_summary.get("settings", {}))}
    real = {**{key: real_summary.get(key) for key in CAPACITY_KEYS},
            **_flatten(real_summary.get("settings", {}))}
    # Which steps replayed CUDA graphs: an engine run's, or the profile a simulation was priced
    # with (a graphed step costs less host time); unknown to the analytic model: not compared.
    if sim_summary.get("graphs") is not None and real_summary.get("graphs") is not None:
        sim.update(_flatten({"graphs": sim_summary["graphs"]}))
        real.update(_flatten({"graphs": real_summary["graphs"]}))
    return {key: {"sim": sim.get(key), "real": real.get(key)}
            for key in sorted(set(sim) | set(real)) if sim.get(key) != real.get(key)}


def compare_runs(sim_dir: str | Path, real_dir: str | Path) -> dict:
    """Every comparison of two run directories that both runs can support; a ZipageError names
    any missing or damaged file. A served run has requests only (no steps, no decisions, no
    config): against one, the setup, decision and step sections are None. The decision check
    is also None when either run has no decision log."""
    sim, real = load_run(sim_dir), load_run(real_dir)
    kinds = {"sim": run_kind(sim.summary), "real": run_kind(real.summary)}
    steps_known = SERVED not in kinds.values()
    sim_lines = read_decisions(sim_dir, sim.summary)
    real_lines = read_decisions(real_dir, real.summary)
    decisions = (compare_decisions(sim_lines, real_lines)
                 if sim_lines is not None and real_lines is not None else None)
    comparison = {
        "runs": {"sim": str(sim_dir), "real": str(real_dir)},
        # What each ran on: the simulated GPU, or the engine's device ("cpu", "NVIDIA H200").
        "devices": {"sim": sim.summary.get("device"), "real": real.summary.get("device")},
        "labels": dict(zip(("sim", "real"), run_labels(sim.summary, real.summary))),
        "kinds": kinds,
        "no_decisions": {"sim": _no_decisions_reason(sim.summary, sim_lines),
                         "real": _no_decisions_reason(real.summary, real_lines)},
        "setup_differences": (setup_differences(sim.summary, real.summary)
                              if steps_known else None),
        "decisions": decisions,
        "step_time": (compare_step_times(sim.steps, real.steps, chunked=_chunked_engine_run(real.summary))
                      if steps_known else None),
        "time_by_kind": compare_time_by_kind(sim.steps, real.steps) if steps_known else None,
        "request_time": compare_request_times(sim.requests, real.requests),
        "distributions": compare_distributions(sim.requests, real.requests),
        "summary": compare_summaries(sim.summary, real.summary, both_only=not steps_known),
        "finish_order_correlation": finish_order_correlation(sim.requests, real.requests),
    }
    comparison["errors"] = latency_errors(comparison, sim.summary, real.summary)
    return comparison


def _chunked_engine_run(summary: dict) -> bool:
    """An engine run (not a simulation, whose steps last what they are priced at) that chunked
    its prompts (the default)."""
    config = (summary.get("settings") or {}).get("config") or {}
    return run_kind(summary) == ENGINE and config.get("chunked_prefill") is not False


def _no_decisions_reason(summary: dict, lines: list[str] | None) -> str | None:
    if lines is not None:
        return None
    return decisions_absent_reason(summary) or "written with --decisions none"


def format_report(comparison: dict) -> str:
    """The text report of `compare_runs`' result."""
    runs = comparison["runs"]
    a, b = comparison.get("labels", {"sim": "sim", "real": "real"}).values()
    width = max(len(a), len(b)) + 1
    devices = comparison.get("devices", {})
    lines = [f"{label + ':':<{width}} {runs[role]}"
             + (f" (on {devices[role]})" if devices.get(role) else "")
             for label, role in ((a, "sim"), (b, "real"))]
    served = [label for label, role in ((a, "sim"), (b, "real"))
              if comparison.get("kinds", {}).get(role) == SERVED]
    if served:
        lines += ["", f"{' and '.join(served)}: a served run (`zipage bench serve`): request-level "
                      "metrics only (no engine steps, no decisions, no config); compared: "
                      "(c), (d) and (e)"]
    if comparison["setup_differences"]:
        lines += ["", f"setup differences ({a} | {b}):"]
        lines += [f"  {key}: {_number(values['sim'])} | {_number(values['real'])}"
                  for key, values in comparison["setup_differences"].items()]

    decisions = comparison["decisions"]
    if decisions is None:
        lines += ["", "(a) scheduling decisions: not compared (" + _why_no_decisions(comparison,
                                                                                    a, b) + ")"]
    else:
        lines += ["", "(a) scheduling decisions: "
                  + ("identical" if decisions["identical"] else "DIFFERENT")
                  + f" ({decisions['identical_lines']} of {max(decisions['lines'].values())}"
                  f" lines identical, {100 * decisions['identical_fraction']:.1f}%;"
                  f" {a} {decisions['lines']['sim']} lines, {b} {decisions['lines']['real']})"]
        difference = decisions["first_difference"]
        if difference is not None:
            first, second = difference["sim"], difference["real"]
            lines += [f"  first difference at line {difference['line']} "
                      f"(step {difference['step']}):",
                      f"    {a + ':':<{width}} {excerpt(first, second)}",
                      f"    {b + ':':<{width}} {excerpt(second, first)}"]

    step_time = comparison["step_time"]
    if step_time is None:
        lines += ["", "(b) step duration error: not compared (no steps in a served run)"]
    else:
        lines += _format_step_time(step_time, a, b)
    lines += _format_requests_and_summary(comparison, a, b)
    return "\n".join(lines) + "\n"


def _why_no_decisions(comparison: dict, a: str, b: str) -> str:
    reasons = comparison.get("no_decisions") or {}
    named = [f"{label}: {reasons[role]}" for label, role in ((a, "sim"), (b, "real"))
             if reasons.get(role)]
    return "; ".join(named) or "a run was written with --decisions none"


def _format_step_time(step_time: dict, a: str, b: str) -> list[str]:
    lines = []
    lines += ["", f"(b) step duration error, {a} against {b} ({step_time['matched_steps']} steps"
              f" matched, {step_time['sim_only_steps']} {a}-only, {step_time['real_only_steps']}"
              f" {b}-only, {step_time['kind_mismatches']} of another kind):"]
    lines += ["  " + _format_stats(kind, stats, unit_scale=1000.0, unit="ms")
              for kind, stats in step_time["duration"].items()]
    if UNSYNCED in step_time["duration"]:
        lines.append(f"  ({UNSYNCED}: {b}'s prompt chunks that sample nothing record their launch only, the step"
                     " after each their forward; each stretch of them is compared as one)")
    total = step_time["total_time"]
    lines.append(f"  total time: {a} {_number(total['sim'])} s, {b} {_number(total['real'])} s,"
                 f" error {_percent(total['relative_error'])}")
    return lines


def _format_requests_and_summary(comparison: dict, a: str, b: str) -> list[str]:
    lines = []
    request_time = comparison["request_time"]
    lines += ["", f"(c) per-request error, {a} against {b} ({request_time['finished_in_both']}"
              f" finished in both; {request_time['sim_only_requests']} {a}-only,"
              f" {request_time['real_only_requests']} {b}-only,"
              f" {request_time['status_mismatches']} with another status):"]
    lines += ["  " + _format_stats(metric, request_time[metric], unit_scale=scale, unit=unit)
              for metric, scale, unit in (("ttft", 1.0, "s"), ("tpot", 1000.0, "ms"),
                                          ("finish", 1.0, "s"))]

    errors = comparison["errors"]
    correlation = comparison["finish_order_correlation"]
    lines += ["", f"(e) run-level error, {a} against {b}: "
              + ", ".join(f"{name} {_percent(errors[name], signed=True)}"
                          for name in ("makespan", "tps", "ttft_p50", "ttft_p90", "ttft_p99",
                                       "tpot_p50", "tpot_p90", "tpot_p99"))
              + f"; end-to-end MAPE {_percent(errors['e2e_mape'])}; finish-order rank correlation "
              + (f"{correlation:.3f}" if correlation is not None else "-")]
    lines.append(f"  distributions, KS distance (the largest gap of the two CDFs: 0 the same, 1 "
                 f"disjoint; n = {a} | {b}): " + ", ".join(
                     f"{metric} {_distance(distance['ks'])} (n={distance['n']['sim']} | "
                     f"{distance['n']['real']})"
                     for metric, distance in comparison["distributions"].items()))
    lines += _format_time_by_kind(comparison.get("time_by_kind"), a, b)
    column = max(14, len(a), len(b))
    lines += ["", f"(d) {'summary':<14} {a:>{column}} {b:>{column}} {'ratio':>9}"
                  f"  (ratio = {a} / {b})"]
    for key, values in comparison["summary"].items():
        ratio = f"{values['ratio']:9.3f}" if values["ratio"] is not None else f"{'-':>9}"
        lines.append(f"    {key:<14} {_number(values['sim']):>{column}}"
                     f" {_number(values['real']):>{column}} {ratio}")
    return lines


def _format_time_by_kind(by_kind: dict | None, a: str, b: str) -> list[str]:
    if by_kind is None:  # a served run, or a comparison made before this section existed
        return []
    lines = ["", f"(f) time by step kind, {a} | {b}: steps, seconds, mean ms; {a} - {b} in % of "
                 f"{b}'s total time"]
    for kind, share in by_kind["share_of_real_time"].items():
        first, second = by_kind["sim"].get(kind, NO_TIME), by_kind["real"].get(kind, NO_TIME)
        lines.append(f"  {kind:<16} {first['steps']:>6} | {second['steps']:<6} "
                     f"{first['seconds']:8.2f} | {second['seconds']:<8.2f} "
                     f"{first['mean_ms']:7.2f} | {second['mean_ms']:<7.2f} "
                     f"{_percent(share, signed=True)}")
    return lines


def _format_stats(name: str, stats: dict, unit_scale: float, unit: str) -> str:
    if not stats["count"]:
        return f"{name:<8} no comparable values ({stats['excluded']} excluded)"
    return (f"{name:<8} |error| median {_percent(stats['median'])}, p90 {_percent(stats['p90'])},"
            f" MAPE {_percent(stats['mape'])}; bias {_percent(stats['bias'], signed=True)};"
            f" median |error| {stats['median_abs'] * unit_scale:.3g} {unit}"
            f" (n={stats['count']}" + (f", {stats['excluded']} excluded)" if stats["excluded"]
                                       else ")"))


def _percent(fraction: float | None, signed: bool = False) -> str:
    if fraction is None:
        return "-"
    return f"{100 * fraction:+.2f}%" if signed else f"{100 * fraction:.2f}%"


def _distance(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _number(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)
