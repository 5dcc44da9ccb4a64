"""`zipage calibrate` through the engine loop and `zipage fidelity`, end to end on the CPU engine
with the tiny model (the GPU runs the same code on CUDA tensors): the built-in traces run through
the engine, the profile is fitted from their steps and validated on a trace it was not fitted on
against the analytic model, and the fidelity check runs fresh traces (and a given file) and
reports both models' errors. The numbers of a loaded 2-core CPU mean nothing; what is checked is
that every part is there, measured, and readable by the simulator."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_engine import tiny_model  # noqa: E402,F401

from zipage.cli.parser import main  # noqa: E402
from zipage.sim.calibrated import CalibratedCostModel  # noqa: E402
from zipage.trace import load_trace  # noqa: E402

KNOBS = ["--block-size", "16", "--window", "4", "--budget", "64", "--kv-memory-gb", "0.01",
         "--hardware", "h200", "--threads", "1"]
FITTED = ("fit-online", "fit-long", "fit-pressure", "fit-shared", "fit-ingest", "fit-longctx")


@pytest.fixture(scope="module")
def calibrated(tiny_model, tmp_path_factory):  # noqa: F811
    directory, _ = tiny_model
    out = tmp_path_factory.mktemp("calibrate")
    status = main(["calibrate", "--engine", "cpu", "--model", str(directory), *KNOBS,
                   "--fit-seconds", "5", "--validation-seconds", "2", "--no-progress",
                   "--runs-dir", str(out / "runs"), "--out", str(out / "profile.json")])
    assert status == 0
    return directory, out


def test_the_profile_is_fitted_from_runs_through_the_loop(calibrated, capsys):
    _, out = calibrated
    profile = json.loads((out / "profile.json").read_text())
    assert profile["source"] == "measured" and "through the engine loop" in profile["note"]
    # (No launch points here: on the CPU a batch finishes inside the step that launches it.)
    for section in ("decode", "prefill", "mixed", "compress"):
        assert profile[section], section
    for name in FITTED + ("validate-bursts",):
        run = out / "runs" / name
        assert (run / "steps.csv").exists() and (run / "summary.json").exists(), name
        assert load_trace(run / "trace.jsonl.gz").requests, name
    long = json.loads((out / "runs" / "fit-long" / "summary.json").read_text())
    assert long["settings"]["config"]["chunked_prefill"] is False
    model = CalibratedCostModel.from_profile(out / "profile.json")
    assert model.contention_factor == 2.0  # batches launched behind the forward


def test_the_profile_carries_its_validation(calibrated):
    _, out = calibrated
    model = CalibratedCostModel.from_profile(out / "profile.json")
    validation = model.validation
    assert validation is not None and validation.workload == "validate-bursts"
    for name in ("profile", "analytic"):
        errors = validation.errors[name]
        assert errors["makespan"] is not None and errors["e2e_mape"] >= 0
        assert errors["ttft_p90"] is not None and errors["tpot_p50"] is not None
    assert validation.recommended in ("profile", "analytic")
    assert validation.band("makespan") == pytest.approx(abs(validation.errors["profile"]["makespan"]))


def test_fidelity_checks_fresh_traces_and_given_files(calibrated, tmp_path, capsys):
    directory, out = calibrated
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"version": 1, "name": "given", "requests": [
        {"id": f"g{i}", "arrival_s": 0.05 * i, "prompt_len": 40 + i, "output_len": 30}
        for i in range(6)]}))
    status = main(["fidelity", "--engine", "cpu", "--model", str(directory), *KNOBS,
                   "--cost-model", str(out / "profile.json"), "--traces", "1",
                   "--trace-seconds", "2", "--trace", str(tiny), "--check-seed", "5",
                   "--no-progress", "--out", str(tmp_path / "fidelity")])
    assert status == 0
    report = json.loads((tmp_path / "fidelity" / "fidelity.json").read_text())
    assert report["check_seed"] == 5
    assert [(row["trace"], row["model"]) for row in report["rows"]] == [
        ("check-conv", "profile"), ("check-conv", "analytic"), ("given", "profile"),
        ("given", "analytic")]
    assert all(row["makespan"] is not None for row in report["rows"])
    assert all(0 <= row["ks_ttft"] <= 1 and 0 <= row["ks_tpot"] <= 1 for row in report["rows"])
    assert report["complete"] is True
    printed = capsys.readouterr().out
    assert "check-conv" in printed and "misses its target" in printed and "ks_tpot" in printed
    # Each trace's table as it finished, then the whole one.
    assert printed.count("given ") == 4 and printed.count("check-conv ") == 4


def test_a_stopped_fidelity_check_keeps_the_traces_it_finished(calibrated, tmp_path, monkeypatch):
    """A check stopped in its second trace (a call's time limit: here an interrupt while the
    engine runs it) leaves fidelity.json with the first trace's rows, marked incomplete."""
    import zipage.analysis.calibration as calibration

    directory, out = calibrated
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"version": 1, "name": "given", "requests": [
        {"id": f"g{i}", "arrival_s": 0.05 * i, "prompt_len": 40 + i, "output_len": 30}
        for i in range(6)]}))
    run_engine = calibration.run_engine

    def stopped_at_given(twin, trace, *args, **kwargs):
        if trace.name == "given":
            raise KeyboardInterrupt
        return run_engine(twin, trace, *args, **kwargs)

    monkeypatch.setattr(calibration, "run_engine", stopped_at_given)
    status = main(["fidelity", "--engine", "cpu", "--model", str(directory), *KNOBS,
                   "--cost-model", str(out / "profile.json"), "--traces", "1", "--trace-seconds",
                   "2", "--trace", str(tiny), "--check-seed", "5", "--no-progress", "--out",
                   str(tmp_path / "f")])
    assert status == 130  # interrupted (zipage/cli/output.py)
    report = json.loads((tmp_path / "f" / "fidelity.json").read_text())
    assert report["complete"] is False
    assert [(row["trace"], row["model"]) for row in report["rows"]] == [
        ("check-conv", "profile"), ("check-conv", "analytic")]


def test_fidelity_prints_the_distances_and_profiles_do_not_record_them():
    from zipage.analysis.calibration import format_table, validation_record
    from zipage.trace import Trace

    errors = {"makespan": 0.02, "ttft_p50": -0.2, "e2e_mape": 0.05, "ks_ttft": 0.125,
              "ks_tpot": None}
    row = {"trace": "check-conv", "requests": 9, "model": "profile", **errors}
    header, _, line, legend = format_table([row]).splitlines()
    assert header.split()[-2:] == ["ks_ttft", "ks_tpot"]
    assert line.split()[-2:] == ["0.125", "-"]  # '-': no TPOT on one side
    assert "-20.0%*" in line and "ks_*" in legend
    record = validation_record(Trace("held-out", []), {"profile": errors, "analytic": errors})
    assert set(record["errors"]["profile"]) == {"makespan", "ttft_p50", "e2e_mape"}


def test_loop_calibration_refuses_bad_input_before_the_engine(tmp_path, capsys):
    assert main(["fidelity", "--engine", "cpu", "--model", "random:smollm2-135m", *KNOBS,
                 "--trace", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["fidelity", "--engine", "cpu", "--model", "random:smollm2-135m", *KNOBS,
                 "--traces", "0", "--out", str(tmp_path)]) == 2
    assert "--traces" in capsys.readouterr().err
