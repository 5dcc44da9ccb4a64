"""The online workload shapes: counts, ranges, shared prefixes, arrivals and reproducibility."""

from __future__ import annotations

import pytest
from tolerance import assert_close, close

from zipage.errors import ConfigError
from zipage.workloads import make_trace


def test_rag_shares_a_document_prefix_and_arrives_online():
    trace = make_trace("rag", 3, num_requests=50, rate_qps=5.0)
    requests = trace.requests
    assert len(requests) == 50
    assert all(2500 <= r.prompt_len <= 4000 and 300 <= r.output_len <= 1500 for r in requests)
    assert {r.prefix_len for r in requests} == {2048}
    assert 1 < len({r.prefix_group for r in requests}) <= 4
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == close(0.0)
    # Mean gap of a Poisson process at 5 req/s: loosely 0.2 s.
    assert 0.1 < arrivals[-1] / (len(arrivals) - 1) < 0.4
    assert_close(make_trace("rag", 3, num_requests=50, rate_qps=5.0), trace)


def test_online_mixture_has_its_three_classes():
    requests = make_trace("online-mixture", 0).requests
    reasoning = [r for r in requests if r.output_len >= 1500 and r.prefix_group is None]
    shared = [r for r in requests if r.prefix_group is not None]
    assert len(requests) == 160
    assert 0.45 < len(reasoning) / 160 < 0.75 and 0.03 < len(shared) / 160 < 0.2
    assert all(2000 <= r.prompt_len <= 3000 and r.prefix_len == 1024 for r in shared)


def test_chat_is_short_and_unshared():
    requests = make_trace("chat", 1).requests
    assert all(r.prompt_len <= 600 and r.output_len <= 500 and r.prefix_group is None
               for r in requests)


@pytest.mark.parametrize("overrides", [{"rate_qps": 0}, {"prompt_len_range": (5000, 100)},
                                       {"prompt_len_range": (1000, 3000)}, {"num_requests": 0}])
def test_bad_options_are_named(overrides):
    with pytest.raises(ConfigError):
        make_trace("rag", 0, **overrides)
