"""A finished run, on disk and as the `--json` object: the files every run directory has
(summary.json, steps.csv, requests.csv, decisions.log) for either twin. Plotting lives in
`zipage.analysis`; the CLI adds timeline.png."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

from zipage.core.config import ZipageConfig
from zipage.core.memory import MemoryPlan
from zipage.core.metrics import REQUEST_COLUMNS, STEP_COLUMNS
from zipage.deployment import ReplaySettings
from zipage.errors import ConfigError


def run_summary(summary: dict, capacity: MemoryPlan, config: ZipageConfig,
                settings: ReplaySettings, driver: str) -> dict:
    """The `--json` object: the metrics summary plus the capacity the run was planned with."""
    return {
        **summary,
        "n_max": config.n_max if config.compress else None,
        "max_concurrency": capacity.num_query_slots if config.compress else None,
        "num_blocks": capacity.num_blocks,
        "driver": driver,
        "settings": settings.to_dict(),
    }


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
              decision_log: list[str]) -> Path:
    out = check_out_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_csv(out / "steps.csv", STEP_COLUMNS, steps)
    _write_csv(out / "requests.csv", REQUEST_COLUMNS, requests)
    (out / "decisions.log").write_text("\n".join(decision_log) + ("\n" if decision_log else ""))
    return out


def _write_csv(path: Path, columns: list[str], records: list) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for record in records:
            row = asdict(record)
            writer.writerow([row[column] for column in columns])
