"""Run directories under interruption, damage and concurrent writers (issue #30).

A run is written whole or not at all (`zipage.rundir.write_run`); every reader refuses a missing,
damaged or cut-short file with one line and exit status 2; a served run says what it lacks;
profiles and runs name a model alike; two plans into one --out never mix their rows."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from zipage import rundir
from zipage.analysis.compare import compare_runs, format_report
from zipage.cli.parser import main
from zipage.errors import ConfigError
from zipage.rundir import load_run, read_decisions, write_run
from zipage.trace import load_trace

TINY_TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "tiny.json")
AMC23_TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "amc23.json")


@pytest.fixture(scope="module")
def simulated():
    """The summary and records of one simulated replay of the tiny trace."""
    from zipage.core.deployment import ReplaySettings
    from zipage.sim.simulate import simulate

    trace = load_trace(TINY_TRACE)
    summary, run = simulate(trace, ReplaySettings(), log_decisions=True)
    return {"trace": trace.name, **summary}, run


def write_simulated(directory: Path, simulated, decisions: str = "gzip",
                    **summary_changes) -> Path:
    summary, run = simulated
    return write_run(directory, {**summary, **summary_changes}, run.steps, run.requests,
                     run.decision_log, decisions=decisions)


def write_served(directory: Path, simulated) -> Path:
    """A run as `zipage bench serve --out` writes it: requests only."""
    from zipage.serve.bench import SERVER_ONLY_KEYS

    summary, run = simulated
    served = {**summary, **{key: None for key in SERVER_ONLY_KEYS}, "driver": "served",
              "kind": "served", "url": "http://localhost:8000", "model": "m", "settings": {}}
    return write_run(directory, served, [], run.requests, [])


def one_line_error(capsys, *argv: str) -> str:
    status = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# ---------------------------------------------------------------- 1. atomic writes

class Killed(Exception):
    pass


def test_a_write_failing_midway_leaves_the_old_run_whole(tmp_path, simulated, monkeypatch):
    out = write_simulated(tmp_path / "run", simulated, trace="old")
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    def die(writer, record):
        assert writer.rows[rundir.STEPS_FILE] > 0  # after the whole first file of the new run
        raise Killed

    monkeypatch.setattr(rundir.RunWriter, "request", die)
    with pytest.raises(Killed):
        write_simulated(out, simulated, trace="new")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert load_run(out).summary["trace"] == "old"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]  # no staging left


def test_a_killed_writer_leaves_the_old_run_or_the_new_one(tmp_path, simulated, capsys):
    """SIGKILL after the new run's first file: nothing runs after it, yet the directory is still
    the old run, and `zipage compare` reads it consistently."""
    out = write_simulated(tmp_path / "run", simulated, trace="old")
    script = f"""
import os, signal
from zipage import rundir
from zipage.core.deployment import ReplaySettings
from zipage.sim.simulate import simulate
from zipage.trace import load_trace

def write_then_die(writer, record):  # after the new run's whole steps.csv
    os.kill(os.getpid(), signal.SIGKILL)
rundir.RunWriter.request = write_then_die
summary, run = simulate(load_trace({TINY_TRACE!r}), ReplaySettings(), log_decisions=True)
rundir.write_run({str(out)!r}, {{**summary, "trace": "new"}}, run.steps, run.requests,
                 run.decision_log)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert no_staging_left(tmp_path), "a SIGKILLed writer left its staging directory"
    run = load_run(out)
    assert run.summary["trace"] == "old" and len(run.steps) == run.summary["rows"]["steps.csv"]
    assert main(["compare", str(out), str(out)]) == 0
    assert "identical" in capsys.readouterr().out


def no_staging_left(directory: Path, within_s: float = 10.0) -> bool:
    """Whether `directory` is free of `.*.writing-*` entries within `within_s` seconds (a killed
    writer's reaper removes its staging directory moments after the kill)."""
    deadline = time.monotonic() + within_s
    while any(directory.glob(".*.writing-*")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_replay_leaves_no_staging_directory(tmp_path, how):
    """`zipage replay --out` killed while it writes: the reaper removes the staging directory
    (~150 MB on a large trace) whatever the signal; nothing is left beside the runs."""
    # amc23: long enough (seconds) to be killed while its records stream into the staging dir.
    process = subprocess.Popen([sys.executable, "-m", "zipage.cli", "replay", AMC23_TRACE,
                                "--out", str(tmp_path / "run")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(tmp_path.glob(".*.writing-*")) and process.poll() is None:
        assert time.monotonic() < deadline, "replay never started writing"
        time.sleep(0.01)
    process.send_signal(how)
    process.wait()
    assert no_staging_left(tmp_path)


def test_a_kill_between_the_renames_leaves_no_mix(tmp_path, simulated, monkeypatch, capsys):
    out = write_simulated(tmp_path / "run", simulated, trace="old")
    real_rename = os.rename
    calls = []

    def rename_once(source, target):
        calls.append(source)
        if len(calls) == 2:  # the old run is away, the new one not yet in
            raise Killed
        real_rename(source, target)

    monkeypatch.setattr(rundir.os, "rename", rename_once)
    with pytest.raises(Killed):
        write_simulated(out, simulated, trace="new")
    monkeypatch.undo()
    err = one_line_error(capsys, "compare", str(out), str(out))
    assert "no such run directory" in err and ".run.old-" in err
    (kept,) = tmp_path.glob(".run.old-*")
    assert load_run(kept).summary["trace"] == "old"


def test_a_new_summary_beside_old_files_is_refused(tmp_path, simulated, capsys):
    """What an in-place writer killed midway left: the new summary.json over the old records."""
    out = write_simulated(tmp_path / "run", simulated)
    other = write_simulated(tmp_path / "other", (simulated[0], replace(
        simulated[1], steps=simulated[1].steps[:-3], decision_log=simulated[1].decision_log[:-3])))
    (out / "summary.json").write_bytes((other / "summary.json").read_bytes())
    err = one_line_error(capsys, "compare", str(out), str(other))
    assert "steps.csv" in err and "rows" in err


def test_rewriting_a_run_replaces_it_and_refuses_a_foreign_directory(tmp_path, simulated):
    out = write_simulated(tmp_path / "run", simulated, trace="old")
    write_simulated(out, simulated, trace="new")
    assert load_run(out).summary["trace"] == "new"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a run's"):
        write_simulated(tmp_path / "notes", simulated)
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"


# ---------------------------------------------------------------- 2. damaged files

@pytest.fixture
def two_runs(tmp_path, simulated):
    """A run with a plain decision log (the one damaged), and one with the default gzip."""
    return (write_simulated(tmp_path / "a", simulated, decisions="plain"),
            write_simulated(tmp_path / "b", simulated))


@pytest.mark.parametrize("name, cut, fragment", [
    ("summary.json", 0.47, "summary.json: not valid JSON"),
    ("summary.json", 0.0, "summary.json: not valid JSON"),
    ("steps.csv", 0.47, "steps.csv: the last line is cut off"),
    ("steps.csv", 0.0, "steps.csv: empty"),
    ("steps.csv", "lines", "steps.csv: 10 rows, but summary.json says the run wrote"),
    ("requests.csv", 0.47, "requests.csv: the last line is cut off"),
    ("decisions.log", 0.47, "decisions.log: the last line is cut off"),
])
def test_truncated_files_are_one_line_errors(two_runs, capsys, tmp_path, name, cut, fragment):
    damaged, other = two_runs
    path = damaged / name
    data = path.read_bytes()
    if cut == "lines":
        path.write_bytes(b"".join(data.splitlines(keepends=True)[:11]))
    else:
        path.write_bytes(data[:int(len(data) * cut)])
    assert fragment in one_line_error(capsys, "compare", str(other), str(damaged))
    if name in ("summary.json", "steps.csv"):
        err = one_line_error(capsys, "calibrate", "--from-run", str(damaged),
                             "--out", str(tmp_path / "profile.json"))
        assert fragment in err or "a simulator run" in err
        assert one_line_error(capsys, "replay", TINY_TRACE, "--step-times", str(damaged))


def test_a_truncated_engine_run_is_refused_by_calibrate(tmp_path, simulated, capsys):
    run = write_simulated(tmp_path / "engine", simulated, driver="engine-cuda")
    steps = run / "steps.csv"
    steps.write_bytes(steps.read_bytes()[:-7])
    err = one_line_error(capsys, "calibrate", "--from-run", str(run),
                         "--out", str(tmp_path / "profile.json"))
    assert "engine/steps.csv: the last line is cut off" in err
    assert not (tmp_path / "profile.json").exists()


def test_a_missing_decision_log_is_told_from_one_not_written(tmp_path, simulated, capsys):
    summary, run = simulated
    skipped = write_run(tmp_path / "skipped", summary, run.steps, run.requests,
                        run.decision_log, decisions="none")
    assert json.loads((skipped / "summary.json").read_text())["decision_log"] == "none"
    assert read_decisions(skipped) is None
    report = format_report(compare_runs(skipped, skipped))
    assert "not compared (A: written with --decisions none; B: written with --decisions none)" \
        in report
    for decisions, name in (("plain", "decisions.log"), ("gzip", "decisions.log.gz")):
        lost = write_simulated(tmp_path / f"lost-{decisions}", simulated, decisions=decisions)
        (lost / name).unlink()
        err = one_line_error(capsys, "compare", str(skipped), str(lost))
        assert f"lost-{decisions}/{name}: file not found, but summary.json says the run " \
               "wrote it" in err


def test_the_default_log_is_gzipped_and_reads_as_the_plain_one(tmp_path, simulated):
    summary, run = simulated
    packed = write_run(tmp_path / "gz", summary, run.steps, run.requests, run.decision_log)
    plain = write_simulated(tmp_path / "plain", simulated, decisions="plain")
    assert sorted(path.name for path in packed.glob("decisions.log*")) == ["decisions.log.gz"]
    assert json.loads((packed / "summary.json").read_text())["decision_log"] == "gzip"
    assert read_decisions(packed) == read_decisions(plain) == run.decision_log
    assert compare_runs(plain, packed)["decisions"]["identical_fraction"] == pytest.approx(1.0)


def test_a_truncated_gzipped_log_is_an_error(tmp_path, simulated, capsys):
    summary, run = simulated
    out = write_run(tmp_path / "gz", summary, run.steps, run.requests, run.decision_log,
                    decisions="gzip")
    packed = out / "decisions.log.gz"
    packed.write_bytes(packed.read_bytes()[:-20])
    assert "decisions.log.gz: not a complete gzip file" in one_line_error(
        capsys, "compare", str(out), str(out))


# ---------------------------------------------------------------- 3. and 4. served runs

def test_calibrate_from_a_served_run_says_what_it_lacks(tmp_path, simulated, capsys):
    served = write_served(tmp_path / "served", simulated)
    err = one_line_error(capsys, "calibrate", "--from-run", str(served),
                         "--out", str(tmp_path / "profile.json"))
    assert "served run" in err and "no engine step log" in err and "zipage replay --gpu" in err
    # The error for a simulated run no longer sends the user to a served one.
    simulated_run = write_simulated(tmp_path / "sim", simulated)
    err = one_line_error(capsys, "calibrate", "--from-run", str(simulated_run),
                         "--out", str(tmp_path / "profile.json"))
    assert "bench serve" not in err


def test_calibrate_names_what_an_engine_run_summary_lacks(tmp_path, simulated, capsys):
    run = write_simulated(tmp_path / "engine", simulated, driver="engine-cuda")
    summary = json.loads((run / "summary.json").read_text())
    del summary["settings"]["dtype"]
    (run / "summary.json").write_text(json.dumps(summary))
    err = one_line_error(capsys, "calibrate", "--from-run", str(run),
                         "--out", str(tmp_path / "profile.json"))
    assert "summary.json lacks settings.dtype" in err


def test_compare_against_a_served_run_compares_requests_only(tmp_path, simulated):
    sim = write_simulated(tmp_path / "sim", simulated)
    served = write_served(tmp_path / "served", simulated)
    assert not list(served.glob("decisions.log*"))
    assert json.loads((served / "summary.json").read_text())["kind"] == "served"
    comparison = compare_runs(sim, served)
    assert comparison["kinds"] == {"sim": "simulated", "real": "served"}
    assert comparison["setup_differences"] is None and comparison["decisions"] is None
    assert comparison["step_time"] is None and comparison["time_by_kind"] is None
    assert set(comparison["summary"]) == {"tps", "makespan_s", "mean_tpot_ms", "compressions",
                                          "preemptions", "prefix_hit_tokens", "first_hit_tokens"}
    assert comparison["request_time"]["finished_in_both"] == simulated[0]["completed"]
    report = format_report(comparison)
    assert "served: a served run (`zipage bench serve`): request-level metrics only" in report
    assert "DIFFERENT" not in report and "setup differences" not in report
    assert "(f) time by step kind" not in report and "steps " not in report.split("(d) summary")[1]
    assert "served: a served run: its client sees no scheduler decisions" in report


def test_every_run_records_its_kind(tmp_path, simulated):
    sim = write_simulated(tmp_path / "sim", simulated)
    engine = write_simulated(tmp_path / "engine", simulated, driver="engine-cpu")
    assert [json.loads((run / "summary.json").read_text())["kind"] for run in (sim, engine)] == [
        "simulated", "engine"]


# ---------------------------------------------------------------- 5. model identity

@pytest.mark.parametrize("profile_model, run_model", [
    ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("SmolLM2-135M-Instruct.Q4_1", "/elsewhere/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("/models/Qwen3-0.6B/", "Qwen3-0.6B"),
    ("random:qwen3-0.6b", "Qwen3_0.6B"),
])
def test_profiles_and_runs_name_a_model_alike(profile_model, run_model):
    from zipage.hardware import get_hardware
    from zipage.presets import get_preset
    from zipage.sim.analytic import AnalyticCostModel, synthesize_profile
    from zipage.sim.calibrated import CalibratedCostModel

    shape = get_preset("qwen3-0.6b")
    profile = synthesize_profile(AnalyticCostModel(shape, get_hardware("h200")))
    profile["model"] = profile_model
    # The shape a run builds from its --model: a .gguf file's stem, a directory's name.
    run_shape = replace(shape, name=Path(run_model).stem if run_model.endswith(".gguf")
                        else Path(run_model).name)
    CalibratedCostModel.from_profile(profile, shape=run_shape)
    with pytest.raises(ConfigError, match="model: measured on"):
        CalibratedCostModel.from_profile(profile, shape=replace(shape, name="qwen3-8b"))


def test_a_profile_fitted_from_a_gguf_run_names_the_model_by_its_stem(tmp_path):
    from test_profile_from_runs import synthetic_run

    from zipage.sim.profile_from_runs import profile_from_runs

    run = synthetic_run(tmp_path / "run", False)
    summary = json.loads((run / "summary.json").read_text())
    summary["settings"]["model"] = str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    (run / "summary.json").write_text(json.dumps(summary))
    assert profile_from_runs([run])["model"] == "SmolLM2-135M-Instruct.Q4_1"


# ---------------------------------------------------------------- 6. concurrent plans

def _write_grid(out: str, rows: int, label: str, start) -> None:
    from zipage.cli import plan_report
    from zipage.sim.planning import RESULT_COLUMNS

    plan_report.plot_pareto = lambda result, spec, path: Path(path).write_bytes(label.encode())
    table = [{column: f"{label}{index}" for column in RESULT_COLUMNS} for index in range(rows)]
    result = plan_report.PlanResult(rows=table, evaluated=rows, cached=0, wall_s=0.0)
    start.wait()
    plan_report.write_outputs(result, None, Path(out))


def test_two_plans_into_one_out_leave_one_whole_grid(tmp_path):
    """Two processes write grids of different sizes into one --out at once, many times over:
    results.csv always holds exactly one grid, and pareto.png is that grid's."""
    import pandas as pd

    context = multiprocessing.get_context("fork")
    grids = {"a": 20000, "b": 7000}
    for attempt in range(6):
        out = tmp_path / f"plan{attempt}"
        start = context.Barrier(2)
        workers = [context.Process(target=_write_grid, args=(str(out), rows, label, start))
                   for label, rows in grids.items()]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
            assert worker.exitcode == 0
        frame = pd.read_csv(out / "results.csv", dtype=str)
        winner = frame["rank"].iloc[0][0]
        assert len(frame) == grids[winner]
        assert frame["rank"].tolist() == [f"{winner}{index}" for index in range(grids[winner])]
        assert (out / "pareto.png").read_text() == winner
        assert [path.name for path in out.iterdir() if path.name.startswith(".")] == []


def test_a_file_writer_killed_midway_leaves_no_half_file(tmp_path):
    """write_file_atomically (traces, plans, reports) killed while it writes: the old file stays
    and the reaper removes the hidden half-written sibling."""
    target = tmp_path / "day.jsonl.gz"
    target.write_text("old")
    script = f"""
import os, signal
from pathlib import Path
from zipage.rundir import write_file_atomically

def write_then_die(temporary):
    temporary.write_bytes(b"x" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)
write_file_atomically(Path({str(target)!r}), write_then_die)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert no_staging_left(tmp_path), "a SIGKILLed file writer left its half-written file"
    assert target.read_text() == "old"
