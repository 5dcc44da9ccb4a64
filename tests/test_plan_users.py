"""`zipage plan --objective max-users`: the most concurrent users of a trace of sessions that a
deployment serves within the SLOs (sim/planning.py, `_search_max_users`; docs/planning.md,
'Planning for sessions'), and the TTFT of follow-up turns alone (`followup_ttft_p90_s`,
`--slo-followup-ttft-p90`). Small traces on qwen3-0.6b with two sequences at a time, so TTFT rises
with the users and a TTFT target binds; every search here takes a fraction of a second."""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import replace

import numpy as np
import pytest
from tolerance import assert_close, close

from zipage.cli.parser import main
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.errors import ConfigError
from zipage.session_workloads import chat_sessions
from zipage.sim.cluster import simulate_cluster
from zipage.sim.planning import (
    MAX_RATE,
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
from zipage.sim.simulate import simulate
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


# ---------------------------------------------------------------- follow-up turns

@pytest.fixture(scope="module")
def agent() -> Trace:
    """8 sessions of 3 turns, each sent 0.2 s after the last answer: at 2 sequences at a time the
    follow-ups queue behind other users' turns, so their TTFT p90 grows with the users (0.14 s at
    4 users, 0.48 s at 5, 0.83 s at 8) while that of all turns stays within 1 s."""
    requests = []
    for session in range(8):
        for turn in range(3):
            request = {"id": f"s{session}-t{turn}", "prompt_len": 300 + 250 * turn,
                       "output_len": 150}
            if turn == 0:
                request.update(session=f"s{session}", arrival_s=0.0)
            else:
                request.update(after=f"s{session}-t{turn - 1}", after_s=0.2,
                               prefix_len=200 + 250 * turn)
            requests.append(request)
    return parse_trace({"version": 1, "name": "agent", "requests": requests})


@pytest.fixture(scope="module")
def single_turns() -> Trace:
    """Requests in no session: no follow-ups."""
    return parse_trace({"version": 1, "name": "single-turns", "requests": [
        {"id": f"r{index}", "arrival_s": 0.5 * index, "prompt_len": 200, "output_len": 50}
        for index in range(6)]})


def test_follow_up_percentiles_are_those_of_the_follow_up_records(agent):
    settings = replace(BASE, hardware="h100", kv_memory_gb=0.5, users=4)
    _, run = simulate(agent, settings)
    records = {record.id: record for record in run.requests}
    ttfts = []
    for request in agent.requests:
        if request.after is not None:
            record, before = records[request.id], records[request.after]
            # Timed from when the turn came due, not from its session's start.
            assert record.arrival == close(before.finish + request.after_s)
            ttfts.append(record.first_token - record.arrival)
    summary = simulate_cluster(agent, settings)
    assert summary["ttft_p90_s"] == close(np.percentile(
        [record.first_token - record.arrival for record in run.requests], 90))
    for percent in (50, 90, 99):
        assert summary[f"followup_ttft_p{percent}_s"] == close(np.percentile(ttfts, percent))
    assert summary["followup_ttft_p90_s"] > 0.1  # (queued: the comparison is not of zeros)


def test_a_trace_without_follow_ups_has_no_follow_up_percentiles(single_turns):
    summary = simulate_cluster(single_turns, replace(BASE, hardware="h100"))
    assert [summary[f"followup_ttft_p{percent}_s"] for percent in (50, 90, 99)] == [None] * 3


def test_a_tight_follow_up_target_serves_fewer_users(agent):
    loose = run_plan(agent, users_spec(slo=SLO(ttft_p90_s=1.0)), executor=SERIAL).rows[0]
    target = SLO(ttft_p90_s=1.0, followup_ttft_p90_s=0.2)
    (tight,) = run_plan(agent, users_spec(slo=target), executor=SERIAL).rows
    assert loose["max_users"] == 8 and tight["status"] == OK
    assert 1 <= tight["max_users"] < loose["max_users"]
    assert tight["followup_ttft_p90_s"] <= 0.2
    # It binds: one user more misses the follow-up target, not the one over all turns.
    beyond = closed_run(agent, tight["max_users"] + 1)
    assert beyond["followup_ttft_p90_s"] > 0.2 and beyond["ttft_p90_s"] <= 1.0


@pytest.mark.parametrize("objective", [TPS, MAX_RATE])
def test_every_objective_holds_the_follow_up_target(agent, objective):
    spec = users_spec(objective=objective, slo=SLO(ttft_p90_s=1.0, followup_ttft_p90_s=0.2))
    (row,) = run_plan(agent, spec, executor=SERIAL).rows
    without = run_plan(agent, replace(spec, slo=SLO(ttft_p90_s=1.0)), executor=SERIAL).rows[0]
    if objective == TPS:  # every session at 0: the follow-ups queue beyond the target
        assert without["status"] == OK and row["status"] == SLO_MISSED
        assert row["reason"].startswith("follow-up TTFT p90 ") and "> 0.2 s" in row["reason"]
    else:
        assert row["status"] == OK and row["followup_ttft_p90_s"] <= 0.2
        assert row["max_rate_qps"] < without["max_rate_qps"]


def test_a_follow_up_target_takes_the_band_of_ttft_p90():
    """No validation measures follow-ups alone: the all-turn TTFT p90 band applies."""
    target = SLO(followup_ttft_p90_s=1.0)
    (item,) = target.verdicts({"followup_ttft_p90_s": 0.95}, {"ttft_p90": 0.1, "ttft_p99": 0.5})
    assert item.verdict == "uncertain" and item.band == close(0.1)
    assert item.describe() == "follow-up TTFT p90 0.95 s within the ±10.0 % band of 1 s"
    assert target.meets({"followup_ttft_p90_s": 0.9}, {"ttft_p90": 0.1})


def test_a_follow_up_target_on_a_trace_without_follow_ups_is_refused(single_turns):
    with pytest.raises(ConfigError, match="--slo-followup-ttft-p90: trace 'single-turns' has "
                                          "no follow-up turns"):
        run_plan(single_turns, users_spec(slo=SLO(followup_ttft_p90_s=1.0)),
                 executor=SERIAL)


def write_agent(tmp_path, agent: Trace) -> str:
    path = tmp_path / "agent.json"
    save_trace(agent, path)
    return str(path)


def test_zipage_plan_prints_the_follow_up_column_and_target(tmp_path, capsys, agent):
    assert main(plan_args(write_agent(tmp_path, agent), "--slo-followup-ttft-p90", "0.2",
                          "--out", str(tmp_path / "out"))) == 0
    printed = capsys.readouterr().out
    assert "SLOs: TTFT p90 <= 1 s, follow-up TTFT p90 <= 0.2 s (8 sessions" in printed
    header = next(line for line in printed.splitlines() if "max users" in line and "#" in line)
    assert "follow-up TTFT p90 s" in header
    with (tmp_path / "out" / "results.csv").open() as handle:
        (row,) = csv.DictReader(handle)
    assert 1 <= int(row["max_users"]) < 8 and float(row["followup_ttft_p90_s"]) <= 0.2
    assert row["followup_ttft_p90_s_band"] == ""  # (the analytic model: no band)


def test_a_trace_without_follow_ups_has_no_follow_up_column(tmp_path, capsys, single_turns):
    path = tmp_path / "single.json"
    save_trace(single_turns, path)
    assert main(plan_args(str(path))) == 0
    assert "follow-up" not in capsys.readouterr().out


@pytest.mark.parametrize("value, fragment", [("soon", "got 'soon'"), ("-1", "got -1.0"),
                                             ("0", "got 0.0"), ("nan", "got nan")])
def test_a_bad_follow_up_target_is_one_line_naming_the_flag(tmp_path, capsys, agent, value,
                                                            fragment):
    assert main(plan_args(write_agent(tmp_path, agent), "--slo-followup-ttft-p90", value)) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("zipage: error: --slo-followup-ttft-p90: ") and fragment in line
    assert "expected a number of seconds > 0" in line and captured.out == ""


def test_a_follow_up_target_without_follow_ups_is_one_line_naming_the_flag(tmp_path, capsys,
                                                                           single_turns):
    path = tmp_path / "single.json"
    save_trace(single_turns, path)
    assert main(plan_args(str(path), "--slo-followup-ttft-p90", "1")) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("zipage: error: --slo-followup-ttft-p90: trace 'single-turns' has no "
                           "follow-up turns")
    assert captured.out == ""  # refused before anything ran
