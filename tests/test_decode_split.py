"""The decode kernel's balanced split (zipage/decode_grid.py): a row's partitions by its share of
the step's entries, the rule that takes it (a step whose longest row it gives more partitions than
the batch split), and both drivers' use of it: the runner picks it per step, the analytic model
and a profile measured with it ("decode_split": "rule") price the longest row over its partitions,
and a profile without the field prices every step as the batch split ran."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_decode_partitions import DEVICE, EXCESS, decode_points, per_partition, profile
from tolerance import close

from zipage.decode_grid import (
    balanced_row_partitions,
    decode_grid_partitions,
    decode_num_partitions,
    takes_balanced_split,
)
from zipage.errors import ConfigError
from zipage.profile import DECODE_SPLIT
from zipage.sim.analytic import AnalyticCostModel
from zipage.sim.calibrated import CalibratedCostModel, DecodePartitions

KV_HEADS, SMS = 8, 132  # Llama-3.1-8B / Qwen3-8B's KV heads, an H200's streaming multiprocessors
LONG_ROW = (96, 95 * 2048 + 20000, 20000)  # TensorRT-LLM's row 2: a 20k-entry row beside 95 of 2k


def test_a_row_takes_its_share_of_the_steps_entries():
    # 66 programs a KV head (4 an SM): an even share of 214,560 entries is 3,251.
    assert balanced_row_partitions(20000, LONG_ROW[1], KV_HEADS, SMS, 6) == 6
    assert balanced_row_partitions(20000, LONG_ROW[1], KV_HEADS, SMS, 4) == 4  # at most the grid's
    assert balanced_row_partitions(2048, LONG_ROW[1], KV_HEADS, SMS, 6) == 1
    assert balanced_row_partitions(20000, 16 * 20000, KV_HEADS, SMS, 4) == 4
    assert balanced_row_partitions(0, 0, KV_HEADS, SMS, 4) == 1
    assert balanced_row_partitions(500, 500, KV_HEADS, SMS, 66) == 3  # no partition under 128 entries


def test_the_balanced_grid_is_widened_for_long_rows_never_past_one_row_alone():
    assert decode_grid_partitions(96, KV_HEADS, SMS) == decode_num_partitions(96, KV_HEADS, SMS) == 1
    assert decode_grid_partitions(96, KV_HEADS, SMS, split="balanced") == 6
    assert decode_grid_partitions(1, KV_HEADS, SMS, split="balanced") == 66
    assert decode_grid_partitions(1024, KV_HEADS, SMS, split="balanced") == 1


@pytest.mark.parametrize("step,balanced", [
    (LONG_ROW, True),
    ((96, 96 * 2048, 2048), False),  # uniform: no row past its share
    ((128, 128 * 600, 600), False),  # the headline's decode: the widened grid would cost 26 %
    ((16, 16 * 20000, 20000), False),  # the batch split already gives each row 4
    ((8, 7 * 2048 + 20000, 20000), True),  # a small batch: the long row gets 38, not 8
    ((512, 511 * 2048 + 4096, 4096), False),  # a large batch: its share is 15.9k entries
    ((192, 190 * 1024 + 2 * 16384, 16384), True),
])
def test_the_rule_takes_the_balanced_split_where_the_longest_row_gains(step, balanced):
    assert takes_balanced_split(*step, KV_HEADS, SMS) is balanced


def test_fp8s_grid_holds_five_programs_an_sm():
    # 82 programs a KV head: a 20k row beside 95 of 2k gets 7 of the widened grid's 7.
    assert decode_grid_partitions(96, KV_HEADS, SMS, programs_per_sm=5, split="balanced") == 7
    assert takes_balanced_split(*LONG_ROW, KV_HEADS, SMS, programs_per_sm=5)


def test_the_runner_picks_the_split_from_the_steps_lengths():
    torch = pytest.importorskip("torch")
    from zipage.engine.runner import ModelRunner

    runner = SimpleNamespace(streaming_multiprocessors=SMS, decode_programs_per_sm=4,
                             kv_cache=torch.empty(2, 1, 1, 1, KV_HEADS, 1))
    lens = np.array([2048] * 95 + [20000])
    assert ModelRunner.decode_split(runner, lens, 96) == "balanced"
    assert ModelRunner.decode_split(runner, np.full(96, 2048), 96) is None
    # Off a GPU the reference attends without a split.
    assert ModelRunner.decode_split(SimpleNamespace(streaming_multiprocessors=None), lens, 96) is None


def analytic(**knobs) -> AnalyticCostModel:
    from zipage.hardware import get_hardware
    from zipage.presets import get_preset

    return AnalyticCostModel(get_preset("llama-3.1-8b"), get_hardware("h200"), block_size=256, **knobs)


def test_the_analytic_model_prices_the_long_row_over_its_balanced_partitions():
    model = analytic()
    batch, context, longest = LONG_ROW
    # Six partitions of 3,334 entries: the step costs what one whose longest row holds 3,334 costs
    # (a row the batch split leaves whole, under twice its share).
    assert model.forward_time(batch, context, 0, 0, 0, 0, 0, longest, 0) == close(
        model.forward_time(batch, context, 0, 0, 0, 0, 0, -(-longest // 6), 0))
    assert not takes_balanced_split(batch, context, -(-longest // 6), KV_HEADS, SMS)


def test_a_profile_measured_with_the_rule_fits_and_prices_the_long_row_over_its_partitions():
    rule_partitions = DecodePartitions(KV_HEADS, SMS, split="rule")

    def per_longest_row(batch: int, context: int, longest: int) -> float:
        excess = max(0.0, longest - context / batch)
        return (DEVICE[0] + DEVICE[1] * batch + DEVICE[2] * context
                + EXCESS * excess / rule_partitions.longest_row(batch, context, longest))

    points = decode_points(per_longest_row)
    assert any(rule_partitions.longest_row(p["batch"], p["context_tokens"], p["max_context"])
               > rule_partitions(p["batch"]) for p in points)  # the law splits some of them
    rule = CalibratedCostModel.from_profile(
        profile(points, decode_excess="per_partition") | {DECODE_SPLIT: "rule"})
    assert rule.decode_fit.coefficients == pytest.approx(DEVICE + (EXCESS,), rel=1e-6)
    batch, context, longest = LONG_ROW
    line = DEVICE[0] + DEVICE[1] * batch + DEVICE[2] * context
    assert rule.decode_time_for(batch, context, max_context=longest) == close(
        line + EXCESS * (longest - context / batch) / 6, rel=1e-6)
    # A profile without the field ran the batch split: the long row is one partition there.
    batch_split = CalibratedCostModel.from_profile(profile(decode_points(per_partition),
                                                           decode_excess="per_partition"))
    assert batch_split.decode_time_for(batch, context, max_context=longest) == close(
        line + EXCESS * (longest - context / batch), rel=1e-6)


def test_decode_partitions_of_the_longest_row():
    plain, rule = DecodePartitions(KV_HEADS, SMS), DecodePartitions(KV_HEADS, SMS, split="rule")
    assert plain.longest_row(*LONG_ROW) == 1
    assert rule.longest_row(*LONG_ROW) == 6
    assert rule.longest_row(96, 96 * 2048, 2048) == 1
    assert rule.longest_row(1024, 1023 * 600 + 30000, 30000) == 1  # the grid is not widened there


@pytest.mark.parametrize("value", ["balanced", "", 1, None])
def test_a_profile_split_must_be_known(value):
    data = profile(decode_points(per_partition), decode_excess="per_partition") | {DECODE_SPLIT: value}
    with pytest.raises(ConfigError, match=f"{DECODE_SPLIT}: got"):
        CalibratedCostModel.from_profile(data)
