"""`zipage replay` output: the summary table, run directories (decision log formats), exit
statuses when requests fail."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from zipage.cli.output import EXIT_REQUESTS_FAILED
from zipage.cli.parser import main
from zipage.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "traces" / "tiny.json")
SMALL = ["--block-size", "16", "--window", "4", "--budget", "64", "--kv-memory-gb", "0.05",
         "--no-progress"]


def table(capsys, *argv: str) -> tuple[int, list[str]]:
    status = main(["replay", TINY, *argv])
    return status, capsys.readouterr().out.splitlines()


def row(lines: list[str], label: str) -> str:
    [line] = [line for line in lines if line.strip().startswith(label)]
    return line.strip()[len(label):].strip()


def test_summary_names_the_run_and_its_knobs(capsys):
    status, lines = table(capsys, *SMALL, "--hardware", "H100")
    assert status == 0
    assert lines[0] == ("tiny on qwen3-8b · simulator on h100-80gb · budget 64, block 16, "
                        "hybrid scheduling")
    assert float(row(lines, "mean TTFT (s)")) > 0 and float(row(lines, "p90 TTFT (s)")) > 0
    assert int(row(lines, "query slots M")) >= 1
    assert int(row(lines, "max blocks after compression")) <= int(
        row(lines, "N_max (blocks per request)"))


def test_full_kv_has_no_compression_numbers(capsys):
    status, lines = table(capsys, "--block-size", "16", "--no-progress", "--no-compress",
                          "--no-hybrid")
    assert status == 0
    assert lines[0].endswith("Full KV (no compression), block 16")
    for label in ("max blocks after compression", "N_max (blocks per request)", "query slots M"):
        assert row(lines, label) == "-"


def test_json_names_trace_and_device(capsys):
    status, lines = table(capsys, *SMALL, "--json")
    summary = json.loads("\n".join(lines))
    assert status == 0 and summary["trace"] == "tiny" and summary["device"] == "a100-80gb"


def test_summary_has_request_input_and_total_throughput_and_p99_latencies(capsys, tmp_path):
    """Issue #48: beside output tok/s, requests/s, input and total tok/s over the same makespan,
    and p99 TTFT and TPOT, in the table and the JSON (the streamed run's too: it gathers its
    summary without request records)."""
    status, lines = table(capsys, *SMALL, "--json")
    summary = json.loads("\n".join(lines))
    prompts = sum(request.prompt_len for request in load_trace(TINY).requests)
    makespan = summary["makespan_s"]
    assert status == 0 and summary["completed"] == summary["requests"]
    assert summary["input_tokens"] == prompts
    assert summary["requests_per_s"] == pytest.approx(summary["completed"] / makespan)
    assert summary["input_tps"] == pytest.approx(prompts / makespan)
    assert summary["total_tps"] == pytest.approx(summary["tps"] + summary["input_tps"])
    assert summary["ttft_p99_s"] >= summary["ttft_p90_s"] > 0
    assert summary["tpot_p99_ms"] > 0
    status, _ = table(capsys, *SMALL, "--out", str(tmp_path))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert {key: written[key] for key in ("input_tokens", "requests_per_s", "total_tps")} == {
        key: summary[key] for key in ("input_tokens", "requests_per_s", "total_tps")}
    status, lines = table(capsys, *SMALL)
    assert float(row(lines, "throughput (req/s)")) == pytest.approx(summary["requests_per_s"],
                                                                    abs=0.005)
    assert float(row(lines, "input throughput (tok/s)").replace(",", "")) == pytest.approx(
        summary["input_tps"], abs=0.05)
    assert float(row(lines, "total throughput (tok/s)").replace(",", "")) == pytest.approx(
        summary["total_tps"], abs=0.05)
    assert float(row(lines, "p99 TTFT (s)")) == pytest.approx(summary["ttft_p99_s"], abs=5e-4)
    assert float(row(lines, "p99 TPOT (ms)")) == pytest.approx(summary["tpot_p99_ms"], abs=5e-3)
    # The simulator's figures are predictions: its footer says how far to trust them.
    assert lines[-1].strip().startswith("no validated error band (analytic cost model)")


def test_summaries_of_a_failed_request_count_only_finished_prompts():
    from zipage.core.metrics import summarize
    from zipage.records import RequestRecord

    done = RequestRecord("a", 0.0, 1.0, 3.0, 100, 5, 0, 0, 0, "finished", None)
    rejected = RequestRecord("b", 0.0, None, None, 700, 9, 0, 0, 0, "rejected", "too long")
    summary = summarize([], [done, rejected])
    assert summary["input_tokens"] == 100 and summary["requests_per_s"] == pytest.approx(1 / 3)
    assert summary["total_tps"] == pytest.approx(105 / 3)


def test_dtype_defaults_to_bfloat16_except_on_the_cpu_engine():
    """One rule (zipage.cli.flags.default_dtype): bfloat16 in the simulator and on a GPU,
    float32 on the CPU, for every command that runs the engine alike (calibrate and fidelity
    took bfloat16 on the CPU before), and the simulator's commands."""
    from zipage.cli.flags import default_dtype, settings_from_args
    from zipage.cli.parser import build_parser
    from zipage.cli.plan import PLAN_AXES

    parser = build_parser()

    def dtype(*argv: str) -> str:
        return settings_from_args(parser.parse_args(list(argv))).dtype

    assert dtype("replay", TINY) == "bfloat16"
    assert dtype("replay", TINY, "--gpu") == "bfloat16"
    assert dtype("replay", TINY, "--engine", "cpu") == "float32"
    assert dtype("replay", TINY, "--engine", "cpu", "--dtype", "float16") == "float16"
    assert dtype("serve", "--model", "m") == "bfloat16"
    assert dtype("serve", "--model", "m", "--engine", "cpu") == "float32"
    for command in ("calibrate", "fidelity"):
        given = (command, "--model", "m", "--out", "p.json")
        assert dtype(*given, "--engine", "cpu") == "float32"
        assert dtype(*given, "--engine", "cpu", "--dtype", "bfloat16") == "bfloat16"
        assert dtype(*given, "--engine", "gpu") == "bfloat16"
        assert dtype(*given, "--gpu") == "bfloat16"
        assert dtype(*given) == "bfloat16"  # the GPU is their default
    assert dtype("report", "ablation", TINY, "--out", "runs/a") == "bfloat16"
    assert settings_from_args(parser.parse_args(["plan", TINY]), axes=PLAN_AXES).dtype == \
        "bfloat16"
    assert parser.parse_args(["generate", "--model", "m", "p"]).dtype is None  # device's default
    assert (default_dtype("cpu"), default_dtype("cuda"), default_dtype(None)) == (
        "float32", "bfloat16", "bfloat16")


@pytest.mark.parametrize("decisions, expected", [
    (None, "decisions.log.gz"),  # the default: 2.7 MB rather than 140 MB for amc23.json
    ("plain", "decisions.log"), ("gzip", "decisions.log.gz"), ("none", None)])
def test_decision_log_formats(capsys, tmp_path, decisions, expected):
    flag = [] if decisions is None else ["--decisions", decisions]
    status, lines = table(capsys, *SMALL, "--out", str(tmp_path), *flag)
    assert status == 0
    logs = sorted(path.name for path in tmp_path.glob("decisions.log*"))
    assert logs == ([expected] if expected else [])
    assert (tmp_path / "timeline.png").is_file()
    assert ("decisions.log" in lines[-1]) == (expected is not None)


def test_a_run_with_failed_requests_exits_3_and_keeps_the_trace_lengths(capsys, tmp_path):
    status, lines = table(capsys, *SMALL, "--max-model-len", "5", "--out", str(tmp_path))
    assert status == EXIT_REQUESTS_FAILED
    assert any(line.strip().startswith("failed: request") for line in lines)
    assert any("more (requests.csv)" in line for line in lines)
    trace = {request.id: request.output_len for request in load_trace(TINY).requests}
    with (tmp_path / "requests.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    rejected = [row for row in rows if row["status"] == "rejected"]
    assert rejected and all(int(row["output_len"]) == trace[row["id"]] for row in rejected)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed"] == len(rejected)


def test_every_request_failing_also_exits_3(capsys, tmp_path):
    trace = tmp_path / "long.json"
    trace.write_text(json.dumps({"version": 1, "name": "long", "requests": [
        {"id": f"r{index}", "arrival_s": 0.0, "prompt_len": 10, "output_len": 10}
        for index in range(3)]}))
    status = main(["replay", str(trace), *SMALL, "--max-model-len", "5", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert status == EXIT_REQUESTS_FAILED
    assert summary["completed"] == 0 and summary["failed"] == 3


def test_no_progress_bars_off_a_terminal(capsys):
    # capsys' stderr is not a terminal: no bar, so logs get no carriage returns or blank lines.
    assert main(["replay", TINY, "--block-size", "16", "--window", "4", "--budget", "64"]) == 0
    assert capsys.readouterr().err == ""


def test_an_error_after_a_progress_bar_starts_on_its_own_line(capsys):
    from tqdm import tqdm

    bar = tqdm(total=3, desc="points")  # a bar an error interrupts, as in `zipage plan`
    bar.update(1)
    assert main(["replay", "no-such-trace.json"]) == 2
    err = capsys.readouterr().err
    assert "\nzipage: error: " in err and err.endswith("\n")
    assert err.splitlines()[-1].startswith("zipage: error: ")


def test_version_and_examples_in_help(capsys):
    from zipage import __version__

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"zipage {__version__}"
    for argv in (["-h"], ["replay", "-h"], ["generate", "-h"], ["compare", "-h"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "example" in capsys.readouterr().out


def test_report_ablation_hides_and_refuses_the_flags_it_varies(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["report", "ablation", "-h"])
    text = capsys.readouterr().out
    assert "--no-hybrid" not in text and "--no-compress" not in text and "--budget" in text
    assert main(["report", "ablation", TINY, "--out", str(tmp_path), "--no-compress"]) == 2
    assert "--no-compress: report ablation runs every variant" in capsys.readouterr().err


def test_report_ablation_says_which_traces_it_does_not_judge(capsys, tmp_path):
    assert main(["report", "ablation", TINY, "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[NO ]" not in out and "not judged: tiny" in out
    assert "no claim of the paper can be judged" in out
