"""Running Triton kernel tests on the CPU through the Triton interpreter.

Triton decides whether it interprets when it is first imported, so a test file's Triton tests run
in a child pytest process started with TRITON_INTERPRET=1; in the parent they are skipped (and the
parent never imports Triton, whose interpreter would otherwise slow every later CPU test).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

UNDER_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
under_interpreter = pytest.mark.skipif(
    not (UNDER_INTERPRETER and TRITON_INSTALLED),
    reason="Triton test: runs in the TRITON_INTERPRET=1 child process of "
           "test_triton_kernels_under_the_interpreter",
)


def run_test_file_under_interpreter(test_file: str) -> None:
    """Run `test_file` in a child pytest with TRITON_INTERPRET=1; fail with its output."""
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    environment.pop("ZIPAGE_FORCE_TRITON", None)
    child = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"],
        env=environment, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
