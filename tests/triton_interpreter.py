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

import hypothesis_profiles
import pytest

UNDER_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
under_interpreter = pytest.mark.skipif(
    not (UNDER_INTERPRETER and TRITON_INSTALLED),
    reason="Triton test: runs in the TRITON_INTERPRET=1 child process of "
           "test_triton_kernels_under_the_interpreter",
)


def run_test_file_under_interpreter(test_file: str) -> None:
    """Run `test_file` in a child pytest with TRITON_INTERPRET=1, under this run's hypothesis profile
    and seed; fail with its output."""
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider",
         *hypothesis_profiles.child_arguments()],
        env=environment, capture_output=True, text=True, timeout=600 * hypothesis_profiles.time_factor())
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]


# ---------------------------------------------------------------- compiling for Hopper without a GPU

# Exit code of a compile-for-hopper child whose Triton lacks the ahead-of-time compiler API.
COMPILER_API_MISSING = 3
HOPPER_COMMAND = "compile-for-hopper"


def compile_for_hopper(launches, argument_type) -> int:
    """Compile every `(kernel, constexpr values)` of `launches()` to a Hopper (sm_90) binary without a
    GPU; `argument_type(name)` is Triton's type of each other argument. The interpreter runs programs
    the compiler would reject, so this is the CPU-side check that the kernels build. Returns an exit
    code (run it in a child without TRITON_INTERPRET: `python TEST_FILE compile-for-hopper`)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        return COMPILER_API_MISSING
    for kernel, constants in launches():
        signature = {name: "constexpr" if name in constants else argument_type(name)
                     for name in kernel.arg_names}
        triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    return 0


def compiler_environment() -> dict[str, str]:
    """The environment of a compile-for-hopper child: Triton must not start in interpreter mode."""
    return {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}


def check_hopper_compilation(returncode: int, stderr: str) -> None:
    if returncode == COMPILER_API_MISSING:
        pytest.skip("this Triton has no triton.compiler.ASTSource / GPUTarget to compile ahead of time")
    assert returncode == 0, stderr[-6000:]


def run_hopper_compilation(test_file: str) -> None:
    """Run `test_file`'s compile-for-hopper entry point in a child process; skip or fail with its output."""
    child = subprocess.run([sys.executable, test_file, HOPPER_COMMAND], env=compiler_environment(),
                           capture_output=True, text=True, timeout=600)
    check_hopper_compilation(child.returncode, child.stderr)
