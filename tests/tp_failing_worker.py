"""A tensor-parallel worker rank that fails on purpose, for tests/test_tensor_parallel.py.

    python tests/tp_failing_worker.py STEP raise|exit FD

It is the engine's worker (`zipage.engine.parallel.worker_main`) with its step wrapped: at step
STEP it raises RuntimeError or exits with code 7, so the test can check that rank 0 stops the run
with one line naming the rank. The test starts it in place of a rank's worker by replacing
`zipage.engine.parallel.worker_command`.
"""

from __future__ import annotations

import os
import sys

from zipage.engine import parallel


def main(step: int, action: str, fd: int) -> None:
    run_step = parallel.run_step

    def failing_step(runner, message: tuple) -> None:
        if message[0] == step:  # a step message starts with the step's id
            if action == "exit":
                os._exit(7)
            raise RuntimeError(f"injected fault at step {step}")
        run_step(runner, message)

    parallel.run_step = failing_step  # worker_main looks it up at each step
    parallel.worker_main(fd)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
