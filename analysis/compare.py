"""`zipage compare SIM_DIR REAL_DIR`: how far two runs of one trace agree.

Typically a simulated run and a real-engine run with the same flags. Reports (a) scheduling
agreement — `decisions.log` line by line (identical in sync mode, since both drive the same
core), (b) per-step duration errors overall and per step kind, (c) per-request errors of TTFT,
TPOT and finish time, and (d) the summaries side by side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from zipage.analysis.timeline import load_run, run_file

SUMMARY_KEYS = ["tps", "makespan_s", "mean_tpot_ms", "steps", "preemptions", "compressions"]


def _error_stats(reference: pd.Series, other: pd.Series) -> dict:
    """Relative errors of `other` against `reference` (rows where the reference is positive)."""
    valid = reference > 0
    relative = ((other[valid] - reference[valid]) / reference[valid]).abs()
    if relative.empty:
        return {"count": 0}
    return {"count": int(relative.size), "median": float(relative.median()),
            "p90": float(relative.quantile(0.9)), "mape": float(relative.mean())}


def compare_runs(first_dir: str | Path, second_dir: str | Path) -> dict:
    first, second = load_run(first_dir), load_run(second_dir)
    first_log = run_file(first_dir, "decisions.log").read_text().splitlines()
    second_log = run_file(second_dir, "decisions.log").read_text().splitlines()
    same = sum(a == b for a, b in zip(first_log, second_log))
    longest = max(len(first_log), len(second_log), 1)
    first_difference = next(
        (index for index, (a, b) in enumerate(zip(first_log, second_log)) if a != b),
        None if len(first_log) == len(second_log) else min(len(first_log), len(second_log)))
    decisions = {
        "identical": first_log == second_log,
        "identical_fraction": same / longest,
        "steps": [len(first_log), len(second_log)],
    }
    if first_difference is not None:
        decisions["first_difference"] = {
            "step": first_difference,
            "first": first_log[first_difference] if first_difference < len(first_log) else None,
            "second": (second_log[first_difference]
                       if first_difference < len(second_log) else None)}

    steps = first.steps.merge(second.steps, on="step_id", suffixes=("_a", "_b"))
    duration_a = steps.t_end_a - steps.t_start_a
    duration_b = steps.t_end_b - steps.t_start_b
    step_errors = {"all": _error_stats(duration_a, duration_b)}
    for kind in sorted(set(steps.kind_a)):
        mask = steps.kind_a == kind
        step_errors[kind] = _error_stats(duration_a[mask], duration_b[mask])

    requests = first.requests.merge(second.requests, on="id", suffixes=("_a", "_b"))
    requests = requests[(requests.status_a == "finished") & (requests.status_b == "finished")]
    request_errors = {
        "ttft": _error_stats(requests.first_token_a - requests.arrival_a,
                             requests.first_token_b - requests.arrival_b),
        "finish": _error_stats(requests.finish_a - requests.arrival_a,
                               requests.finish_b - requests.arrival_b),
    }
    decoding = requests[(requests.output_len_a > 1) & (requests.output_len_b > 1)]
    request_errors["tpot"] = _error_stats(
        (decoding.finish_a - decoding.first_token_a) / (decoding.output_len_a - 1),
        (decoding.finish_b - decoding.first_token_b) / (decoding.output_len_b - 1))

    summaries = {key: [first.summary.get(key), second.summary.get(key)] for key in SUMMARY_KEYS}
    return {"runs": [str(first_dir), str(second_dir)], "decisions": decisions,
            "step_time_error": step_errors, "request_error": request_errors,
            "summary": summaries}


def format_report(comparison: dict) -> str:
    first, second = comparison["runs"]
    decisions = comparison["decisions"]
    lines = [f"A = {first}", f"B = {second}", "",
             f"scheduling decisions: {'identical' if decisions['identical'] else 'DIFFERENT'} "
             f"({100 * decisions['identical_fraction']:.1f}% of steps; "
             f"{decisions['steps'][0]} vs {decisions['steps'][1]} steps)"]
    if "first_difference" in decisions:
        difference = decisions["first_difference"]
        lines += [f"  first difference at step {difference['step']}:",
                  f"    A: {difference['first']}", f"    B: {difference['second']}"]
    lines += ["", "step duration error of B against A (relative):"]
    for kind, stats in comparison["step_time_error"].items():
        lines.append("  " + _format_stats(kind, stats))
    lines += ["", "per-request error of B against A (relative):"]
    for name, stats in comparison["request_error"].items():
        lines.append("  " + _format_stats(name, stats))
    lines += ["", f"{'summary':<14} {'A':>14} {'B':>14} {'B/A':>8}"]
    for key, (a, b) in comparison["summary"].items():
        ratio = f"{b / a:8.3f}" if isinstance(a, (int, float)) and a and b is not None else "       -"
        lines.append(f"{key:<14} {_number(a):>14} {_number(b):>14} {ratio}")
    return "\n".join(lines)


def _format_stats(name: str, stats: dict) -> str:
    if not stats.get("count"):
        return f"{name:<8} no data"
    return (f"{name:<8} median {100 * stats['median']:6.2f}%  p90 {100 * stats['p90']:6.2f}%  "
            f"MAPE {100 * stats['mape']:6.2f}%  (n={stats['count']})")


def _number(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if isinstance(value, float) and not np.isnan(value) else str(value)
