"""`zipage replay` output: the summary table, run directories (decision log formats), exit
statuses when requests fail."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from zipage.cli import EXIT_REQUESTS_FAILED, main
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
