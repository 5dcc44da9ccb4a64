"""A profile's decode fit at the live batch and at the captured graph's padded batch
(decode_graph_sizes), each judged on decode points it was not fitted on: k-fold cross-validation
over the profile's own decode points (docs/cost_model.md, 'Decode: the graph's padded batch').
Only the decode model is compared: a profile's compress points are residuals over the decode
model it was written with, so a shipped profile does not change form by this; it is measured
again. Prints, per profile, each form's held-out error in all and by batch range, and how far
the live form's residuals follow the padding.

    python bench/graph_batch_fits.py [PROFILE ...]   (default: every shipped H200 profile)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from zipage.decode_grid import GRAPH_BATCH_SIZES, graph_batch
from zipage.profile import DECODE_GRAPH_SIZES, read_profile
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_model import StepWork

ROOT = Path(__file__).resolve().parent.parent
FOLDS = 5
# Batch ranges the captured sizes split unevenly: 9-16 pads to 16, 17-24 to 24, 33-48 to 48, ...
BATCHES = ((1, 9), (9, 33), (33, 65), (65, 10_000))


def held_out_errors(data: dict, sizes: list[int] | None, seed: int = 0) -> np.ndarray:
    """Each decode point's relative error under a decode model fitted without it."""
    # The decode section and what its fit reads; the other sections left out (their fits are
    # not compared, and launch's is fitted over the decode model).
    header = {key: value for key, value in data.items()
              if key not in (DECODE_GRAPH_SIZES, "decode", "launch", "compress", "contention_factor")}
    if sizes:
        header[DECODE_GRAPH_SIZES] = sizes
    points = data["decode"]
    order = np.random.default_rng(seed).permutation(len(points))
    errors = np.zeros(len(points))
    for fold in np.array_split(order, FOLDS):
        kept = np.setdiff1d(order, fold)
        model = CalibratedCostModel.from_profile(
            {**header, "decode": [points[i] for i in kept]})
        for i in fold:
            point = points[i]
            predicted = model.forward_time_for(StepWork(
                point["batch"], point["context_tokens"],
                decode_max_context=point.get("max_context") or 0,
                shared_kv_tokens=point.get("shared_tokens", 0)))
            errors[i] = predicted / point["time_s"] - 1
    return errors


def report(path: Path) -> None:
    _, data = read_profile(path)
    batch = np.array([point["batch"] for point in data["decode"]])
    padding = np.array([graph_batch(b, GRAPH_BATCH_SIZES) / b - 1 for b in batch])
    live = held_out_errors(data, None)
    padded = held_out_errors(data, list(GRAPH_BATCH_SIZES))
    print(f"{path.name}: {len(batch)} decode points, batch {batch.min()}-{batch.max()}; "
          f"live residuals vs padding: r = {np.corrcoef(live, padding)[0, 1]:+.2f}")
    for name, errors in (("live", live), ("padded", padded)):
        parts = [f"rms {np.sqrt(np.mean(errors ** 2)):.2%}"]
        for low, high in BATCHES:
            inside = (batch >= low) & (batch < high)
            if inside.any():
                parts.append(f"[{low},{min(high, 999)}) {np.sqrt(np.mean(errors[inside] ** 2)):.1%}"
                             f" ({int(inside.sum())})")
        print(f"  {name:<7} {'  '.join(parts)}")


def main(paths: list[str]) -> None:
    for path in paths or sorted((ROOT / "sim" / "profiles").glob("*-h200-*.json")):
        report(Path(path))


if __name__ == "__main__":
    main(sys.argv[1:])
