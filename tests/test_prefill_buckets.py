"""The token buckets of padded prefill steps (zipage/prefill_buckets.py) and where prefill graphs
are on by default (zipage.engine.builder.default_prefill_graphs, the CLI's --[no-]prefill-graphs)."""

from __future__ import annotations

import pytest

from zipage.prefill_buckets import PREFILL_GRAPH_TOKENS, bucket_of, buckets_up_to, padded_rows


def test_the_ladder_pads_a_step_by_at_most_half_from_256_rows():
    assert list(PREFILL_GRAPH_TOKENS) == sorted(set(PREFILL_GRAPH_TOKENS))
    for smaller, larger in zip(PREFILL_GRAPH_TOKENS, PREFILL_GRAPH_TOKENS[1:]):
        assert larger <= (2 if smaller < 256 else 1.5) * smaller
    for rows in range(1, PREFILL_GRAPH_TOKENS[-1] + 1):
        bucket = bucket_of(rows, PREFILL_GRAPH_TOKENS)
        assert bucket >= rows and padded_rows(rows, PREFILL_GRAPH_TOKENS) == bucket
        if rows > 16:
            assert bucket < 2 * rows
        if rows > 256:
            assert bucket <= 1.5 * rows


def test_steps_past_the_largest_bucket_run_unpadded():
    largest = PREFILL_GRAPH_TOKENS[-1]
    assert bucket_of(largest + 1, PREFILL_GRAPH_TOKENS) is None
    assert padded_rows(largest + 1, PREFILL_GRAPH_TOKENS) == largest + 1
    assert bucket_of(5, ()) is None and padded_rows(5, ()) == 5


def test_buckets_stop_at_the_step_token_budget():
    assert buckets_up_to(2048)[-1] == 2048
    assert buckets_up_to(1000)[-1] == 768
    assert buckets_up_to(8) == ()
    assert buckets_up_to(10**6) == PREFILL_GRAPH_TOKENS


def test_prefill_graphs_default_on_only_where_graphs_are_captured():
    torch = pytest.importorskip("torch")
    from zipage.engine.builder import default_prefill_graphs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_prefill_graphs(None, True, cuda) is True
    assert default_prefill_graphs(None, False, cuda) is False  # --no-cuda-graphs: all eager
    assert default_prefill_graphs(None, True, cpu) is False  # nothing to replay on the CPU
    assert default_prefill_graphs(False, True, cuda) is False
    assert default_prefill_graphs(True, True, cpu) is True  # the CPU tests of the padded path


@pytest.mark.parametrize("argv, expected", [([], None), (["--prefill-graphs"], True),
                                            (["--no-prefill-graphs"], False)])
def test_the_flag_leaves_the_default_to_the_engine(argv, expected):
    from zipage.cli.parser import build_parser

    for command in (["replay", "trace.json"], ["calibrate", "--out", "p.json"]):
        assert build_parser().parse_args(command + argv).prefill_graphs is expected
