"""A profile's decode fit both ways on the same points: as written (a new profile prices the
longest request over its decode partitions, decode_excess "per_partition") and per entry (the
field removed), with each one's error on the decode steps of the given engine runs, by batch.
What bench/partition_fit_gpu.sh prints after each calibration (docs/cost_model.md, 'Decode: the
longest request over its partitions'). Only the decode model is compared: a profile's compress
points are residuals over the decode model it was written with.

    python bench/partition_fits.py PROFILE [RUN_DIR ...]
"""

from __future__ import annotations

import sys

import numpy as np

from zipage.profile import DECODE_EXCESS, DECODE_EXCESS_MODES, read_profile
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_model import StepWork
from zipage.sim.profile_from_runs import forward_points

# Batch ranges of 66, 33-16, 13-4, 3-2 and 1 partitions a sequence on an 8B H200 (8 KV heads, 132
# SMs): where the two forms differ most, and (batch 34 and up) where they agree.
BATCHES = ((1, 2), (2, 5), (5, 17), (17, 34), (34, 10_000))


def models(path: str) -> dict[str, CalibratedCostModel]:
    """The profile's decode model fitted each way, whichever way it was written."""
    _, data = read_profile(path)
    return {mode: CalibratedCostModel.from_profile({**data, DECODE_EXCESS: mode})
            for mode in DECODE_EXCESS_MODES}


def errors(model: CalibratedCostModel, points: list[dict]) -> str:
    batch = np.array([point["batch"] for point in points])
    time = np.array([point["time_s"] for point in points])
    predicted = np.array([model.forward_time_for(StepWork(
        point["batch"], point["context_tokens"], decode_max_context=point.get("max_context") or 0,
        shared_kv_tokens=point.get("shared_tokens", 0))) for point in points])
    parts = [f"sum {predicted.sum() / time.sum() - 1:+.1%} rms "
             f"{np.sqrt(np.mean((predicted / time - 1) ** 2)):.1%}"]
    for low, high in BATCHES:
        inside = (batch >= low) & (batch < high)
        if inside.any():
            parts.append(f"[{low},{min(high, 999)}) {predicted[inside].sum() / time[inside].sum() - 1:+.1%}"
                         f" ({int(inside.sum())})")
    return "  ".join(parts)


def main(path: str, runs: list[str]) -> None:
    fitted = models(path)
    for name, model in fitted.items():
        fit = model.decode_fit
        print(f"{name:<14} decode {fit.describe()} s  (relative RMS error "
              f"{fit.relative_rms_error:.1%} over {fit.num_points} points)")
    for run in runs:
        points = forward_points([run], stall_factor=10)["decode"]
        if not points:
            continue
        print(f"{run.rstrip('/').split('/')[-1]}: {len(points)} decode steps")
        for name, model in fitted.items():
            print(f"  {name:<14} {errors(model, points)}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
