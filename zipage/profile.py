"""The profile file: the measured step times a calibrated cost model is fitted to.

Its one owner: `zipage calibrate --gpu` (zipage/engine/calibrate.py) and `--from-run`
(sim/profile_from_runs.py) write profiles in this format, the simulator's calibrated model
(sim/calibrated.py) reads them through it. A profile is a JSON object (optionally gzipped): a
header naming the setup it was measured on (model, GPU, dtype, the knobs that change a step's
cost, tensor parallelism) and lists of measured points per section, and optionally the record of
its validation on a held-out workload (`Validation`: how far to trust what it predicts), the
machine and deployment it was measured on and a quick correction's record (`read_record`). Every
field is described in docs/cost_model.md. Reading refuses, with one `ConfigError` naming the
field, a malformed profile and a profile measured for another setup than the run's.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zipage.config import REDUNDANCY_MODES, ZipageConfig
from zipage.dtypes import DTYPE_BYTES
from zipage.errors import ConfigError
from zipage.hardware import GPUSpec, get_hardware
from zipage.presets import model_identity
from zipage.shape import ModelShape

# Version 2 added the "mixed" section; version 3 fits prefill steps as host- or device-bound with
# a per-sequence term, every coefficient >= 0 (sim/prefill_fit.py). Older profiles still load and
# predict what they did.
PROFILE_VERSION = 3
READABLE_PROFILE_VERSIONS = (1, 2, 3)
PROFILE_SECTIONS = ("decode", "prefill", "mixed", "compress", "launch")
# The optional record of the profile's check on a held-out workload: not part of the header (it
# says nothing about the setup measured) and not a section of points. Older readers ignore it.
VALIDATION = "validation"
# Optional records beside it, none of them part of the header (no setup check reads them, no
# prediction changes with them), each an object that older readers ignore: the machine the points
# were measured on (GPU, driver, torch, host CPU: what moves a profile between machines of one
# kind), the deployment calibrate ran (`ReplaySettings.to_dict()`: what `zipage calibrate --quick`
# rebuilds to re-measure it), and the quick correction that re-scaled a profile measured on
# another machine (sim/quick_correction.py).
MACHINE, SETTINGS, CORRECTION = "machine", "settings", "correction"
RECORDS = (VALIDATION, MACHINE, SETTINGS, CORRECTION)
# What a cost model is built for: the knobs that change a step's duration (declared with
# `cost=True` on ZipageConfig), the element size, the sharding and the contention factor. A
# profile's header records the knobs it was measured with.
COST_KNOBS = tuple(ZipageConfig().cost_knobs())
COST_MODEL_KNOBS = ("dtype_bytes", *COST_KNOBS, "tensor_parallel", "contention_factor")
# Cost knobs whose absence from a header says what they were: a profile written before async
# scheduling was recorded measured steps that ran one after another, their host time included
# (a run with async scheduling hides it: such a profile would price its steps long). Any other
# knob a header lacks is taken as the run's.
ABSENT_KNOBS = {"async_scheduling": False}
# How the decode fit prices the longest request's entries beyond its batch's mean (a header
# field, since 2026-11-29): "per_entry", one cost an entry whatever the batch (every profile
# written before the field, which reads as it); "per_partition", that excess divided by the
# split-K decode kernel's partitions at the step's batch (zipage/decode_grid.py, from the
# header's model and GPU), as the kernel runs it. It decides how the decode points are fitted,
# and the compress points of a profile are residuals over that decode model: a writer sets it
# when it fits, and a reader never changes it (docs/cost_model.md, 'Decode: the longest request').
DECODE_EXCESS = "decode_excess"
PER_ENTRY, PER_PARTITION = "per_entry", "per_partition"
DECODE_EXCESS_MODES = (PER_ENTRY, PER_PARTITION)
# The batch sizes the measured engine captured decode CUDA graphs at (a header field, since
# 2026-11-29; zipage/decode_grid.py): a decode step replays the smallest that holds its batch, so
# its rows, and its kernel's partitions, are that size's; the decode fit and its predictions read
# the padded size. Absent (profiles written before it, eager engines): the live batch.
DECODE_GRAPH_SIZES = "decode_graph_sizes"
# The decode programs an SM the measured engine's grid aimed for (a header field, since 2026-12-01;
# zipage/decode_grid.py `programs_per_sm`): its kernel's partitions at a batch follow from it, and
# a "per_partition" fit counts them so. Absent (every profile before the fp8 launch got its own
# grid): 4, the grid every engine ran until then.
DECODE_PROGRAMS_PER_SM = "decode_programs_per_sm"
# How the measured engine split a decode step's rows (a header field, since 2026-12-02;
# zipage/decode_grid.py): "rule", balanced where `takes_balanced_split` holds; "batch", every row
# alike from its batch. Absent (every profile before the balanced split): "batch". A
# "per_partition" fit counts the longest row's partitions so.
DECODE_SPLIT = "decode_split"
DECODE_SPLIT_MODES = ("batch", "rule")


def read_profile(profile: str | Path | dict) -> tuple[str, dict]:
    """The profile's data and the name its errors give it ("profile PATH")."""
    if isinstance(profile, dict):
        return "profile", profile
    path = Path(profile)
    source = f"profile {path}"
    try:
        # A profile fitted from long runs holds thousands of points: it may be kept gzipped.
        text = (gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz"
                else path.read_text())
        data = json.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{source}: not a readable JSON file ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    return source, data


def check_header(source: str, data: dict, shape: ModelShape | None, gpu: GPUSpec | None,
                 knobs: dict[str, Any]) -> dict[str, Any]:
    """The profile's header (every field but the sections), validated; a profile measured for
    another model, GPU, dtype or knob than the run's (`shape`, `gpu`, `knobs`, where given) is
    refused."""
    check_knob_names(knobs)
    version = data.get("version")
    if isinstance(version, bool) or version not in READABLE_PROFILE_VERSIONS:
        raise ConfigError(f"{source}: version: got {version!r}, expected one of "
                          f"{', '.join(map(str, READABLE_PROFILE_VERSIONS))}")
    if version < 2 and "mixed" in data:
        raise ConfigError(f"{source}: mixed: a version-2 section; set \"version\" to 2")
    for name in ("model", "gpu"):
        if not isinstance(data.get(name), str):
            raise ConfigError(f"{source}: {name}: expected a string naming the "
                              f"{'model preset' if name == 'model' else 'GPU'} it was measured on")
    header = {key: value for key, value in data.items()
              if key not in PROFILE_SECTIONS and key not in RECORDS}
    if header.get("redundancy", "lightning") not in REDUNDANCY_MODES:
        raise ConfigError(f"{source}: redundancy: got {header['redundancy']!r}, expected one of "
                          f"{', '.join(REDUNDANCY_MODES)}")
    if "dtype" in header and header["dtype"] not in DTYPE_BYTES:
        raise ConfigError(f"{source}: dtype: got {header['dtype']!r}, expected one of "
                          f"{', '.join(DTYPE_BYTES)}")
    buckets = header.get("prefill_buckets")
    if buckets is not None and not _increasing_sizes(buckets):
        raise ConfigError(f"{source}: prefill_buckets: got {buckets!r}, expected increasing "
                          "positive token counts: the buckets the measured engine padded prefill "
                          "and mixed steps to (or leave the field out: steps were not padded)")
    if header.get(DECODE_EXCESS, PER_ENTRY) not in DECODE_EXCESS_MODES:
        raise ConfigError(f"{source}: {DECODE_EXCESS}: got {header[DECODE_EXCESS]!r}, expected "
                          f"one of {', '.join(map(repr, DECODE_EXCESS_MODES))}: how the decode "
                          "fit prices the longest request (or leave the field out: per entry)")
    graphs = header.get("graphs")
    if graphs is not None and not (isinstance(graphs, dict) and set(graphs) == {"decode", "prefill"}
                                   and all(isinstance(value, bool) for value in graphs.values())):
        raise ConfigError(f"{source}: graphs: got {graphs!r}, expected {{\"decode\": true|false, "
                          "\"prefill\": true|false}: which engine steps replayed CUDA graphs "
                          "when it was measured")
    sizes = header.get(DECODE_GRAPH_SIZES)
    if sizes is not None and not (_increasing_sizes(sizes)
                                  and (graphs or {}).get("decode")):
        raise ConfigError(f"{source}: {DECODE_GRAPH_SIZES}: got {sizes!r}, expected increasing "
                          "positive batch sizes, with graphs.decode true: the decode graphs the "
                          "measured engine captured (or leave the field out: decode steps are "
                          "priced at their live batch)")
    programs = header.get(DECODE_PROGRAMS_PER_SM)
    if programs is not None and not (isinstance(programs, int) and not isinstance(programs, bool)
                                     and programs > 0):
        raise ConfigError(f"{source}: {DECODE_PROGRAMS_PER_SM}: got {programs!r}, expected a positive "
                          "integer: the decode programs an SM the measured engine's grid aimed for (or "
                          "leave the field out: 4)")
    if header.get(DECODE_SPLIT, "batch") not in DECODE_SPLIT_MODES:
        raise ConfigError(f"{source}: {DECODE_SPLIT}: got {header[DECODE_SPLIT]!r}, expected one of "
                          f"{', '.join(map(repr, DECODE_SPLIT_MODES))}: how the measured engine split a "
                          "decode step's rows (or leave the field out: \"batch\")")
    fix = "measure a profile for this setup, or use --cost-model analytic"
    if shape is not None and model_identity(data["model"]) != model_identity(shape.name):
        raise ConfigError(f"{source}: model: measured on {data['model']!r}, but this run uses "
                          f"{shape.name!r}; {fix}")
    if gpu is not None and _gpu_name(data["gpu"]) != gpu.name:
        raise ConfigError(f"{source}: gpu: measured on {data['gpu']!r}, but this run uses "
                          f"{gpu.name!r}; {fix}")
    if "dtype_bytes" in knobs and "dtype" in header \
            and DTYPE_BYTES[header["dtype"]] != knobs["dtype_bytes"]:
        raise ConfigError(f"{source}: dtype: measured in {header['dtype']}, but this run uses "
                          f"{knobs['dtype_bytes']}-byte values; {fix}")
    for name in (*COST_KNOBS, "tensor_parallel"):
        measured = header.get(name, ABSENT_KNOBS.get(name))
        if name in knobs and measured is not None and knobs[name] != measured:
            raise ConfigError(f"{source}: {name}: measured with {measured!r}, but this run "
                              f"uses {knobs[name]!r}; {fix}")
    return header


def check_knob_names(knobs: dict[str, Any]) -> None:
    """Refuse a keyword no cost model is built with (a misspelt knob would be ignored)."""
    unknown = sorted(set(knobs) - set(COST_MODEL_KNOBS))
    if unknown:
        raise ConfigError(f"cost model: unknown knob(s) {', '.join(unknown)}; known: "
                          f"{', '.join(COST_MODEL_KNOBS)}")


def _plain(name: str) -> str:
    return name.strip().lower().replace("_", "-").split("/")[-1].removeprefix("random:")


def _gpu_name(name: str) -> str:
    try:
        return get_hardware(name).name
    except ConfigError:
        return _plain(name)


def read_points(source: str, data: dict, section: str, required: tuple[str, ...],
                optional: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one profile section, every field checked to be a non-negative number;
    `optional` fields a row leaves out take their default."""
    rows = data.get(section)
    if not isinstance(rows, list):
        raise ConfigError(f"{source}: {section}: expected a list of measured points "
                          f"({', '.join(required + ('time_s',))}), got {type(rows).__name__}")
    points = []
    for index, row in enumerate(rows):
        where = f"{source}: {section}[{index}]"
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected an object, got {row!r}")
        point = {}
        for name in required + ("time_s",) + tuple(optional):
            if name not in row:
                if name in optional:
                    point[name] = optional[name]
                    continue
                raise ConfigError(f"{where}.{name}: missing")
            value = row[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}.{name}: expected a non-negative number, got {value!r}")
            point[name] = value
        if not point["time_s"] > 0:
            raise ConfigError(f"{where}.time_s: expected a positive duration, got "
                              f"{point['time_s']!r}")
        if "requests" in point and not point["requests"] >= 1:
            raise ConfigError(f"{where}.requests: expected at least 1, got {point['requests']!r}")
        points.append(point)
    return points


# The validation record's metrics, each the error of one figure of a simulated run's summary (the
# key it names) against the engine's, on the held-out workload: signed, (simulated - engine) /
# engine. e2e_mape is the mean absolute percentage error of the requests' end-to-end latencies,
# request by request (a fraction >= 0, no summary key). Any may be null: undefined there.
VALIDATION_METRICS = {
    "makespan": "makespan_s", "throughput": "tps",
    "ttft_p50": "ttft_p50_s", "ttft_p90": "ttft_p90_s", "ttft_p99": "ttft_p99_s",
    "tpot_p50": "tpot_p50_ms", "tpot_p90": "tpot_p90_ms", "tpot_p99": "tpot_p99_ms",
    "e2e_mape": None,
}
# The models a validation compares with the engine: the profile itself and the analytic model.
PROFILE_MODEL, ANALYTIC_MODEL = "profile", "analytic"
VALIDATED_MODELS = (PROFILE_MODEL, ANALYTIC_MODEL)


@dataclass(frozen=True)
class Validation:
    """A profile's record of its check on a held-out workload (`zipage calibrate` runs one the
    fit never saw through the engine and simulates it with each model): the errors per model
    and metric, the model it recommends and its warnings."""

    workload: str  # the held-out workload's name
    requests: int  # its request count
    # errors[model][metric]: the signed error (e2e_mape: >= 0), None where undefined; "profile"
    # always present, "analytic" where the validation simulated it too.
    errors: dict[str, dict[str, float | None]]
    recommended: str = PROFILE_MODEL  # "profile" or "analytic"
    warnings: tuple[str, ...] = field(default=())

    def error(self, metric: str, model: str = PROFILE_MODEL) -> float | None:
        """The signed error of `model` on `metric` (None: undefined, or `model` not validated)."""
        return self.errors.get(model, {}).get(metric)

    def band(self, metric: str) -> float | None:
        """How far a figure the profile predicts may be off, as a fraction: the size of its
        error on `metric` in validation (None: no validated error for it)."""
        error = self.error(metric)
        return None if error is None else abs(error)

    def bands(self) -> dict[str, float | None]:
        return {metric: self.band(metric) for metric in VALIDATION_METRICS}

    def record(self) -> dict[str, Any]:
        """The `validation` field of a profile, as `write_profile` writes it."""
        return {"workload": self.workload, "requests": self.requests,
                "errors": {model: {metric: errors.get(metric) for metric in VALIDATION_METRICS}
                           for model, errors in self.errors.items()},
                "recommended": self.recommended, "warnings": list(self.warnings)}

    def summary(self) -> dict[str, Any]:
        """What a simulated run's summary says about its figures' trust: the workload, the
        recommended model, the warnings, the profile's signed errors and its bands."""
        return {"workload": self.workload, "requests": self.requests,
                "recommended": self.recommended, "warnings": list(self.warnings),
                "errors": {metric: self.error(metric) for metric in VALIDATION_METRICS},
                "bands": self.bands()}


def read_validation(source: str, data: dict) -> Validation | None:
    """The profile's `validation` record, checked (None: it has none). Unknown keys are ignored,
    so a newer calibrate's additions do not break this reader; a known field of the wrong type
    is refused with a `ConfigError` naming it."""
    record = data.get(VALIDATION)
    if record is None:
        return None
    where = f"{source}: {VALIDATION}"
    fix = "re-run `zipage calibrate --gpu` to write it, or delete the field"
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected an object, got {_json_type(record)}; {fix}")
    workload = record.get("workload")
    if not isinstance(workload, str) or not workload:
        raise ConfigError(f"{where}.workload: expected the held-out workload's name, got "
                          f"{_json_text(workload)}; {fix}")
    requests = record.get("requests")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ConfigError(f"{where}.requests: expected the workload's request count (an "
                          f"integer >= 1), got {_json_text(requests)}; {fix}")
    errors = record.get("errors")
    if not isinstance(errors, dict):
        raise ConfigError(f"{where}.errors: expected an object of errors per model, got "
                          f"{_json_type(errors)}; {fix}")
    if PROFILE_MODEL not in errors:
        raise ConfigError(f"{where}.errors.profile: missing (the profile's own errors); {fix}")
    checked = {}
    for model in VALIDATED_MODELS:
        if model not in errors:
            continue
        if not isinstance(errors[model], dict):
            raise ConfigError(f"{where}.errors.{model}: expected an object of errors per metric, "
                              f"got {_json_type(errors[model])}; {fix}")
        checked[model] = {metric: _error(f"{where}.errors.{model}.{metric}",
                                         errors[model].get(metric), metric, fix)
                          for metric in VALIDATION_METRICS}
    recommended = record.get("recommended")
    if recommended not in VALIDATED_MODELS:
        raise ConfigError(f"{where}.recommended: expected \"profile\" or \"analytic\", got "
                          f"{_json_text(recommended)}; {fix}")
    if recommended == ANALYTIC_MODEL and ANALYTIC_MODEL not in checked:
        raise ConfigError(f"{where}.recommended: \"analytic\", but errors.analytic is missing: "
                          f"the model recommended must have been validated; {fix}")
    warnings = record.get("warnings")
    warnings = [] if warnings is None else warnings
    if not isinstance(warnings, list) or not all(isinstance(line, str) for line in warnings):
        raise ConfigError(f"{where}.warnings: expected a list of strings, got {_json_text(warnings)}; {fix}")
    return Validation(workload, requests, checked, recommended, tuple(warnings))


def read_record(source: str, data: dict, name: str) -> dict | None:
    """The profile's `machine`, `settings` or `correction` record (None: it has none, as every
    profile written before them). Only its being an object is checked: what is in it describes
    the profile, and a newer writer may add to it."""
    if name not in (MACHINE, SETTINGS, CORRECTION):
        raise ValueError(f"not a profile record: {name!r}")
    record = data.get(name)
    if record is None:
        return None
    if not isinstance(record, dict):
        raise ConfigError(f"{source}: {name}: expected an object, got {_json_type(record)}; "
                          "re-run `zipage calibrate` to write it, or delete the field")
    if name == CORRECTION:
        scales = record.get("scales")
        if not isinstance(scales, dict) or not scales or not all(
                not isinstance(value, bool) and isinstance(value, (int, float))
                and math.isfinite(value) and value > 0 for value in scales.values()):
            raise ConfigError(f"{source}: {CORRECTION}.scales: expected an object of positive "
                              f"factors per term group, got {_json_text(scales)}; re-run "
                              "`zipage calibrate --quick`, or delete the field")
    return record


def _error(where: str, value: Any, metric: str, fix: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a number or null, got {_json_text(value)}; {fix}")
    if VALIDATION_METRICS[metric] is None and value < 0:
        raise ConfigError(f"{where}: expected a mean absolute error (a fraction >= 0), got "
                          f"{_json_text(value)}; {fix}")
    return float(value)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             type(None): "null"}
    return names.get(type(value), _json_text(value))


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def profile_text(profile: dict) -> str:
    """The profile as JSON with one measured point per line, so that its diffs stay readable."""
    lines = []
    for key, value in profile.items():
        if isinstance(value, list):
            rows = ",\n".join(f"  {json.dumps(row)}" for row in value)
            lines.append(f' {json.dumps(key)}: [\n{rows}\n ]')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_profile(profile: dict, path: str | Path) -> Path:
    """Write `profile` to `path` (its folder made if missing), gzipped where the name ends in
    .gz as `read_profile` reads it; no timestamp in the gzip header, so a profile gives the same
    bytes whenever it is written. Its `validation` may be a `Validation` or the record as a dict;
    either is checked first, so a malformed one is refused before anything is written."""
    if isinstance(profile.get(VALIDATION), Validation):
        profile = {**profile, VALIDATION: profile[VALIDATION].record()}
    read_validation(f"profile {path}", profile)
    for name in (MACHINE, SETTINGS, CORRECTION):
        read_record(f"profile {path}", profile, name)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = profile_text(profile)
    if out.suffix == ".gz":
        out.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        out.write_text(text)
    return out


def _increasing_sizes(sizes: Any) -> bool:
    return (isinstance(sizes, list) and bool(sizes)
            and all(isinstance(size, int) and not isinstance(size, bool) and size > 0
                    for size in sizes)
            and all(a < b for a, b in zip(sizes, sizes[1:])))
