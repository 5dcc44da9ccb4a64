"""`zipage calibrate --quick`: a profile re-scaled to this machine from a few anchor steps.

The fit (sim/quick_correction.py) on anchors of known scales: it recovers them, picks the fewest
scales the anchors need, and refuses what no scaling explains. The re-scaled profile predicts
each step moved by its groups' scales. The machine record is written and read back, old profiles
without it still load. End to end on the CPU engine with the tiny model: the anchors of one set
of runs recover exactly the factor a profile was perturbed by, and the command re-measures and
recovers it within what a shared 2-core CPU allows; a profile of another setup or kind of
machine is refused in one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from zipage.analysis.quick_calibration import anchor_table
from zipage.errors import ConfigError
from zipage.model_spec import resolve_shape
from zipage.profile import read_profile, read_record, write_profile
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_model import PROFILES_DIR, StepWork
from zipage.sim.quick_correction import (
    GROUPS,
    MAX_RESIDUAL,
    NOISE_FLOOR,
    Anchor,
    apply_correction,
    fit_correction,
    roofline_model,
    step_shares,
)

SHIPPED = PROFILES_DIR / "qwen3-8b-h200-b64-k512-zipage.json"
ROOT = Path(__file__).resolve().parents[1]
# Shares of the anchors a Qwen3-8B engine on an H200 runs (host, memory, compute of the shipped
# profile's predictions: one request's decode to long prompt chunks; printed by
# `step_shares` for the anchor plan's shapes).
GPU_LIKE_SHARES = [(0.30, 0.70, 0.00), (0.37, 0.63, 0.00), (0.59, 0.41, 0.00), (0.29, 0.71, 0.00),
                   (0.61, 0.38, 0.01), (0.05, 0.00, 0.95), (0.08, 0.02, 0.90), (0.45, 0.30, 0.25)]


def anchors_of(shares, scales, noise=()) -> list[Anchor]:
    """Anchors whose ratio is exactly what `scales` (per group) make of their shares, times
    1 + noise[i]."""
    anchors = []
    for index, share in enumerate(shares):
        ratio = sum(s * scales[group] for s, group in zip(share, GROUPS))
        ratio *= 1.0 + (noise[index] if index < len(noise) else 0.0)
        anchors.append(Anchor(f"a{index}", "decode", 10, ratio * 1e-3, 1e-3, ratio, share))
    return anchors


# ---------------------------------------------------------------- the fit


def test_one_scale_when_the_anchors_agree():
    anchors = anchors_of(GPU_LIKE_SHARES, dict.fromkeys(GROUPS, 0.91))
    correction = fit_correction(anchors)
    assert correction.refusal is None and correction.model == "uniform"
    assert correction.scales["host"] == pytest.approx(0.91, rel=1e-9)
    assert correction.worst < 1e-9


def test_host_and_device_apart_when_only_the_host_moved():
    # A host 20 % faster, the GPU as it was: the "host speed" case.
    scales = {"host": 0.8, "memory": 1.0, "compute": 1.0}
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, scales))
    assert correction.refusal is None and correction.model == "host-device"
    for group, value in scales.items():
        assert correction.scales[group] == pytest.approx(value, rel=1e-6)
    # One scale for all would miss the anchors by ~4 % RMS (the long prompt chunks, all compute,
    # by ~10 %): more than the engine's own spread.
    assert correction.considered["uniform"] > NOISE_FLOOR


def test_three_groups_when_clocks_and_bandwidth_moved_apart():
    scales = {"host": 0.9, "memory": 1.0, "compute": 1.15}
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, scales))
    assert correction.model == "host-memory-compute" and correction.refusal is None
    for group, value in scales.items():
        assert correction.scales[group] == pytest.approx(value, rel=1e-6)


def test_noise_below_the_floor_keeps_one_scale():
    # Scales 2 % apart are within the engine's own spread: no extra parameter for them.
    scales = {"host": 0.99, "memory": 1.01, "compute": 1.01}
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, scales))
    assert correction.worst <= NOISE_FLOOR
    assert correction.model == "uniform"


def test_a_host_only_profile_cannot_split_its_groups():
    # The CPU engine priced by a GPU's roofline: every anchor all host, so only one scale.
    shares = [(1.0, 0.0, 0.0)] * 5
    correction = fit_correction(anchors_of(shares, dict.fromkeys(GROUPS, 1.3),
                                           noise=(0.01, -0.01, 0.0, 0.02, -0.02)))
    assert correction.model == "uniform" and correction.refusal is None
    assert correction.considered["host-device"] is None
    assert correction.scales["memory"] == pytest.approx(1.3, rel=0.02)


def test_refused_when_no_scaling_explains_the_anchors():
    noise = (0.0, 0.0, 0.0, 0.0, 0.4, 0.0, 0.0, -0.3)  # two anchors far off any scaling
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, dict.fromkeys(GROUPS, 1.0), noise))
    assert correction.refusal is not None and correction.worst > MAX_RESIDUAL
    assert "off after scaling" in correction.refusal


def test_refused_beyond_the_largest_scale():
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, dict.fromkeys(GROUPS, 3.0)))
    assert correction.refusal is not None and "scale of 3.00" in correction.refusal
    assert fit_correction(anchors_of(GPU_LIKE_SHARES, dict.fromkeys(GROUPS, 3.0)),
                          max_scale=4.0).refusal is None


def test_refused_with_too_few_anchors():
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES[:2], dict.fromkeys(GROUPS, 1.0)))
    assert correction.refusal is not None and "2 anchor(s)" in correction.refusal


# The anchors of `zipage fidelity --quick-correct` with the 8B Zipage profile on the H200 host the
# profile was measured on (2026-11-29, docs/BENCHMARKS.md 'Quick correction across H200s'): name,
# ratio (measured / predicted) and shares. Every anchor within 7.5 % but one request's 64-token
# prefill, which the profile prices at its prefill floor (9.05 ms against 6.83 measured).
SAME_HOST_ANCHORS = [
    ("single prefill", 0.754, (0.55, 0.43, 0.02)), ("single decode", 0.975, (0.27, 0.73, 0.0)),
    ("batch16 prefill", 0.993, (0.1, 0.01, 0.9)), ("batch16 decode", 0.993, (0.29, 0.71, 0.0)),
    ("batch64 prefill", 1.013, (0.05, 0.0, 0.95)), ("batch64 mixed", 0.939, (0.32, 0.2, 0.48)),
    ("batch64 decode", 0.962, (0.32, 0.66, 0.02)), ("long16 prefill", 0.973, (0.05, 0.0, 0.95)),
    ("long16 mixed", 1.074, (0.1, 0.0, 0.89)), ("long16 decode", 0.995, (0.28, 0.72, 0.0))]


def _named_anchors(rows) -> list[Anchor]:
    return [Anchor(name, name.split()[1], 10, ratio * 1e-3, 1e-3, ratio, shares)
            for name, ratio, shares in rows]


def test_one_mispriced_shape_is_left_out_not_scaled_for():
    # Every anchor together asks for a host scale of 0.47 (memory 1.19) on the profile's own
    # host: one shape pulling every scale. Left out, the rest agree on one scale near 1.
    correction = fit_correction(_named_anchors(SAME_HOST_ANCHORS))
    assert correction.refusal is None and correction.model == "uniform"
    assert correction.scales["host"] == pytest.approx(0.99, abs=0.01)
    [(anchor, missed)] = correction.left_out
    assert anchor.name == "single prefill" and missed < -MAX_RESIDUAL
    assert len(correction.anchors) == len(SAME_HOST_ANCHORS) - 1
    assert correction.record()["left_out"][0]["name"] == "single prefill"
    assert "left out: 'single prefill'" in anchor_table(correction)


def test_two_mispriced_shapes_are_still_refused():
    # Leaving one out is for one shape; two far off any scaling are the profile against this
    # machine, and the refusal stands (as for the old profiles' 64-request decode and mixed steps).
    rows = [(name, ratio * (0.75 if name == "batch64 decode" else 1.0), shares)
            for name, ratio, shares in SAME_HOST_ANCHORS]
    correction = fit_correction(_named_anchors(rows))
    assert correction.refusal is not None and not correction.left_out


@settings(max_examples=examples(200), deadline=None)
@given(scale=st.floats(0.6, 1.6), outlier=st.integers(0, len(GPU_LIKE_SHARES) - 1),
       error=st.floats(0.3, 0.6), sign=st.sampled_from((-1.0, 1.0)),
       noise=st.lists(st.floats(-0.01, 0.01), min_size=len(GPU_LIKE_SHARES),
                      max_size=len(GPU_LIKE_SHARES)))
def test_one_outlier_among_agreeing_anchors_is_left_out(scale, outlier, error, sign, noise):
    """Anchors that agree on one scale within the engine's spread, but one 30-60 % off: that one
    is left out, whichever it is, and the scale is the others'."""
    noise[outlier] = sign * error
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, dict.fromkeys(GROUPS, scale), noise))
    assert correction.refusal is None, correction.refusal
    assert [anchor.name for anchor, _ in correction.left_out] == [f"a{outlier}"]
    assert all(value == pytest.approx(scale, rel=0.03) for value in correction.scales.values())


@settings(max_examples=examples(200), deadline=None)
@given(scale=st.floats(0.6, 1.6), noise=st.lists(st.floats(-0.05, 0.05),
                                                 min_size=len(GPU_LIKE_SHARES),
                                                 max_size=len(GPU_LIKE_SHARES)))
def test_anchors_within_the_limit_are_all_kept(scale, noise):
    """No anchor is left out where one scale explains every anchor within the residual limit."""
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, dict.fromkeys(GROUPS, scale), noise))
    assert correction.refusal is None and not correction.left_out


def test_an_anchor_the_rest_explain_is_never_left_out():
    for scales in ({"host": 0.8, "memory": 1.0, "compute": 1.0}, dict.fromkeys(GROUPS, 0.91)):
        assert not fit_correction(anchors_of(GPU_LIKE_SHARES, scales)).left_out


# ---------------------------------------------------------------- the corrected profile


def shipped_model_and_roofline():
    _, data = read_profile(SHIPPED)
    model = CalibratedCostModel.from_profile(data)
    return data, model, roofline_model(model.header, resolve_shape(data["model"]))


WORKS = {"decode b1": StepWork(1, 300), "decode b64": StepWork(64, 64 * 400),
         "prefill 2k": StepWork(num_prefill=1, num_sampled_prefill=1, prefill_tokens=2048,
                                attention_pairs=2048 * 2049 // 2)}


def test_a_uniform_correction_scales_every_prediction():
    data, model, roofline = shipped_model_and_roofline()
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, dict.fromkeys(GROUPS, 0.93)))
    corrected = apply_correction(data, correction, roofline, correction.record())
    refit = CalibratedCostModel.from_profile(corrected)
    for work in WORKS.values():
        assert refit.forward_time_for(work) == pytest.approx(
            0.93 * model.forward_time_for(work), rel=1e-6)
    assert refit.correction["scales"]["host"] == pytest.approx(0.93)


@pytest.mark.parametrize("scales", [{"host": 0.8, "memory": 1.0, "compute": 1.0},
                                    {"host": 1.0, "memory": 1.1, "compute": 1.1}])
def test_each_step_moves_by_its_own_groups(scales):
    """A step moves by its shares of the scales: with a 20 % faster host a long prompt chunk
    (the GPU's FLOPs) by ~2 %, one request's decode (a quarter host) by ~5 %; as far as the
    refitted lines follow their re-scaled points, which blurs a step's change by up to ~4 points
    (docs/cost_model.md, 'Quick correction'); never beyond the scales themselves."""
    data, model, roofline = shipped_model_and_roofline()
    correction = fit_correction(anchors_of(GPU_LIKE_SHARES, scales))
    refit = CalibratedCostModel.from_profile(
        apply_correction(data, correction, roofline, correction.record()))
    for name, work in WORKS.items():
        before = model.forward_time_for(work)
        expected = float(np.dot(step_shares(roofline, work, before),
                                [scales[group] for group in GROUPS]))
        change = refit.forward_time_for(work) / before
        assert change == pytest.approx(expected, abs=0.045), name
        assert min(scales.values()) - 0.01 <= change <= max(scales.values()) + 0.01, name


def test_a_decode_step_of_the_8b_is_mostly_its_weights():
    _, model, roofline = shipped_model_and_roofline()
    weights_s = roofline.weight_bytes / roofline.gpu.achievable_bandwidth
    work = WORKS["decode b1"]
    seconds = model.forward_time_for(work)
    host, memory, compute = step_shares(roofline, work, seconds)
    assert memory * seconds == pytest.approx(weights_s, rel=0.25)
    assert compute < 0.02 and host == pytest.approx(1.0 - memory - compute)
    assert step_shares(None, work, seconds) == (1.0, 0.0, 0.0)


# ---------------------------------------------------------------- records


def test_old_profiles_have_no_records_and_still_load():
    old = ROOT / "tests/golden/profiles/before-host-tables/qwen3-8b-h200-b64-k512-zipage.json"
    source, data = read_profile(old)
    assert read_record(source, data, "machine") is None
    model = CalibratedCostModel.from_profile(old)
    assert model.machine is None and model.correction is None


def test_the_shipped_profile_records_its_machine():
    model = CalibratedCostModel.from_profile(SHIPPED)
    assert "H200" in model.machine["gpu_name"] and model.correction is None


def test_records_are_checked_when_written(tmp_path):
    _, data = read_profile(SHIPPED)
    machine = {"device": "cuda", "gpu_name": "NVIDIA H200", "host_cpu": "x"}
    out = write_profile({**data, "machine": machine}, tmp_path / "p.json")
    assert CalibratedCostModel.from_profile(out).machine == machine
    # The header is unchanged by the record: the setup checks ignore it.
    assert "machine" not in CalibratedCostModel.from_profile(out).header
    with pytest.raises(ConfigError, match="machine: expected an object"):
        write_profile({**data, "machine": "H200"}, tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="correction.scales"):
        write_profile({**data, "correction": {"scales": {"host": -1}}}, tmp_path / "bad.json")


# ---------------------------------------------------------------- the CPU engine, end to end

torch_needed = pytest.mark.engine
KNOBS = ["--block-size", "16", "--window", "4", "--budget", "128", "--max-model-len", "512",
         "--kv-memory-gb", "0.01", "--hardware", "h200", "--threads", "1", "--dtype", "float32"]
# The factor the test profile is perturbed by: far beyond the CPU's noise between two
# measurements a few seconds apart (tens of percent on a shared 2-core host).
FACTOR = 2.5


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The tiny model's anchor runs on the CPU engine, a profile fitted from them (this
    machine's own), the same profile perturbed by FACTOR, and the twin (closed at the end)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from tiny_models import save_tiny_qwen3

    from zipage.analysis import quick_calibration as quick
    from zipage.analysis.calibration import STALL_FACTOR, open_twin
    from zipage.config import ZipageConfig
    from zipage.core.deployment import ReplaySettings
    from zipage.sim.profile_from_runs import profile_from_runs

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("quick")
    model_dir = root / "tiny-qwen3"
    model_dir.mkdir()
    save_tiny_qwen3(model_dir)
    settings = ReplaySettings(model=str(model_dir), dtype="float32", kv_memory_gb=0.01,
                              config=ZipageConfig(block_size=16, window=4, kv_budget=128,
                                                  max_model_len=512))
    twin = open_twin(settings, "cpu", hardware="h200")
    bursts = quick.anchor_plan(twin.engine.config, twin.engine.capacity)
    runs = quick.run_anchors(twin, bursts, root / "runs")
    profile = profile_from_runs([path for paths in runs.values() for path in paths], gpu="h200",
                                stall_factor=STALL_FACTOR)
    profile.update(machine=quick.machine_record(twin.engine.device),
                   settings=twin.settings.to_dict())
    perturbed = {key: ([dict(row, time_s=row["time_s"] * FACTOR) for row in value]
                       if key in ("decode", "prefill", "mixed", "compress", "launch") else value)
                 for key, value in profile.items()}
    paths = {"own": write_profile(profile, root / "own.json"),
             "perturbed": write_profile(perturbed, root / "perturbed.json")}
    yield SimpleNamespace(twin=twin, bursts=bursts, runs=runs, paths=paths, root=root,
                          model_dir=model_dir)
    twin.close()


def anchors_against(measured, path):
    from zipage.analysis.quick_calibration import burst_anchors

    model = CalibratedCostModel.from_profile(path)
    roofline = roofline_model(model.header, measured.twin.engine.shape)
    return [anchor for burst in measured.bursts
            for anchor in burst_anchors(burst, measured.runs[burst.name], model, roofline)]


@torch_needed
def test_the_anchors_recover_the_perturbation_exactly(measured):
    """Same runs, the profile and the profile x FACTOR: every anchor's ratio, and so the scale,
    is FACTOR apart, and the corrected perturbed profile predicts what the corrected own one does
    (no timing noise: one set of runs)."""
    from zipage.analysis.quick_calibration import corrected_profile

    own = anchors_against(measured, measured.paths["own"])
    perturbed = anchors_against(measured, measured.paths["perturbed"])
    assert len(own) >= 4 and [a.name for a in own] == [a.name for a in perturbed]
    for mine, theirs in zip(own, perturbed):
        assert theirs.ratio * FACTOR == pytest.approx(mine.ratio, rel=1e-6), mine.name
    fits = [fit_correction(anchors, max_residual=5.0, max_scale=6.0)
            for anchors in (own, perturbed)]
    assert fits[1].scales["host"] * FACTOR == pytest.approx(fits[0].scales["host"], rel=1e-6)
    models = [CalibratedCostModel.from_profile(corrected_profile(
        read_profile(measured.paths[name])[1], fit, None,
        {**fit.record(), "machine": {"device": "cpu"}, "date": "today"}))
        for name, fit in zip(("own", "perturbed"), fits)]
    for work in (StepWork(1, 40), StepWork(16, 16 * 60)):
        assert models[1].forward_time_for(work) == pytest.approx(
            models[0].forward_time_for(work), rel=1e-6)


# What the CPU tests let through: the tiny model's steps on a shared 2-core host move by up to
# 2x between two measurements a minute apart (other processes' load), and one anchor of three
# prompt steps may be 100 % off the others; the GPU's anchors are medians of steady steps.
CPU_LIMITS = ["--max-residual", "5", "--max-scale", "6"]
CPU_DRIFT = 2.0


@torch_needed
def test_quick_recovers_the_factor_on_the_cpu_engine(measured, tmp_path, capsys):
    """The command re-measures the anchors and re-scales the perturbed profile by about
    1 / FACTOR: within CPU_DRIFT either way (a correction not applied is FACTOR off, an
    inverted one FACTOR squared)."""
    from zipage.cli.parser import main

    out = tmp_path / "corrected.json"
    status = main(["calibrate", "--quick", "--profile", str(measured.paths["perturbed"]),
                   "--engine", "cpu", "--model", str(measured.model_dir), *KNOBS, *CPU_LIMITS,
                   "--out", str(out)])
    captured = capsys.readouterr()
    printed = captured.out
    assert status == 0, printed + captured.err
    assert "anchors (each burst's prefill" in printed and "in all (engine build" in printed
    corrected = json.loads(out.read_text())
    correction = corrected["correction"]
    scale = correction["scales"]["host"]
    assert 1 / (CPU_DRIFT * FACTOR) <= scale <= CPU_DRIFT / FACTOR, printed
    assert correction["source"] == str(measured.paths["perturbed"])
    assert correction["machine"]["device"] == "cpu" and len(correction["anchors"]) >= 4
    assert correction["elapsed_s"] > 0 and corrected["machine"]["device"] == "cpu"
    # The corrected profile is a profile: it loads for this setup and predicts the scaled times.
    perturbed = CalibratedCostModel.from_profile(measured.paths["perturbed"])
    model = CalibratedCostModel.from_profile(out)
    work = StepWork(16, 16 * 60)
    assert model.forward_time_for(work) == pytest.approx(  # the record's scale: 5 digits
        scale * perturbed.forward_time_for(work), rel=1e-4)


@torch_needed
@pytest.mark.parametrize("change, message", [
    ({"machine": {"device": "cuda", "gpu_name": "NVIDIA H200"}}, "measured on a cuda engine"),
    ({"kv_budget": 64}, "kv_budget: measured with 64"),
    ({"settings.kv_memory_gb": 0.02}, "kv_memory_gb 0.02 (this run: 0.01)"),
])
def test_another_setup_or_machine_is_refused(measured, tmp_path, capsys, change, message):
    from zipage.cli.parser import main

    _, data = read_profile(measured.paths["own"])
    for key, value in change.items():
        if key.startswith("settings."):
            data = {**data, "settings": {**data["settings"], key.split(".", 1)[1]: value}}
        else:
            data = {**data, key: value}
    path = write_profile(data, tmp_path / "other.json")
    status = main(["calibrate", "--quick", "--profile", str(path), "--engine", "cpu",
                   "--model", str(measured.model_dir), *KNOBS, "--out", str(tmp_path / "x.json")])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1 and message in error[0], error
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--quick"], "--quick: name the profile to re-scale with --profile"),
    (["--profile", "p.json"], "--profile: only read with --quick"),
    (["--quick", "--profile", "p.json", "--grid"], "--grid: not with --quick"),
    (["--quick", "--profile", "p.json", "--max-residual", "0"], "--max-residual: got 0"),
    (["--quick", "--profile", "p.json", "--max-residual", "nan"], "--max-residual: got nan"),
    (["--quick", "--profile", "p.json", "--max-scale", "1"], "--max-scale: got 1"),
    (["--quick", "--profile", "missing.json", "--engine", "cpu"], "missing.json: no such file"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, flags, message):
    from zipage.cli.parser import main

    status = main(["calibrate", *flags, "--out", str(tmp_path / "x.json")])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1 and message in error[0], error


def test_fidelity_quick_correct_needs_a_profile(tmp_path, capsys):
    from zipage.cli.parser import main

    status = main(["fidelity", "--engine", "cpu", "--quick-correct", "--out", str(tmp_path)])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and "--quick-correct: give --cost-model PROFILE" in error[0]


@torch_needed
def test_fidelity_prints_both_profiles(measured, tmp_path, capsys):
    """`zipage fidelity --quick-correct`: the perturbed profile and its correction side by side,
    each simulating the same engine run."""
    from zipage.cli.parser import main

    trace = tmp_path / "given.json"
    trace.write_text(json.dumps({"version": 1, "name": "given", "requests": [
        {"id": f"g{index}", "arrival_s": 0.0, "prompt_len": 30 + index,
         "output_len": 24} for index in range(6)]}))
    # Bounds wide enough for any load: this test is about the report (the bounds have their
    # own tests), and a CPU whose load changes between the fixture's runs and these anchors
    # moved the scale 2.6x.
    status = main(["fidelity", "--engine", "cpu", "--model", str(measured.model_dir), *KNOBS,
                   "--cost-model", str(measured.paths["perturbed"]), "--quick-correct",
                   "--max-residual", "50", "--max-scale", "50",
                   "--traces", "0", "--trace", str(trace), "--no-progress",
                   "--out", str(tmp_path / "fidelity")])
    captured = capsys.readouterr()
    printed = captured.out
    assert status == 0, printed + captured.err
    report = json.loads((tmp_path / "fidelity" / "fidelity.json").read_text())
    rows = {row["model"]: row for row in report["rows"]}
    assert report["correction"]["refusal"] is None, report["correction"]
    assert set(rows) == {"profile", "corrected", "analytic"}, rows
    # Both simulate the one engine run, whatever the CPU's load did to it; every request arrives
    # at once, so both schedule the same steps, each priced times the correction's one scale
    # (or, where noisy anchors asked for a scale per group, times a mix of its scales).
    ratio = (1 + rows["corrected"]["makespan"]) / (1 + rows["profile"]["makespan"])
    correction = report["correction"]
    scales = correction["scales"]
    # A failure names the correction's model, scales and any anchor left out.
    explain = rows, {key: correction.get(key) for key in ("model", "scales", "left_out")}
    if correction["model"] == "uniform":
        assert ratio == pytest.approx(scales["host"], rel=1e-3), explain
    else:
        assert min(scales.values()) * (1 - 1e-3) <= ratio <= max(scales.values()) * (1 + 1e-3), explain
    assert np.isfinite(rows["corrected"]["e2e_mape"])


# ---------------------------------------------------------------- the anchor plan


@pytest.mark.parametrize("compress, expected", [
    (True, [(1, 64, 48), (16, 64, 48), (64, 64, 48), (16, 464, 48)]),
    (False, [(1, 64, 48), (16, 64, 48), (64, 64, 48), (16, 2048, 48)]),
])
def test_the_anchor_plan_of_the_8b_headline_setup(compress, expected):
    pytest.importorskip("torch")
    from zipage.analysis.quick_calibration import anchor_plan
    from zipage.config import ZipageConfig

    config = ZipageConfig(block_size=64, kv_budget=512, compress=compress, max_model_len=40960)
    capacity = SimpleNamespace(num_blocks=682, num_query_slots=120 if compress else 0)
    plan = anchor_plan(config, capacity)
    assert [(burst.requests, burst.prompt_len, burst.output_len) for burst in plan] == expected
    if compress:  # no request outgrows the budget: the anchors never compress
        assert all(burst.prompt_len + burst.output_len <= 512 for burst in plan)


def test_the_anchor_plan_fits_a_small_pool():
    pytest.importorskip("torch")
    from zipage.analysis.quick_calibration import anchor_plan
    from zipage.config import ZipageConfig

    config = ZipageConfig(block_size=64, compress=False, max_model_len=40960)
    plan = anchor_plan(config, SimpleNamespace(num_blocks=100, num_query_slots=0))
    for burst in plan:
        blocks = burst.requests * -(-(burst.prompt_len + burst.output_len + 1) // 64)
        assert blocks <= 80, burst
    assert plan[-1].requests < 16  # the long burst shrank to what the pool holds


def test_settings_differences_name_the_fields():
    pytest.importorskip("torch")
    from zipage.analysis.quick_calibration import settings_differences

    ours = {"model": "random:qwen3-8b", "dtype": "bfloat16", "kv_memory_gb": 6.0,
            "tensor_parallel": 1, "config": {"compress": True, "max_num_seqs": 512}}
    theirs = {**ours, "model": "qwen3-8b", "config": {"compress": False, "max_num_seqs": 512}}
    assert settings_differences(theirs, ours) == ["compress False (this run: True)"]
    assert settings_differences({**ours, "kv_memory_gb": 3.0}, ours) == [
        "kv_memory_gb 3.0 (this run: 6.0)"]


def test_machines_of_one_kind():
    pytest.importorskip("torch")
    from zipage.engine.machine import same_kind

    h200 = {"device": "cuda", "gpu_name": "NVIDIA H200", "host_cpu": "A"}
    assert same_kind({**h200, "host_cpu": "B"}, h200) is None
    assert same_kind(h200, None) is None  # a profile from before records: its header decides
    assert "NVIDIA H100" in same_kind({**h200, "gpu_name": "NVIDIA H100 80GB HBM3"}, h200)
    assert "cpu engine" in same_kind({"device": "cpu"}, h200)


def test_the_machine_record_of_this_host():
    torch = pytest.importorskip("torch")
    import socket

    from zipage.engine.machine import machine_record

    record = machine_record(torch.device("cpu"))
    assert record["device"] == "cpu" and record["torch"] == torch.__version__
    assert record["host_cpu"] and record["host_cores"] >= 1 and record["threads"] >= 1
    assert len(record["host_id"]) == 12 and socket.gethostname() not in json.dumps(record)
