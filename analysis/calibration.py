"""Calibration through the engine loop, validated on traffic it was not fitted on: `zipage
calibrate` and `zipage fidelity`.

A profile measured on isolated steps (`zipage.engine.calibrate`'s grid) prices what a step costs
alone; inside a running engine a step also pays for its host work, sampling, scheduling,
requests joining and leaving, long single contexts, recompute prefill beside decodes and
compression batches in flight. So `calibrate_in_loop` runs built-in traces through the engine
exactly as `zipage replay --gpu` does (zipage/calibration_traces.py sizes them to this engine),
fits the profile from those runs' steps (`zipage calibrate --from-run`'s fit), adds isolated grid
points only beyond what the runs reached, then runs one more trace it did not fit on, simulates
it with the new profile and with the analytic model, and writes the errors of both into the
profile (`validation`): the band `zipage replay` and `zipage plan` print beside their figures.
`check_twin` does the same over fresh traces and prints the table (docs/cost_model.md,
'Calibrating through the engine loop').
"""

from __future__ import annotations

import datetime
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from zipage.analysis.compare import KS_METRICS, compare_runs
from zipage.calibration_traces import (
    DEFAULT_FIT_SECONDS,
    DEFAULT_VALIDATION_SECONDS,
    EngineSpeed,
    check_traces,
    fit_traces,
    validation_trace,
)
from zipage.core.deployment import ReplaySettings
from zipage.engine.builder import Engine, build_engine, device_memory
from zipage.engine.calibrate import (
    Bench,
    chunk_points,
    decode_points,
    hardware_name,
    prefill_points,
    probe_speed,
    short_prompt_points,
)
from zipage.engine.machine import machine_record
from zipage.engine.replay import run_on_engine
from zipage.errors import ConfigError
from zipage.profile import MACHINE, SETTINGS, write_profile
from zipage.rundir import write_run
from zipage.sim.cost_model import ANALYTIC
from zipage.sim.profile_from_runs import profile_from_runs
from zipage.sim.simulate import simulate
from zipage.trace import Trace, save_trace

# Decode steps slower than this many times their run's median are kernel compilations (a new
# shape met mid-run), not a cost to learn.
STALL_FACTOR = 10.0
# Forward points the fit misses by more than this are not what their step computed (a prompt
# chunk that samples nothing returns before its GPU work ends; a host pause): left out.
OUTLIER_LIMIT = 0.5
# The errors a validation records (the names `zipage compare` gates on, throughput as "tps").
VALIDATED = {"makespan": "makespan", "throughput": "tps", "ttft_p50": "ttft_p50",
             "ttft_p90": "ttft_p90", "ttft_p99": "ttft_p99", "tpot_p50": "tpot_p50",
             "tpot_p90": "tpot_p90", "tpot_p99": "tpot_p99", "e2e_mape": "e2e_mape"}
# The metrics a recommendation weighs, and issue #33's targets on them (fractions).
TARGETS = {"makespan": 0.03, "ttft_p50": 0.10, "ttft_p90": 0.10, "tpot_p50": 0.05,
           "tpot_p90": None, "e2e_mape": 0.08}
# Each run directory keeps the trace it ran (a generated trace is made again only from the
# probe's measurements).
TRACE_FILE = "trace.jsonl.gz"
# A profile worse than the analytic model by more than this on a metric is warned about.
WORSE_BY = 0.01

Report = Callable[[str], None]


@dataclass
class Twin:
    """An engine built once, the settings a simulation of it plans the same capacity with, and
    the hardware-table entry its profile is named for."""

    engine: Engine
    settings: ReplaySettings
    gpu: str
    speed: EngineSpeed | None = None

    def close(self) -> None:
        self.engine.close()


def open_twin(settings: ReplaySettings, device: str, *, hardware: str | None = None,
              cuda_graphs: bool = True, prefill_graphs: bool | None = None) -> Twin:
    engine = build_engine(settings, device, cuda_graphs, prefill_graphs)
    try:
        gpu = hardware_name(hardware, engine.device)
        # The memory the engine planned from (a CPU engine's default cache size), so that a
        # simulation plans exactly the engine's blocks and slots.
        resolved, _, _ = device_memory(settings, engine.device)
        return Twin(engine, replace(resolved, hardware=gpu), gpu)
    except BaseException:
        engine.close()
        raise


def calibrate_in_loop(twin: Twin, *, fit_seconds: float = DEFAULT_FIT_SECONDS,
                      validation_seconds: float = DEFAULT_VALIDATION_SECONDS, seed: int = 0,
                      runs_dir: str | Path | None = None, progress: bool = False,
                      report: Report = print) -> dict:
    """The profile of `twin`'s engine, fitted from runs of the built-in traces and validated on
    one more; `runs_dir` keeps the run directories (default: a temporary directory)."""
    if not fit_seconds > 0 or not validation_seconds > 0:
        raise ConfigError("--fit-seconds / --validation-seconds: expected seconds > 0")
    with runs_directory(runs_dir) as root:
        speed = measure_speed(twin, report)
        _warm_up(twin, speed, root, report)
        runs = []
        for trace, changes in fit_traces(speed, fit_seconds, seed):
            settings = replace(twin.settings, config=replace(twin.settings.config, **changes))
            runs.append(run_engine(twin, trace, settings, root / trace.name, progress, report))
        profile = profile_from_runs(runs, gpu=twin.gpu, stall_factor=STALL_FACTOR,
                                    outliers=OUTLIER_LIMIT)
        grid = _beyond_the_runs(twin, profile)
        profile.update(
            source="measured",
            note=(f"measured by `zipage calibrate` through the engine loop on "
                  f"{_device_name(twin)}, {datetime.date.today().isoformat()}: "
                  f"{', '.join(run.name for run in runs)}; "
                  f"{grid} isolated grid point(s) beyond them; {profile['note']}"))
        # Where and how it was measured: what `zipage calibrate --quick` checks and rebuilds.
        profile.update({MACHINE: machine_record(twin.engine.device),
                        SETTINGS: twin.settings.to_dict()})
        trace = validation_trace(speed, validation_seconds, seed)
        engine_run = run_engine(twin, trace, twin.settings, root / trace.name, progress, report)
        errors = twin_errors(trace, engine_run, twin.settings, profile, root)
        profile["validation"] = validation_record(trace, errors)
        return profile


def measure_speed(twin: Twin, report: Report) -> EngineSpeed:
    if twin.speed is None:
        twin.speed = probe_speed(Bench(twin.engine, repeats=3))
        speed = twin.speed
        report(f"probe: decode step {speed.decode_step_s * 1e3:.2f} ms, prefill "
               f"{speed.prefill_token_s * 1e6:.1f} us a token; {speed.kv_tokens:,} KV entries, "
               f"{speed.concurrency} requests at most")
    return twin.speed


def _warm_up(twin: Twin, speed: EngineSpeed, root: Path, report: Report) -> None:
    """Compile the kernels the traces will meet (a new shape compiles mid-run otherwise) on a
    short trace of the validation's shape, fitted on nothing and discarded."""
    trace = validation_trace(speed, 2.0, seed=10_007)
    report(f"warm-up: {len(trace.requests)} requests")
    run_on_engine(twin.engine, trace, twin.settings)


def run_engine(twin: Twin, trace: Trace, settings: ReplaySettings, directory: Path,
               progress: bool, report: Report) -> Path:
    """`trace` through the engine, its run directory written to `directory`."""
    summary, run = run_on_engine(twin.engine, trace, settings, progress=progress)
    summary = {"trace": trace.name, **summary}
    write_run(directory, summary, run.steps, run.requests, [], decisions="none")
    save_trace(trace, directory / TRACE_FILE)  # what ran, to simulate or replay it again
    report(f"{trace.name}: {len(trace.requests)} requests, {summary['steps']:,} steps, "
           f"{summary['makespan_s']:.1f} s, {summary['preemptions']} preemptions, "
           f"{summary['compressions']} compressions")
    return directory


def simulate_run(trace: Trace, settings: ReplaySettings, cost_model: str,
                 directory: Path) -> Path:
    summary, run = simulate(trace, replace(settings, cost_model=cost_model))
    write_run(directory, {"trace": trace.name, **summary}, run.steps, run.requests, [],
              decisions="none")
    return directory


def twin_errors(trace: Trace, engine_run: Path, settings: ReplaySettings, profile: dict,
                root: Path, others: dict[str, Path] | None = None
                ) -> dict[str, dict[str, float | None]]:
    """The errors of the simulation of `trace` against its engine run, with `profile` and with
    the analytic model: {"profile": {metric: error}, "analytic": {...}}; the KS distances of the
    TTFT and TPOT distributions too (`ks_ttft`, `ks_tpot`). `others` adds a row per named profile
    file (`zipage fidelity --quick-correct`: the profile re-scaled to this machine)."""
    path = write_profile(profile, root / f"{trace.name}-profile.json")
    errors = {}
    models = [("profile", str(path)), *((name, str(other)) for name, other in
                                        (others or {}).items()), ("analytic", ANALYTIC)]
    for name, spec in models:
        simulated = simulate_run(trace, settings, spec, root / f"{trace.name}-sim-{name}")
        comparison = compare_runs(simulated, engine_run)
        _same_capacity(comparison)
        errors[name] = {metric: comparison["errors"][key] for metric, key in VALIDATED.items()}
        # How far the TTFT and TPOT distributions are apart, beside their percentiles' errors.
        errors[name].update({key: comparison["errors"][key] for key in KS_METRICS})
    return errors


def _same_capacity(comparison: dict) -> None:
    differ = [key for key in ("num_blocks", "max_concurrency", "n_max")
              if key in (comparison["setup_differences"] or {})]
    if differ:
        raise ConfigError(f"calibrate: the simulation planned another capacity than the engine "
                          f"({', '.join(differ)}); pass --kv-memory-gb so both plan the same")


def validation_record(trace: Trace, errors: dict) -> dict:
    """The `validation` object of a profile (docs/cost_model.md): both models' errors on the
    held-out trace, the model with the smaller mean error on the headline metrics, and a
    warning for every metric where the profile is worse than the analytic model by more than a
    point."""
    means = {name: _mean_error(values) for name, values in errors.items()}
    warnings = []
    for metric in TARGETS:
        ours, analytic = errors["profile"].get(metric), errors["analytic"].get(metric)
        if ours is not None and analytic is not None and abs(ours) > abs(analytic) + WORSE_BY:
            warnings.append(f"{metric}: the profile ({ours:+.1%}) is worse than the analytic "
                            f"model ({analytic:+.1%})")
    # A profile records the validated errors only (the distances are `zipage fidelity`'s).
    recorded = {name: {metric: value for metric, value in values.items()
                       if metric not in KS_METRICS} for name, values in errors.items()}
    return {"workload": trace.name, "requests": len(trace.requests), "errors": recorded,
            "recommended": "profile" if means["profile"] <= means["analytic"] else "analytic",
            "warnings": warnings}


def _mean_error(errors: dict[str, float | None]) -> float:
    values = [abs(errors[metric]) for metric in TARGETS if errors.get(metric) is not None]
    return sum(values) / len(values) if values else float("inf")


def _beyond_the_runs(twin: Twin, profile: dict) -> int:
    """Isolated grid points where the runs could not reach: decode batches larger than any run
    decoded, prefill steps longer than any run's, prefill and mixed steps of more prompt chunks
    than any run's (`chunk_points`: a burst of short prompts), and one short prompt alone, shorter
    than any the runs' steps held alone (`short_prompt_points`). Added to the profile's sections;
    their count."""
    bench = Bench(twin.engine, repeats=3)
    decode = decode_points(bench, above_batch=max(
        (point["batch"] for point in profile["decode"]), default=0))
    prefill = prefill_points(bench, above_tokens=max(
        (point["new_tokens"] * point["requests"] for point in profile["prefill"]), default=0))
    mixed_runs = profile.get("mixed")
    chunked, mixed = chunk_points(
        bench, above_prefill=max((point["requests"] for point in profile["prefill"]), default=0),
        above_mixed=None if mixed_runs is None else max(point["requests"] for point in mixed_runs))
    short = short_prompt_points(bench, below_tokens=min(
        (point["new_tokens"] for point in profile["prefill"] if _whole_alone(point)),
        default=float("inf")))
    profile["decode"] += decode
    profile["prefill"] += prefill + chunked + short
    if mixed:
        profile["mixed"] += mixed
    return len(decode) + len(prefill) + len(chunked) + len(short) + len(mixed)


def _whole_alone(point: dict) -> bool:
    """A prefill point of one prompt computed whole (no cached context: its causal pairs are
    n (n + 1) / 2 of its n tokens)."""
    tokens = point["new_tokens"]
    pairs = point.get("attention_pairs", tokens * (tokens + 1) / 2)
    return point.get("requests", 1) == 1 and not point.get("cached_tokens") \
        and pairs <= tokens * (tokens + 1) / 2 + 0.5


def _device_name(twin: Twin) -> str:
    import torch

    device = twin.engine.device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class runs_directory:
    """The given directory, or a temporary one removed afterwards."""

    def __init__(self, path: str | Path | None) -> None:
        self.path, self._temporary = path, None

    def __enter__(self) -> Path:
        if self.path is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="zipage-calibrate-")
            return Path(self._temporary.name)
        Path(self.path).mkdir(parents=True, exist_ok=True)
        return Path(self.path)

    def __exit__(self, *exc) -> None:
        if self._temporary is not None:
            self._temporary.cleanup()


# ---------------------------------------------------------------- zipage fidelity

def check_twin(twin: Twin, profile_path: Path, traces: list[Trace], root: Path,
               progress: bool = False, report: Report = print,
               others: dict[str, Path] | None = None,
               on_trace: Callable[[list[dict], list[dict]], None] | None = None) -> list[dict]:
    """Each trace through the engine, then simulated with the profile, each of `others` (named
    profile files) and the analytic model: one row per trace and model, its errors.
    `on_trace(rows so far, this trace's rows)` after each trace, so a long check that is stopped
    keeps what it finished."""
    rows = []
    profile = _read(profile_path)
    for trace in traces:
        engine_run = run_engine(twin, trace, twin.settings, root / trace.name / "engine",
                                progress, report)
        errors = twin_errors(trace, engine_run, twin.settings, profile, root / trace.name, others)
        added = [{"trace": trace.name, "requests": len(trace.requests), "model": model, **values}
                 for model, values in errors.items()]
        rows += added
        if on_trace is not None:
            on_trace(rows, added)
    return rows


def fresh_traces(twin: Twin, seconds: float, seed: int, count: int,
                 report: Report) -> list[Trace]:
    return check_traces(measure_speed(twin, report), seconds, seed, count)


def _read(path: Path) -> dict:
    from zipage.profile import read_profile

    return read_profile(path)[1]


def within_targets(row: dict) -> dict[str, bool | None]:
    """Per targeted metric: within issue #33's target (None: not targeted or not measured)."""
    verdicts = {}
    for metric, target in TARGETS.items():
        value = row.get(metric)
        verdicts[metric] = None if target is None or value is None else abs(value) <= target
    return verdicts


def format_table(rows: list[dict]) -> str:
    """The error table: one line per trace and model, errors in percent, '*' where a target is
    missed, then the KS distances of the TTFT and TPOT distributions ('-': a side without
    values)."""
    metrics = list(TARGETS)
    header = (f"{'trace':<22} {'model':<9} " + " ".join(f"{m:>10}" for m in metrics) + " "
              + " ".join(f"{key:>8}" for key in KS_METRICS))
    lines = [header, "-" * len(header)]
    for row in rows:
        verdicts = within_targets(row)
        cells = []
        for metric in metrics:
            value = row.get(metric)
            text = "-" if value is None else (f"{100 * value:.1f}%" if metric == "e2e_mape"
                                              else f"{100 * value:+.1f}%")
            cells.append(f"{text + ('*' if verdicts[metric] is False else ' '):>10}")
        cells += [f"{'-' if row.get(key) is None else format(row[key], '.3f'):>8}"
                  for key in KS_METRICS]
        lines.append(f"{row['trace']:<22} {row['model']:<9} " + " ".join(cells))
    targets = ", ".join(f"{m} {100 * t:g}%" for m, t in TARGETS.items() if t is not None)
    lines.append(f"errors: (simulated - engine) / engine; e2e_mape per request; * misses its "
                 f"target ({targets}); ks_*: the largest gap of the two runs' CDFs (0.1: never "
                 f"more than 10 points apart)")
    return "\n".join(lines)
