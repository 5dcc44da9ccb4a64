"""Hostile trace files (tests/hostile_traces/): every one gives one error line and exit 2.

The corpus holds the cases a fuzz run of the loader found escaping as tracebacks, hangs or silent
acceptance: bad encodings, integers too long to convert, nesting deeper than the parser recurses,
numbers past every sane bound, lone surrogates and duplicated keys. Each must raise one
`TraceError` line naming the file (and the request and field where the file is readable), and the
real CLI must print exactly that line on stderr and exit 2. A prompt that can never fit is not a
file error: it loads, and fails alone at admission while the other requests run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zipage.cli.parser import main
from zipage.core.deployment import ReplaySettings, trace_sequences
from zipage.errors import TraceError
from zipage.sim.simulate import plan_deployment, simulate
from zipage.trace import load_trace

CORPUS = Path(__file__).resolve().parent / "hostile_traces"

# file -> what its one error line must say
REJECTED = {
    "latin1_id.json": "not UTF-8 text: byte 0xe9 at line 2 column 11",
    "invalid_utf8.json": "not UTF-8 text: byte 0xc3 at line 2",
    "utf16_bom.json": "the file is UTF-16 or UTF-32 text",
    "utf16_no_bom.json": "NUL byte at line 1 column 2",
    "empty.json": "not valid JSON at line 1 column 1: Expecting value",
    "integer_5000_digits.json":
        "request #0 (id 'a'): output_len must be an integer between 1 and 2147483647, "
        "got an integer of 5000 digits",
    "deep_array.json": "JSON nested too deeply",
    "deep_object.json": "JSON nested too deeply",
    "arrival_400_digits.json":
        "request #0 (id 'a'): arrival_s must be a number between 0 and 1000000000",
    "arrival_nan.json": "request #0 (id 'a'): arrival_s must be a number between 0 and "
                        "1000000000 (seconds from the trace start, not an absolute time), got nan",
    "prompt_len_2_63.json":
        "request #0 (id 'a'): prompt_len must be an integer between 1 and 2147483647, "
        "got 9223372036854775808",
    "output_len_2_63.json":
        "request #0 (id 'a'): output_len must be an integer between 1 and 2147483647, "
        "got 9223372036854775808",
    "token_id_2_63.json": "request #0 (id 'a'): prompt_token_ids[1] must be an integer between 0 "
                          "and 2147483647, got 9223372036854775808",
    "lone_surrogate_id.json": r"request #0: id must be a non-empty string, got 'a\ud800' "
                              r"(an unpaired surrogate \ud800 at character 1",
    "lone_surrogate_group.json": r"request #0 (id 'a'): prefix_group must be a non-empty string, "
                                 r"got 'g\udfff' (an unpaired surrogate \udfff at character 1",
    "duplicated_output_len.json": "request #0 (id 'a'): duplicated key 'output_len'",
    "duplicated_requests.json": "duplicated key 'requests'",
}
LOADS = {"prompt_len_1e9.json", "utf8_bom.json"}


def test_corpus_is_exactly_the_listed_files() -> None:
    on_disk = {path.name for path in CORPUS.iterdir()}
    assert on_disk == set(REJECTED) | LOADS


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_loader_rejects_with_one_line(name: str) -> None:
    path = CORPUS / name
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert REJECTED[name] in message
    assert "\n" not in message and len(message) < 400


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_cli_prints_one_line_and_exits_2(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(CORPUS / name), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zipage: error: ")
    assert REJECTED[name] in lines[0]


def test_cli_subprocess_gives_one_line_and_no_traceback() -> None:
    names = ["latin1_id.json", "deep_object.json", "integer_5000_digits.json",
             "duplicated_output_len.json"]
    for name in names:
        done = subprocess.run([sys.executable, "-m", "zipage.cli", "replay", str(CORPUS / name),
                               "--json"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stdout == ""
        assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
        assert REJECTED[name] in done.stderr


def test_utf8_byte_order_mark_is_skipped() -> None:
    trace = load_trace(CORPUS / "utf8_bom.json")
    assert [request.id for request in trace.requests] == ["ok"]


def test_prompt_that_can_never_fit_fails_alone_without_tokens() -> None:
    trace = load_trace(CORPUS / "prompt_len_1e9.json")
    deployment = plan_deployment(ReplaySettings())
    scheduler = deployment.new_scheduler()
    huge, ok = trace_sequences(trace, deployment.shape.vocab_size, need_tokens=True,
                               scheduler=scheduler)
    # No 10^9-token prompt was synthesised (that alone takes minutes and gigabytes) ...
    assert huge.prompt_len == 10**9 and huge.prompt_token_ids is None
    assert ok.prompt_token_ids is not None and len(ok.prompt_token_ids) == 8
    # ... and admission rejects it with its reason while the other request runs.
    summary, run = simulate(trace, ReplaySettings())
    assert (summary["completed"], summary["failed"]) == (1, 1)
    errors = {record.id: record.error for record in run.requests}
    assert errors["ok"] is None
    assert "request a: prompt_len + output_len = 1000000004 exceeds max_model_len" in errors["a"]


def test_cli_runs_the_others_when_one_prompt_can_never_fit(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Exit 3: the run finished but a request failed (docs/engine.md, exit statuses).
    assert main(["replay", str(CORPUS / "prompt_len_1e9.json"), "--json"]) == 3
    summary = json.loads(capsys.readouterr().out)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (2, 1, 1)


@pytest.mark.parametrize("terminal", [False, True])
def test_json_progress_goes_to_stderr_of_a_terminal_only(
        terminal: bool, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A million requests take a minute: a person at a terminal sees progress even under --json
    # (on stderr, so stdout stays one JSON object); a script capturing stderr sees nothing.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    tiny = Path(__file__).resolve().parents[1] / "traces" / "tiny.json"
    assert main(["replay", str(tiny), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["requests"] == 18
    assert ("requests" in captured.err) is terminal


def test_engine_replay_runs_the_others_when_one_prompt_can_never_fit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The real engine gets no prompt for the 10^9-token request (it is rejected at admission);
    # the other request is generated.
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import save_tiny_qwen3

    model_dir = tmp_path / "tiny-qwen3"
    save_tiny_qwen3(model_dir)
    code = main(["replay", str(CORPUS / "prompt_len_1e9.json"), "--engine", "cpu", "--model",
                 str(model_dir), "--no-compress", "--block-size", "16", "--dtype", "float32",
                 "--kv-memory-gb", "0.001", "--json", "--no-progress"])
    assert code == 3  # a request failed (exit status 3), the other completed
    summary = json.loads(capsys.readouterr().out)
    assert (summary["driver"], summary["completed"], summary["failed"]) == ("engine-cpu", 1, 1)


def test_many_unknown_or_duplicated_keys_still_give_a_short_line(tmp_path: Path) -> None:
    unknown = {f"field{index}": index for index in range(10_000)}
    request = {"id": "a", "arrival_s": 0, "prompt_len": 1, "output_len": 1, **unknown}
    path = tmp_path / "unknown.json"
    path.write_text(json.dumps({"version": 1, "requests": [request]}))
    with pytest.raises(TraceError, match="unknown fields 'field0', .* and 9995 more; allowed"
                       ) as caught:
        load_trace(path)
    assert len(str(caught.value)) < 400
    fields = '"id": "a", "arrival_s": 0, "prompt_len": 1, "output_len": 1, "prefix_group": "g", '
    path.write_text('{"version": 1, "requests": [{' + fields * 1000 + '"prefix_len": 1}]}')
    with pytest.raises(TraceError, match="request #0 \\(id 'a'\\): duplicated keys 'id', "
                       "'arrival_s', 'prompt_len', 'output_len', 'prefix_group': ") as caught:
        load_trace(path)
    assert len(str(caught.value)) < 400
