"""Capacity planning (`zipage plan`): the grid, infeasible points kept with their reasons, the
result cache, executors that cannot change a result (serial, process pool, Ray), routing across
replicas, the max-rate bisection, and the command line."""

from __future__ import annotations

import argparse
import csv
from dataclasses import replace
from pathlib import Path

import pytest
from tolerance import assert_close, close

from zipage.cli.plan import add_parser as add_plan_command
from zipage.cli.plan import parse_rates, parse_replicas
from zipage.cli.plan_report import format_report
from zipage.core.deployment import ReplaySettings
from zipage.errors import ConfigError
from zipage.records import StepRecord
from zipage.sim.cluster import peak_concurrent_running, simulate_cluster
from zipage.sim.planning import (
    INFEASIBLE,
    LOCAL,
    MAX_RATE,
    OK,
    RAY,
    SERIAL,
    SLO,
    TPS_PER_DOLLAR,
    PlanSpec,
    arrival_capped,
    run_plan,
)
from zipage.sim.simulate import simulate
from zipage.trace import Trace, TraceRequest, load_trace, stamp_arrivals

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def small_trace() -> Trace:
    """The first 60 GSM8K-like requests: big enough to queue, small enough to simulate fast."""
    trace = load_trace(ROOT / "traces" / "gsm8k.json")
    return Trace("gsm8k-60", trace.requests[:60])


def small_spec(**changes) -> PlanSpec:
    """Two GPUs x two budgets x hybrid on/off in 2 GiB of cache memory."""
    spec = PlanSpec(hardware=["h100", "a100"], budgets=[512, 1024], hybrid=[True, False],
                    kv_memory_gb=[2.0])
    return replace(spec, **changes)


# ---------------------------------------------------------------- the grid

def test_grid_is_the_product_of_the_axes():
    spec = PlanSpec(hardware=["h100", "h200", "a100"], budgets=[1024, 2048, 4096, 8192],
                    hybrid=[True, False])
    spec.validate()
    assert len(spec.points()) == 24
    assert {point.hardware for point in spec.points()} == {"h100-80gb", "h200-141gb", "a100-80gb"}
    spec = replace(spec, replicas=[1, 2], rates=[None, 5.0])
    assert len(spec.points()) == 96
    # The max-rate objective searches the rate: one point per deployment, whatever --rate says.
    spec = replace(spec, objective=MAX_RATE, rates=[5.0], slo=SLO(ttft_p90_s=1.0))
    spec.validate()
    assert len(spec.points()) == 48
    assert {point.rate_qps for point in spec.points()} == {None}


def test_search_mistakes_fail_before_anything_runs(small_trace):
    with pytest.raises(ConfigError, match="gpu: unknown GPU"):
        run_plan(small_trace, small_spec(hardware=["h900"]), executor=SERIAL)
    with pytest.raises(ConfigError, match="slo-ttft-p90"):
        run_plan(small_trace, small_spec(objective=MAX_RATE), executor=SERIAL)
    with pytest.raises(ConfigError, match="replicas"):
        run_plan(small_trace, small_spec(replicas=[0]), executor=SERIAL)
    # A target that is not > 0 names its flag (sim/slo.py, TARGETS).
    for slo, flag in ((SLO(tpot_p99_ms=0.0), "--slo-tpot-p99"),
                      (SLO(ttft_p99_s=-1.0), "--slo-ttft-p99")):
        with pytest.raises(ConfigError, match=f"^{flag}: got .*, expected a number of"):
            run_plan(small_trace, small_spec(slo=slo), executor=SERIAL)


def test_comma_list_flags_parse():
    assert parse_replicas("1..3,8") == [1, 2, 3, 8]
    assert parse_rates("offline,5,2.5") == [None, 5.0, 2.5]
    with pytest.raises(ConfigError, match="--replicas"):
        parse_replicas("4..2")
    with pytest.raises(ConfigError, match="--rate"):
        parse_rates("fast")


# ---------------------------------------------------------------- infeasible points

def test_infeasible_points_are_kept_with_their_reason(small_trace):
    spec = small_spec(hardware=["h100"], budgets=[512, 640], kv_memory_gb=[0.01, 2.0])
    result = run_plan(small_trace, spec, executor=SERIAL)
    assert len(result.rows) == len(spec.points()) == 8
    infeasible = [row for row in result.rows if row["status"] == INFEASIBLE]
    # Too little memory for one request at any budget, and a budget that is no multiple of the
    # block size: both kept, ranked last, each with the planner's or the config's message.
    assert len(infeasible) == 6
    assert result.rows[-len(infeasible):] == infeasible
    for row in infeasible:
        assert row["tps"] is None and not row["pareto"]
        if row["budget"] == 640:
            assert "kv_budget" in row["reason"] and "multiple of block_size" in row["reason"]
        else:
            assert "cannot hold one request" in row["reason"]
            assert "--kv-memory-gb" in row["reason"]
    assert [row["status"] for row in result.rows[:2]] == [OK, OK]


def test_a_point_that_rejects_requests_is_infeasible():
    trace = Trace("long-prompt", [
        TraceRequest("short", 0.0, prompt_len=100, output_len=10),
        TraceRequest("huge", 0.0, prompt_len=20_000, output_len=10),
    ])
    result = run_plan(trace, small_spec(hardware=["h100"], budgets=[1024], hybrid=[True]),
                      executor=SERIAL)
    (row,) = result.rows
    assert row["status"] == INFEASIBLE
    assert row["reason"].startswith("1 of 2 requests can never be served: ")


# ---------------------------------------------------------------- cache and executors

def test_a_rerun_reads_every_point_from_the_cache(small_trace, tmp_path):
    spec = small_spec()
    first = run_plan(small_trace, spec, executor=SERIAL, cache_dir=tmp_path)
    assert (first.evaluated, first.cached) == (8, 0)
    second = run_plan(small_trace, spec, executor=SERIAL, cache_dir=tmp_path)
    assert (second.evaluated, second.cached) == (0, 8)
    assert_close(second.rows, first.rows)
    # An interrupted search resumes: only the points without a cache file are simulated.
    for path in sorted(tmp_path.glob("*.json"))[:3]:
        path.unlink()
    resumed = run_plan(small_trace, spec, executor=SERIAL, cache_dir=tmp_path)
    assert (resumed.evaluated, resumed.cached) == (3, 5)
    assert_close(resumed.rows, first.rows)
    # The objective only ranks: switching it reuses every simulated point.
    other = run_plan(small_trace, replace(spec, objective=TPS_PER_DOLLAR), executor=SERIAL,
                     cache_dir=tmp_path)
    assert other.evaluated == 0


def test_a_changed_trace_or_point_misses_the_cache(small_trace, tmp_path):
    run_plan(small_trace, small_spec(), executor=SERIAL, cache_dir=tmp_path)
    longer = Trace(small_trace.name, [replace(small_trace.requests[0], output_len=999),
                                      *small_trace.requests[1:]])
    assert run_plan(longer, small_spec(), executor=SERIAL, cache_dir=tmp_path).cached == 0
    more_memory = small_spec(kv_memory_gb=[3.0])
    assert run_plan(small_trace, more_memory, executor=SERIAL, cache_dir=tmp_path).cached == 0


def test_the_process_pool_returns_the_serial_results(small_trace):
    spec = small_spec(replicas=[1, 2], rates=[None, 20.0])
    serial = run_plan(small_trace, spec, executor=SERIAL)
    pooled = run_plan(small_trace, spec, executor=LOCAL, workers=2)
    assert pooled.evaluated == len(spec.points()) == 32
    assert_close(pooled.rows, serial.rows)


def test_ray_tasks_return_the_local_results(small_trace):
    ray = pytest.importorskip(
        "ray", reason="Ray is not installed (pip install 'zipage[ray]'); the --ray path is "
                      "untested here")
    spec = small_spec()
    local = run_plan(small_trace, spec, executor=LOCAL, workers=2)
    # A production trace read from its own format (Mooncake: block hashes shared as a tree) on
    # its own arrival times, routed by shared leading blocks: what `zipage plan FILE --ray` runs.
    from zipage.trace_import import load_trace_file

    mooncake = load_trace_file(ROOT / "tests" / "fixtures" / "traces" / "mooncake.jsonl")
    real_spec = small_spec(budgets=[1024], hybrid=[True], replicas=[1, 2], speedups=[1.0, 4.0],
                           routing="prefix-affinity")
    real_local = run_plan(mooncake, real_spec, executor=LOCAL, workers=2)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        on_ray = run_plan(small_trace, spec, executor=RAY)
        real_on_ray = run_plan(mooncake, real_spec, executor=RAY)
    finally:
        ray.shutdown()
    assert on_ray.evaluated == 8
    assert_close(on_ray.rows, local.rows)
    assert real_on_ray.evaluated == 8
    assert_close(real_on_ray.rows, real_local.rows)
    assert {row["routing"] for row in real_on_ray.rows} == {"prefix-affinity"}


# ---------------------------------------------------------------- replicas and routing

def test_one_replica_is_exactly_zipage_replay(small_trace):
    settings = ReplaySettings(hardware="h100", kv_memory_gb=2.0)
    online = stamp_arrivals(small_trace, 5.0)
    replayed, _ = simulate(online, settings)
    clustered = simulate_cluster(online, settings, replicas=1)
    for key in ("tps", "makespan_s", "ttft_p90_s", "tpot_p99_ms", "peak_running",
                "mean_running", "preemptions", "steps", "num_blocks", "max_concurrency"):
        assert_close(clustered[key], replayed[key], what=key)


def test_routing_spreads_requests_over_replicas():
    # Long and short requests alternate: round-robin sends every long one to replica 0, which
    # has blocks for only a few of them, while least-loaded sees the short ones finish and
    # sends long ones to replica 1 too.
    requests = [TraceRequest(f"r{index}", 0.5 * index, prompt_len=64,
                             output_len=1500 if index % 2 == 0 else 2) for index in range(24)]
    trace = Trace("alternating", requests)
    settings = ReplaySettings(hardware="h100", kv_memory_gb=1.0)
    round_robin = simulate_cluster(trace, settings, replicas=2, routing="round-robin")
    least_loaded = simulate_cluster(trace, settings, replicas=2, routing="least-loaded")
    assert round_robin["requests_per_replica"] == [12, 12]
    for summary in (round_robin, least_loaded):
        assert summary["completed"] == 24 and summary["replicas"] == 2
        assert sum(summary["requests_per_replica"]) == 24
    # The long requests no longer queue behind each other on one replica.
    assert least_loaded["ttft_p90_s"] < round_robin["ttft_p90_s"] / 10
    assert least_loaded["makespan_s"] < round_robin["makespan_s"]
    with pytest.raises(ConfigError, match="routing"):
        simulate_cluster(trace, settings, replicas=2, routing="random")


def test_more_replicas_serve_an_online_trace_faster(small_trace):
    online = stamp_arrivals(small_trace, 40.0)
    settings = ReplaySettings(hardware="a100", kv_memory_gb=1.0)
    one, two = (simulate_cluster(online, settings, replicas=count) for count in (1, 2))
    assert two["ttft_p90_s"] < one["ttft_p90_s"]
    assert two["completed"] == one["completed"] == len(small_trace.requests)


def test_peak_running_adds_replicas_up_over_time():
    def step(start: float, end: float, running: int) -> StepRecord:
        return StepRecord(0, start, end, "decode", 0, running, 0, running, 0, 0, 10, 0, 0, 0, 0)

    first = [step(0.0, 1.0, 3), step(1.0, 2.0, 5)]
    second = [step(0.5, 1.5, 4), step(2.0, 3.0, 9)]
    # 3+4 overlap on [0.5, 1), then 5+4 on [1, 1.5); the 9 starts when the 5 ends.
    assert peak_concurrent_running([first, second]) == 9
    assert peak_concurrent_running([first]) == 5


# ---------------------------------------------------------------- the max-rate objective

def test_max_rate_bisection_meets_the_slo_and_grows_with_it(small_trace):
    rates = []
    for ttft_slo in (0.5, 1.0, 2.0):
        spec = small_spec(hardware=["a100"], budgets=[2048], hybrid=[True], kv_memory_gb=[1.0],
                          objective=MAX_RATE, slo=SLO(ttft_p90_s=ttft_slo))
        (row,) = run_plan(small_trace, spec, executor=SERIAL).rows
        assert row["status"] == OK and 0 < row["max_rate_qps"] < float("inf")
        assert row["rate_qps"] == close(row["max_rate_qps"])
        assert row["ttft_p90_s"] <= ttft_slo
        assert row["simulations"] <= spec.search.max_simulations
        rates.append(row["max_rate_qps"])
    assert rates == sorted(rates)
    # An SLO the offline trace already meets holds at any rate.
    loose = small_spec(hardware=["a100"], budgets=[2048], hybrid=[True], kv_memory_gb=[1.0],
                       objective=MAX_RATE, slo=SLO(ttft_p90_s=1000.0))
    (row,) = run_plan(small_trace, loose, executor=SERIAL).rows
    assert row["max_rate_qps"] == float("inf") and row["simulations"] == 1


def test_an_slo_missed_by_every_point_leaves_an_empty_front(small_trace):
    spec = small_spec(slo=SLO(tpot_p99_ms=0.001))
    result = run_plan(small_trace, spec, executor=SERIAL)
    assert {row["status"] for row in result.rows} == {"slo-missed"}
    assert all("TPOT p99" in row["reason"] for row in result.rows)
    assert result.pareto == []


def test_pareto_front_keeps_only_undominated_points_per_gpu(small_trace):
    result = run_plan(small_trace, small_spec(budgets=[512, 1024, 2048]), executor=SERIAL)
    front = result.pareto
    assert front and {row["hardware"] for row in front} == {"h100-80gb", "a100-80gb"}
    for row in front:
        for other in result.rows:
            if other is row or other["hardware"] != row["hardware"] or other["status"] != OK:
                continue
            assert not (other["budget"] >= row["budget"] and other["tps"] > row["tps"])
    ok = [row for row in result.rows if row["status"] == OK]
    assert [row["rank"] for row in ok] == list(range(1, len(ok) + 1))
    assert [row["tps"] for row in ok] == sorted((row["tps"] for row in ok), reverse=True)


# ---------------------------------------------------------------- the command line

def plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zipage")
    add_plan_command(parser.add_subparsers(dest="command", required=True))
    return parser


def test_zipage_plan_prints_the_table_and_writes_the_results(tmp_path, capsys):
    trace_path = ROOT / "traces" / "tiny.json"
    args = plan_parser().parse_args([
        "plan", str(trace_path), "--hardware", "h100,h200", "--budget", "256,512",
        "--hybrid", "on,off", "--kv-memory-gb", "0.05,1", "--workers", "1", "--no-progress",
        "--out", str(tmp_path)])
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert "16 points (2 GPUs x 2 budgets x 2 hybrid modes x 2 memory sizes)" in printed
    assert "infeasible points: 8" in printed and "cannot hold one request" in printed
    assert "Pareto front" in printed
    with (tmp_path / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 16 and sum(row["status"] == INFEASIBLE for row in rows) == 8
    assert (tmp_path / "pareto.png").stat().st_size > 0
    assert list((tmp_path / ".zipage-cache" / "plan").glob("*.json"))
    assert (tmp_path / "results.parquet").exists() or "skipped" in printed

    args = plan_parser().parse_args(["plan", str(trace_path), "--hybrid", "maybe"])
    with pytest.raises(ConfigError, match="--hybrid"):
        args.handler(args)


# ---------------------------------------------------------------- a production trace's load

def paced_trace(gap_s: float) -> Trace:
    """Eight short requests `gap_s` apart: at 30 s apart any GPU serves each long before the next
    arrives, so the last arrival sets the makespan; at 0 they all arrive at once."""
    return Trace("paced", [TraceRequest(f"r{index}", gap_s * index, prompt_len=64, output_len=16)
                           for index in range(8)])


def test_arrival_capped_points_are_marked_and_noted():
    spec = PlanSpec(hardware=["h100", "a100"], kv_memory_gb=[1.0])
    capped = run_plan(paced_trace(30.0), spec, executor=SERIAL)
    # Arrivals span 210 s; each point finishes its last request well under a second later.
    assert all(row["arrival_capped"] for row in capped.rows)
    report = format_report(capped, spec)
    assert ("note: every point served the trace as fast as it arrived (2/2 points "
            "arrival-capped: tok/s within 10% of the trace's output tokens / arrival span)"
            in report)
    assert "--objective max-rate" in report
    header, *table = report.splitlines()[1:4]
    assert "capped" in header.split() and all(" yes " in line for line in table)

    at_once = run_plan(paced_trace(0.0), spec, executor=SERIAL)
    assert not any(row["arrival_capped"] for row in at_once.rows)
    report = format_report(at_once, spec)
    assert "arrival-capped" not in report and "capped" not in report.splitlines()[1].split()


def test_the_arrival_cap_rule_is_the_arrival_span_against_the_makespan():
    trace = paced_trace(30.0)  # arrivals span 210 s: capped while the makespan is <= 210 / 0.9
    assert arrival_capped(trace, 210.0 / 0.9 - 1e-6)
    assert not arrival_capped(trace, 210.0 / 0.9 + 1e-6)
    assert not arrival_capped(paced_trace(0.0), 1.0)
    assert not arrival_capped(trace, 0.0)  # (nothing finished)


def test_speedup_plays_the_traces_own_arrivals_faster(small_trace):
    online = stamp_arrivals(small_trace, 2.0)
    spec = PlanSpec(hardware=["h100"], kv_memory_gb=[2.0], replicas=[1, 2], speedups=[1.0, 8.0])
    result = run_plan(online, spec, executor=SERIAL)
    by_point = {(row["replicas"], row["speedup"]): row for row in result.rows}
    assert set(by_point) == {(1, 1.0), (1, 8.0), (2, 1.0), (2, 8.0)}
    # The same requests in an eighth of the time: more load, a longer queue, sooner done.
    slow, fast = by_point[(1, 1.0)], by_point[(1, 8.0)]
    assert fast["makespan_s"] < slow["makespan_s"] and fast["ttft_p99_s"] > slow["ttft_p99_s"]
    assert fast["completed"] == slow["completed"] == 60
    with pytest.raises(ConfigError, match="give one of them"):
        replace(spec, rates=[5.0]).validate()
    with pytest.raises(ConfigError, match="speedup"):
        replace(spec, speedups=[0.0]).validate()


def test_plan_names_the_fewest_replicas_meeting_the_slos(tmp_path, capsys):
    trace_path = ROOT / "tests" / "fixtures" / "traces" / "azure_conv_2023_excerpt.csv"
    args = plan_parser().parse_args([
        "plan", str(trace_path), "--model", "qwen3-8b", "--hardware", "h100,h200",
        "--replicas", "1..3", "--speedup", "4,16", "--slo-ttft-p99", "1", "--slo-tpot-p99", "60",
        "--routing", "prefix-affinity", "--workers", "1", "--no-progress", "--no-cache"])
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert "12 points (2 GPUs x 3 replica counts x 2 speed-ups)" in printed
    assert "TTFT p99" in printed
    section = printed.split("fewest replicas meeting the SLOs")[1]
    rows = [line.split() for line in section.splitlines()[2:] if line.strip()]
    fewest = {(row[0], row[1]): row[2] for row in rows}
    assert set(fewest) == {("h100-80gb", "4x"), ("h100-80gb", "16x"), ("h200-141gb", "4x"),
                           ("h200-141gb", "16x")}
    # 16x the load needs more replicas than 4x on either GPU.
    for gpu in ("h100-80gb", "h200-141gb"):
        assert int(fewest[(gpu, "16x")]) > int(fewest[(gpu, "4x")])
