"""`zipage calibrate --from-run`: a cost profile fitted from run directories' steps.

The synthetic runs here follow known costs exactly, in the simulator's own terms (a prefill
step host- or device-bound plus a per-prompt cost, an async batch stretching the steps it
overlaps by the contention factor), so the fit must give those costs back."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from tolerance import close

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.errors import ConfigError
from zipage.profile import DECODE_PROGRAMS_PER_SM
from zipage.records import STEP_COLUMN_DEFAULTS, STEP_COLUMNS
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.profile_from_runs import forward_points, profile_from_runs

DECODE = (2e-3, 1e-5, 2e-8)  # seconds: constant, per request, per context token
# Prefill: per prompt, host-bound time, and the device line: constant, per new token, per pair.
PER_SEQUENCE, HOST, DEVICE = 3e-4, 25e-3, (5e-3, 2e-5, 1e-10)
MIXED_CONSTANT = 6e-3  # a mixed step's own constant; its slopes are the parts'
COMPRESS = (1e-3, 4e-5)  # constant, per source block
# A compressing decode step (and the step after it) reads this much more context, so that it
# lasts longer than its compression (the engine's batches finish within their launching step).
COMPRESSING_CONTEXT = 500_000


def step_kind(step_id: int) -> str:
    return {0: "prefill", 3: "mixed", 7: "mixed"}.get(step_id % 10, "decode")


def compresses(step_id: int) -> bool:
    """A decode step in ten and a mixed step in twenty compress."""
    return step_id % 10 == 5 or step_id % 20 == 7


def prefill_time(prompts: int, new: int, pairs: int) -> float:
    return PER_SEQUENCE * prompts + max(HOST, DEVICE[0] + DEVICE[1] * new + DEVICE[2] * pairs)


def forward_time(kind: str, batch: int, context: int, prompts: int, new: int, pairs: int) -> float:
    if kind == "prefill":
        return prefill_time(prompts, new, pairs)
    decode = DECODE[1] * batch + DECODE[2] * context
    if kind == "decode":
        return DECODE[0] + decode
    # Mixed steps here carry long chunks: device-bound, so their points leave the mixed host
    # bound open and the fit takes the prefill's (docs/cost_model.md).
    return PER_SEQUENCE * prompts + MIXED_CONSTANT + decode + DEVICE[1] * new + DEVICE[2] * pairs


def synthetic_steps(seed: int = 0) -> list[dict]:
    """300 steps of known work; `forward` is each one's forward time."""
    rng = np.random.default_rng(seed)
    steps = []
    for step_id in range(300):
        kind = step_kind(step_id)
        batch, context = int(rng.integers(1, 64)), int(rng.integers(100, 100_000))
        prompts = int(rng.integers(1, 9)) if kind == "prefill" else int(rng.integers(1, 4))
        each = int(np.exp(rng.uniform(np.log(16), np.log(2048))))
        if kind == "mixed":
            each = int(rng.integers(2048, 4096))
        new = prompts * each
        pairs = prompts * each * (each + 1) // 2 + int(rng.integers(0, 4096)) * new
        blocks = int(rng.integers(9, 200)) if compresses(step_id) else 0
        if blocks or compresses(step_id - 1):  # the steps an async batch overlaps: inside the
            context += COMPRESSING_CONTEXT  # clean steps' range, above the fit's floor
        decodes, prefills = kind != "prefill", kind != "decode"
        steps.append(dict(
            STEP_COLUMN_DEFAULTS, step_id=step_id, kind=kind, n_prefill=prompts if prefills else 0,
            n_decode=batch if decodes else 0, n_compress=int(bool(blocks)), n_running=batch,
            n_waiting=0, blocks_used=0, blocks_total=1000, slots_used=0, preempted=0,
            prefill_tokens=new if prefills else 0,
            decode_context_tokens=context if decodes else 0,
            attention_pairs=pairs if prefills else 0, compress_blocks=blocks,
            forward=forward_time(kind, batch if decodes else 0, context, prompts, new, pairs)))
    return steps


def write_run(directory, steps: list[dict], durations: list[float], asynchronous: bool,
              gap: float = 0.0):
    """A run directory of `steps` lasting `durations`, `gap` seconds of host time between two."""
    t = 0.0
    for step, duration in zip(steps, durations):
        step.update(t_start=t, t_end=t + duration)
        t += duration + gap
    directory.mkdir()
    pd.DataFrame(steps)[STEP_COLUMNS].to_csv(directory / "steps.csv", index=False)
    settings = ReplaySettings(model="qwen3-8b", hardware="h200",
                              config=ZipageConfig(async_compress=asynchronous))
    (directory / "summary.json").write_text(json.dumps({"driver": "engine-cuda",
                                                        "settings": settings.to_dict()}))
    return directory


def compress_time(blocks: int) -> float:
    return COMPRESS[0] + COMPRESS[1] * blocks


def synthetic_run(directory, asynchronous: bool, seed: int = 0, gap: float = 0.0):
    """Sync: a compression runs before its step's forward. Async: each batch is reported done in
    the step that launched it, which it delays by its whole duration (a serial overlap)."""
    steps = synthetic_steps(seed)
    durations = [step["forward"] + (compress_time(step["compress_blocks"])
                                    if step["compress_blocks"] else 0.0) for step in steps]
    for step in steps:
        step["batches_done"] = int(asynchronous and step["compress_blocks"] > 0)
    return write_run(directory, steps, durations, asynchronous, gap)


def assert_prefill(fit, rel: float) -> None:
    assert fit.per_sequence_s == pytest.approx(PER_SEQUENCE, rel=rel)
    assert fit.host_s == pytest.approx(HOST, rel=rel)
    assert fit.device_coefficients == pytest.approx(DEVICE, rel=rel)


def test_fit_recovers_the_costs_of_sync_runs(tmp_path):
    profile = profile_from_runs([synthetic_run(tmp_path / "a", False),
                                 synthetic_run(tmp_path / "b", False, seed=1)])
    model = CalibratedCostModel.from_profile(profile)
    assert profile["version"] == 3
    assert model.decode_fit.coefficients == pytest.approx(DECODE, rel=1e-6)
    assert_prefill(model.prefill_fit, rel=1e-6)
    assert model.mixed_fit.coefficients == pytest.approx(
        (MIXED_CONSTANT,) + DECODE[1:] + DEVICE[1:], rel=1e-6)
    assert not model.mixed_fit.host_fitted
    assert model.mixed_fit.host_s == close(model.prefill_fit.host_s)
    assert model.compress_fit.coefficients == pytest.approx(COMPRESS, rel=1e-6)
    assert profile["gpu"] == "h200" and profile["block_size"] == 256
    clean = [step_kind(i) for i in range(300) if not compresses(i)]
    for kind in ("decode", "prefill", "mixed"):
        assert len(profile[kind]) == 2 * clean.count(kind)
    assert len(profile["compress"]) == 2 * sum(map(compresses, range(300)))
    assert "contention_factor" not in profile  # no async batch measured it


def test_prefill_points_carry_the_prompts_of_their_step(tmp_path):
    run = synthetic_run(tmp_path / "a", False)
    steps = pd.read_csv(run / "steps.csv")
    prefill = steps[steps["kind"] == "prefill"]
    points = forward_points([run])["prefill"]
    assert [point["requests"] for point in points] == prefill["n_prefill"].tolist()
    assert [point["requests"] * point["new_tokens"] for point in points] == pytest.approx(
        prefill["prefill_tokens"].tolist())
    assert [point["attention_pairs"] for point in points] == prefill["attention_pairs"].tolist()


def test_host_time_between_steps_is_part_of_every_step(tmp_path):
    gap = 5e-5
    profile = profile_from_runs([synthetic_run(tmp_path / "a", False, gap=gap)])
    model = CalibratedCostModel.from_profile(profile)
    # The simulator runs steps back to back: the engine's gap joins each step's constant.
    assert model.decode_fit.coefficients == pytest.approx((DECODE[0] + gap,) + DECODE[1:],
                                                          rel=1e-6)
    assert model.prefill_fit.host_s == pytest.approx(HOST + gap, rel=1e-6)
    assert model.compress_fit.coefficients == pytest.approx(COMPRESS, rel=1e-6)


def test_runs_without_mixed_steps_give_a_profile_without_mixed_points(tmp_path):
    run = synthetic_run(tmp_path / "a", False)
    steps = pd.read_csv(run / "steps.csv")
    steps[steps["kind"] != "mixed"].to_csv(run / "steps.csv", index=False)
    profile = profile_from_runs([run])
    assert "mixed" not in profile
    # The one-forward assumption then times a mixed step (docs/cost_model.md).
    assert CalibratedCostModel.from_profile(profile).mixed_fit.num_points == 0


def test_async_batches_within_their_step_are_taken_as_a_serial_overlap(tmp_path):
    """Every batch ends in the step that launched it (as on the H200): the runs cannot tell its
    duration from the slowdown it causes, so the overlap is taken as serial (c = 2) and the
    batch's duration is its step's time beyond the forward: the known costs come back."""
    profile = profile_from_runs([synthetic_run(tmp_path / "a", True)], gpu="h200-141gb")
    assert profile["contention_factor"] == close(2.0)
    model = CalibratedCostModel.from_profile(profile)
    assert model.compress_fit.coefficients == pytest.approx(COMPRESS, rel=1e-6)
    assert profile["gpu"] == "h200-141gb"


def test_batches_launched_behind_the_forward_add_their_mean_extra_time(tmp_path):
    """The engine of now: a batch starts when its launching step's forward ends and is reported
    by the next step, which it stretches. Its duration and its slowdown cannot be told apart
    (only their product moves the run), so the profile takes the serial contention factor, 2,
    and gives each batch size the mean time its batches added to the steps they overlapped:
    the simulator then adds exactly that time."""
    slowdown = 0.15  # of the batch's duration, added to the step that reports it
    steps = synthetic_steps()
    durations, added = [], {}
    for index, step in enumerate(steps):
        step["batches_done"] = int(bool(index and steps[index - 1]["compress_blocks"]))
        duration = step["forward"]
        if step["batches_done"]:
            blocks = steps[index - 1]["compress_blocks"]
            duration += slowdown * compress_time(blocks)
            added.setdefault(blocks, []).append(slowdown * compress_time(blocks))
        durations.append(duration)
    run = write_run(tmp_path / "a", steps, durations, True)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "async_launch": "after-forward"}))
    profile = profile_from_runs([run])
    assert profile["contention_factor"] == 2.0
    means = {blocks: sum(times) / len(times) for blocks, times in added.items()}
    assert [point["time_s"] for point in profile["compress"]] == pytest.approx(
        [means[point["blocks"]] for point in profile["compress"]], rel=1e-6)
    assert len(profile["compress"]) == sum(len(times) for times in added.values())
    # Runs of the two engines do not make one profile.
    old = synthetic_run(tmp_path / "b", True)
    with pytest.raises(ConfigError, match="different orders"):
        profile_from_runs([run, old])


def test_launching_steps_give_the_host_floor_of_a_launch(tmp_path):
    """A decode step that launches a batch behind its forward lasts at least the host's time to
    enqueue the batch's kernels: its points go to the `launch` section, and the calibrated
    model fits that floor from them."""
    floor = 13.5e-3  # within the compressing steps' forwards (12-15 ms: they read more context)
    steps = synthetic_steps()
    durations, launched = [], []
    for index, step in enumerate(steps):
        step["batches_done"] = int(bool(index and steps[index - 1]["compress_blocks"]))
        duration = step["forward"]
        if step["compress_blocks"] and step["kind"] == "decode":
            duration = max(floor, duration)
            launched.append(duration)
        durations.append(duration)
    run = write_run(tmp_path / "a", steps, durations, True)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "async_launch": "after-forward"}))
    profile = profile_from_runs([run])
    assert [point["time_s"] for point in profile["launch"]] == pytest.approx(launched)
    assert min(launched) == pytest.approx(floor) and max(launched) > floor
    assert CalibratedCostModel.from_profile(profile).launch_floor_s == pytest.approx(floor)


def test_decode_points_carry_the_shared_entries_and_the_runs_their_buckets(tmp_path):
    steps = synthetic_steps()
    for index, step in enumerate(steps):
        step["shared_kv_tokens"] = 64 * (index % 7)
    run = write_run(tmp_path / "a", steps, [step["forward"] for step in steps], False)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "prefill_buckets": [16, 32, 64]}))
    profile = profile_from_runs([run])
    clean = [step for step in steps if step["kind"] == "decode" and not step["compress_blocks"]]
    assert [point.get("shared_tokens", 0) for point in profile["decode"]] == [
        step["shared_kv_tokens"] for step in clean]
    assert profile["prefill_buckets"] == [16, 32, 64]
    other = write_run(tmp_path / "b", synthetic_steps(), [step["forward"] for step in steps], False)
    summary = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps({**summary, "prefill_buckets": [16, 32]}))
    with pytest.raises(ConfigError, match="differ in prefill_buckets"):
        profile_from_runs([run, other])


def test_batches_over_several_steps_measure_contention_whatever_their_kind(tmp_path):
    """Each batch lasts its launching step's forward plus half the next step's; the steps it
    overlaps are stretched as the simulator stretches them with c = 1.5: the factor and every
    batch's duration come back."""
    contention = 1.5
    steps = synthetic_steps()
    durations, batches = [], []
    for index, step in enumerate(steps):
        step["batches_done"] = 0
        if index and steps[index - 1]["compress_blocks"]:  # the step after a launch
            overlap = batches[-1] - durations[-1]
            step["batches_done"] = 1
            durations.append(step["forward"] + (contention - 1) * overlap)
        elif step["compress_blocks"]:
            durations.append(contention * step["forward"])  # overlapped whole
            batches.append(durations[-1] + 0.5 * steps[index + 1]["forward"])
        else:
            durations.append(step["forward"])
    run = write_run(tmp_path / "a", steps, durations, True)
    kinds = {step["kind"] for index, step in enumerate(steps)
             if step["compress_blocks"] or (index and steps[index - 1]["compress_blocks"])}
    assert kinds == {"decode", "mixed"}
    profile = profile_from_runs([run])
    assert profile["contention_factor"] == pytest.approx(contention)
    assert [point["time_s"] for point in profile["compress"]] == pytest.approx(batches, rel=1e-6)
    overlapped = sum(1 for index, step in enumerate(steps)
                     if step["compress_blocks"] or (index and steps[index - 1]["compress_blocks"]))
    assert sum(len(profile[kind]) for kind in ("decode", "prefill", "mixed")) == (
        len(steps) - overlapped)


def test_stalled_steps_are_left_out_on_request(tmp_path):
    run = synthetic_run(tmp_path / "a", True)
    steps = pd.read_csv(run / "steps.csv")
    stalled = steps.index[(steps["kind"] == "decode") & (steps["n_compress"] > 0)][0]
    steps.loc[stalled:, ["t_start", "t_end"]] += 2.0  # a 2 s compilation inside one step
    steps.loc[stalled, "t_start"] -= 2.0
    steps.to_csv(run / "steps.csv", index=False)
    batches = int((steps["n_compress"] > 0).sum())
    kept = profile_from_runs([run])
    assert len(kept["compress"]) == batches
    assert max(point["time_s"] for point in kept["compress"]) > 1.0
    left_out = profile_from_runs([run], stall_factor=10)
    assert len(left_out["compress"]) == batches - 1
    assert "1 decode step(s) over 10x the median left out" in left_out["note"]
    model = CalibratedCostModel.from_profile(left_out)
    assert model.compress_fit.coefficients == pytest.approx(COMPRESS, rel=1e-6)
    with pytest.raises(ConfigError, match="stall-factor"):
        profile_from_runs([run], stall_factor=0.5)


def test_a_prefill_step_that_returned_at_launch_and_the_step_charged_for_it_are_left_out(tmp_path):
    """A prompt chunk that samples nothing ends at its launch: the run shows it faster than any
    decode step and charges its forward to the next step. Both are left out; the fits stay exact.
    Only chunked prefill makes such chunks."""
    steps = synthetic_steps()
    durations = [step["forward"] for step in steps]
    early = [index for index in range(100, 200, 10) if steps[index]["kind"] == "prefill"]
    for index in early:
        durations[index + 1] += durations[index] - 1e-4
        durations[index] = 1e-4
    run = write_run(tmp_path / "a", steps, durations, asynchronous=False)
    profile = profile_from_runs([run])
    model = CalibratedCostModel.from_profile(profile)
    assert_prefill(model.prefill_fit, rel=1e-6)
    assert model.decode_fit.coefficients == pytest.approx(DECODE, rel=1e-6)
    kinds = [step["kind"] for step in steps if not step["compress_blocks"]]
    assert len(profile["prefill"]) == kinds.count("prefill") - len(early)
    assert len(profile["decode"]) == kinds.count("decode") - len(early)
    # Without chunked prefill every prefill step samples: a fast one is a point (a tiny model on a
    # busy CPU), so none is left out.
    summary = json.loads((run / "summary.json").read_text())
    summary["settings"]["config"]["chunked_prefill"] = False
    (run / "summary.json").write_text(json.dumps(summary))
    unchunked = profile_from_runs([run])
    assert len(unchunked["prefill"]) == kinds.count("prefill")
    assert len(unchunked["decode"]) == kinds.count("decode")


def test_runs_of_different_setups_are_refused(tmp_path):
    sync, other = synthetic_run(tmp_path / "a", False), synthetic_run(tmp_path / "b", False)
    summary = json.loads((other / "summary.json").read_text())
    summary["settings"]["config"]["block_size"] = 128
    summary["settings"]["config"]["kv_budget"] = 2048
    (other / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="block_size"):
        profile_from_runs([sync, other])
    with pytest.raises(ConfigError, match="--from-run"):
        profile_from_runs([tmp_path / "missing"])


def test_the_graphed_steps_of_the_runs_go_into_the_profile(tmp_path):
    """Runs that say which steps replayed CUDA graphs pass it on; runs that differ in it are
    refused (a graphed prefill costs less host time); a run that does not say agrees with any."""
    first, second = synthetic_run(tmp_path / "a", False), synthetic_run(tmp_path / "b", False)
    assert "graphs" not in profile_from_runs([first, second])  # runs that do not say
    summary = json.loads((first / "summary.json").read_text())
    summary["graphs"] = {"decode": True, "prefill": True}
    (first / "summary.json").write_text(json.dumps(summary))
    # A run that does not say agrees with one that does.
    assert profile_from_runs([first, second])["graphs"] == {"decode": True, "prefill": True}
    summary = json.loads((second / "summary.json").read_text())
    summary["graphs"] = {"decode": True, "prefill": True}
    (second / "summary.json").write_text(json.dumps(summary))
    assert profile_from_runs([first, second])["graphs"] == {"decode": True, "prefill": True}
    summary = json.loads((second / "summary.json").read_text())
    summary["graphs"]["prefill"] = False
    (second / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="differ in graphs"):
        profile_from_runs([first, second])


def test_the_decode_grid_of_the_runs_goes_into_the_profile(tmp_path):
    """A run records the programs an SM its decode grid aimed for; a run before the field ran 4. A profile
    fitted from runs that differ in it is refused: its partition term would count two grids."""
    first, second = synthetic_run(tmp_path / "a", False), synthetic_run(tmp_path / "b", False)
    assert profile_from_runs([first, second])[DECODE_PROGRAMS_PER_SM] == 4
    for run in (first, second):
        summary = json.loads((run / "summary.json").read_text())
        summary[DECODE_PROGRAMS_PER_SM] = 3
        (run / "summary.json").write_text(json.dumps(summary))
    assert profile_from_runs([first, second])[DECODE_PROGRAMS_PER_SM] == 3
    (first / "summary.json").write_text(json.dumps(json.loads((first / "summary.json").read_text())
                                                   | {DECODE_PROGRAMS_PER_SM: 4}))
    with pytest.raises(ConfigError, match=f"differ in {DECODE_PROGRAMS_PER_SM}"):
        profile_from_runs([first, second])


def test_command_line_stall_factor(tmp_path, capsys):
    from zipage.cli.parser import main

    run, out = synthetic_run(tmp_path / "a", True), tmp_path / "profile.json"
    assert main(["calibrate", "--from-run", str(run), "--stall-factor", "10", "--hardware",
                 "h200", "--out", str(out)]) == 0
    assert "prefill  0.0003 * requests + max(0.025," in capsys.readouterr().out
    assert json.loads(out.read_text())["contention_factor"] == close(2.0)
    assert main(["calibrate", "--from-run", str(run), "--stall-factor", "1", "--out",
                 str(out)]) == 2
    assert "--stall-factor" in capsys.readouterr().err
