"""A calibrated cost profile fitted from real runs: `zipage calibrate --from-run RUN_DIR...`.

`zipage calibrate --gpu` times synthetic steps; users have production traffic instead. Every run
directory an engine replay writes (`zipage replay --gpu --out`) holds each step's kind, batch,
context, prefill tokens, prompts and attention pairs, compressed blocks and measured start and
end (a served run, `zipage bench serve --out`, has none of them: its client sees requests
only). This module turns those steps into the profile format of `CalibratedCostModel`
(docs/cost_model.md):

- decode, prefill and mixed points (a mixed step: decodes and prompt chunks in one forward, with
  chunked prefill): the steps of that kind that neither compress nor overlap an async
  compression batch, one point each (batch and context tokens of the decodes; prompts, new
  tokens and attention pairs of the prompt chunks);
- compress points: a sync compression runs before its step's forward, so its duration is the
  step's time beyond the forward (the fitted model's prediction). An async batch runs beside
  the steps, and the simulator stretches the part of a step it overlaps by the contention
  factor c: its duration is the steps it overlapped whole plus, of the step that reported it
  done, the extra time over the forward divided by c - 1;
- launch points: a decode step that launches an async batch behind its forward (and
  overlaps no other) is a point of the `launch` section: the calibrated model fits from them
  the host floor such a step cannot go below (the host enqueues the batch's kernels);
- the contention factor: the median ratio of the steps a batch overlapped from start to end to
  the fitted model. When no batch outlasted a step (so no step was overlapped whole), the runs
  cannot tell a batch's duration from the slowdown it causes; c is then assumed: 2 for runs
  that launched batches before the forward (a serial overlap, measured then), the analytic
  model's default for runs that launch behind it (measured on such runs, docs/cost_model.md),
  and a batch's duration is its steps' extra time over c - 1.

The engine launches a batch behind its step's forward (the run's summary says `async_launch`), so
a batch overlaps the steps after the one that launched it; in runs whose summary has no
`async_launch` it was launched first and overlapped that step too.

A step starts when the engine's loop iteration does, so admission and scheduling are inside it;
the bookkeeping after a step's end until the next step starts (the run's median gap, tens of
microseconds) is added to every step, because the simulator runs its steps back to back. The
profile's header names the model, GPU, dtype and knobs the runs had; the runs must agree on them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from zipage.core.step import causal_pairs
from zipage.decode_grid import PROGRAMS_PER_SM
from zipage.errors import ConfigError
from zipage.presets import model_label
from zipage.profile import (
    DECODE_EXCESS,
    DECODE_GRAPH_SIZES,
    DECODE_PROGRAMS_PER_SM,
    DECODE_SPLIT,
    PER_PARTITION,
    PROFILE_VERSION,
)
from zipage.records import STEP_COLUMN_DEFAULTS
from zipage.sim.calibrated import CalibratedCostModel, partition_geometry_known
from zipage.sim.cost_model import StepWork

FLAG = "--from-run"  # the option naming the run directories, in every error
# What a profile's header is made of (`_header`), from a run's summary.json "settings".
SETTINGS_KEYS = ("config", "model", "hardware", "dtype", "tensor_parallel")

# Contention assumed when no batch outlasted a step of runs that launched batches before the
# step's forward: such a batch delayed its step by about its whole duration (`zipage calibrate
# --gpu` measured 2.09 on the H200 then). Runs that launch behind the forward take the analytic
# model's default, which was measured on runs of that engine.
SERIAL_CONTENTION = 2.0

# Below this slowdown an overlap is practically free, and a batch's extra time says nothing of
# its duration: its duration is then the span from its launch to the end of the step that
# reported it (an upper bound).
FREE_OVERLAP = 1.05


@dataclass
class AsyncBatch:
    """An async compression batch of a run: the steps from its launch to its report."""

    requests: int
    blocks: int
    steps: list[tuple[StepWork | None, float]] = field(default_factory=list)  # None: idle
    span_s: float = 0.0  # launching step's start to the reporting step's end


def profile_from_runs(run_dirs: list[str | Path], *, gpu: str | None = None,
                      stall_factor: float | None = None, outliers: float | None = None) -> dict:
    """The profile of the runs in `run_dirs`; `gpu` labels it (default: the runs' hardware).

    `stall_factor`: leave out decode steps slower than this many times their run's median decode
    step (a mid-run kernel compilation, which no cost model should learn), and the compression
    batches they launched or reported. `outliers`: leave out the forward points (decode,
    prefill, mixed, launch) the fitted model misses by more than this relative error, or by
    more than OUTLIER_SPREAD times the section's median miss if that is larger (`drop_outliers`)."""
    if not run_dirs:
        raise ConfigError("--from-run: give at least one run directory (zipage replay --out)")
    if stall_factor is not None and not stall_factor > 1:
        raise ConfigError(f"--stall-factor: got {stall_factor!r}, expected a number > 1")
    runs = [_read(Path(directory)) for directory in run_dirs]
    header = _header(runs, gpu)
    points, sync, batches, stalls = _sort_steps(runs, stall_factor)
    profile = {**header, "decode": points["decode"], "prefill": points["prefill"]}
    if points["launch"]:
        profile["launch"] = points["launch"]
    if stalls:
        profile["note"] += f"; {stalls} decode step(s) over {stall_factor:g}x the median left out"
    if len(points["mixed"]) >= 2:  # what a fit of their constant needs; else one is assumed
        profile["mixed"] = points["mixed"]
    if outliers is not None:
        dropped = drop_outliers(profile, outliers)
        if dropped:
            profile["note"] += (f"; {dropped} step(s) the fit missed by more than "
                                f"{outliers:.0%} left out")
    model = CalibratedCostModel.from_profile(profile)
    compress = [dict(point, time_s=time_s - model.forward_time_for(work))
                for point, work, time_s in sync]
    if _launch_order(runs) == "after-forward":
        contention = SERIAL_CONTENTION
        compress += _extra_points(model, batches)
    else:
        # When no batch outlasted a step, the runs cannot tell its duration from its slowdown.
        contention = _contention(model, batches, SERIAL_CONTENTION)
        compress += [_batch_point(model, batch, contention) for batch in batches]
    usable = [point for point in compress if point["time_s"] > 0]
    if usable:
        profile["compress"] = usable
    if batches:
        profile["contention_factor"] = round(contention, 4)
    return profile


def forward_points(run_dirs: list[str | Path], *, stall_factor: float | None = None
                   ) -> dict[str, list]:
    """The decode, prefill, mixed and launch points of runs, as `profile_from_runs` takes them, without
    a profile around them: to compose a profile from runs of several setups (a Full-KV decode,
    say, with the prefill of compressing runs: bench/fidelity_cross_trace.py)."""
    return _sort_steps([_read(Path(directory)) for directory in run_dirs], stall_factor)[0]


def _sort_steps(runs: list[tuple[dict, pd.DataFrame]], stall_factor: float | None):
    """Every run's steps sorted into clean points, sync compressions and async batches, and the
    number of stalled steps left out."""
    points: dict[str, list] = {"decode": [], "prefill": [], "mixed": [], "launch": []}
    sync, batches, stalls = [], [], 0
    for summary, steps in runs:
        config = summary["settings"]["config"]
        asynchronous = config["async_compress"]
        behind = _run_launch_order(summary) == "after-forward"
        # Only chunked prefill splits a prompt into chunks that sample nothing (None: the default, on).
        chunked = config.get("chunked_prefill") is not False
        stalls += _collect(_durations(steps, stall_factor, chunked), asynchronous, behind, points,
                           sync, batches)
    return points, sync, batches, stalls


def _run_launch_order(summary: dict) -> str:
    # Runs without the field launched every batch before its step's forward.
    return summary.get("async_launch", "before-forward")


def _launch_order(runs: list[tuple[dict, pd.DataFrame]]) -> str:
    orders = sorted({_run_launch_order(summary) for summary, _ in runs})
    if len(orders) > 1:
        raise ConfigError("--from-run: the runs launched async batches in different orders "
                          f"({' and '.join(orders)} the step's forward: two versions of the engine); "
                          "fit one profile per engine")
    return orders[0]


def _read(directory: Path) -> tuple[dict, pd.DataFrame]:
    from zipage.rundir import read_summary, read_table

    summary = read_summary(directory, FLAG)
    _require_engine_run(directory, summary)
    steps = read_table(directory, "steps.csv", summary, FLAG)
    needed = {"kind", "n_prefill", "n_decode", "n_compress", "decode_context_tokens",
              "prefill_tokens", "attention_pairs", "compress_blocks", "batches_done", "t_start",
              "t_end"}
    missing = sorted(needed - set(steps.columns))
    if missing:
        raise ConfigError(f"{FLAG} {directory}: steps.csv lacks {', '.join(missing)}"
                          "; rerun with this version's `zipage replay --out`")
    for column, default in STEP_COLUMN_DEFAULTS.items():  # optional to a fit: the rest are needed
        if column not in needed and column not in steps:
            steps[column] = default
    return summary, steps


def _require_engine_run(directory: Path, summary: dict) -> None:
    """Only the real engine's step log times steps: refuse a simulated or a served run, and a
    summary without the settings a profile's header comes from."""
    from zipage.rundir import ENGINE, SERVED, run_kind

    kind = run_kind(summary)
    if kind == SERVED:
        raise ConfigError(f"{FLAG} {directory}: a served run (`zipage bench serve`) has no engine "
                          "step log and no config, only request-level metrics; fit from an "
                          "engine run (`zipage replay --gpu --out DIR` on the same trace) or "
                          "measure with `zipage calibrate --gpu`")
    if kind != ENGINE:
        raise ConfigError(f"{FLAG} {directory}: a {summary.get('driver', kind)} run; fit "
                          "profiles from real engine runs (`zipage replay --gpu --out DIR`)")
    settings = summary.get("settings")
    settings = settings if isinstance(settings, dict) else {}
    missing = [f"settings.{key}" for key in SETTINGS_KEYS if key not in settings]
    if missing or not isinstance(settings.get("config"), dict):
        raise ConfigError(f"{FLAG} {directory}: summary.json lacks "
                          f"{', '.join(missing) or 'settings.config as an object'}; rerun with "
                          "this version's `zipage replay --gpu --out DIR`")


def _header(runs: list[tuple[dict, pd.DataFrame]], gpu: str | None) -> dict:
    from zipage.config import ZipageConfig

    headers = []
    for summary, _ in runs:
        settings = summary["settings"]
        config = ZipageConfig.from_dict(settings["config"])
        headers.append({
            "model": model_label(settings["model"]),
            "gpu": gpu or settings["hardware"],
            "dtype": settings["dtype"],
            **config.cost_knobs(),
            "tensor_parallel": settings["tensor_parallel"],
            "compress": config.compress, "async_compress": config.async_compress,
        })
    # Which steps replayed CUDA graphs. Runs without the field do not say: they agree with any.
    known = [summary["graphs"] for summary, _ in runs if summary.get("graphs") is not None]
    # The token buckets padded steps ran at (engine runs record them since they were added).
    buckets = [summary["prefill_buckets"] for summary, _ in runs
               if summary.get("prefill_buckets") is not None]
    # The decode graphs' batch sizes (engine runs record them since 2026-11-29).
    graph_sizes = [summary[DECODE_GRAPH_SIZES] for summary, _ in runs
                   if summary.get(DECODE_GRAPH_SIZES) is not None]
    # The decode grid's programs an SM (recorded since 2026-12-01; before, 4 in every run).
    grids = [summary.get(DECODE_PROGRAMS_PER_SM) or PROGRAMS_PER_SM for summary, _ in runs]
    # How decode steps split their rows (recorded since 2026-12-02; before, "batch" in every run).
    splits = [summary.get(DECODE_SPLIT) or "batch" for summary, _ in runs]
    for other in headers[1:]:
        differ = [key for key in headers[0] if other[key] != headers[0][key]]
        if any(graphs != known[0] for graphs in known[1:]):
            differ.append("graphs")
        if any(value != buckets[0] for value in buckets[1:]):
            differ.append("prefill_buckets")
        if any(value != graph_sizes[0] for value in graph_sizes[1:]):
            differ.append(DECODE_GRAPH_SIZES)
        if any(value != grids[0] for value in grids[1:]):
            differ.append(DECODE_PROGRAMS_PER_SM)
        if any(value != splits[0] for value in splits[1:]):
            differ.append(DECODE_SPLIT)
        if differ:
            raise ConfigError(f"--from-run: the runs differ in {', '.join(differ)}; fit one "
                              "profile per setup")
    header = headers[0]
    header.pop("compress"), header.pop("async_compress")
    if known:
        header["graphs"] = known[0]
    if buckets and buckets[0]:
        header["prefill_buckets"] = buckets[0]
    if graph_sizes and graph_sizes[0] and header.get("graphs", {}).get("decode"):
        header[DECODE_GRAPH_SIZES] = graph_sizes[0]
    header[DECODE_PROGRAMS_PER_SM] = grids[0]
    header[DECODE_SPLIT] = splits[0]
    # A new fit prices the longest request over its decode partitions, as the split-K kernel
    # runs it, wherever the header names the partitions (a preset model, a GPU of the table):
    # always, not the better of the two forms on the fit's own points, because those points
    # favour it anyway (5.1 -> 2.9 % on the 8B H200 runs) and cannot say whether the context
    # slope it leaves is right; only long uncompressed contexts can (`zipage calibrate` runs
    # fit-longctx for them). docs/cost_model.md, 'Decode: the longest request'.
    if partition_geometry_known(header):
        header[DECODE_EXCESS] = PER_PARTITION
    return {"version": PROFILE_VERSION, "source": "runs",
            "note": f"fitted by `zipage calibrate --from-run` from {len(runs)} run(s)", **header}


def _durations(steps: pd.DataFrame, stall_factor: float | None, chunked: bool
               ) -> pd.DataFrame:
    """The steps with `duration` (start to end plus the run's median gap to the next step),
    `stalled` (a decode step over `stall_factor` times the median) and `unsynced`
    (`unsynced_chunk_steps`; only where the run chunked its prompts)."""
    steps = steps.copy()
    gaps = (steps["t_start"].shift(-1) - steps["t_end"]).dropna()
    gap = float(gaps.median()) if len(gaps) else 0.0
    steps["duration"] = steps["t_end"] - steps["t_start"] + max(gap, 0.0)
    steps["stalled"] = False
    steps["unsynced"] = False
    decode = steps["kind"] == "decode"
    if not decode.any():
        return steps
    median = steps.loc[decode, "duration"].median()
    if stall_factor is not None:
        steps["stalled"] = decode & (steps["duration"] > stall_factor * median)
    if chunked:
        steps["unsynced"] = unsynced_chunk_steps(steps["kind"], steps["duration"], steps.get("n_sampled"))
    return steps


def unsynced_chunk_steps(kinds: pd.Series, durations: pd.Series, sampled: pd.Series | None = None
                         ) -> pd.Series:
    """The steps of an engine run whose recorded durations are not their own, in a run that
    chunked its prompts (without chunking every prefill step samples).

    A prefill step that samples nothing (a prompt's chunk before its last) ends when its forward
    is launched, not done, and the next step that samples waits for it (the 8B H200 loop runs:
    2,048-token chunks "taking" 2 ms, the next step 80 ms for 35; a 20,000-token prompt's nine
    chunks 1-56 ms, the tenth 765 ms). Flagged: every step that samples nothing and the step
    after each. `sampled`: the steps' `n_sampled`; where the run did not record it (-1), a
    prefill step shorter than the run's median decode step stands for one that samples nothing
    (no forward of the same weights can be faster, though a tiny model's short prompt on a busy
    CPU may: a step like any other, hence the record)."""
    if sampled is not None and (sampled >= 0).all():
        silent = sampled == 0
    else:
        decode = kinds == "decode"
        if not decode.any():
            return pd.Series(False, index=kinds.index)
        silent = (kinds == "prefill") & (durations < durations[decode].median())
    return silent | silent.shift(1, fill_value=False)


def _collect(steps: pd.DataFrame, asynchronous: bool, behind: bool, points: dict[str, list],
             sync: list, batches: list[AsyncBatch]) -> int:
    """Sort one run's steps into clean points, sync compressions and async batches; returns the
    number of stalled steps left out. `behind`: the run launched each async batch behind its
    step's forward, so a batch overlaps the steps after its launching step (that one too only
    when the batch reported done in it, which a short batch can)."""
    in_flight: AsyncBatch | None = None
    tainted = False  # the batch in flight launched or overlapped a stalled step
    for step in steps.itertuples(index=False):
        duration = float(step.duration)
        work = None
        if step.kind in points:  # every kind but idle runs a forward
            work = StepWork(num_decode=int(step.n_decode),
                            decode_context_tokens=int(step.decode_context_tokens),
                            num_prefill=int(step.n_prefill),
                            prefill_tokens=int(step.prefill_tokens),
                            attention_pairs=int(step.attention_pairs),
                            decode_max_context=int(step.decode_max_context),
                            shared_kv_tokens=int(step.shared_kv_tokens))
        before_batch = False  # a launching step the batch (launched behind it) did not overlap
        if step.n_compress and asynchronous and in_flight is None:
            in_flight = AsyncBatch(int(step.n_compress), int(step.compress_blocks))
            tainted = False
            before_batch = behind and work is not None and not step.batches_done
        if before_batch:
            tainted |= bool(step.stalled)
            if step.kind == "decode" and not step.stalled:
                points["launch"].append(_point("decode", work, duration))
        elif in_flight is not None:
            in_flight.steps.append((work, duration))
            in_flight.span_s += duration
            tainted |= bool(step.stalled)
        elif step.stalled or step.unsynced:
            pass
        elif step.n_compress:  # sync: the compressions run before this step's forward
            sync.append(({"requests": int(step.n_compress), "blocks": int(step.compress_blocks)},
                         work, duration))
        elif work is not None:
            points[step.kind].append(_point(step.kind, work, duration))
        if step.batches_done and in_flight is not None:
            if not tainted:
                batches.append(in_flight)
            in_flight = None
    return int(steps["stalled"].sum())


def _extra_points(model: CalibratedCostModel, batches: list[AsyncBatch]) -> list[dict]:
    """Batches launched behind their step's forward, as the time they added to the steps they
    overlapped (each step's time beyond its fitted forward; an idle step's whole): a point per
    batch, at the mean over the batches of its size. A batch mostly ends in the step after its
    launch, so its duration and the slowdown it causes cannot be told apart, and only their
    product moves the run; with the serial contention factor (2) the simulator adds exactly
    that time. The mean of its size, not its own: one batch's extra is a difference of two step
    times, noise included, and a relative-error fit of noisy differences near zero would follow
    the noise."""
    extras = [sum(duration - (model.forward_time_for(work) if work is not None else 0.0)
                  for work, duration in batch.steps) for batch in batches]
    groups: dict[int, list[float]] = {}
    for batch, extra in zip(batches, extras):
        groups.setdefault(batch.blocks, []).append(extra)
    means = {blocks: sum(values) / len(values) for blocks, values in groups.items()}
    return [{"requests": batch.requests, "blocks": batch.blocks, "time_s": means[batch.blocks]}
            for batch in batches]


OUTLIER_SPREAD = 5.0


def drop_outliers(profile: dict, limit: float, rounds: int = 2) -> int:
    """Leave out of `profile`'s forward sections the points its own fit misses by more than
    `limit` (relative), or OUTLIER_SPREAD times the section's median miss if larger: a step
    whose time is not its work's (a kernel compiled mid-run, a prompt chunk that samples
    nothing and so returns before its GPU work ends, a host pause). Fitted and trimmed
    `rounds` times; returns how many points were left out."""
    dropped = 0
    for _ in range(rounds):
        model = CalibratedCostModel.from_profile(profile)
        for section in ("decode", "prefill", "mixed", "launch"):
            rows = profile.get(section)
            if not rows:
                continue
            misses = np.array([abs(_predict(model, section, row) / row["time_s"] - 1.0)
                               for row in rows])
            bound = max(limit, OUTLIER_SPREAD * float(np.median(misses)))
            kept = [row for row, miss in zip(rows, misses) if miss <= bound]
            dropped += len(rows) - len(kept)
            profile[section] = kept
    return dropped


def _predict(model: CalibratedCostModel, section: str, row: dict) -> float:
    decodes = section != "prefill"
    prompts = section in ("prefill", "mixed")
    requests = row.get("requests", 1)
    work = StepWork(
        num_decode=row["batch"] if decodes else 0,
        decode_context_tokens=row["context_tokens"] if decodes else 0,
        num_prefill=requests if prompts else 0,
        prefill_tokens=round(requests * row["new_tokens"]) if prompts else 0,
        attention_pairs=(row.get("attention_pairs") if row.get("attention_pairs") is not None
                         else requests * causal_pairs(row["new_tokens"],
                                                      row.get("cached_tokens", 0)))
        if prompts else 0,
        decode_max_context=int(row.get("max_context") or 0) if decodes else 0,
        shared_kv_tokens=row.get("shared_tokens", 0) if decodes else 0)
    forward = model.forward_time_for(work)
    # A launching step is priced at least its host floor, as the simulator prices it.
    return model.launch_time(forward) if section == "launch" else forward


def _overlapped_whole(batch: AsyncBatch) -> list[tuple[StepWork | None, float]]:
    """The steps a batch overlapped from their start to their end: all but the reporting one."""
    return batch.steps[:-1]


def _contention(model: CalibratedCostModel, batches: list[AsyncBatch], default: float) -> float:
    """The median slowdown of the steps batches overlapped whole; `default` (the analytic
    model's, measured on the engine) when no batch outlasted a step."""
    ratios = [duration / model.forward_time_for(work) for batch in batches
              for work, duration in _overlapped_whole(batch) if work is not None]
    if not ratios:
        return default
    return max(1.0, statistics.median(ratios))


def _batch_point(model: CalibratedCostModel, batch: AsyncBatch, contention: float) -> dict:
    """The batch's duration as the simulator would have to run it to stretch its steps as the
    engine's were: the steps it overlapped whole, plus the part of the reporting step that
    step's extra time over its forward implies, (extra) / (c - 1); an idle reporting step
    waited for the batch whole."""
    point = {"requests": batch.requests, "blocks": batch.blocks}
    if contention < FREE_OVERLAP:
        return {**point, "time_s": batch.span_s}
    whole = sum(duration for _, duration in _overlapped_whole(batch))
    work, duration = batch.steps[-1]
    last = duration
    if work is not None:
        extra = duration - model.forward_time_for(work)
        last = min(max(extra / (contention - 1.0), 0.0), duration)
    return {**point, "time_s": whole + last}


def _point(kind: str, work: StepWork, duration: float) -> dict:
    """A profile point in the section `kind` (format: docs/cost_model.md). A step's prompts
    differ in length: `new_tokens` is their mean, `attention_pairs` the step's total."""
    decode = {"batch": work.num_decode, "context_tokens": work.decode_context_tokens}
    if work.decode_max_context:  # runs written before steps.csv had it give none
        decode["max_context"] = work.decode_max_context
    if work.shared_kv_tokens and kind == "decode":
        decode["shared_tokens"] = work.shared_kv_tokens
    prompts, tokens = max(work.num_prefill, 1), work.prefill_tokens
    mean = tokens // prompts if tokens % prompts == 0 else tokens / prompts
    prefill = {"new_tokens": mean, "requests": prompts,
               "attention_pairs": work.attention_pairs}
    sections = {"decode": decode, "prefill": prefill, "mixed": {**decode, **prefill}}
    return {**sections[kind], "time_s": duration}
