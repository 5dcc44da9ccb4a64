"""A finished run, on disk and as the `--json` object: the files every run directory has
(summary.json, steps.csv, requests.csv, and decisions.log unless skipped) for either twin, how
they are written (`write_run`) and read back (`load_run`, `read_decisions`).
Plotting lives in `zipage.analysis`; the CLI adds timeline.png.

The decision log has one line per step (the scheduler's plan in words, what `zipage compare`
diffs): 140 MB plain for the AMC23 trace, so it is written as decisions.log.gz by default
(`decisions="gzip"`: 2.7 MB, and ~1.5 s more on that run); `"plain"` writes decisions.log,
`"none"` skips it; summary.json's "decision_log" says which. Readers take either file.

A run is written whole or not at all: every file goes into a hidden sibling directory
(`.NAME.writing-*`), summary.json last, and that directory then takes the run's name by rename
(an existing run is renamed away first and deleted after). A writer killed at any point leaves
either the old run or the new one under NAME, never a mix; a kill between the two renames leaves
NAME absent and the old run in `.NAME.old-*`. No staging directory outlives its writer, however
it ends: a small reaper process (`_Reaper`) removes it once the writer's end of a pipe closes,
which the kernel does for a process killed by SIGKILL or the OOM killer too. summary.json's
"kind" says what wrote the run and its "rows" how many records each file holds, so readers
refuse a file cut short."""

from __future__ import annotations

import csv
import fcntl
import gzip
import io
import json
import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from zipage.errors import ConfigError
from zipage.records import REQUEST_COLUMN_DEFAULTS, REQUEST_COLUMNS, STEP_COLUMN_DEFAULTS, STEP_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")

SUMMARY_FILE = "summary.json"
STEPS_FILE = "steps.csv"
REQUESTS_FILE = "requests.csv"
DECISIONS_FILE = "decisions.log"
TIMELINE_FILE = "timeline.png"
DECISION_FORMATS = {"plain": DECISIONS_FILE, "gzip": DECISIONS_FILE + ".gz", "none": None}
DEFAULT_DECISIONS = "gzip"  # `write_run`'s and `zipage replay --decisions`'s default
# gzip's own default level: a level 9 (gzip.open's) took twice as long for a tenth less.
DECISIONS_GZIP_LEVEL = 6
# Everything a run directory may hold: replacing a directory with anything else in it would
# delete the user's files.
RUN_FILES = frozenset({SUMMARY_FILE, STEPS_FILE, REQUESTS_FILE, TIMELINE_FILE,
                       *filter(None, DECISION_FORMATS.values())})

# What wrote a run (summary.json "kind"): the simulator (also the step-time replay), the real
# engine, or `zipage bench serve`, whose client sees requests only: no steps, no decisions, no
# config.
SIMULATED, ENGINE, SERVED = "simulated", "engine", "served"
RUN_KINDS = (SIMULATED, ENGINE, SERVED)

WRITE_HINT = "re-run the command that wrote it (`zipage replay ... --out DIR`)"




def run_kind(summary: dict) -> str:
    """SIMULATED, ENGINE or SERVED: the summary's "kind", else (runs written before it was
    recorded) read from its driver."""
    kind = summary.get("kind")
    if kind in RUN_KINDS:
        return kind
    driver = str(summary.get("driver", ""))
    if driver == "served":
        return SERVED
    return ENGINE if driver.startswith("engine-") else SIMULATED


# ---------------------------------------------------------------- writing

def check_out_dir(out_dir: str | Path, flag: str = "--out") -> Path:
    """Refuse an output directory that cannot be one before the run starts (a long run should
    not end in a traceback): it must be a directory or not exist yet."""
    out = Path(out_dir)
    for parent in (out, *out.parents):
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{flag}: {parent} exists and is not a directory; give a directory "
                              "(it is created if missing)")
    return out


def check_run_out_dir(out_dir: str | Path, flag: str = "--out") -> Path:
    """`check_out_dir` for a run, which replaces the whole directory: it must not exist yet, or
    be empty, or hold only a run's files."""
    out = check_out_dir(out_dir, flag)
    if out.is_dir():
        foreign = sorted(entry.name for entry in out.iterdir() if entry.name not in RUN_FILES)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ConfigError(f"{flag}: {out} holds files that are not a run's ({shown}); the "
                              "new run replaces the whole directory, so give a new or empty "
                              "directory, or a run directory to overwrite")
    return out


def write_run(out_dir: str | Path, summary: dict, steps: list, requests: list,
              decision_log: list[str], decisions: str = DEFAULT_DECISIONS,
              finish: Callable[[Path], object] | None = None) -> Path:
    """Write the run's files and make them `out_dir` in one rename (an earlier run there is
    replaced); `decisions` is a key of DECISION_FORMATS (a served run never has a log).
    `finish(directory)` adds derived files (the timeline) before the run takes its name.
    Returns the directory."""
    writer = RunWriter(out_dir, decisions, kind=run_kind(summary))
    try:
        for step in steps:
            writer.step(step)
        for request in requests:
            writer.request(request)
        for line in decision_log:
            writer.decision(line)
    except BaseException:
        writer.discard()
        raise
    return writer.close(summary, finish)


class RunWriter:
    """A run directory written as the run goes: a `RecordSink` (zipage.core.recorder) whose
    records land in the hidden sibling directory at once, so none is kept in memory; `close`
    adds summary.json last and gives the directory its name by rename (the same one-rename
    write as `write_run`, which is built on it); `discard` removes it (a run that failed)."""

    # Decision lines go out in batches: one write, and one newline count, per batch.
    DECISION_BATCH = 4096
    takes_steps = True  # (a `RecordSink` that drops them takes none)

    def __init__(self, out_dir: str | Path, decisions: str = DEFAULT_DECISIONS,
                 kind: str = SIMULATED) -> None:
        if decisions not in DECISION_FORMATS:
            raise ConfigError(f"decisions: got {decisions!r}, expected one of "
                              f"{', '.join(DECISION_FORMATS)}")
        self.out = check_run_out_dir(out_dir)
        if kind == SERVED:  # a client sees no scheduler: an empty log would read as "no steps"
            decisions = "none"
        self.kind, self.decisions = kind, decisions
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.staging = _sibling(self.out, "writing")
        # The reaper first: a writer killed between the two leaves nothing (its rm finds no
        # directory); the other way round, a kill while the reaper starts left one behind.
        self._reaper = _Reaper(self.staging)
        self.staging.mkdir()  # mode from the umask, like any directory the user makes
        self._handles: list = []
        self._steps = self._table(STEPS_FILE, STEP_COLUMNS)
        self._requests = self._table(REQUESTS_FILE, REQUEST_COLUMNS)
        self.rows = {STEPS_FILE: 0, REQUESTS_FILE: 0}
        self._log_name = DECISION_FORMATS[decisions]
        self._log = None
        if self._log_name is not None:
            path = self.staging / self._log_name
            self._log = _packed_writer(path) if decisions == "gzip" else path.open("w")
            self._handles.append(self._log)
            self.rows[self._log_name] = 0
        self._lines: list[str] = []

    def _table(self, name: str, columns: list[str]):
        handle = (self.staging / name).open("w", newline="")
        self._handles.append(handle)
        writer = csv.writer(handle)
        writer.writerow(columns)
        row = attrgetter(*columns)  # the record's values in column order, as one tuple
        return lambda record: writer.writerow(row(record))

    def step(self, record) -> None:
        self._steps(record)
        self.rows[STEPS_FILE] += 1

    def request(self, record) -> None:
        self._requests(record)
        self.rows[REQUESTS_FILE] += 1

    def decision(self, line: str) -> None:
        if self._log is None:
            return
        self._lines.append(line)
        if len(self._lines) >= self.DECISION_BATCH:
            self._flush_decisions()

    def _flush_decisions(self) -> None:
        if self._lines:
            text = "\n".join(self._lines) + "\n"
            self._lines = []
            # What a reader can count whatever the lines hold.
            self.rows[self._log_name] += text.count("\n")
            self._log.write(text)

    def close(self, summary: dict, finish: Callable[[Path], object] | None = None) -> Path:
        """Finish the files, write summary.json (plus the kind, the log's format and the rows
        of each file), run `finish(directory)` (derived files: the timeline) and give the run
        its name. Returns the directory."""
        try:
            if self._log is not None:
                self._flush_decisions()
            self._close_handles()
            record = {**summary, "kind": self.kind, "decision_log": self.decisions,
                      "rows": self.rows}
            (self.staging / SUMMARY_FILE).write_text(json.dumps(record, indent=2) + "\n")
            if finish is not None:
                finish(self.staging)
            _replace_dir(self.staging, self.out)
        except BaseException:
            self.discard()
            raise
        self._reaper.release()
        return self.out

    def discard(self) -> None:
        self._close_handles()
        shutil.rmtree(self.staging, ignore_errors=True)
        self._reaper.release()

    def _close_handles(self) -> None:
        for handle in self._handles:
            handle.close()
        self._handles = []


def _packed_writer(path: Path):
    """A text handle writing gzip to `path`, its header's time 0: the same run gives the same
    bytes (runs are compared file for file)."""
    return io.TextIOWrapper(gzip.GzipFile(path, "wb", DECISIONS_GZIP_LEVEL, mtime=0))


REAPER_WAIT_S = 1.0  # a reaper whose pipe closed exits in milliseconds


class _Reaper:
    """Removes a staging directory or file if its writer dies before `release`. A `sh` (a millisecond to
    start, not a Python) blocks reading a pipe whose only writer is this process; the kernel
    closes that end when the process exits in any way, SIGKILL included, and then `rm -rf` runs.
    After `release` the directory is gone (renamed to the run, or discarded), so the same `rm`
    finds nothing. Its own session keeps a terminal's Ctrl-C (sent to the whole foreground group)
    from killing it before the writer has cleaned up."""

    def __init__(self, directory: Path) -> None:
        self._process = subprocess.Popen(
            ["sh", "-c", 'read _; rm -rf -- "$1"', "zipage-reaper", str(directory)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def release(self) -> None:
        """The directory is the run's now, or gone: let the reaper exit (and wait for it, so it
        is no zombie). Safe to call more than once. A child forked while the pipe was open holds
        its end too, and then the reaper lives until that child exits (its `rm` finds nothing by
        then): the wait is bounded, and subprocess reaps it later."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=REAPER_WAIT_S)
            except subprocess.TimeoutExpired:
                pass


def _replace_dir(staging: Path, out: Path) -> None:
    """Give `staging` the name `out`. Linux cannot swap two directories by rename, so an existing
    run is renamed away first and deleted after; the lock keeps two writers of one name from
    interleaving those renames."""
    with directory_lock(out.parent):
        if not out.exists():
            os.rename(staging, out)
            return
        old = _sibling(out, "old")
        os.rename(out, old)
        os.rename(staging, out)
        shutil.rmtree(old, ignore_errors=True)


def _sibling(path: Path, role: str) -> Path:
    """A hidden name beside `path` no other writer picks: `.NAME.ROLE-XXXXXXXX`."""
    return path.parent / f".{path.resolve().name}.{role}-{uuid.uuid4().hex[:8]}"


@contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive lock (flock) on a directory itself: writers of files in it take turns, and no
    lock file is left behind. Released when the block ends, or when the process dies."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def write_file_atomically(path: Path, write: Callable[[Path], T]) -> T:
    """`write(temporary)` writes the file beside `path` (same suffix, for writers that read the
    format from it), which then takes `path`'s name by rename: a reader sees the old file or the
    new one, whole, never a mix of two writers; returns what `write` returned. Symbolic links are
    followed: the file `path` names is replaced, the links stay. A `path` that names no regular
    file but a pipe, a terminal or a device (/dev/stdout) is written in place: a rename would
    replace the pipe, not feed it."""
    if path.exists() and not path.is_file():
        return write(path)
    path = Path(os.path.realpath(path))
    temporary = _sibling(path, "writing")
    temporary = temporary.with_name(temporary.name + path.suffix)
    reaper = _Reaper(temporary)  # a killed writer's half file goes too (a 10M-request trace)
    try:
        result = write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        reaper.release()
    return result


# ---------------------------------------------------------------- reading

@dataclass
class RunData:
    """The records of one run directory."""

    directory: Path
    summary: dict
    steps: pd.DataFrame
    requests: pd.DataFrame

    @property
    def kind(self) -> str:
        return run_kind(self.summary)


def load_run(directory: str | Path, flag: str | None = None,
             summary: dict | None = None) -> RunData:
    """Read `summary.json` (unless given), `steps.csv` and `requests.csv` of a run directory; a
    ConfigError (prefixed with `flag`, the option that named the directory) names a missing,
    damaged or truncated file."""
    directory = Path(directory)
    summary = summary if summary is not None else read_summary(directory, flag)
    steps = read_table(directory, STEPS_FILE, summary, flag)
    # Request ids are names ("amc23-q0-s0", but also "7"): never let pandas turn them into numbers.
    requests = read_table(directory, REQUESTS_FILE, summary, flag,
                          dtype={"id": str, "status": str, "error": str})
    for column, default in STEP_COLUMN_DEFAULTS.items():  # runs written before the column
        if column not in steps.columns:
            steps[column] = default
    for column, default in REQUEST_COLUMN_DEFAULTS.items():
        if column not in requests.columns:
            requests[column] = default
    _require_columns(steps.columns, STEP_COLUMNS, directory / STEPS_FILE, flag)
    _require_columns(requests.columns, REQUEST_COLUMNS, directory / REQUESTS_FILE, flag)
    return RunData(directory=directory, summary=summary, steps=steps, requests=requests)


def _prefix(flag: str | None) -> str:
    return f"{flag} " if flag else ""


def run_file(directory: str | Path, name: str, flag: str | None = None) -> Path:
    """Path of one file of a run directory; a clear error when it is not there."""
    path = Path(directory) / name
    if path.is_file():
        return path
    if not Path(directory).is_dir():
        left = sorted(Path(directory).parent.glob(f".{Path(directory).name}.old-*"))
        where = (f"; an interrupted write left the previous run in {left[0]}" if left else
                 "; give a directory written with --out")
        raise ConfigError(f"{_prefix(flag)}{directory}: no such run directory{where}")
    raise ConfigError(
        f"{_prefix(flag)}{path}: file not found. A run directory written by `zipage replay TRACE "
        f"--out DIR` holds {SUMMARY_FILE}, {STEPS_FILE}, {REQUESTS_FILE} and {DECISIONS_FILE}[.gz]; "
        f"check the directory or re-run the replay.")


def read_summary(directory: str | Path, flag: str | None = None) -> dict:
    """summary.json as a dict; a one-line error when it is missing, cut short or not an
    object."""
    path = run_file(directory, SUMMARY_FILE, flag)
    try:
        summary = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"{_prefix(flag)}{path}: not text: the file is damaged; "
                          f"{WRITE_HINT}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{_prefix(flag)}{path}: not valid JSON ({error.msg}: line "
                          f"{error.lineno}, column {error.colno}): the file is truncated or "
                          f"damaged; {WRITE_HINT}") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"{_prefix(flag)}{path}: expected a JSON object, got "
                          f"{type(summary).__name__}: not a run's summary; {WRITE_HINT}")
    return summary


def read_table(directory: str | Path, name: str, summary: dict, flag: str | None = None,
               dtype: dict | None = None) -> pd.DataFrame:
    """One CSV of a run, checked whole: its last line complete and, where summary.json records
    it, as many rows as the run wrote."""
    import pandas as pd

    path = run_file(directory, name, flag)
    _check_complete_last_line(path, flag)
    with _readable_csv(path, flag):
        frame = pd.read_csv(path, dtype=dtype)
    _check_rows(path, len(frame), summary, flag)
    return frame


# Rows of steps.csv (or requests.csv) read at a time by `iter_step_chunks`: ~20 MB of frame,
# whatever the run's length.
STEP_CHUNK_ROWS = 200_000


def iter_step_chunks(directory: str | Path, summary: dict, flag: str | None = None,
                     columns: list[str] | None = None,
                     rows: int | None = None) -> Iterator[pd.DataFrame]:
    """steps.csv a chunk of `rows` rows at a time, in file order (the timeline of a 2M-step run
    reads it in bounded memory); only `columns` when given. Checked as `load_run` checks it:
    the last line complete, the columns there (older runs' missing ones filled with their
    defaults), and, once read through, as many rows as the run wrote."""
    return _iter_chunks(directory, STEPS_FILE, STEP_COLUMNS, STEP_COLUMN_DEFAULTS, summary, flag,
                        columns, rows)


def iter_request_chunks(directory: str | Path, summary: dict, flag: str | None = None,
                        columns: list[str] | None = None,
                        rows: int | None = None) -> Iterator[pd.DataFrame]:
    """requests.csv as `iter_step_chunks` reads steps.csv (a day of traffic has millions)."""
    return _iter_chunks(directory, REQUESTS_FILE, REQUEST_COLUMNS, REQUEST_COLUMN_DEFAULTS,
                        summary, flag, columns, rows, dtype={"id": str, "status": str,
                                                             "error": str})


def _iter_chunks(directory: str | Path, name: str, all_columns: list[str], column_defaults: dict,
                 summary: dict, flag: str | None, columns: list[str] | None, rows: int | None,
                 dtype: dict | None = None) -> Iterator[pd.DataFrame]:
    import pandas as pd

    path = run_file(directory, name, flag)
    _check_complete_last_line(path, flag)
    wanted = all_columns if columns is None else columns
    defaults = {column: column_defaults[column] for column in wanted
                if column in column_defaults}
    found = 0
    with _readable_csv(path, flag):
        header = list(pd.read_csv(path, nrows=0).columns)
        _require_columns(header + list(defaults), wanted, path, flag)
        present = [column for column in wanted if column in header]
        dtype = {column: kind for column, kind in (dtype or {}).items() if column in present}
        for chunk in pd.read_csv(path, usecols=present, chunksize=rows or STEP_CHUNK_ROWS,
                                 dtype=dtype or None):
            found += len(chunk)
            for column, default in defaults.items():  # runs written before the column
                if column not in chunk.columns:
                    chunk[column] = default
            yield chunk
    _check_rows(path, found, summary, flag)


@contextmanager
def _readable_csv(path: Path, flag: str | None) -> Iterator[None]:
    """A CSV pandas cannot read is a one-line error naming the file."""
    import pandas as pd

    try:
        yield
    except pd.errors.EmptyDataError:
        raise ConfigError(f"{_prefix(flag)}{path}: empty (not even the header): the file is "
                          f"truncated; {WRITE_HINT}") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{_prefix(flag)}{path}: not a readable CSV ({reason}): the file is "
                          f"damaged; {WRITE_HINT}") from None


def _check_complete_last_line(path: Path, flag: str | None) -> None:
    # Every writer ends a line before the next; a file cut mid-line would parse with NaNs.
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        if handle.tell() == 0:
            return
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) != b"\n":
            raise ConfigError(f"{_prefix(flag)}{path}: the last line is cut off: the file is "
                              f"truncated; {WRITE_HINT}")


def _check_rows(path: Path, found: int, summary: dict, flag: str | None) -> None:
    expected = (summary.get("rows") or {}).get(path.name)
    if isinstance(expected, int) and found != expected:
        raise ConfigError(f"{_prefix(flag)}{path}: {found} rows, but summary.json says the run "
                          f"wrote {expected}: the file is truncated or from another run; "
                          f"{WRITE_HINT}")


def _require_columns(present, columns: list[str], path: Path, flag: str | None) -> None:
    """`present`: the column names a file has (or will have, defaults filled in)."""
    missing = [column for column in columns if column not in present]
    if missing:
        raise ConfigError(f"{_prefix(flag)}{path}: missing column(s) {', '.join(missing)}; the "
                          f"file must have the header {','.join(columns)}")


def decisions_absent_reason(summary: dict) -> str | None:
    """Why a run has no decision log by design (None when it should have one)."""
    if run_kind(summary) == SERVED:
        return "a served run: its client sees no scheduler decisions"
    if summary.get("decision_log") == "none":
        return "written with --decisions none"
    return None


def read_decisions(directory: str | Path, summary: dict | None = None,
                   flag: str | None = None) -> list[str] | None:
    """The lines of a run directory's decisions.log (or decisions.log.gz); None when the run has
    none by design (`decisions_absent_reason`; runs that do not record it: when no log is
    there). A log the summary says was written but is missing or cut short is an error."""
    directory = Path(directory)
    summary = summary if summary is not None else read_summary(directory, flag)
    if decisions_absent_reason(summary) is not None:
        return None
    plain, packed = directory / DECISIONS_FILE, directory / DECISION_FORMATS["gzip"]
    if plain.is_file():
        path, text = plain, _read_plain_log(plain, flag)
    elif packed.is_file():
        path, text = packed, _read_packed_log(packed, flag)
    elif summary.get("decision_log") in ("plain", "gzip"):
        name = DECISION_FORMATS[summary["decision_log"]]
        raise ConfigError(f"{_prefix(flag)}{directory / name}: file not found, but summary.json "
                          f"says the run wrote it: the directory is incomplete; {WRITE_HINT}")
    else:
        return None  # a run of before "decision_log": --decisions none left no file
    _check_rows(path, text.count("\n"), summary, flag)
    return text.splitlines()


def _read_plain_log(path: Path, flag: str | None) -> str:
    _check_complete_last_line(path, flag)
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{_prefix(flag)}{path}: not text: the file is damaged; "
                          f"{WRITE_HINT}") from None


def _read_packed_log(path: Path, flag: str | None) -> str:
    try:
        with gzip.open(path, "rt") as handle:
            text = handle.read()
    except (OSError, EOFError, UnicodeDecodeError) as error:
        raise ConfigError(f"{_prefix(flag)}{path}: not a complete gzip file ({error}): the file "
                          f"is truncated or damaged; {WRITE_HINT}") from None
    if text and not text.endswith("\n"):
        raise ConfigError(f"{_prefix(flag)}{path}: the last line is cut off: the file is "
                          f"truncated; {WRITE_HINT}")
    return text
