"""The hypothesis profiles, and how many examples a property test draws (`examples`).

- `ci`, the default and what CI runs: derandomized, so every run on every machine draws the same
  examples. A red CI is then a change of the code, never the luck of a draw, and a green one
  stays green until the code changes.
- `deep`: every property test at DEEP_FACTOR times its examples, drawn at random. Run it before
  stopping, on several seeds (docs/testing.md):
  `python -m pytest -q -p no:cacheprovider --hypothesis-profile=deep --hypothesis-seed=N`.
  A failure prints the seed and a `@reproduce_failure` blob to replay it.
- `dev`: a quick local pass. `mutation`: ci's draws, stopping at the first failure
  (tests/mutation_check.py).

A test that states its own number of examples states it through `examples(n)`, so the profile
scales it too: a literal `max_examples=` would pin it at n under every profile.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

BASE_EXAMPLES = 200  # the ci profile's examples per test; a test's own n is counted against it
DEEP_FACTOR = 10

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=BASE_EXAMPLES, derandomize=True, database=None,
                          **_common)
settings.register_profile("deep", max_examples=BASE_EXAMPLES * DEEP_FACTOR, **_common)
settings.register_profile("dev", max_examples=30, **_common)
settings.register_profile("mutation", max_examples=BASE_EXAMPLES, derandomize=True,
                          database=None, report_multiple_bugs=False, **_common)

# The run's --hypothesis-seed, if one was given (tests/conftest.py sets it): `mode_seed` mixes it
# into each mode's seed, so the parametrized modes draw different examples under it too.
run_seed: int | None = None
# The run's --hypothesis-profile, if one was given: a test that runs a test file in a child pytest
# (tests/triton_interpreter.py) passes both on, so a deep run shakes the child's tests too.
run_profile: str | None = None


def time_factor() -> int:
    """How many times longer than under `ci` this run's examples may take (a child's time limit)."""
    return DEEP_FACTOR if run_profile == "deep" else 1


def child_arguments() -> list[str]:
    """The pytest options that give a child run this run's profile and seed."""
    return ([f"--hypothesis-profile={run_profile}"] if run_profile else []) + (
        [f"--hypothesis-seed={run_seed}"] if run_seed is not None else [])


def examples(n: int) -> int:
    """A test's `n` examples under the ci profile, scaled by the profile in force."""
    return max(1, round(n * settings.default.max_examples / BASE_EXAMPLES))
