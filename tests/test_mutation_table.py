"""The mutation table of tests/mutation_check.py still applies to the code: every snippet is
found exactly once (the full check, which runs the tests against each mutation, takes minutes
and is run by hand: `python tests/mutation_check.py`)."""

from __future__ import annotations

from mutation_check import MUTATIONS, check_snippets


def test_every_mutation_snippet_is_found_exactly_once():
    assert check_snippets() == [], (
        "refresh these snippets in tests/mutation_check.py to the current code")


def test_mutations_are_named_once_and_change_something():
    names = [mutation.name for mutation in MUTATIONS]
    assert len(names) == len(set(names))
    assert all(mutation.old != mutation.new for mutation in MUTATIONS)
