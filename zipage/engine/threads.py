"""How many threads torch may use for the CPU engine.

torch's default is one OpenMP thread per core, and its threads spin while they wait for each
other. On a machine whose cores are busy with anything else, a spinning thread that loses its core
stalls every matmul: on a shared 2-core machine a 576x1536 linear (SmolLM2-135M's MLP) took
5.1 ms with 2 threads against 0.16 ms with 1, and `zipage replay traces/tiny.json --engine cpu`
went from about 100 s to over 1,300 s (docs/engine.md has the numbers, `bench/cpu_threads.py`
measures them). With the cores idle, 2 threads were only 1.5-2.6x faster. So we use half the cores
we may run on (at least 1, at most `MAX_DEFAULT_THREADS`): a small loss on an idle machine, never
the collapse on a busy one. `--threads N` (or `LLM(threads=N)`), `ZIPAGE_CPU_THREADS` or
`OMP_NUM_THREADS` choose otherwise, in that order.
"""

from __future__ import annotations

import os

from zipage.errors import ConfigError

THREADS_ENV = "ZIPAGE_CPU_THREADS"
MAX_DEFAULT_THREADS = 8  # a small model's matmuls stop gaining well before this


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's CPU set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    return max(1, min(usable_cores() // 2, MAX_DEFAULT_THREADS))


def choose_threads(requested: int | None = None) -> tuple[int, str]:
    """The thread count and where it came from: the flag, an environment variable, or the
    default."""
    if requested is not None:
        return _positive(requested, "--threads"), "--threads"
    for variable in (THREADS_ENV, "OMP_NUM_THREADS"):
        value = os.environ.get(variable, "").strip()
        if value:
            try:
                return _positive(int(value), variable), variable
            except ValueError:
                raise ConfigError(f"{variable}: got {value!r}, expected a positive integer "
                                  "number of threads") from None
    return default_threads(), f"default: half of {usable_cores()} cores"


def set_cpu_threads(requested: int | None = None) -> int:
    """Apply `choose_threads` to torch; returns the count."""
    import torch

    threads, _ = choose_threads(requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def _positive(value: int, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: got {value!r}, expected a positive integer number of threads")
    return value
