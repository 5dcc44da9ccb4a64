"""Test configuration: the hypothesis profiles (tests/hypothesis_profiles.py; `ci` unless
`--hypothesis-profile` names another), torch's threads, the rule-coverage table."""

import hypothesis_profiles
import pytest
from hypothesis import settings

settings.load_profile("ci")


def pytest_configure(config):
    seed = config.getoption("hypothesis_seed", None)
    hypothesis_profiles.run_seed = None if seed is None else int(seed)
    hypothesis_profiles.run_profile = config.getoption("hypothesis_profile", None)


def pytest_report_header(config):
    profile = config.getoption("hypothesis_profile", None) or "ci"
    seed = config.getoption("hypothesis_seed", None)
    return f"hypothesis profile: {profile}" + (f", seed {seed}" if seed is not None else "")


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
