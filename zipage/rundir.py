"""A finished run, on disk and as the `--json` object: the files every run directory has
(summary.json, steps.csv, requests.csv, and decisions.log unless skipped) for either twin.
Plotting lives in `zipage.analysis`; the CLI adds timeline.png.

The decision log has one line per step (the scheduler's plan in words, what `zipage compare`
diffs): 140 MB for the AMC23 trace. `decisions="gzip"` writes decisions.log.gz instead (about
a tenth), `"none"` skips it."""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import asdict
from pathlib import Path

from zipage.core.config import ZipageConfig
from zipage.core.memory import MemoryPlan
from zipage.core.metrics import REQUEST_COLUMNS, STEP_COLUMNS
from zipage.deployment import ReplaySettings
from zipage.errors import ConfigError


DECISIONS_FILE = "decisions.log"
DECISION_FORMATS = {"plain": DECISIONS_FILE, "gzip": DECISIONS_FILE + ".gz", "none": None}


def run_summary(summary: dict, capacity: MemoryPlan, config: ZipageConfig,
                settings: ReplaySettings, driver: str) -> dict:
    """The `--json` object: the metrics summary plus the capacity the run was planned with and
    the device it ran on (the simulated GPU's table name, or the engine's device type)."""
    return {
        **summary,
        # A maximum over the requests that compressed: none under Full KV, or when no
        # request grew long enough to compress.
        "max_blocks_after_compress": (summary["max_blocks_after_compress"]
                                      if config.compress and summary["compressions"] else None),
        "device": run_device(settings, driver),
        "n_max": config.n_max if config.compress else None,
        "max_concurrency": capacity.num_query_slots if config.compress else None,
        "num_blocks": capacity.num_blocks,
        "driver": driver,
        "settings": settings.to_dict(),
    }


def run_device(settings: ReplaySettings, driver: str) -> str:
    """What the run ran on: the hardware table's name of the simulated GPU ("h100" ->
    "h100-80gb"), or "cpu" / "cuda" for the real engine (which ignores --hardware)."""
    if driver.startswith("engine-"):
        return driver.removeprefix("engine-")
    from zipage.sim.hardware import get_hardware

    return get_hardware(settings.hardware).name


def check_out_dir(out_dir: str | Path, flag: str = "--out") -> Path:
    """Refuse an output directory that cannot be one before the run starts (a long run should
    not end in a traceback): it must be a directory or not exist yet."""
    out = Path(out_dir)
    for parent in (out, *out.parents):
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{flag}: {parent} exists and is not a directory; give a directory "
                              "(it is created if missing)")
    return out


def write_run(out_dir: str | Path, summary: dict, steps: list, requests: list,
              decision_log: list[str], decisions: str = "plain") -> Path:
    """Write the run's files into `out_dir` (created if missing); `decisions` is a key of
    DECISION_FORMATS. Returns the directory."""
    if decisions not in DECISION_FORMATS:
        raise ConfigError(f"decisions: got {decisions!r}, expected one of "
                          f"{', '.join(DECISION_FORMATS)}")
    out = check_out_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_csv(out / "steps.csv", STEP_COLUMNS, steps)
    _write_csv(out / "requests.csv", REQUEST_COLUMNS, requests)
    for name in DECISION_FORMATS.values():  # no stale log of an earlier run in another format
        if name is not None:
            (out / name).unlink(missing_ok=True)
    text = "\n".join(decision_log) + ("\n" if decision_log else "")
    if decisions == "plain":
        (out / DECISIONS_FILE).write_text(text)
    elif decisions == "gzip":
        with gzip.open(out / DECISION_FORMATS["gzip"], "wt") as handle:
            handle.write(text)
    return out


def _write_csv(path: Path, columns: list[str], records: list) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for record in records:
            row = asdict(record)
            writer.writerow([row[column] for column in columns])
