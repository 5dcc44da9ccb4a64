"""Where two runs of one trace spend their time differently, term by term.

    python -m zipage.analysis.attribution RUN_A RUN_B [--labels fixed,elastic]

Made for the elastic-vs-fixed budget comparison (docs/BENCHMARKS.md, 'Elastic budgets') and usable for
any two run directories (engine or simulator). Each run's clock, up to the end of its last step,
is split into terms that add up to it exactly:

- **decode forward**: one decode plane, t = a + b * requests + c * KV entries read, is fitted by
  least squares to the decode steps of *both* runs that compress nothing, and prices every decode
  step: `decode steps` (count x a), `decode requests` (x b), `decode context` (x c), plus
  `decode residual`, what the plane misses on the steps that compress nothing (a run that was
  slower throughout shows it here);
- **compression**: what the decode steps of each compression cost beyond the plane: the price of
  the compressions as the run paid it. A compression's steps are the step that runs it (sync) or
  launches it (async) and, for an async batch, every step up to the one that reports it done.
  On the H200 an async batch launched before its step's forward cost all of it on that step;
  launched behind the forward, as the engine does, it finishes in the next step and costs little
  on either;
- **prefill** (prefill and mixed steps: recomputation after preemption included), **idle** steps
  (waiting for an async batch) and **host gaps** between steps.

The difference B - A of each term says which one moved the makespan; the compression term is also
split into its count (B's batches minus A's, at A's mean price) and its price (B's batches times
the difference of the mean prices).

With `--cost-model SPEC` (analytic or a profile) each compression's batch is also
priced by that model, job by job from the run's decision log (source and kept blocks; an engine
run written without one gets it from its step-time replay, `zipage replay TRACE --step-times RUN
--out DIR`, which keeps the engine's clock), and the report gives the compression term over the
modelled durations: the contention factor minus 1 that the run implies for that model.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from zipage.analysis.compare import read_decisions
from zipage.analysis.timeline import load_run
from zipage.core.deployment import ReplaySettings
from zipage.errors import ZipageError

TERMS = ("decode steps", "decode requests", "decode context", "decode residual", "compression",
         "prefill", "idle", "host gaps")
PREFILL_KINDS = ("prefill", "mixed")
# A plane has three coefficients; fewer clean decode steps than this cannot price the others.
MIN_CLEAN_DECODE_STEPS = 4
# One compression job of a decision-log line: its source table and its target blocks.
_JOB = re.compile(r"compress\((?:launch|sync)\)=\S+?:\[([^\]]*)\]->\[([^\]]*)\]")
_STEP = re.compile(r"step (\d+) ")


def _durations(steps: pd.DataFrame) -> np.ndarray:
    return (steps["t_end"] - steps["t_start"]).to_numpy(dtype=float)


def _features(steps: pd.DataFrame) -> np.ndarray:
    return np.column_stack([np.ones(len(steps)), steps["n_decode"].to_numpy(dtype=float),
                            steps["decode_context_tokens"].to_numpy(dtype=float)])


def compression_owner(steps: pd.DataFrame) -> np.ndarray:
    """For each step, the step_id of the compression it runs, launches or overlaps, or -1.

    A compressing step owns itself and, when its batch is async, every step up to the one that
    reports a batch done (the core keeps one batch in flight, so the next launch comes after). A
    sync compression is never reported: the next compressing step, or the run's end, comes first
    and the compression owns its step alone."""
    ids = steps["step_id"].to_numpy()
    compress = steps["n_compress"].to_numpy() > 0
    done = steps["batches_done"].to_numpy() > 0
    owner = np.full(len(steps), -1, dtype=np.int64)
    for start in np.flatnonzero(compress):
        end = start
        while not done[end] and end + 1 < len(steps) and not compress[end + 1]:
            end += 1
        owner[start:end + 1 if done[end] else start + 1] = ids[start]
    return owner


def _decode_steps(steps: pd.DataFrame, compressing: bool) -> pd.DataFrame:
    """Decode steps of a compression (`compression_owner`), or those of none."""
    decode = (steps["kind"] == "decode").to_numpy()
    return steps[decode & ((compression_owner(steps) >= 0) == compressing)]


def _compressions(steps: pd.DataFrame, plane: np.ndarray | None = None) -> pd.Series:
    """What each compression's decode steps cost beyond the plane (seconds; 0 without a
    plane), by the step_id of the compression: the compressions that have decode steps."""
    owner = compression_owner(steps)
    decode = (steps["kind"] == "decode").to_numpy() & (owner >= 0)
    rows = steps[decode]
    residual = (_durations(rows) - _features(rows) @ plane if plane is not None
                else np.zeros(len(rows)))
    return pd.Series(residual).groupby(owner[decode]).sum()


def decode_plane(runs: list[pd.DataFrame]) -> np.ndarray:
    """(a, b, c) of t = a + b * requests + c * context tokens, fitted to the decode steps that
    compress nothing, pooled over `runs` so that every run is priced by the same plane."""
    clean = pd.concat([_decode_steps(steps, compressing=False) for steps in runs])
    if len(clean) < MIN_CLEAN_DECODE_STEPS:
        raise ZipageError(f"attribution: {len(clean)} decode step(s) without compression; at "
                          f"least {MIN_CLEAN_DECODE_STEPS} are needed to fit the decode plane")
    plane, *_ = np.linalg.lstsq(_features(clean), _durations(clean), rcond=None)
    return plane


def run_terms(steps: pd.DataFrame, plane: np.ndarray) -> dict[str, float]:
    """Seconds of each term of `TERMS`; they add up to the end of the run's last step."""
    decode = steps[steps["kind"] == "decode"]
    clean, compressing = (_decode_steps(steps, flag) for flag in (False, True))
    durations = _durations(steps)
    terms = {
        "decode steps": len(decode) * plane[0],
        "decode requests": float(decode["n_decode"].sum()) * plane[1],
        "decode context": float(decode["decode_context_tokens"].sum()) * plane[2],
        "decode residual": float((_durations(clean) - _features(clean) @ plane).sum()),
        "compression": float((_durations(compressing) - _features(compressing) @ plane).sum()),
        "prefill": float(durations[steps["kind"].isin(PREFILL_KINDS).to_numpy()].sum()),
        "idle": float(durations[(steps["kind"] == "idle").to_numpy()].sum()),
    }
    # Whatever the steps do not cover: host time between steps (and before the first one).
    terms["host gaps"] = float(steps["t_end"].max()) - float(durations.sum())
    return terms


def run_counts(steps: pd.DataFrame) -> dict[str, float]:
    """What the terms are made of: steps, decode rows, KV entries, compressions, preemptions."""
    decode = steps[steps["kind"] == "decode"]
    return {
        "decode steps": len(decode),
        "decode requests": int(decode["n_decode"].sum()),
        "decode context (M tokens)": float(decode["decode_context_tokens"].sum()) / 1e6,
        # Compressions (sync steps or async batches) with decode steps to price them by.
        "compression batches": len(_compressions(steps)),
        # Jobs of every step: an idle step may launch a batch too (its wait is the idle term).
        "compressions (jobs)": int(steps["n_compress"].sum()),
        "source blocks compressed": int(steps["compress_blocks"].sum()),
        "prefill steps": int(steps["kind"].isin(PREFILL_KINDS).sum()),
        "prefill tokens": int(steps["prefill_tokens"].sum()),
        "preemptions": int(steps["preempted"].sum()),
    }


def residual_after_compression(steps: pd.DataFrame, plane: np.ndarray) -> float | None:
    """Mean plane residual (s) of the decode steps of no compression that follow one's last
    step: near 0 when a compression costs only its own steps."""
    inside = compression_owner(steps) >= 0
    follows = np.concatenate([[False], inside[:-1]]) & ~inside
    after = steps[follows & (steps["kind"] == "decode").to_numpy()]
    if after.empty:
        return None
    return float((_durations(after) - _features(after) @ plane).mean())


def _median_price(steps: pd.DataFrame, plane: np.ndarray) -> float | None:
    prices = _compressions(steps, plane)
    return None if prices.empty else float(prices.median())


def attribute(steps_a: pd.DataFrame, steps_b: pd.DataFrame) -> dict:
    """Terms and counts of both runs, their differences, and the compression term split into
    its count and its price."""
    plane = decode_plane([steps_a, steps_b])
    terms = [run_terms(steps, plane) for steps in (steps_a, steps_b)]
    counts = [run_counts(steps) for steps in (steps_a, steps_b)]
    batches = [count["compression batches"] for count in counts]
    price = [term["compression"] / n if n else 0.0 for term, n in zip(terms, batches)]
    # The median resists the odd step of a run (a kernel compiled mid-run takes seconds).
    median = [_median_price(steps, plane) for steps in (steps_a, steps_b)]
    return {
        "plane": tuple(float(value) for value in plane),
        "terms": terms,
        "counts": counts,
        "makespan": [sum(term.values()) for term in terms],
        "compression_price_s": price,
        "compression_median_price_s": median,
        "residual_after_compression_s": [residual_after_compression(steps, plane)
                                         for steps in (steps_a, steps_b)],
        "compression_count_effect_s": (batches[1] - batches[0]) * price[0],
        "compression_price_effect_s": batches[1] * (price[1] - price[0]),
    }


def attribute_runs(dir_a: str | Path, dir_b: str | Path, cost_spec: str | None = None) -> dict:
    result = attribute(load_run(dir_a).steps, load_run(dir_b).steps)
    if cost_spec is not None:
        plane = np.asarray(result["plane"])
        result["cost_model"] = cost_spec
        result["price_over_modelled"] = [modelled_price_ratio(directory, cost_spec, plane)
                                         for directory in (dir_a, dir_b)]
    return result


def format_attribution(result: dict, labels: tuple[str, str] = ("A", "B")) -> str:
    """Markdown: the terms (s), their difference and its share of A's makespan; the counts; the
    plane, the compression prices and (with a cost model) the implied contention."""
    return "\n".join(_terms_table(result, labels) + [""] + _counts_table(result, labels) + [""]
                     + _notes(result, labels))


def _terms_table(result: dict, labels: tuple[str, str]) -> list[str]:
    a, b = labels
    (terms_a, terms_b), (span_a, span_b) = result["terms"], result["makespan"]
    rows = [*((name, terms_a[name], terms_b[name]) for name in TERMS),
            ("makespan", span_a, span_b)]
    return [f"| term | {a} s | {b} s | {b} - {a} s | of {a}'s makespan |",
            "|---|---:|---:|---:|---:|",
            *(f"| {name} | {value_a:.3f} | {value_b:.3f} | {value_b - value_a:+.3f} | "
              f"{(value_b - value_a) / span_a:+.2%} |" for name, value_a, value_b in rows)]


def _counts_table(result: dict, labels: tuple[str, str]) -> list[str]:
    counts_a, counts_b = result["counts"]
    return [f"| count | {labels[0]} | {labels[1]} |", "|---|---:|---:|",
            *(f"| {name} | {_number(value)} | {_number(counts_b[name])} |"
              for name, value in counts_a.items())]


def _notes(result: dict, labels: tuple[str, str]) -> list[str]:
    a, b = labels
    plane_a, plane_b, plane_c = result["plane"]
    price_a, price_b = (_ms(price, signed=False) for price in result["compression_price_s"])
    median_a, median_b = (_ms(price, signed=False)
                          for price in result["compression_median_price_s"])
    after_a, after_b = (_ms(value) for value in result["residual_after_compression_s"])
    notes = [f"decode plane: {plane_a * 1e3:.3f} ms + {plane_b * 1e6:.2f} us per request + "
             f"{plane_c * 1e9:.1f} ns per KV entry read",
             f"compression price per batch, mean (median): {a} {price_a} "
             f"({median_a}), {b} {price_b} ({median_b}); {b} - {a} = "
             f"{result['compression_count_effect_s']:+.3f} s from the count + "
             f"{result['compression_price_effect_s']:+.3f} s from the price",
             "mean residual of the clean decode steps right after a compression's steps: "
             f"{a} {after_a}, {b} {after_b}"]
    if "price_over_modelled" in result:
        (ratio_a, median_a), (ratio_b, median_b) = result["price_over_modelled"]
        notes.append(f"compression term / the batches' durations in {result['cost_model']} "
                     f"(median step): {a} {ratio_a:.2f} ({median_a:.2f}), {b} {ratio_b:.2f} "
                     f"({median_b:.2f}): the contention factor minus 1 that the run implies "
                     "for that model")
    return notes


def _ms(seconds: float | None, signed: bool = True) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:+.3f} ms" if signed else f"{seconds * 1e3:.3f} ms"


def batch_blocks(decision_lines: list[str]) -> dict[int, tuple[list[int], list[int]]]:
    """Source and kept blocks of each job, by the step that compresses them."""
    batches = {}
    for line in decision_lines:
        jobs = _JOB.findall(line)
        if jobs:
            sources = [len(source.split(",")) for source, _ in jobs]
            kept = [len(target.split(",")) if target else 0 for _, target in jobs]
            batches[int(_STEP.match(line).group(1))] = (sources, kept)
    return batches


def modelled_price_ratio(run_dir: str | Path, cost_spec: str,
                         plane: np.ndarray) -> tuple[float, float]:
    """Compression term / the durations `cost_spec` gives the same batches, over the run's
    compressions: what the run implies for that model's contention factor, minus 1; and the
    median of that ratio batch by batch (which a few outlying steps do not move)."""
    from zipage.sim.simulate import plan_deployment  # the simulator is only needed here

    run = load_run(run_dir)
    lines = read_decisions(run_dir)
    if not lines:
        raise ZipageError(f"{run_dir}: no decision log to take the compression jobs from; "
                          "replay the run with `zipage replay TRACE --step-times RUN --out DIR`")
    settings = replace(ReplaySettings.from_dict(run.summary["settings"]), cost_model=cost_spec)
    cost = plan_deployment(settings).cost_model
    batches = batch_blocks(lines)
    paid = _compressions(run.steps, plane)
    missing = sorted(set(paid.index) - set(batches))
    if missing:
        raise ZipageError(f"{run_dir}: the decision log has no compression jobs for step(s) "
                          f"{', '.join(map(str, missing[:5]))}; is it this run's log?")
    modelled = np.array([cost.compress_time_for(*batches[step]) for step in paid.index])
    paid = paid.to_numpy()
    return float(paid.sum() / modelled.sum()), float(np.median(paid / modelled))


def _number(value: float) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", help="run directory (e.g. the fixed budget)")
    parser.add_argument("run_b", help="run directory of the same trace (e.g. elastic)")
    parser.add_argument("--labels", default="A,B", help="names of the two runs, comma-separated")
    parser.add_argument("--cost-model", default=None,
                        help="also price each compression's batch with this cost model "
                             "('analytic' or a profile; needs the runs' decision logs)")
    args = parser.parse_args(argv)
    labels = tuple(args.labels.split(","))
    if len(labels) != 2:
        parser.error("--labels: give two names, e.g. fixed,elastic")
    print(format_attribution(attribute_runs(args.run_a, args.run_b, args.cost_model), labels))


if __name__ == "__main__":
    main()
