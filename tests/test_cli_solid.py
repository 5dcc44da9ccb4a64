"""Mistakes that used to slip through the command line: a mistyped flag, a cache size no GPU
has, a plan grid with one bad budget, a Full-KV plan labelled with a budget."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from zipage.cli import main
from zipage.deployment import ReplaySettings, plan_capacity
from zipage.errors import MemoryPlanError
from zipage.presets import resolve_shape

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
