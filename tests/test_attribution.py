"""analysis/attribution.py: two runs' clocks split into terms that add up (steps of known cost)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from zipage.analysis.attribution import TERMS, attribute, attribute_runs, batch_blocks, main
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.errors import ZipageError
from zipage.records import REQUEST_COLUMNS, STEP_COLUMN_DEFAULTS, STEP_COLUMNS
from zipage.sim.simulate import plan_deployment

PLANE = (6e-3, 4e-6, 6e-8)  # seconds: per decode step, per request, per KV entry read
PREFILL_S = 0.03
GAP_S = 1e-4


def synthetic_steps(compress_price_s, compress_every: int, context_scale: float,
                    seed: int = 0) -> pd.DataFrame:
    """A prefill step, then decode steps priced exactly by PLANE; every `compress_every`-th one
    compresses and costs `compress_price_s` more (seconds, or a function of the step id); a
    fixed host gap between steps."""
    price_of = compress_price_s if callable(compress_price_s) else lambda _: compress_price_s
    rng = np.random.default_rng(seed)
    rows, t = [], 0.0
    for step_id in range(400):
        kind = "prefill" if step_id == 0 else "decode"
        batch = int(rng.integers(8, 96))
        context = int(batch * rng.integers(500, 2000) * context_scale)
        compresses = kind == "decode" and step_id % compress_every == 0
        if kind == "prefill":
            duration = PREFILL_S
        else:
            duration = PLANE[0] + PLANE[1] * batch + PLANE[2] * context
            duration += price_of(step_id) if compresses else 0.0
        rows.append(dict(STEP_COLUMN_DEFAULTS, step_id=step_id, t_start=t, t_end=t + duration,
                         kind=kind, n_prefill=int(kind == "prefill"),
                         n_decode=batch if kind == "decode" else 0,
                         n_compress=2 if compresses else 0, n_running=batch, n_waiting=0,
                         blocks_used=0, blocks_total=1000, slots_used=0, preempted=0,
                         prefill_tokens=500 if kind == "prefill" else 0,
                         decode_context_tokens=context if kind == "decode" else 0,
                         batches_done=int(compresses), attention_pairs=0,
                         compress_blocks=18 if compresses else 0))
        t += duration + GAP_S
    return pd.DataFrame(rows)[STEP_COLUMNS]


def test_terms_add_up_and_recover_the_known_costs():
    fixed = synthetic_steps(4e-3, compress_every=3, context_scale=1.0)
    elastic = synthetic_steps(3e-3, compress_every=4, context_scale=1.2, seed=1)
    result = attribute(fixed, elastic)
    assert result["plane"] == pytest.approx(PLANE, rel=1e-6)
    for steps, terms, makespan in zip((fixed, elastic), result["terms"], result["makespan"]):
        assert set(terms) == set(TERMS)
        assert makespan == pytest.approx(steps["t_end"].max(), rel=1e-9)
        assert terms["decode residual"] == pytest.approx(0.0, abs=1e-9)
        assert terms["prefill"] == pytest.approx(PREFILL_S)
        assert terms["host gaps"] == pytest.approx(GAP_S * (len(steps) - 1), rel=1e-6)
    assert result["compression_price_s"] == pytest.approx([4e-3, 3e-3], rel=1e-6)
    assert result["compression_median_price_s"] == pytest.approx([4e-3, 3e-3], rel=1e-6)
    assert result["residual_after_compression_s"] == pytest.approx([0.0, 0.0], abs=1e-9)
    # The count and the price account for the whole change of the compression term.
    change = result["terms"][1]["compression"] - result["terms"][0]["compression"]
    assert (result["compression_count_effect_s"] + result["compression_price_effect_s"]
            == pytest.approx(change))
    counts = result["counts"]
    assert counts[0]["compression batches"] == len(range(3, 400, 3))
    assert counts[1]["compressions (jobs)"] == 2 * len(range(4, 400, 4))


def test_too_few_clean_decode_steps_is_an_error():
    steps = synthetic_steps(4e-3, compress_every=1, context_scale=1.0)  # every decode compresses
    with pytest.raises(ZipageError, match="decode step"):
        attribute(steps, steps)


def test_cli_prints_the_tables(tmp_path, capsys):
    for name, every in (("fixed", 3), ("elastic", 4)):
        directory = tmp_path / name
        directory.mkdir()
        synthetic_steps(4e-3, every, 1.0).to_csv(directory / "steps.csv", index=False)
        pd.DataFrame(columns=REQUEST_COLUMNS).to_csv(directory / "requests.csv", index=False)
        (directory / "summary.json").write_text(json.dumps({"driver": "simulator"}))
    main([str(tmp_path / "fixed"), str(tmp_path / "elastic"), "--labels", "fixed,elastic"])
    out = capsys.readouterr().out
    assert "| compression |" in out and "elastic - fixed" in out and "from the count" in out
    assert attribute_runs(tmp_path / "fixed", tmp_path / "elastic")["plane"] == \
        pytest.approx(PLANE, rel=1e-6)


def job_blocks(step_id: int) -> tuple[list[int], list[int]]:
    """Source and kept blocks of the jobs a synthetic step compresses."""
    return [9 + step_id % 5, 9], [8 + step_id % 3, 8]


def decision_line(step_id: int) -> str:
    sources, kept = job_blocks(step_id)
    jobs = [f"compress(launch)=r{index}:{list(range(count))}->{list(range(keep))}+99"
            for index, (count, keep) in enumerate(zip(sources, kept))]
    return f"step {step_id} decode decode=r0,r1 " + " ".join(jobs)


def test_decision_log_gives_each_jobs_blocks():
    line = "step 385 decode decode=a,b compress(launch)=a:[39, 40, 41]->[446, 318]+123 " \
           "compress(launch)=b:[1, 2, 3, 4]->[5, 6, 7]+8"
    assert batch_blocks(["step 1 decode decode=a", line]) == {385: ([3, 4], [2, 3])}


def test_cost_model_prices_the_batches_and_gives_the_implied_contention(tmp_path):
    settings = ReplaySettings(model="qwen3-8b", hardware="h200",
                              config=ZipageConfig(block_size=64, kv_budget=512))
    cost = plan_deployment(settings).cost_model
    modelled = {step: cost.compress_time_for(*job_blocks(step)) for step in range(400)}
    for name, extra in (("a", 1.1), ("b", 0.5)):
        directory = tmp_path / name
        directory.mkdir()
        steps = synthetic_steps(lambda step, extra=extra: extra * modelled[step], 3, 1.0)
        steps.to_csv(directory / "steps.csv", index=False)
        pd.DataFrame(columns=REQUEST_COLUMNS).to_csv(directory / "requests.csv", index=False)
        (directory / "summary.json").write_text(json.dumps(
            {"driver": "step-replay", "settings": settings.to_dict()}))
        compressing = steps.loc[steps["n_compress"] > 0, "step_id"]
        (directory / "decisions.log").write_text(
            "\n".join(decision_line(step) for step in compressing) + "\n")
    result = attribute_runs(tmp_path / "a", tmp_path / "b", "analytic")
    assert result["price_over_modelled"] == [pytest.approx((extra, extra), rel=1e-6)
                                             for extra in (1.1, 0.5)]
    (tmp_path / "b" / "decisions.log").unlink()
    with pytest.raises(ZipageError, match="step-times"):
        attribute_runs(tmp_path / "a", tmp_path / "b", "analytic")
