"""Tests of the trace schema (zipage/trace.py) and the workload generators (zipage/workloads.py).

They pin the file format (round trip, one clear error line per mistake), the prompt-token synthesis
that makes prefix caching hit identically in the simulator and the engine, the workload sizes and
caps the paper states, the shipped traces (regenerated and compared byte for byte so they cannot
drift from their generators), and the statistics of re-stamped arrival times.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from tolerance import assert_close, assert_text_close, close

from zipage.errors import ConfigError, TraceError, ZipageError
from zipage.trace import Trace, TraceRequest, load_trace, parse_trace, prompt_token_ids, save_trace, stamp_arrivals
from zipage.workloads import WORKLOADS, make_trace

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACES_DIR = REPO_ROOT / "traces"

PAPER_SIZES = {"amc23": 1280, "gsm8k": 5276, "mixture": 5436, "longbench": 600}
PAPER_OUTPUT_CAPS = {"amc23": 16384, "gsm8k": 16384, "mixture": 16384, "longbench": 4096}


@pytest.fixture(scope="module")
def generated() -> dict[str, Trace]:
    return {kind: make_trace(kind, seed=0) for kind in WORKLOADS}


def valid_trace_object() -> dict[str, Any]:
    return {
        "version": 1,
        "name": "example",
        "requests": [
            {"id": "a", "arrival_s": 0, "prompt_len": 40, "output_len": 8},
            {"id": "b", "arrival_s": 0.5, "prompt_len": 64, "prefix_group": "g", "prefix_len": 32,
             "output_len": 16},
            {"id": "c", "arrival_s": 1.0, "prompt_token_ids": [5, 6, 7], "output_len": 2,
             "kv_budget": 512},
        ],
    }


# ----------------------------------------------------------------------------- round trip


def test_round_trip_preserves_every_field(tmp_path: Path) -> None:
    trace = parse_trace(valid_trace_object())
    stamped = stamp_arrivals(trace, rate_qps=3.0, seed=1)
    path = tmp_path / "trace.json"
    save_trace(stamped, path)
    assert_close(load_trace(path), stamped)


def test_parse_fills_derived_fields() -> None:
    trace = parse_trace(valid_trace_object())
    first, grouped, explicit = trace.requests
    assert (first.prefix_group, first.prefix_len, first.prompt_token_ids) == (None, 0, None)
    assert (grouped.prefix_group, grouped.prefix_len) == ("g", 32)
    assert explicit.prompt_len == 3 and explicit.prompt_token_ids == [5, 6, 7]
    assert isinstance(first.arrival_s, float)
    assert (first.kv_budget, explicit.kv_budget) == (None, 512)


def test_prefix_len_defaults_to_whole_prompt() -> None:
    obj = valid_trace_object()
    del obj["requests"][1]["prefix_len"]
    assert parse_trace(obj).requests[1].prefix_len == 64


def test_missing_name_defaults_to_file_stem(tmp_path: Path) -> None:
    obj = valid_trace_object()
    del obj["name"]
    path = tmp_path / "my-workload.json"
    path.write_text(json.dumps(obj))
    assert load_trace(path).name == "my-workload"


def test_saved_file_has_one_request_per_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    save_trace(parse_trace(valid_trace_object()), path)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 3 + 1
    assert json.loads(lines[1].rstrip(",")) == {"id": "a", "arrival_s": 0.0, "prompt_len": 40,
                                                "output_len": 8}


def test_save_refuses_an_invalid_trace(tmp_path: Path) -> None:
    bad = Trace(name="bad", requests=[TraceRequest("x", arrival_s=0.0, prompt_len=4, output_len=0)])
    path = tmp_path / "bad.json"
    with pytest.raises(TraceError, match="output_len"):
        save_trace(bad, path)
    assert not path.exists()


# ----------------------------------------------------------------------------- validation

Mutation = Callable[[dict[str, Any]], None]


def set_field(field: str, value: Any) -> Mutation:
    def mutate(request: dict[str, Any]) -> None:
        request[field] = value
    return mutate


def drop_field(field: str) -> Mutation:
    def mutate(request: dict[str, Any]) -> None:
        del request[field]
    return mutate


REQUEST_MISTAKES: list[tuple[str, Mutation, str]] = [
    ("output zero", set_field("output_len", 0), "output_len must be an integer between 1 and 2147483647, got 0"),
    ("output float", set_field("output_len", 2.0), "output_len must be an integer between 1 and 2147483647, got 2.0"),
    ("output bool", set_field("output_len", True), "output_len must be an integer between 1 and 2147483647, got True"),
    ("output missing", drop_field("output_len"), "output_len is missing"),
    ("arrival negative", set_field("arrival_s", -1), "arrival_s must be a number between 0 and 1000000000"),
    ("arrival string", set_field("arrival_s", "0"), "arrival_s must be a number between 0 and 1000000000"),
    ("arrival nan", set_field("arrival_s", math.nan), "arrival_s must be a number between 0 and 1000000000"),
    ("arrival missing", drop_field("arrival_s"), "arrival_s is missing"),
    ("prompt zero", set_field("prompt_len", 0), "prompt_len must be an integer between 1 and 2147483647, got 0"),
    ("prompt both", set_field("prompt_token_ids", [1, 2]),
     "give exactly one of prompt_len or prompt_token_ids, got both"),
    ("prompt neither", drop_field("prompt_len"),
     "give exactly one of prompt_len or prompt_token_ids, got neither"),
    ("prefix beyond prompt", set_field("prefix_len", 65),
     "prefix_len must be an integer between 1 and the prompt length (64), got 65"),
    ("prefix zero", set_field("prefix_len", 0), "prefix_len must be an integer between 1"),
    ("prefix without group", drop_field("prefix_group"), "prefix_len needs prefix_group"),
    ("group empty", set_field("prefix_group", ""), "prefix_group must be a non-empty string"),
    ("unknown field", set_field("promt_len", 3),
     "unknown field 'promt_len' (did you mean 'prompt_len'?); allowed fields are id,"),
    ("duplicate id", set_field("id", "a"), "id duplicates request #0; ids must be unique"),
    ("budget zero", set_field("kv_budget", 0), "kv_budget must be an integer between 1 and "
     "2147483647 (the KV entries the request keeps, a multiple of the block size; leave it out "
     "for --budget), got 0"),
    ("budget float", set_field("kv_budget", 512.0), "kv_budget must be an integer between 1"),
    ("budget bool", set_field("kv_budget", True), "kv_budget must be an integer between 1"),
    ("budget string", set_field("kv_budget", "512"), "kv_budget must be an integer between 1"),
]


@pytest.mark.parametrize("mutate, expected", [(m, e) for _, m, e in REQUEST_MISTAKES],
                         ids=[name for name, _, _ in REQUEST_MISTAKES])
def test_request_mistake_names_file_request_and_field(mutate: Mutation, expected: str) -> None:
    obj = valid_trace_object()
    mutate(obj["requests"][1])
    request_id = obj["requests"][1]["id"]
    with pytest.raises(TraceError) as caught:
        parse_trace(obj, source="trace.json")
    message = str(caught.value)
    assert message.startswith(f"trace.json: request #1 (id {request_id!r}): ")
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("tokens, expected", [
    ([], "prompt_token_ids must be a non-empty list of token ids"),
    ([1, -2], "prompt_token_ids[1] must be an integer between 0 and 2147483647, got -2"),
    ("1 2 3", "prompt_token_ids must be a non-empty list"),
])
def test_bad_token_ids_are_named(tokens: Any, expected: str) -> None:
    obj = valid_trace_object()
    obj["requests"][2]["prompt_token_ids"] = tokens
    with pytest.raises(TraceError, match=r"trace\.json: request #2 \(id 'c'\): ") as caught:
        parse_trace(obj, source="trace.json")
    assert expected in str(caught.value)


@pytest.mark.parametrize("request_value, expected", [
    ({"arrival_s": 0, "prompt_len": 1, "output_len": 1}, "request #0: id is missing"),
    ({"id": 7, "arrival_s": 0, "prompt_len": 1, "output_len": 1},
     "request #0: id must be a non-empty string, got 7"),
    ([1, 2], "request #0: must be a JSON object, got a list"),
])
def test_request_without_usable_id_is_named_by_index(request_value: Any, expected: str) -> None:
    with pytest.raises(TraceError, match=expected):
        parse_trace({"version": 1, "name": "x", "requests": [request_value]}, source="t.json")


def test_group_cannot_mix_token_ids_and_lengths() -> None:
    obj = valid_trace_object()
    obj["requests"][2].update(prefix_group="g", prefix_len=2)
    with pytest.raises(TraceError, match=r"request #2 \(id 'c'\): prefix_group 'g' mixes "
                                         r"prompt_token_ids and prompt_len"):
        parse_trace(obj)


def test_group_members_with_token_ids_must_agree_on_shared_prefix() -> None:
    requests = [
        {"id": "long", "arrival_s": 0, "prompt_token_ids": [1, 2, 3, 4, 5], "prefix_group": "g",
         "prefix_len": 4, "output_len": 1},
        {"id": "short", "arrival_s": 0, "prompt_token_ids": [1, 2, 9], "prefix_group": "g",
         "prefix_len": 2, "output_len": 1},
        {"id": "wrong", "arrival_s": 0, "prompt_token_ids": [1, 2, 3, 8, 5], "prefix_group": "g",
         "prefix_len": 4, "output_len": 1},
    ]
    expected = (r"request #2 \(id 'wrong'\): prompt_token_ids\[3\] differs from "
                r"request #0 \(id 'long'\)")
    with pytest.raises(TraceError, match=expected):
        parse_trace({"version": 1, "name": "x", "requests": requests})
    parse_trace({"version": 1, "name": "x", "requests": requests[:2]})


@pytest.mark.parametrize("obj, expected", [
    ([], "a trace must be a JSON object with keys version, name, requests, got a list"),
    ({"name": "x", "requests": []}, 'version is missing; add "version": 1'),
    ({"version": 2, "requests": []}, "version must be 1 (the trace schema this Zipage reads)"),
    ({"version": 1, "name": "x"}, "requests is missing"),
    ({"version": 1, "requests": {}}, "requests must be a non-empty list of request objects"),
    ({"version": 1, "requests": []}, "requests is empty; a trace needs at least one request"),
    ({"version": 1, "name": "", "requests": []}, "name must be a non-empty string"),
    ({"version": 1, "requets": []}, "unknown field 'requets' (did you mean 'requests'?)"),
])
def test_top_level_mistakes(obj: Any, expected: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace(obj, source="trace.json")
    assert str(caught.value).startswith("trace.json: ")
    assert expected in str(caught.value)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="missing.json: cannot read the trace file"):
        load_trace(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1,\n "requests": [}')
    with pytest.raises(TraceError, match=r"broken\.json: not valid JSON at line 2 column"):
        load_trace(broken)


def test_trace_error_is_a_user_error() -> None:
    assert issubclass(TraceError, ZipageError) and issubclass(ConfigError, ZipageError)


# ----------------------------------------------------------------------------- token synthesis


def request(request_id: str, prompt_len: int, group: str | None = None,
            prefix_len: int = 0) -> TraceRequest:
    return TraceRequest(id=request_id, arrival_s=0.0, prompt_len=prompt_len, output_len=1,
                        prefix_group=group, prefix_len=prefix_len)


def test_synthesis_is_pinned() -> None:
    # Golden values: a change here breaks every recorded replay, so it must be deliberate.
    assert prompt_token_ids(request("solo", 5)) == [26720, 24833, 3590, 19664, 22480]
    assert prompt_token_ids(request("a", 150, "g", 100))[:5] == [1357, 3309, 5364, 31319, 7582]


def test_synthesis_is_stable_across_processes() -> None:
    script = ("from zipage.trace import TraceRequest, prompt_token_ids; "
              "print(prompt_token_ids(TraceRequest('q3-s7', 0.0, 300, 1, None, 'q3', 200)))")
    outputs = set()
    for hash_seed in ("1", "2"):
        python_path = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
        environment = {**os.environ, "PYTHONHASHSEED": hash_seed,
                       "PYTHONPATH": os.pathsep.join(filter(None, python_path))}
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                env=environment, check=True)
        outputs.add(result.stdout)
    expected = prompt_token_ids(request("q3-s7", 300, "q3", 200))
    assert outputs == {f"{expected}\n"}


def test_group_members_share_exactly_their_prefix() -> None:
    first = prompt_token_ids(request("a", 150, "g", 100))
    second = prompt_token_ids(request("b", 130, "g", 100))
    assert len(first) == 150 and len(second) == 130
    assert first[:100] == second[:100]
    assert first[100] != second[100]
    assert sum(x == y for x, y in zip(first[100:], second[100:])) <= 1


def test_members_with_different_prefix_lengths_share_the_shorter() -> None:
    long_prefix = prompt_token_ids(request("a", 300, "g", 256))
    short_prefix = prompt_token_ids(request("b", 200, "g", 64))
    assert long_prefix[:64] == short_prefix[:64]
    assert long_prefix[64] != short_prefix[64]


def test_nothing_else_collides() -> None:
    whole_prompt = prompt_token_ids(request("s0", 64, "question", 64))
    other_group = prompt_token_ids(request("s1", 64, "other-question", 64))
    ungrouped = prompt_token_ids(request("solo", 64))
    # A request named like a group must not pick up the group's tokens.
    named_like_group = prompt_token_ids(request("question", 64))
    sequences = [whole_prompt, other_group, ungrouped, named_like_group]
    for i, left in enumerate(sequences):
        for right in sequences[i + 1:]:
            assert sum(x == y for x, y in zip(left, right)) <= 1


def test_identical_prompts_of_a_question_are_identical() -> None:
    first_sample, second_sample = request("s0", 64, "q", 64), request("s1", 64, "q", 64)
    assert prompt_token_ids(first_sample) == prompt_token_ids(second_sample)


def test_token_range_and_vocabulary() -> None:
    subject = request("r", 2000, "g", 1000)
    default = prompt_token_ids(subject)
    assert min(default) >= 100 and max(default) < 32000
    assert prompt_token_ids(subject, vocab_size=49152) == default
    assert prompt_token_ids(subject, vocab_size=151936) == default
    small = prompt_token_ids(subject, vocab_size=1000)
    assert min(small) >= 100 and max(small) < 1000
    with pytest.raises(ConfigError, match="vocab_size must be greater than 100"):
        prompt_token_ids(subject, vocab_size=100)


def test_given_token_ids_are_used_as_is() -> None:
    given = TraceRequest("c", arrival_s=0.0, prompt_len=3, output_len=1, prompt_token_ids=[5, 6, 7])
    tokens = prompt_token_ids(given)
    assert tokens == [5, 6, 7]
    tokens.append(8)
    assert given.prompt_token_ids == [5, 6, 7]


def test_tiny_trace_prefix_groups_share_exactly(generated: dict[str, Trace]) -> None:
    requests = generated["tiny"].requests
    tokens = {r.id: prompt_token_ids(r) for r in requests}
    for left in requests:
        for right in requests:
            if left.id >= right.id:
                continue
            common = 0
            while (common < min(left.prompt_len, right.prompt_len)
                   and tokens[left.id][common] == tokens[right.id][common]):
                common += 1
            if left.prefix_group is not None and left.prefix_group == right.prefix_group:
                assert common == min(left.prefix_len, right.prefix_len)
            else:
                assert common == 0


# ----------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("kind", PAPER_SIZES)
def test_sizes_and_caps_match_the_paper(generated: dict[str, Trace], kind: str) -> None:
    requests = generated[kind].requests
    assert len(requests) == PAPER_SIZES[kind]
    assert len({r.id for r in requests}) == len(requests)
    assert max(r.output_len for r in requests) <= PAPER_OUTPUT_CAPS[kind]
    assert min(r.output_len for r in requests) >= 1
    assert all(r.arrival_s == 0.0 for r in requests)


@pytest.mark.parametrize("kind", PAPER_SIZES)
def test_samples_of_a_question_share_their_whole_prompt(generated: dict[str, Trace],
                                                        kind: str) -> None:
    groups: dict[str, set[int]] = {}
    for r in generated[kind].requests:
        assert r.prefix_group is not None and r.prefix_len == r.prompt_len
        groups.setdefault(r.prefix_group, set()).add(r.prompt_len)
    assert all(len(lengths) == 1 for lengths in groups.values())
    expected_questions = {"amc23": 40, "gsm8k": 1319, "mixture": 1359, "longbench": 150}[kind]
    assert len(groups) == expected_questions


def test_workload_shapes(generated: dict[str, Trace]) -> None:
    def stats(kind: str, field: str) -> np.ndarray:
        return np.array([getattr(r, field) for r in generated[kind].requests])

    longbench_outputs = stats("longbench", "output_len")
    assert abs(longbench_outputs.mean() - 400) < 40  # the paper: "only 400 tokens" on average
    assert 4000 < stats("longbench", "prompt_len").mean() < 8000
    assert (longbench_outputs > 1000).any()
    amc_outputs = stats("amc23", "output_len")
    assert 5000 < amc_outputs.mean() < 11000 and (amc_outputs == 16384).any()
    assert stats("amc23", "prompt_len").max() < 512
    gsm_outputs = stats("gsm8k", "output_len")
    assert np.median(gsm_outputs) < 400 and (gsm_outputs > 2000).any()


def test_mixture_is_gsm8k_plus_four_samples_of_amc23_shuffled(generated: dict[str, Trace]) -> None:
    mixture = generated["mixture"].requests
    expected = generated["gsm8k"].requests + [
        r for r in generated["amc23"].requests if int(r.id.rsplit("-s", 1)[1]) < 4
    ]
    assert sorted(mixture, key=lambda r: r.id) == sorted(expected, key=lambda r: r.id)
    question_order = [r.prefix_group for r in mixture][::4]
    assert [r.prefix_group for r in mixture] == [g for g in question_order for _ in range(4)]
    first_amc = min(i for i, g in enumerate(question_order) if g.startswith("amc23"))
    last_amc = max(i for i, g in enumerate(question_order) if g.startswith("amc23"))
    assert last_amc - first_amc > 1000  # spread through the run, not bunched at one end


@pytest.mark.parametrize("kind", ["amc23", "longbench"])
def test_generation_is_deterministic_and_seeded(generated: dict[str, Trace], kind: str) -> None:
    assert_close(make_trace(kind, seed=0), generated[kind])
    assert make_trace(kind, seed=1) != generated[kind]


def test_overrides_keep_each_question_stable(generated: dict[str, Trace]) -> None:
    small = make_trace("amc23", num_questions=3, samples_per_question=2, max_output_len=4096)
    assert len(small.requests) == 6
    full = {r.id: r for r in generated["amc23"].requests}
    for r in small.requests:
        assert r.prompt_len == full[r.id].prompt_len
        assert r.output_len == min(full[r.id].output_len, 4096)


def test_make_trace_rejects_unknown_kinds_and_options() -> None:
    known = "amc23, gsm8k, mixture, longbench, tiny"
    with pytest.raises(ConfigError, match=f"unknown workload kind 'amc24'; known kinds: {known}"):
        make_trace("amc24")
    with pytest.raises(ConfigError, match="workload 'gsm8k' has no option 'questions'; its options "
                                          "are: num_questions"):
        make_trace("gsm8k", questions=3)
    with pytest.raises(ConfigError, match="num_questions must be an integer >= 1, got 0"):
        make_trace("longbench", num_questions=0)
    with pytest.raises(ConfigError, match="seed must be an integer >= 0"):
        make_trace("tiny", seed=-1)


def test_tiny_exercises_block_boundaries(generated: dict[str, Trace]) -> None:
    requests = generated["tiny"].requests
    prompt_lengths = {r.prompt_len for r in requests}
    for block_size in (16, 32, 64, 256):
        assert {block_size - 1, block_size, block_size + 1} <= prompt_lengths
    assert min(r.output_len for r in requests) == 1
    groups = {r.prefix_group for r in requests if r.prefix_group}
    assert len(groups) == 2
    assert any(r.prefix_group and r.prefix_len < r.prompt_len for r in requests)
    assert any(r.prefix_group and r.prefix_len == r.prompt_len for r in requests)


@pytest.mark.parametrize("kind", list(WORKLOADS))
def test_shipped_trace_equals_its_generator(generated: dict[str, Trace], kind: str,
                                            tmp_path: Path) -> None:
    shipped = TRACES_DIR / f"{kind}.json"
    regenerated = tmp_path / f"{kind}.json"
    save_trace(generated[kind], regenerated)
    assert_text_close(regenerated.read_text(), shipped.read_text(), what=(
        f"{shipped} drifted from make_trace({kind!r}, seed=0); run `python traces/make_all.py`"))
    assert_close(load_trace(shipped), generated[kind])


def test_shipped_scaled_traces_equal_their_generators(tmp_path: Path) -> None:
    sys.path.insert(0, str(TRACES_DIR))
    try:
        from make_all import SCALED, SHIPPED_SEED
    finally:
        sys.path.remove(str(TRACES_DIR))
    for stem, (kind, arguments) in SCALED.items():
        regenerated = tmp_path / f"{stem}.json"
        save_trace(make_trace(kind, SHIPPED_SEED, **arguments), regenerated)
        assert_text_close(regenerated.read_text(), (TRACES_DIR / f"{stem}.json").read_text(),
                          what=f"traces/{stem}.json drifted from its generator; run "
                               "`python traces/make_all.py`")


def test_shipped_traces_are_compact() -> None:
    assert sum((TRACES_DIR / f"{kind}.json").stat().st_size for kind in WORKLOADS) < 2_000_000


# ----------------------------------------------------------------------------- arrivals


def synthetic_trace(num_requests: int) -> Trace:
    return Trace(name="big", requests=[request(f"r{i}", 16) for i in range(num_requests)])


def test_poisson_arrivals_have_the_requested_rate() -> None:
    trace = synthetic_trace(20000)
    stamped = stamp_arrivals(trace, rate_qps=50.0, seed=3)
    arrivals = np.array([r.arrival_s for r in stamped.requests])
    assert arrivals[0] == close(0.0) and (np.diff(arrivals) >= 0).all()
    gaps = np.diff(arrivals)
    assert abs(len(gaps) / arrivals[-1] - 50.0) < 50.0 * 0.03
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential gaps
    unstamped = [dataclasses.replace(r, arrival_s=0.0) for r in stamped.requests]
    assert unstamped == trace.requests
    assert_close(stamp_arrivals(trace, rate_qps=50.0, seed=3), stamped)
    assert stamp_arrivals(trace, rate_qps=50.0, seed=4) != stamped


def test_bursty_arrivals_come_in_bursts_at_the_requested_rate() -> None:
    trace = synthetic_trace(40000)
    stamped = stamp_arrivals(trace, rate_qps=20.0, pattern="bursty", seed=0, burst_size=8)
    arrivals = np.array([r.arrival_s for r in stamped.requests])
    bursts = arrivals.reshape(-1, 8)
    assert (bursts == bursts[:, :1]).all()
    assert (np.diff(bursts[:, 0]) > 0).all()
    assert abs((len(arrivals) - 8) / arrivals[-1] - 20.0) < 20.0 * 0.05


def test_bursty_keeps_a_partial_last_burst() -> None:
    stamped = stamp_arrivals(synthetic_trace(10), rate_qps=1.0, pattern="bursty", burst_size=4)
    arrivals = [r.arrival_s for r in stamped.requests]
    assert arrivals[:4] == close([0.0] * 4) and len(set(arrivals)) == 3


@pytest.mark.parametrize("arguments, expected", [
    ({"rate_qps": 0}, "rate_qps must be a finite number > 0"),
    ({"rate_qps": math.inf}, "rate_qps must be a finite number > 0"),
    ({"rate_qps": 1, "pattern": "uniform"}, "pattern must be one of poisson, bursty, got 'unif"),
    ({"rate_qps": 1, "pattern": "bursty", "burst_size": 0}, "burst_size must be an integer >= 1"),
    ({"rate_qps": 1, "seed": -1}, "seed must be an integer >= 0"),
])
def test_stamp_arrivals_rejects_bad_arguments(arguments: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        stamp_arrivals(synthetic_trace(3), **arguments)
    assert expected in str(caught.value)


def test_stamped_trace_survives_a_round_trip(tmp_path: Path) -> None:
    stamped = stamp_arrivals(make_trace("tiny"), rate_qps=7.0, pattern="bursty", burst_size=3)
    path = tmp_path / "online.json"
    save_trace(stamped, path)
    assert_close(load_trace(path), stamped)
