"""`zipage compare`'s run-level errors, finish-order correlation and --max-error gates."""

from __future__ import annotations

import pytest
from test_analysis import (  # the run-directory builders of the analysis tests
    REAL_DECISIONS,
    REAL_DURATIONS,
    REAL_KINDS,
    REAL_SUMMARY,
    make_requests,
    make_steps,
    real_requests,
    write_run_dir,
)
from tolerance import close

from zipage.analysis.compare import compare_runs, exceeded, format_report, parse_max_errors
from zipage.errors import ZipageError


def runs(tmp_path, sim_finish, sim_summary):
    real = write_run_dir(tmp_path / "real", make_steps(REAL_KINDS, REAL_DURATIONS),
                         real_requests(), REAL_SUMMARY, REAL_DECISIONS)
    sim_requests = make_requests(arrival=[0.0, 1.0, 0.0], first_token=[2.0, 2.0, 4.0],
                                 finish=sim_finish, output_len=[4, 6, 1])
    sim = write_run_dir(tmp_path / "sim", make_steps(REAL_KINDS, REAL_DURATIONS), sim_requests,
                        {**REAL_SUMMARY, **sim_summary}, REAL_DECISIONS)
    return compare_runs(sim, real)


def test_errors_and_gates(tmp_path):
    comparison = runs(tmp_path, sim_finish=[8.0, 13.1, 4.0],
                      sim_summary={"tps": 90.0, "makespan_s": 12.1, "ttft_p90_s": 1.0})
    errors = comparison["errors"]
    assert errors["tps"] == pytest.approx(-0.10)
    assert errors["makespan"] == pytest.approx(0.10)
    assert errors["decisions"] == close(0.0)
    # End-to-end latency (finish - arrival): 8/8, 12.1/11, 4/4 -> MAPE 10/3 %.
    assert errors["e2e_mape"] == pytest.approx(0.1 / 3)
    assert comparison["finish_order_correlation"] == pytest.approx(1.0)
    assert "finish-order rank correlation 1.000" in format_report(comparison)
    limits = parse_max_errors(["tps=5", "makespan=15", "e2e_mape=5", "ttft_p90=10"])
    failed = exceeded(errors, limits)
    assert len(failed) == 2 and failed[0].startswith("tps: error -10.00% exceeds 5%")
    assert "ttft_p90: not measurable" in failed[1]  # the real summary has no TTFT p90


def test_finish_order_that_differs(tmp_path):
    comparison = runs(tmp_path, sim_finish=[3.0, 12.0, 9.0], sim_summary={})
    # Ranks 2,3,1 (real) against 1,3,2: Spearman 1 - 6 * 2 / (3 * 8) = 0.5.
    assert comparison["finish_order_correlation"] == pytest.approx(0.5)


def test_distributions_of_ttft_and_tpot(tmp_path):
    comparison = runs(tmp_path, sim_finish=[8.0, 13.1, 4.0], sim_summary={})
    distributions = comparison["distributions"]
    # TTFT 2, 1, 4 in both runs; TPOT 2, 2.22 against 2, 2 (the one-token request has none): at
    # x = 2 the real CDF is at 1, the simulated one at 1/2.
    assert distributions["ttft"]["n"] == {"sim": 3, "real": 3}
    assert distributions["tpot"]["n"] == {"sim": 2, "real": 2}
    assert abs(comparison["errors"]["ks_ttft"]) <= 1e-12
    assert abs(comparison["errors"]["ks_tpot"] - 0.5) <= 1e-12
    assert "ttft 0.000 (n=3 | 3), tpot 0.500 (n=2 | 2)" in format_report(comparison)
    failed = exceeded(comparison["errors"], parse_max_errors(["ks_ttft=1", "ks_tpot=40"]))
    assert failed == ["ks_tpot: error +50.00% exceeds 40%"]


def test_a_side_without_values_has_no_distance(tmp_path):
    real = write_run_dir(tmp_path / "real", make_steps(REAL_KINDS, REAL_DURATIONS),
                         real_requests(), REAL_SUMMARY, REAL_DECISIONS)
    one_token = make_requests(arrival=[0.0, 1.0], first_token=[2.0, 2.0], finish=[2.0, 2.0],
                              output_len=[1, 1])
    sim = write_run_dir(tmp_path / "sim", make_steps(REAL_KINDS, REAL_DURATIONS), one_token,
                        REAL_SUMMARY, REAL_DECISIONS)
    comparison = compare_runs(sim, real)
    assert comparison["distributions"]["tpot"] == {"ks": None, "n": {"sim": 0, "real": 2}}
    assert comparison["errors"]["ks_tpot"] is None
    assert "tpot - (n=0 | 2)" in format_report(comparison)


@pytest.mark.parametrize("item", ["latency=5", "tps", "tps=fast", "tps=-1"])
def test_bad_gate_names_the_fix(item):
    with pytest.raises(ZipageError, match="--max-error"):
        parse_max_errors([item])


def test_cli_gates_exit_status(tmp_path, capsys):
    from zipage.cli.parser import main

    runs(tmp_path, sim_finish=[8.0, 13.1, 4.0], sim_summary={"tps": 90.0, "makespan_s": 12.1})
    sim, real = str(tmp_path / "sim"), str(tmp_path / "real")
    assert main(["compare", sim, real, "--max-error", "tps=5", "--max-error", "makespan=15"]) == 1
    captured = capsys.readouterr()
    assert "(e) run-level error" in captured.out
    assert captured.err.splitlines() == [
        "zipage compare: gate failed: tps: error -10.00% exceeds 5%"]
    assert main(["compare", sim, real, "--max-error", "tps=10.5", "--max-error", "e2e_mape=4"]) == 0
    assert "all 2 gates passed" in capsys.readouterr().out
    assert main(["compare", sim, real]) == 0  # no gate: a report only
    assert main(["compare", sim, real, "--max-error", "latency=5"]) == 2
    assert "--max-error: unknown metric 'latency'" in capsys.readouterr().err


def test_a_second_run_of_the_reference_widens_the_gates(tmp_path, capsys):
    from zipage.analysis.compare import format_spread, widened
    from zipage.cli.parser import main

    comparison = runs(tmp_path, sim_finish=[8.0, 13.1, 4.0],
                      sim_summary={"tps": 90.0, "makespan_s": 12.1})
    # The reference run again: 15 % longer, as fast in tokens per second.
    again = write_run_dir(tmp_path / "again", make_steps(REAL_KINDS, REAL_DURATIONS),
                          real_requests(), {**REAL_SUMMARY, "makespan_s": 12.65}, REAL_DECISIONS)
    spread = compare_runs(again, tmp_path / "real")["errors"]
    assert spread["makespan"] == pytest.approx(0.15)
    limits = widened(parse_max_errors(["makespan=5", "tps=5"]), spread)
    assert limits == {"makespan": pytest.approx(0.15), "tps": pytest.approx(0.05)}
    # The simulator's makespan (+10 %) is within the run's own spread, its tps (-10 %) is not.
    assert [line.split(":")[0] for line in exceeded(comparison["errors"], limits)] == ["tps"]
    text = format_spread(comparison["errors"], spread, "sim", "real", "again")
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:-1]}
    assert rows["makespan"] == ["+10.00%", "+15.00%", "yes"]
    assert rows["tps"] == ["-10.00%", "+0.00%", "no"]
    inside = sum(row[-1] == "yes" for row in rows.values())
    assert text.splitlines()[-1] == f"  {inside} of {len(rows)} within the spread"

    status = main(["compare", str(tmp_path / "sim"), str(tmp_path / "real"), "--spread",
                   str(again), "--max-error", "makespan=5"])
    out = capsys.readouterr().out
    assert status == 0 and "beside" in out and "all 1 gates passed: makespan <= 15%" in out
    # A --spread that is no run fails alone, in one line naming the flag.
    status = main(["compare", str(tmp_path / "sim"), str(tmp_path / "real"), "--spread",
                   str(tmp_path / "nowhere")])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1 and "--spread" in error[0], error
