"""Priority classes in the waiting queue (docs/architecture.md, 'Waiting-queue policies'): the
queue's order and aging, the starvation bound, the victim choice, the refusal under FCFS, and
the field end to end (trace, SamplingParams, the simulator). The random cases are the two
priority modes of tests/test_core_properties.py, whose checker verifies the order every step."""

from __future__ import annotations

import json

import pytest

from zipage.config import ZipageConfig
from zipage.core.sampling import SamplingParams
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence
from zipage.core.waiting import PriorityWaiting
from zipage.errors import ConfigError, TraceError
from zipage.sim.instant import InstantDriver
from zipage.trace import Trace, TraceRequest, load_trace, save_trace


def request(seq_id: str, arrival: float, priority: int = 0, prompt: int = 16,
            output: int = 8) -> Sequence:
    seq = Sequence(seq_id, list(range(100 + len(seq_id) * 50, 100 + len(seq_id) * 50 + prompt)),
                   output, arrival_s=arrival)
    seq.priority = priority
    return seq


def one_at_a_time(aging: float = 10.0, **knobs) -> Scheduler:
    """Full KV serving one request at a time: the admission order is the queue's order."""
    config = ZipageConfig(block_size=16, compress=False, max_num_seqs=1, chunked_prefill=False,
                          scheduling_policy="priority", priority_aging_s=aging, **knobs)
    return Scheduler(config, num_blocks=64, num_query_slots=0)


def test_queue_orders_by_class_then_arrival_and_ages() -> None:
    queue = PriorityWaiting(aging_s=10.0)
    late_urgent, early_low, older_low = request("u", 5.0, 0), request("l", 1.0, 1), \
        request("o", 0.0, 1)
    for seq in (early_low, late_urgent, older_low):
        queue.append(seq)
    assert [seq.seq_id for seq in queue] == ["u", "o", "l"]
    # Aging: a class-1 request that waited more than 10 s before a class-0 one arrived is ahead.
    stale = request("s", 0.0, 1)
    fresh = request("f", 10.5, 0)
    aged = PriorityWaiting(aging_s=10.0)
    aged.append(fresh)
    aged.append(stale)
    assert aged[0] is stale
    assert len(aged) == 2 and aged.popleft() is stale and aged.popleft() is fresh and not aged


def test_preempted_request_returns_to_its_place_and_remove_keeps_order() -> None:
    queue = PriorityWaiting(aging_s=1.0)
    a, b, c = request("a", 0.0, 0), request("b", 1.0, 0), request("c", 2.0, 0)
    for seq in (a, b, c):
        queue.append(seq)
    assert queue.popleft() is a
    queue.appendleft(a)  # preempted: back to its own key, which is still the first
    assert [seq.seq_id for seq in queue] == ["a", "b", "c"]
    queue.remove(b)
    assert [seq.seq_id for seq in queue] == ["a", "c"]
    with pytest.raises(ValueError):
        queue.remove(b)
    with pytest.raises(IndexError):
        queue[1]


def test_a_later_request_of_a_better_class_is_served_first() -> None:
    scheduler = one_at_a_time()
    sequences = [request("first", 0.0, 0, output=30), request("low", 1.0, 3),
                 request("high", 2.0, -1)]
    InstantDriver(scheduler, check=True).run(sequences)
    assert scheduler.admission_order == ["first", "high", "low"]


def test_starvation_bound_under_a_stream_of_urgent_requests() -> None:
    """A class-2 request at t=0 under a stream of class-0 requests, one a step: it is passed only
    by those that arrived within 2 x aging of it, whatever the stream's length."""
    aging = 5.0
    scheduler = one_at_a_time(aging)
    starved = request("starved", 0.0, 2, output=4)
    stream = [request(f"u{index:03d}", float(index), 0, output=4) for index in range(60)]
    InstantDriver(scheduler, check=True).run([starved] + stream)
    order = scheduler.admission_order
    passed = order[:order.index("starved")]
    arrivals = {seq.seq_id: seq.arrival_s for seq in stream}
    assert passed, "the stream should pass it at first: the test would not test the bound"
    assert max(arrivals[seq_id] for seq_id in passed) <= 2 * aging
    # Ties of the key go to the request queued first: the starved one.
    assert all(arrivals[seq_id] >= 2 * aging for seq_id in order[order.index("starved") + 1:])


def test_victim_is_the_last_in_priority_order() -> None:
    """Full KV on a pool too small for both: the urgent request admitted last keeps running,
    the low-class one admitted first is preempted."""
    config = ZipageConfig(block_size=16, compress=False, chunked_prefill=False,
                          scheduling_policy="priority", priority_aging_s=1000.0)
    scheduler = Scheduler(config, num_blocks=6, num_query_slots=0)
    low, urgent = request("low", 0.0, 3, prompt=16, output=60), \
        request("urgent", 0.0, 0, prompt=16, output=60)
    run = InstantDriver(scheduler, check=True, log_decisions=True).run([low, urgent])
    assert run.summary["completed"] == 2
    preempted = [line for line in run.decision_log if "preempt=" in line]
    assert preempted and all("preempt=low" in line for line in preempted)


def test_fcfs_refuses_a_class_other_than_zero_alone() -> None:
    scheduler = Scheduler(ZipageConfig(block_size=16, compress=False), num_blocks=64,
                          num_query_slots=0)
    ok, classed = request("ok", 0.0, 0), request("classed", 0.0, 1)
    run = InstantDriver(scheduler, check=True).run([ok, classed])
    assert run.summary["completed"] == 1
    assert "--scheduling-policy priority" in classed.error and "classed" in classed.error
    assert scheduler.admission.priority_reason(0) is None


def test_the_field_in_traces_and_sampling(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    save_trace(Trace("t", [TraceRequest("a", 0.0, 8, 4, priority=-2),
                           TraceRequest("b", 0.0, 8, 4)]), path)
    header, first, second = path.read_text().splitlines()
    assert '"priority":-2' in first.replace(" ", "") and "priority" not in second
    assert [r.priority for r in load_trace(path).requests] == [-2, 0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "requests": [{"id": "x", "arrival_s": 0, "prompt_len": 4,
                                             "output_len": 2, "priority": "high"}]}))
    with pytest.raises(TraceError, match=r"\(id 'x'\): priority must be an integer"):
        load_trace(bad)
    assert SamplingParams(priority=3).priority == 3
    with pytest.raises(ConfigError, match="^priority: must be an integer between"):
        SamplingParams(priority=10**7)
    with pytest.raises(ConfigError, match="scheduling_policy"):
        ZipageConfig(scheduling_policy="lifo")
    with pytest.raises(ConfigError, match="priority_aging_s"):
        ZipageConfig(priority_aging_s=0)
