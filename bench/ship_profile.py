"""Thin a measured profile for shipping, and check that thinning changed no fidelity figure.

    python bench/ship_profile.py OUT/profile.json OUT/runs --out sim/profiles/NAME.json

A profile measured through the engine loop keeps every step it fitted (thousands of decode,
launch and compress points: ~1 MB). The simulator refits from the points when it loads one, so
the shipped file keeps every `stride`-th point of a section over `--max-points` (the points are in
run order, so a stride keeps every run and every phase of it). Then every engine run of a
`zipage fidelity --out OUT` directory (OUT/runs/NAME/engine) is simulated again with the thinned
profile, and its errors are printed beside those of the full profile that `zipage fidelity`
wrote (OUT/fidelity.json), with the validation re-run the same way. Ship only where they agree.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from zipage.analysis.calibration import TRACE_FILE, format_table, twin_errors, validation_record
from zipage.core.deployment import ReplaySettings
from zipage.trace_import import load_trace_file

THINNED = ("decode", "launch", "compress")


def thin(profile: dict, max_points: int) -> tuple[dict, list[str]]:
    """The profile with every section of THINNED cut to every k-th point (at most max_points),
    and a note per cut section ("decode: one point in 6 of 6,157")."""
    thinned, notes = dict(profile), []
    for section in THINNED:
        points = profile.get(section) or []
        if len(points) > max_points:
            stride = -(-len(points) // max_points)
            thinned[section] = points[::stride]
            notes.append(f"{section}: one point in {stride} of {len(points):,}")
    return thinned, notes


def rerun(profile: dict, engine_runs: list[Path], scratch: Path) -> list[dict]:
    """One row per engine run and model: the simulation's errors against the run."""
    rows = []
    for engine_run in engine_runs:
        summary = json.loads((engine_run / "summary.json").read_text())
        settings = ReplaySettings.from_dict(summary["settings"])
        trace = load_trace_file(engine_run / TRACE_FILE)
        errors = twin_errors(trace, engine_run, settings, profile, scratch / trace.name)
        rows += [{"trace": trace.name, "model": model, **values} for model, values in errors.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path, help="the profile `zipage fidelity` wrote")
    parser.add_argument("runs", type=Path, help="its runs/ directory (engine runs per trace)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="its calibration/ directory, to re-run the validation (default: "
                             "beside runs/)")
    parser.add_argument("--max-points", type=int, default=1200)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    profile = json.loads(args.profile.read_text())
    thinned, notes = thin(profile, args.max_points)
    if notes:
        thinned["note"] = f"{profile.get('note', '')}; shipped with {', '.join(notes)}"
    calibration = args.calibration or args.runs.parent / "calibration"
    with tempfile.TemporaryDirectory(prefix="ship-profile-") as scratch:
        validation = calibration / profile["validation"]["workload"]
        if validation.exists():  # the held-out trace, re-run with the thinned points
            rows = rerun(thinned, [validation], Path(scratch) / "validation")
            errors = {row["model"]: {k: v for k, v in row.items() if k not in ("trace", "model")}
                      for row in rows}
            thinned["validation"] = validation_record(load_trace_file(validation / TRACE_FILE), errors)
            print("validation, thinned profile:\n" + format_table(
                [{"trace": validation.name, "model": model, **values} for model, values in errors.items()]))
        rows = rerun(thinned, sorted(args.runs.glob("*/engine")), Path(scratch))
        print("fidelity runs, thinned profile:\n" + format_table(rows))
    full = args.runs.parent / "fidelity.json"
    if full.exists():
        print("fidelity runs, full profile (zipage fidelity):\n"
              + format_table(json.loads(full.read_text())["rows"]))
    args.out.write_text(json.dumps(thinned, indent=1) + "\n")
    print(f"wrote {args.out} ({'; '.join(notes) or 'nothing thinned'})")


if __name__ == "__main__":
    main()
