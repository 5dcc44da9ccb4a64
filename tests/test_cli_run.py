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


@pytest.mark.parametrize("decisions, expected", [("plain", "decisions.log"),
                                                 ("gzip", "decisions.log.gz"), ("none", None)])
def test_decision_log_formats(capsys, tmp_path, decisions, expected):
    status, lines = table(capsys, *SMALL, "--out", str(tmp_path), "--decisions", decisions)
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
