"""Mistakes that used to slip through the command line: a mistyped flag, a cache size no GPU
has, a plan grid with one bad budget, a Full-KV plan labelled with a budget."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from zipage.cli.parser import main
from zipage.core.deployment import ReplaySettings, plan_capacity
from zipage.errors import MemoryPlanError
from zipage.model_spec import resolve_shape

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "traces" / "tiny.json")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    return lines[0]


# ---------------------------------------------------------------- mistyped flags

@pytest.mark.parametrize("argv, unknown, suggested", [
    (["replay", TINY, "--buget", "512"], "--buget", "--budget"),
    (["replay", TINY, "--kv-memry-gb=3"], "--kv-memry-gb", "--kv-memory-gb"),
    (["plan", TINY, "--hybird", "on,off"], "--hybird", "--hybrid"),
    (["compare", "a", "b", "--max-eror", "tps=3"], "--max-eror", "--max-error"),
    (["trace", "make", "tiny", "-o", "x.json", "--burstsize", "4"], "--burstsize",
     "--burst-size"),
])
def test_a_mistyped_flag_names_the_closest_flags_of_its_subcommand(capsys, argv, unknown,
                                                                    suggested):
    status, _, err = run(capsys, *argv)
    line = one_line(err)
    assert status == 2
    command = " ".join(argv[:2] if argv[0] == "trace" else argv[:1])
    assert line.startswith(f"zipage: error: zipage {command}: unknown flag {unknown};"), line
    assert f"did you mean {suggested}" in line, line


def test_a_flag_nothing_resembles_points_to_the_subcommands_help(capsys):
    status, _, err = run(capsys, "replay", TINY, "--zzzzzz")
    assert status == 2
    assert "`zipage replay --help` lists its flags" in one_line(err)


def test_an_extra_positional_argument_is_named(capsys):
    status, _, err = run(capsys, "replay", TINY, TINY)
    assert status == 2
    assert "unexpected argument" in one_line(err)


# ---------------------------------------------------------------- --kv-memory-gb

@pytest.mark.parametrize("gigabytes", ["1e9", "5000", "64"])
def test_the_simulator_refuses_more_cache_memory_than_the_gpu_has(capsys, gigabytes):
    """64 GiB + Qwen3-8B's 15.3 GiB of weights exceed an H100's 79.1 GiB; 1e9 used to reach
    the block manager's allocation (MemoryError), 5000 used to be simulated."""
    status, out, err = run(capsys, "replay", TINY, "--hardware", "h100",
                           "--kv-memory-gb", gigabytes)
    line = one_line(err)
    assert status == 2 and not out
    assert line.startswith("zipage: error: --kv-memory-gb:") and "h100-80gb" in line, line
    assert "give at most 63.9" in line


def test_weights_larger_than_the_gpu_name_the_model_not_the_cache(capsys):
    """Qwen3-32B's 61 GiB of bfloat16 weights on a GPU of 40 GiB: no --kv-memory-gb could help,
    so the error names the model and what would."""
    status, out, err = run(capsys, "replay", TINY, "--model", "qwen3-32b", "--hardware", "a100",
                           "--gpu-memory-gb", "40", "--kv-memory-gb", "1")
    line = one_line(err)
    assert status == 2 and not out
    assert line.startswith("zipage: error: --model: qwen3-32b's weights take"), line
    assert "--tensor-parallel" in line


def test_cache_memory_that_fits_next_to_the_weights_is_planned(capsys):
    status, _, err = run(capsys, "replay", TINY, "--hardware", "h100", "--kv-memory-gb", "60",
                         "--json")
    assert status == 0, err


def test_tensor_parallel_checks_the_weights_of_one_gpu():
    shape = resolve_shape("qwen3-32b")  # 30.5 GiB of weights per GPU at TP=2
    gpu = int(79.11 * 1024**3)
    plan_capacity(ReplaySettings(model="qwen3-32b", tensor_parallel=2, kv_memory_gb=45), shape,
                  gpu)
    with pytest.raises(MemoryPlanError, match="30.5 GiB per GPU"):
        plan_capacity(ReplaySettings(model="qwen3-32b", tensor_parallel=2, kv_memory_gb=50),
                      shape, gpu)


def test_the_engine_checks_cache_memory_against_the_devices_total(monkeypatch):
    """The engine's planning path on a GPU, with torch's memory query mocked: an 80 GB device
    refuses --kv-memory-gb 5000 before any cache is allocated."""
    torch = pytest.importorskip("torch")
    from zipage.engine import builder

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(79.11 * 1024**3)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    settings = ReplaySettings(model="qwen3-8b", kv_memory_gb=5000)
    settings, total, name = builder.device_memory(settings, torch.device("cuda"))
    assert total == int(79.11 * 1024**3)
    with pytest.raises(MemoryPlanError, match=r"--kv-memory-gb: got 5000, but the GPU "
                                              r"\(NVIDIA H100 80GB HBM3\) has 79.1 GiB"):
        plan_capacity(settings, resolve_shape("qwen3-8b"), total, name)


def test_the_cpu_engine_checks_cache_memory_against_the_host(capsys):
    pytest.importorskip("torch")
    status, _, err = run(capsys, "replay", TINY, "--engine", "cpu", "--model",
                         "random:smollm2-135m", "--kv-memory-gb", "1e9")
    line = one_line(err)
    assert status == 2 and "--kv-memory-gb: got 1e+09, but this host's memory has" in line


# ---------------------------------------------------------------- zipage plan

def test_an_off_multiple_budget_is_an_infeasible_row_and_the_others_run(capsys, tmp_path):
    status, out, err = run(capsys, "plan", TINY, "--hardware", "h200", "--budget", "1000,2048",
                           "--workers", "1", "--no-cache", "--no-progress", "--out",
                           str(tmp_path))
    assert status == 0, err
    assert "infeasible points: 1" in out
    assert ("h200-141gb budget 1000, block 256, hybrid on, 1 replica: kv_budget: got 1000, "
            "expected a positive multiple of block_size 256") in out
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [(row["budget"], row["status"]) for row in rows] == [("2048", "ok"),
                                                                 ("1000", "infeasible")]


def test_a_grid_without_one_valid_budget_is_refused(capsys):
    status, _, err = run(capsys, "plan", TINY, "--hardware", "h200", "--budget", "1000",
                         "--workers", "1", "--no-cache")
    assert status == 2 and "kv_budget: got 1000" in one_line(err)


def test_a_full_kv_plan_is_labelled_full_kv(capsys, tmp_path):
    status, out, err = run(capsys, "plan", TINY, "--no-compress", "--hardware", "h100,a100",
                           "--workers", "1", "--no-cache", "--no-progress", "--out",
                           str(tmp_path))
    assert status == 0, err
    assert "2048" not in out and "hybrid on" not in out and "vs KV budget" not in out, out
    assert "best per GPU" in out and "Full KV" in out
    table = out[out.index("ranked by"):out.index("infeasible points")]
    # The ranked rows, not the notes under them.
    rows = [line for line in table.splitlines()[2:] if line.split()[:1] and line.split()[0].isdigit()]
    assert rows and all("Full KV" in line for line in rows), table
    assert (tmp_path / "pareto.png").stat().st_size > 0


def test_a_full_kv_plan_refuses_budget_axes(capsys):
    status, _, err = run(capsys, "plan", TINY, "--no-compress", "--budget", "1024,2048",
                         "--hybrid", "on,off", "--workers", "1", "--no-cache")
    line = one_line(err)
    assert status == 2 and line.startswith("zipage: error: --budget, --hybrid: --no-compress")
