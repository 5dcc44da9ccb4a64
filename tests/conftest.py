"""Test configuration: hypothesis profiles.

`ci` (the default) runs a fixed, derandomized number of examples so CI is repeatable;
`thorough` is for long local runs: `pytest --hypothesis-profile=thorough tests/test_core_properties.py`.
"""

import pytest
from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=200, derandomize=True, print_blob=True, **_common)
settings.register_profile("thorough", max_examples=5000, print_blob=True, **_common)
settings.register_profile("dev", max_examples=30, **_common)
# tests/mutation_check.py: the ci examples, but stop at the first failure and name it.
settings.register_profile("mutation", max_examples=200, derandomize=True,
                          report_multiple_bugs=False, **_common)
settings.load_profile("ci")


def pytest_terminal_summary(terminalreporter):
    """Print how often the core property tests' examples reached each rule, per mode."""
    from rule_coverage import format_tally

    table = format_tally()
    if table:
        terminalreporter.write_sep("-", "rule coverage of the core property tests")
        terminalreporter.write_line(table)


@pytest.fixture(scope="module")
def one_cpu_thread():
    """torch on one thread for a module's tests: on a busy 2-core machine torch's default made
    the CPU engine many times slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
