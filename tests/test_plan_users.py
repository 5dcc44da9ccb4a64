"""`zipage plan --objective max-users`: the most concurrent users of a trace of sessions that a
deployment serves within the SLOs (sim/planning.py, `_search_max_users`; docs/planning.md,
'Planning for sessions'). Small traces on qwen3-0.6b with two sequences at a time, so TTFT rises
with the users and a TTFT target binds; every search here takes a fraction of a second."""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import replace

import pytest
from tolerance import assert_close, close

from zipage.cli.parser import main
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.errors import ConfigError
from zipage.session_workloads import chat_sessions
from zipage.sim.cluster import simulate_cluster
from zipage.sim.planning import (
    MAX_USERS,
    OK,
    RESULT_COLUMNS,
    SERIAL,
    SLO,
    SLO_MISSED,
    TPS,
    PlanSpec,
    PointTask,
    count_sessions,
    plan_context,
    point_key,
    run_plan,
)
from zipage.trace import Trace, TraceRequest, load_trace, parse_trace, save_trace

BASE = ReplaySettings(model="qwen3-0.6b", config=ZipageConfig(max_num_seqs=2))
TTFT_SLO = SLO(ttft_p90_s=1.0)


@pytest.fixture(scope="module")
def chat() -> Trace:
    """16 chat sessions, 40 turns: at 2 sequences at a time, TTFT p90 grows from milliseconds
    with a few users to ~1.8 s with all 16."""
    return chat_sessions(0, sessions=16)


def users_spec(**changes) -> PlanSpec:
    spec = PlanSpec(base=BASE, hardware=["h100"], budgets=[2048], hybrid=[True],
                    kv_memory_gb=[0.5], objective=MAX_USERS, slo=TTFT_SLO)
    return replace(spec, **changes)


def closed_run(trace: Trace, users: int, replicas: int = 1,
               routing: str = "least-loaded") -> dict:
    """The run the search simulates at `users`: every session starting at 0."""
    closed = Trace(trace.name, [dataclasses.replace(request, arrival_s=0.0)
                                for request in trace.requests])
    settings = replace(BASE, hardware="h100", kv_memory_gb=0.5, users=users)
    return simulate_cluster(closed, settings, replicas, routing)


def test_the_answer_meets_the_slos_and_one_more_user_does_not(chat):
    assert count_sessions(chat) == 16
    (row,) = run_plan(chat, users_spec(), executor=SERIAL).rows
    found = row["max_users"]
    assert row["status"] == OK and row["objective_value"] == found
    assert 1 <= found < 16 and row["users"] == found and row["sessions"] == 16
    assert row["simulations"] <= users_spec().search.max_simulations
    assert row["ttft_p90_s"] <= TTFT_SLO.ttft_p90_s
    # The row's metrics are the run at the answer; one more user misses the target.
    at_answer = closed_run(chat, found)
    assert row["ttft_p90_s"] == close(at_answer["ttft_p90_s"])
    assert TTFT_SLO.meets(at_answer)
    assert not TTFT_SLO.meets(closed_run(chat, found + 1))


def test_a_looser_target_serves_more_users(chat):
    found = [run_plan(chat, users_spec(slo=SLO(ttft_p90_s=target)), executor=SERIAL)
             .rows[0]["max_users"] for target in (0.5, 1.5)]
    assert found == sorted(found) and found[0] < found[-1]


def test_when_every_session_fits_the_answer_is_the_number_of_sessions(chat):
    (row,) = run_plan(chat, users_spec(slo=SLO(ttft_p90_s=100.0)), executor=SERIAL).rows
    assert row["status"] == OK
    assert row["max_users"] == row["users"] == 16 and row["simulations"] == 1


def test_a_target_missed_even_by_one_user_is_zero_users(chat):
    (row,) = run_plan(chat, users_spec(slo=SLO(ttft_p90_s=1e-6)), executor=SERIAL).rows
    assert row["status"] == SLO_MISSED and row["max_users"] == 0 and row["users"] == 1
    assert row["reason"].startswith("SLOs missed even with 1 user: TTFT p90")


def test_a_trace_without_sessions_counts_each_request_as_a_session():
    trace = parse_trace({"version": 1, "name": "single-turns", "requests": [
        {"id": f"r{index}", "arrival_s": 5.0 * index, "prompt_len": 400, "output_len": 200}
        for index in range(12)]})
    assert count_sessions(trace) == 12
    (row,) = run_plan(trace, users_spec(slo=SLO(ttft_p90_s=0.5)), executor=SERIAL).rows
    assert row["status"] == OK and row["sessions"] == 12
    found = row["max_users"]
    assert 1 <= found < 12
    slo = SLO(ttft_p90_s=0.5)
    assert slo.meets(closed_run(trace, found)) and not slo.meets(closed_run(trace, found + 1))


def test_a_hand_built_session_trace_loaded_from_a_file(tmp_path):
    """Follow-ups get their session from the loader; the search counts the first turns."""
    requests = []
    for session in range(6):
        first = TraceRequest(f"s{session}-t0", 0.0, prompt_len=300, output_len=150,
                             session=f"s{session}")
        second = TraceRequest(f"s{session}-t1", 0.0, prompt_len=600, output_len=150,
                              after=first.id, after_s=1.0, prefix_len=450)
        requests += [first, second]
    save_trace(Trace("hand", requests), tmp_path / "hand.json")
    trace = load_trace(tmp_path / "hand.json")
    assert count_sessions(trace) == 6
    (row,) = run_plan(trace, users_spec(slo=SLO(ttft_p90_s=0.3)), executor=SERIAL).rows
    assert row["status"] == OK and 1 <= row["max_users"] <= 6


def test_session_affinity_over_two_replicas(chat):
    spec = users_spec(replicas=[1, 2], routing="session-affinity")
    rows = {row["replicas"]: row for row in run_plan(chat, spec, executor=SERIAL).rows}
    assert rows[2]["status"] == OK and rows[2]["max_users"] >= rows[1]["max_users"]
    at_answer = closed_run(chat, rows[2]["max_users"], 2, "session-affinity")
    assert rows[2]["ttft_p90_s"] == close(at_answer["ttft_p90_s"])


def test_the_search_is_deterministic(chat):
    spec = users_spec(replicas=[2], routing="session-affinity")
    first = run_plan(chat, spec, executor=SERIAL).rows
    second = run_plan(chat, spec, executor=SERIAL).rows
    for row in (*first, *second):
        row.pop("key")  # (equal too, but not a result)
    assert_close(second, first)


def test_the_cache_key_tells_max_users_from_the_other_objectives(chat):
    spec = users_spec()
    spec.validate()
    (point,) = spec.points()
    context = plan_context(chat, spec.base)
    users_key = point_key(context, PointTask(point, MAX_USERS, TTFT_SLO, spec.search))
    assert users_key != point_key(context, PointTask(point, TPS, TTFT_SLO, spec.search))
    assert users_key != point_key(context, PointTask(point, MAX_USERS, SLO(ttft_p90_s=2.0),
                                                     spec.search))
    assert "max_users" in RESULT_COLUMNS and "users" in RESULT_COLUMNS


def test_spec_mistakes_fail_before_anything_runs(chat):
    for changes, message in (({"slo": SLO()}, "needs an SLO"),
                             ({"rates": [2.0]}, "drop --rate"),
                             ({"speedups": [2.0]}, "drop --speedup"),
                             ({"base": replace(BASE, users=4)}, "drop --users")):
        with pytest.raises(ConfigError, match=message):
            run_plan(chat, users_spec(**changes), executor=SERIAL)


# ---------------------------------------------------------------- the command line

def write_chat(tmp_path) -> str:
    path = tmp_path / "chat.json"
    save_trace(chat_sessions(0, sessions=16), path)
    return str(path)


def plan_args(trace: str, *extra: str) -> list[str]:
    return ["plan", trace, "--model", "qwen3-0.6b", "--hardware", "h100", "--max-num-seqs", "2",
            "--kv-memory-gb", "0.5", "--objective", "max-users", "--slo-ttft-p90", "1",
            "--workers", "1", "--no-progress", "--no-cache", *extra]


def test_zipage_plan_max_users_prints_the_column(tmp_path, capsys):
    trace = write_chat(tmp_path)
    assert main(plan_args(trace, "--replicas", "1,2", "--routing", "session-affinity",
                          "--out", str(tmp_path / "out"))) == 0
    printed = capsys.readouterr().out
    assert "objective max-users" in printed
    assert "ranked by max concurrent users meeting the SLOs, SLOs: TTFT p90 <= 1 s " \
           "(16 sessions, all starting at 0)" in printed
    header = next(line for line in printed.splitlines() if "max users" in line and "#" in line)
    assert "rate" not in header
    with (tmp_path / "out" / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["objective"] for row in rows] == ["max-users", "max-users"]
    assert all(int(row["max_users"]) >= 1 and row["sessions"] == "16" for row in rows)
    assert all(row["users"] == row["max_users"] for row in rows)


@pytest.mark.parametrize("extra, flag", [
    (["--rate", "2"], "--rate"), (["--arrivals", "bursty"], "--arrivals"),
    (["--speedup", "2"], "--speedup"), (["--users", "4"], "--users"),
    (["--burst-size", "4"], "--burst-size"), (["--arrival-seed", "1"], "--arrival-seed"),
    (["--rate-tolerance", "0.1"], "--rate-tolerance")])
def test_flags_of_a_rate_are_refused_in_one_line(tmp_path, capsys, extra, flag):
    assert main(plan_args(write_chat(tmp_path), *extra)) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"zipage: error: {flag}: --objective max-users") and f"drop {flag}" in line
    assert captured.out == ""


def test_max_users_without_an_slo_is_refused(tmp_path, capsys):
    arguments = plan_args(write_chat(tmp_path))
    index = arguments.index("--slo-ttft-p90")
    assert main(arguments[:index] + arguments[index + 2:]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "max-users" in line and "--slo-ttft-p90" in line
