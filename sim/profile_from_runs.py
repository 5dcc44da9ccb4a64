"""A calibrated cost profile fitted from real runs: `zipage calibrate --from-run RUN_DIR...`.

`zipage calibrate --gpu` times synthetic steps; users have production traffic instead. Every run
directory an engine replay or a served run writes (`--out`) holds each step's kind, batch,
context, prefill tokens and attention pairs, compressed blocks and measured start and end. This
module turns those steps into the profile format of `CalibratedCostModel` (docs/cost_model.md):

- decode points: decode steps that neither compress nor overlap an async compression batch;
- prefill points: prefill steps, one point each (`new_tokens` and its `attention_pairs`);
- compress points: sync compressions, measured as the step's time minus the decode fit's
  prediction of its decode; async batches as the time from the launching step's start to the end
  of the step that reported them done (an upper bound: the batch shares the GPU meanwhile);
- the contention factor: the median ratio of overlapped decode steps to the decode fit.

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

from .cost_model import PROFILE_VERSION, CalibratedCostModel


def profile_from_runs(run_dirs: list[str | Path], *, gpu: str | None = None) -> dict:
    """The profile of the runs in `run_dirs`; `gpu` labels it (default: the runs' hardware)."""
    if not run_dirs:
        raise ConfigError("--from-run: give at least one run directory (zipage replay --out)")
    runs = [_read(Path(directory)) for directory in run_dirs]
    header = _header(runs, gpu)
    decode, prefill, compress, overlapped = [], [], [], []
    for summary, steps in runs:
        asynchronous = summary["settings"]["config"]["async_compress"]
        _collect(steps, asynchronous, decode, prefill, compress, overlapped)
    profile = {**header, "decode": decode, "prefill": prefill}
    decode_fit = CalibratedCostModel.from_profile(profile).decode_fit
    for row in compress:
        batch, context = row.pop("batch"), row.pop("context_tokens")
        if row.pop("sync"):  # the step's time less its decode
            row["time_s"] -= decode_fit.predict(batch, context)
    usable = [row for row in compress if row["time_s"] > 0]
    if usable:
        profile["compress"] = usable
    ratios = [row["time_s"] / decode_fit.predict(row["batch"], row["context_tokens"])
              for row in overlapped]
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
    needed = {"kind", "n_decode", "n_compress", "decode_context_tokens", "prefill_tokens",
              "attention_pairs", "compress_blocks", "batches_done", "t_start", "t_end"}
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


def _collect(steps: pd.DataFrame, asynchronous: bool, decode: list, prefill: list,
             compress: list, overlapped: list) -> None:
    launched_at: float | None = None  # start of the step that launched the batch in flight
    pending: dict | None = None  # the compress point of that batch, until it is reported done
    for step in steps.itertuples(index=False):
        duration = float(step.t_end - step.t_start)
        if step.kind == "prefill":
            prefill.append({"new_tokens": int(step.prefill_tokens),
                            "attention_pairs": int(step.attention_pairs), "time_s": duration})
        elif step.kind == "decode":
            point = {"batch": int(step.n_decode), "context_tokens": int(step.decode_context_tokens),
                     "time_s": duration}
            if step.n_compress and not asynchronous:
                compress.append({"requests": int(step.n_compress),
                                 "blocks": int(step.compress_blocks), "sync": True, **point})
            elif step.n_compress:
                launched_at = float(step.t_start)
                pending = {"requests": int(step.n_compress), "blocks": int(step.compress_blocks),
                           "sync": False, **point}
                overlapped.append(point)
            elif launched_at is not None:
                overlapped.append(point)
            elif step.n_decode:
                decode.append(point)
        if step.batches_done and pending is not None:
            pending["time_s"] = float(step.t_end) - launched_at
            compress.append(pending)
            launched_at = pending = None
