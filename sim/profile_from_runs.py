"""A calibrated cost profile fitted from real runs: `zipage calibrate --from-run RUN_DIR...`.

`zipage calibrate --gpu` times synthetic steps; users have production traffic instead. Every run
directory an engine replay or a served run writes (`--out`) holds each step's kind, batch,
context, prefill tokens and attention pairs, compressed blocks and measured start and end. This
module turns those steps into the profile format of `CalibratedCostModel` (docs/cost_model.md):

- decode, prefill and mixed points (a mixed step: decodes and prompt chunks in one forward, with
  chunked prefill): the steps of that kind that neither compress nor overlap an async
  compression batch, one point each (batch and context tokens of the decodes, new tokens and
  attention pairs of the prompt chunks);
- compress points: sync compressions, measured as the step's time minus the fitted model's
  prediction of its forward; async batches as the time from the launching step's start to the end
  of the step that reported them done (an upper bound: the batch shares the GPU meanwhile);
- the contention factor: the median ratio of overlapped steps to the fitted model.

A step starts when the engine's loop iteration does, so the host time between steps (admission,
scheduling, input staging) is inside the fitted times. The profile's header names the model,
GPU, dtype and knobs the runs had; the runs must agree on them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd

from zipage.errors import ConfigError

from .cost_model import PROFILE_VERSION, CalibratedCostModel, StepWork


def profile_from_runs(run_dirs: list[str | Path], *, gpu: str | None = None) -> dict:
    """The profile of the runs in `run_dirs`; `gpu` labels it (default: the runs' hardware)."""
    if not run_dirs:
        raise ConfigError("--from-run: give at least one run directory (zipage replay --out)")
    runs = [_read(Path(directory)) for directory in run_dirs]
    header = _header(runs, gpu)
    points: dict[str, list] = {"decode": [], "prefill": [], "mixed": []}
    compress, overlapped = [], []
    for summary, steps in runs:
        asynchronous = summary["settings"]["config"]["async_compress"]
        _collect(steps, asynchronous, points, compress, overlapped)
    profile = {**header, "decode": points["decode"], "prefill": points["prefill"]}
    if len(points["mixed"]) >= 2:  # what a fit of their constant needs; else one is assumed
        profile["mixed"] = points["mixed"]
    model = CalibratedCostModel.from_profile(profile)
    for row in compress:
        work = row.pop("work")
        if row.pop("sync"):  # the step's time less its forward
            row["time_s"] -= model.forward_time_for(work)
    usable = [row for row in compress if row["time_s"] > 0]
    if usable:
        profile["compress"] = usable
    ratios = [time_s / model.forward_time_for(work) for work, time_s in overlapped]
    if ratios:
        profile["contention_factor"] = round(max(1.0, statistics.median(ratios)), 4)
    return profile


def _read(directory: Path) -> tuple[dict, pd.DataFrame]:
    try:
        summary = json.loads((directory / "summary.json").read_text())
        steps = pd.read_csv(directory / "steps.csv")
    except (OSError, ValueError) as error:
        raise ConfigError(f"--from-run {directory}: cannot read the run directory ({error}); "
                          "give a directory written by `zipage replay --gpu --out DIR`") from None
    needed = {"kind", "n_prefill", "n_decode", "n_compress", "decode_context_tokens",
              "prefill_tokens", "attention_pairs", "compress_blocks", "batches_done", "t_start",
              "t_end"}
    missing = sorted(needed - set(steps.columns))
    if missing or "settings" not in summary:
        raise ConfigError(f"--from-run {directory}: steps.csv lacks {', '.join(missing) or '-'}"
                          "; rerun with this version's `zipage replay --out`")
    if summary.get("driver") in ("simulator", "step-replay"):
        raise ConfigError(f"--from-run {directory}: a {summary['driver']} run; fit profiles from "
                          "real engine runs (zipage replay --gpu --out, or zipage bench serve)")
    return summary, steps


def _header(runs: list[tuple[dict, pd.DataFrame]], gpu: str | None) -> dict:
    from zipage.core.config import ZipageConfig

    headers = []
    for summary, _ in runs:
        settings = summary["settings"]
        config = ZipageConfig.from_dict(settings["config"])
        headers.append({
            "model": settings["model"].removeprefix("random:"),
            "gpu": gpu or settings["hardware"],
            "dtype": settings["dtype"],
            **config.cost_knobs(),
            "tensor_parallel": settings["tensor_parallel"],
            "compress": config.compress, "async_compress": config.async_compress,
        })
    for other in headers[1:]:
        differ = [key for key in headers[0] if other[key] != headers[0][key]]
        if differ:
            raise ConfigError(f"--from-run: the runs differ in {', '.join(differ)}; fit one "
                              "profile per setup")
    header = headers[0]
    header.pop("compress"), header.pop("async_compress")
    return {"version": PROFILE_VERSION, "source": "runs",
            "note": f"fitted by `zipage calibrate --from-run` from {len(runs)} run(s)", **header}


def _collect(steps: pd.DataFrame, asynchronous: bool, points: dict[str, list], compress: list,
             overlapped: list) -> None:
    launched_at: float | None = None  # start of the step that launched the batch in flight
    pending: dict | None = None  # the compress point of that batch, until it is reported done
    for step in steps.itertuples(index=False):
        duration = float(step.t_end - step.t_start)
        if step.kind in points:  # every kind but idle runs a forward
            work = StepWork(num_decode=int(step.n_decode),
                            decode_context_tokens=int(step.decode_context_tokens),
                            num_prefill=int(step.n_prefill),
                            prefill_tokens=int(step.prefill_tokens),
                            attention_pairs=int(step.attention_pairs))
            if step.n_compress and not asynchronous:
                compress.append({"requests": int(step.n_compress),
                                 "blocks": int(step.compress_blocks), "time_s": duration,
                                 "sync": True, "work": work})
            elif step.n_compress:
                launched_at = float(step.t_start)
                pending = {"requests": int(step.n_compress), "blocks": int(step.compress_blocks),
                           "sync": False, "work": work}
                overlapped.append((work, duration))
            elif launched_at is not None:
                overlapped.append((work, duration))
            else:
                points[step.kind].append(_point(step.kind, work, duration))
        if step.batches_done and pending is not None:
            pending["time_s"] = float(step.t_end) - launched_at
            compress.append(pending)
            launched_at = pending = None


def _point(kind: str, work: StepWork, duration: float) -> dict:
    """A profile point in the section `kind` (format: docs/cost_model.md)."""
    decode = {"batch": work.num_decode, "context_tokens": work.decode_context_tokens}
    prefill = {"new_tokens": work.prefill_tokens, "attention_pairs": work.attention_pairs}
    sections = {"decode": decode, "prefill": prefill, "mixed": {**decode, **prefill}}
    return {**sections[kind], "time_s": duration}
