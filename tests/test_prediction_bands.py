"""How far to trust a prediction: a profile's validation record (read, checked, written), the
band printed beside each figure `zipage replay` and `zipage plan` print, and plan's three-valued
SLO verdicts (meets, misses, uncertain) at and around the band's edges. A profile without a
record behaves as before (its predictions are pinned in tests/test_cost_model.py)."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from tolerance import assert_close, close

from zipage.cli.bands import validation_lines
from zipage.cli.parser import main
from zipage.errors import ConfigError
from zipage.hardware import get_hardware
from zipage.presets import get_preset
from zipage.profile import VALIDATION_METRICS, Validation, read_validation, write_profile
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_loader import load_cost_model
from zipage.sim.planning import OK, SERIAL, SLO_MISSED, SLO_UNCERTAIN, PlanSpec, run_plan
from zipage.sim.slo import MEETS, MISSES, SLO, UNCERTAIN, verdict
from zipage.trace import Trace, load_trace, stamp_arrivals

ROOT = Path(__file__).resolve().parent.parent
# Qwen3-8B on an A100 at the default knobs: the setup `zipage replay` simulates by default.
EXAMPLE_PROFILE = ROOT / "sim" / "profiles" / "example-synthetic.json"
TINY = str(ROOT / "traces" / "tiny.json")
QWEN3_8B, A100 = get_preset("qwen3-8b"), get_hardware("a100")

PROFILE_ERRORS = {"makespan": -0.021, "throughput": 0.022, "ttft_p50": 0.05, "ttft_p90": -0.08,
                  "ttft_p99": -0.11, "tpot_p50": -0.013, "tpot_p90": 0.02, "tpot_p99": 0.04,
                  "e2e_mape": 0.043}
RECORD = {
    "workload": "calibrate-validate", "requests": 160,
    "errors": {"profile": PROFILE_ERRORS,
               "analytic": {**PROFILE_ERRORS, "ttft_p90": -0.04, "ttft_p99": None}},
    "recommended": "profile",
    "warnings": ["ttft_p90: the profile (-8.0 %) is worse than the analytic model (-4.0 %)"],
}


def validated_profile(record: dict | None = None, **errors: float | None) -> dict:
    """The shipped synthetic example with a validation record (`errors` replace the profile's)."""
    profile = json.loads(EXAMPLE_PROFILE.read_text())
    record = json.loads(json.dumps(record or RECORD))
    record["errors"]["profile"].update(errors)
    return {**profile, "validation": record}


def write(tmp_path: Path, profile: dict, name: str = "validated.json") -> str:
    return str(write_profile(profile, tmp_path / name))


# ---------------------------------------------------------------- the record

@pytest.mark.parametrize("name", ["validated.json", "validated.json.gz"])
def test_a_validation_record_round_trips_through_the_profile(tmp_path, name):
    path = write(tmp_path, validated_profile(), name)
    model = CalibratedCostModel.from_profile(path)
    expected = Validation("calibrate-validate", 160,
                          {"profile": PROFILE_ERRORS,
                           "analytic": {**PROFILE_ERRORS, "ttft_p90": -0.04, "ttft_p99": None}},
                          "profile", (RECORD["warnings"][0],))
    assert_close(model.validation, expected)
    assert model.validation.band("ttft_p99") == close(0.11)
    assert model.validation.band("throughput") == close(0.022)
    assert model.validation.error("ttft_p99", "analytic") is None
    assert set(model.validation.bands()) == set(VALIDATION_METRICS)
    # The record is not part of the header: the setup checks never see it.
    assert "validation" not in model.header
    # A Validation object is written as its record, and reads back the same.
    again = write(tmp_path, {**validated_profile(), "validation": model.validation},
                  "again.json")
    assert_close(CalibratedCostModel.from_profile(again).validation, expected)


def test_the_record_changes_no_prediction_and_old_profiles_have_none(tmp_path):
    plain = load_cost_model(str(EXAMPLE_PROFILE), QWEN3_8B, A100)
    validated = load_cost_model(write(tmp_path, validated_profile()), QWEN3_8B, A100)
    assert plain.validation is None
    assert load_cost_model("analytic", QWEN3_8B, A100).validation is None
    for batch, context in ((1, 512), (64, 64 * 2048), (256, 256 * 4096)):
        assert validated.decode_time_for(batch, context) == close(
            plain.decode_time_for(batch, context))
    assert validated.prefill_time_for([(2048, 0)]) == close(plain.prefill_time_for([(2048, 0)]))


def test_unknown_keys_are_tolerated_and_nulls_are_undefined_metrics():
    record = json.loads(json.dumps(RECORD))
    record["errors"]["profile"].update(ttft_p999=0.3, prefill_share="new")  # a newer calibrate
    record["errors"]["profile"]["tpot_p90"] = None
    del record["errors"]["profile"]["tpot_p99"]  # missing: undefined, as null
    record["errors"]["fitted-on"] = {"makespan": 0.0}
    record["seeds"] = [1, 2]
    validation = read_validation("profile P", {"validation": record})
    assert validation.band("tpot_p90") is None and validation.band("tpot_p99") is None
    assert "ttft_p999" not in validation.bands()
    assert read_validation("profile P", {}) is None


def edited(edit) -> dict:
    record = json.loads(json.dumps(RECORD))
    edit(record)
    return {"validation": record}


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["errors"]["profile"].update(ttft_p50="x"),
     'profile P: validation.errors.profile.ttft_p50: expected a number or null, got "x"'),
    (lambda r: r["errors"]["analytic"].update(makespan=True),
     "validation.errors.analytic.makespan: expected a number or null, got true"),
    (lambda r: r["errors"]["profile"].update(throughput=math.inf),
     "validation.errors.profile.throughput: expected a number or null, got Infinity"),
    (lambda r: r["errors"]["profile"].update(e2e_mape=-0.1),
     "validation.errors.profile.e2e_mape: expected a mean absolute error"),
    (lambda r: r["errors"].pop("profile"), "validation.errors.profile: missing"),
    (lambda r: r["errors"].update(profile=[0.1]),
     "validation.errors.profile: expected an object of errors per metric, got a list"),
    (lambda r: r.update(errors=None), "validation.errors: expected an object"),
    (lambda r: r.update(workload=""), "validation.workload: expected the held-out"),
    (lambda r: r.update(requests=0), "validation.requests: expected the workload's request"),
    (lambda r: r.update(requests=1.5), "validation.requests"),
    (lambda r: r.update(recommended="roofline"), "validation.recommended: expected"),
    (lambda r: (r["errors"].pop("analytic"), r.update(recommended="analytic")),
     "validation.recommended: \"analytic\", but errors.analytic is missing"),
    (lambda r: r.update(warnings="worse"), "validation.warnings: expected a list of strings"),
    (lambda r: r.update(warnings=[3]), "validation.warnings"),
])
def test_a_malformed_record_is_one_line_naming_the_field(edit, message):
    with pytest.raises(ConfigError) as raised:
        read_validation("profile P", edited(edit))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert "zipage calibrate --gpu" in str(raised.value)  # the fix


def test_a_record_that_is_no_object_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ConfigError, match=r"validation: expected an object, got a list"):
        read_validation("profile P", {"validation": [1]})
    with pytest.raises(ConfigError, match="ttft_p50"):
        write_profile(validated_profile(ttft_p50="x"), tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_a_bad_record_makes_replay_exit_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(validated_profile(ttft_p90="x")))
    assert main(["replay", TINY, "--no-progress", "--cost-model", str(bad)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"zipage: error: profile {bad}: validation.errors.profile.ttft_p90:")
    assert "\n" not in error


# ---------------------------------------------------------------- zipage replay

def replay(capsys, *argv: str) -> list[str]:
    assert main(["replay", TINY, "--no-progress", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def row(lines: list[str], label: str) -> str:
    [line] = [line for line in lines if line.strip().startswith(label)]
    return line.strip()[len(label):].strip()


def test_replay_prints_the_band_beside_each_validated_figure(tmp_path, capsys):
    lines = replay(capsys, "--cost-model", write(tmp_path, validated_profile()))
    assert row(lines, "throughput (tok/s)").endswith("(±2.2 % on validation)")
    assert row(lines, "makespan (s)").endswith("(±2.1 % on validation)")
    assert row(lines, "p90 TTFT (s)").endswith("(±8.0 % on validation)")
    # The medians the validation measured get rows of their own; means have no band.
    assert row(lines, "p50 TTFT (s)").endswith("(±5.0 % on validation)")
    assert row(lines, "p50 TPOT (ms)").endswith("(±1.3 % on validation)")
    assert "validation" not in row(lines, "mean TTFT (s)")
    assert "validation" not in row(lines, "mean TPOT (ms)")
    # The notes start in one column.
    columns = {line.index("(±") for line in lines if "on validation)" in line}
    assert len(columns) == 1
    assert any("calibrate-validate (160 requests" in line
               and "calibrate recommends this profile" in line for line in lines)
    assert any(line.strip().startswith("validation warning: ttft_p90") for line in lines)
    assert not any(line.strip().startswith("warning:") for line in lines)
    assert not any("no validated error band" in line for line in lines)


def test_replay_warns_when_the_profiles_validation_recommends_the_analytic_model(tmp_path,
                                                                                 capsys):
    record = {**RECORD, "recommended": "analytic"}
    lines = replay(capsys, "--cost-model", write(tmp_path, validated_profile(record)))
    assert any("calibrate recommends the analytic model" in line for line in lines)
    assert any(line.strip().startswith("warning:") and "--cost-model analytic" in line
               for line in lines)


def test_an_undefined_metric_says_it_has_no_band(tmp_path, capsys):
    lines = replay(capsys, "--cost-model", write(tmp_path, validated_profile(ttft_p50=None)))
    assert row(lines, "p50 TTFT (s)").endswith("(not validated)")


def test_replay_json_carries_the_bands(tmp_path, capsys):
    [text] = replay(capsys, "--cost-model", write(tmp_path, validated_profile()), "--json")
    validation = json.loads(text)["validation"]
    assert validation["workload"] == "calibrate-validate" and validation["requests"] == 160
    assert validation["recommended"] == "profile"
    assert validation["bands"]["ttft_p90"] == close(0.08)
    assert validation["errors"]["ttft_p90"] == close(-0.08)
    assert set(validation["bands"]) == set(VALIDATION_METRICS)
    [text] = replay(capsys, "--json")
    assert json.loads(text)["validation"] is None


@pytest.mark.parametrize("cost_model, says", [
    ("analytic", "no validated error band (analytic cost model)"),
    ("example-synthetic", "profile example-synthetic has no validation record"),
])
def test_without_a_validated_profile_replay_says_so_once(capsys, cost_model, says):
    lines = replay(capsys, "--cost-model", cost_model)
    notes = [line for line in lines if "validat" in line]
    assert len(notes) == 1 and says in notes[0] and "zipage calibrate --gpu" in notes[0]
    assert "p50 TTFT (s)" not in "\n".join(lines)  # the table as before


def test_an_engine_runs_summary_has_no_band_line():
    assert validation_lines({"driver": "engine-cuda"}) == []


# ---------------------------------------------------------------- the verdict rule

@pytest.mark.parametrize("predicted, target, band, expected", [
    (3.0, 6.0, 0.5, MEETS),  # predicted = target (1 - band): the engine's value is <= target
    (3.0, math.nextafter(6.0, 0.0), 0.5, UNCERTAIN),  # just inside the band
    (3.0, 2.0, 0.5, UNCERTAIN),  # predicted = target (1 + band): the engine may meet it
    (3.0, math.nextafter(2.0, 0.0), 0.5, MISSES),  # just beyond the band
    (3.0, 3.0, 0.5, UNCERTAIN),
    (3.0, 3.0, None, MEETS),  # no band: the prediction decides, as before
    (3.0, math.nextafter(3.0, 0.0), None, MISSES),
    (3.0, 3.0, 0.0, MEETS),
    (0.5, 100.0, 1.5, UNCERTAIN),  # a band past 100 %: never sure to meet
])
def test_the_verdict_rule_at_and_around_the_band_edges(predicted, target, band, expected):
    assert verdict(predicted, target, band) == expected


# ---------------------------------------------------------------- zipage plan

@pytest.fixture(scope="module")
def online() -> Trace:
    """60 GSM8K-like requests at 40 req/s: enough queueing that a second replica helps."""
    trace = load_trace(ROOT / "traces" / "gsm8k.json")
    return stamp_arrivals(Trace("gsm8k-60", trace.requests[:60]), 40.0)


def plan(trace: Trace, profile: str, slo: SLO, replicas=(1,)) -> list[dict]:
    spec = PlanSpec(hardware=["a100"], budgets=[2048], block_sizes=[256], hybrid=[True],
                    replicas=list(replicas), slo=slo,
                    base=replace(PlanSpec().base, cost_model=profile))
    return run_plan(trace, spec, executor=SERIAL).rows


def test_plan_verdicts_are_uncertain_exactly_within_the_band(tmp_path, online):
    # Bands: TTFT p90 50 % (its lower edge is exact: 2x * 0.5 = x), TTFT p99 100 % (its upper
    # edge is exact: x/2 * 2 = x).
    profile = write(tmp_path, validated_profile(ttft_p90=-0.5, ttft_p99=1.0))
    [predicted] = plan(online, profile, SLO())
    p90, p99 = predicted["ttft_p90_s"], predicted["ttft_p99_s"]
    assert predicted["ttft_p90_s_band"] == close(0.5) and predicted["validated_on"] == \
        "calibrate-validate"

    def status(slo: SLO) -> dict:
        [row] = plan(online, profile, slo)
        return row

    at_lower_edge = status(SLO(ttft_p90_s=2 * p90))
    assert at_lower_edge["status"] == OK and at_lower_edge["slo_verdicts"] == "TTFT p90: meets"
    inside = status(SLO(ttft_p90_s=math.nextafter(2 * p90, 0.0)))
    assert inside["status"] == SLO_UNCERTAIN and "within the ±50.0 % band" in inside["reason"]
    at_upper_edge = status(SLO(ttft_p99_s=p99 / 2))
    assert at_upper_edge["status"] == SLO_UNCERTAIN
    assert at_upper_edge["slo_verdicts"] == "TTFT p99: uncertain"
    beyond = status(SLO(ttft_p99_s=math.nextafter(p99 / 2, 0.0)))
    assert beyond["status"] == SLO_MISSED and "beyond its ±100.0 % band" in beyond["reason"]
    # The analytic model has no band: the same prediction is judged as it always was.
    [analytic] = plan(online, "analytic", SLO(ttft_p90_s=math.nextafter(2 * p90, 0.0)))
    assert analytic["validated_on"] is None and analytic["ttft_p90_s_band"] is None


def test_plan_names_an_uncertain_smaller_replica_count(tmp_path, online, capsys):
    unbanded = plan(online, "example-synthetic", SLO(), replicas=(1, 2))
    by_count = {row["replicas"]: row["ttft_p90_s"] for row in unbanded}
    assert by_count[2] < by_count[1]
    # A band that puts 1 replica's TTFT p90 inside the band of a target 2 replicas surely meet.
    band = (1 - by_count[2] / by_count[1]) / 2
    profile = write(tmp_path, validated_profile(ttft_p90=band))
    slo_s = by_count[1]
    out = tmp_path / "plan"
    status = main(["plan", _save(online, tmp_path),
                   "--hardware", "a100", "--replicas", "1..2", "--slo-ttft-p90", repr(slo_s),
                   "--cost-model", profile, "--workers", "1", "--no-progress", "--no-cache",
                   "--out", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    fewest = printed.split("fewest replicas meeting the SLOs")[1].splitlines()[2]
    assert fewest.split()[:2] == ["a100-80gb", "2"]
    assert "(1 is uncertain: TTFT p90" in fewest
    assert "#2 may miss the SLOs: TTFT p90" in printed
    assert f"TTFT p90 s ±{100 * band:.1f} %" in printed  # the band in the column's header
    assert "calibrate-validate (160 requests" in printed
    with (out / "results.csv").open() as handle:
        rows = {int(row["replicas"]): row for row in csv.DictReader(handle)}
    assert rows[1]["status"] == SLO_UNCERTAIN and rows[2]["status"] == OK
    assert rows[1]["slo_verdicts"] == "TTFT p90: uncertain"
    assert float(rows[1]["ttft_p90_s_band"]) == close(band)
    assert rows[1]["validated_on"] == "calibrate-validate"


def _save(trace: Trace, directory: Path) -> str:
    from zipage.trace import save_trace

    path = directory / "online.json"
    save_trace(trace, path)
    return str(path)


def test_plan_without_a_validated_profile_says_so_once(capsys):
    assert main(["plan", TINY, "--hardware", "a100", "--slo-ttft-p90", "10", "--workers", "1",
                 "--no-progress", "--no-cache"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "validat" in line]
    assert len(notes) == 1 and "no validated error band (analytic cost model)" in notes[0]


def test_max_rate_with_a_band_finds_a_rate_that_surely_meets(tmp_path, online):
    profile = write(tmp_path, validated_profile(ttft_p90=0.2))
    spec = PlanSpec(hardware=["a100"], budgets=[2048], hybrid=[True], objective="max-rate",
                    slo=SLO(ttft_p90_s=0.5), base=replace(PlanSpec().base, cost_model=profile))
    [banded] = run_plan(online, spec, executor=SERIAL).rows
    [plain] = run_plan(online, replace(spec, base=replace(spec.base,
                                                          cost_model="example-synthetic")),
                       executor=SERIAL).rows
    assert banded["status"] == OK and banded["ttft_p90_s"] <= 0.5 * (1 - 0.2)
    assert banded["max_rate_qps"] <= plain["max_rate_qps"]
