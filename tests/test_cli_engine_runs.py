"""What `zipage replay --engine cpu` prints and records, beside the simulator's run of the same
trace (issue #48): no validated-band footer under measured figures, the device that actually ran
in the summary and in `zipage compare`'s header, float32 as the CPU's default dtype."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402

from zipage.cli.parser import main  # noqa: E402
from zipage.trace import Trace, TraceRequest, save_trace  # noqa: E402

pytestmark = pytest.mark.engine

FLAGS = ["--no-compress", "--block-size", "16", "--kv-memory-gb", "0.001", "--threads", "1",
         "--no-progress"]
NO_BAND = "no validated error band"


@pytest.fixture(scope="module")
def printed_runs(tmp_path_factory):
    """A four-request trace replayed by the simulator and the CPU engine (tiny Qwen3): the run
    directories, what each printed (stdout redirected: the fixture serves the whole module, so
    it cannot take capsys) and their summaries. Same flags: --dtype left to its default."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("engine-runs")
    save_tiny_qwen3(root / "model")
    trace = root / "trace.json"
    save_trace(Trace("four", [TraceRequest(id=f"r{i}", arrival_s=0.0, prompt_len=12 + 5 * i,
                                           output_len=6) for i in range(4)]), trace)
    printed = {}
    for name, extra in (("sim", []), ("cpu", ["--engine", "cpu"])):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            status = main(["replay", str(trace), "--model", str(root / "model"), *FLAGS, *extra,
                           "--out", str(root / name)])
        assert status == 0, buffer.getvalue()
        printed[name] = buffer.getvalue()
    summaries = {name: json.loads((root / name / "summary.json").read_text())
                 for name in printed}
    return root, printed, summaries


def test_only_the_simulator_prints_the_band_footer(printed_runs):
    _, printed, _ = printed_runs
    assert NO_BAND in printed["sim"]
    assert NO_BAND not in printed["cpu"]
    assert printed["cpu"].splitlines()[0].startswith("four on ") and " · engine-cpu on cpu · " in (
        printed["cpu"].splitlines()[0])


def test_the_summary_records_what_ran(printed_runs):
    _, _, summaries = printed_runs
    assert summaries["sim"]["device"] == "a100-80gb"  # the simulated GPU (--hardware)
    assert summaries["cpu"]["device"] == "cpu"
    # --hardware keeps its meaning (the GPU a simulation of these settings prices) in both.
    assert summaries["cpu"]["settings"]["hardware"] == summaries["sim"]["settings"]["hardware"]
    assert summaries["sim"]["settings"]["dtype"] == "bfloat16"
    assert summaries["cpu"]["settings"]["dtype"] == "float32"  # the CPU's default


def test_compare_names_each_runs_device(printed_runs, capsys):
    root, _, _ = printed_runs
    assert main(["compare", str(root / "sim"), str(root / "cpu")]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("simulator:") and first.endswith("(on a100-80gb)")
    assert second.startswith("engine-cpu:") and second.endswith("(on cpu)")


def test_a_cuda_run_records_the_device_name(monkeypatch):
    from zipage.engine.replay import device_name

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    cuda = SimpleNamespace(type="cuda")
    assert device_name(cuda) == "NVIDIA H200"
    assert device_name(cuda, 2) == "2 x NVIDIA H200"
    assert device_name(torch.device("cpu"), 2) == "cpu"
