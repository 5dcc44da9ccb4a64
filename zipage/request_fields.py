"""The scheduling fields a request may bring: declared once, with their bounds and meaning.

A trace request (`zipage/trace.py`), `SamplingParams` (`zipage/core/sampling.py`), the server's
request body (`zipage/serve/protocol.py`) and the core's `Sequence` all carry these fields; each
reads the declaration here, so a bound, a message or a new field is written in one place
(docs/architecture.md, 'Adding a request field'). The deployment's defaults stay knobs of
`ZipageConfig`; a field left out (None, or 0 for `priority`) means "the deployment's".

`reason(name, value)` is the one check: None when the value is valid, else the message, which
starts with the field's name (every caller prefixes its own context: a request id, a 400).
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass

from zipage.config import COMPRESS_SCOPES
from zipage.scoring import SCORING_POLICIES

MAX_FIELD_INT = 2**31 - 1
# Priority classes are small integers in practice (vLLM's `priority`); the bound keeps the waiting
# queue's key (priority x aging seconds + arrival) exact in a float to well under a microsecond.
MAX_PRIORITY = 1_000_000

_SHOWN = reprlib.Repr()  # a message never carries unbounded input back
_SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother, _SHOWN.maxlist = 40, 40, 40, 4


@dataclass(frozen=True)
class RequestField:
    """One field: its name, the default when left out, what it means, which deployment knob it
    overrides (its flag), and its bounds: an integer range, or a set of choices."""

    name: str
    default: object
    meaning: str
    default_hint: str
    low: int | None = None
    high: int | None = None
    choices: tuple[str, ...] | None = None

    def reason(self, value) -> str | None:
        """None when `value` is valid, else "<name> must be ..., got <value>"."""
        rule = self.rule_broken(value)
        return None if rule is None else f"{self.name} {rule}"

    def rule_broken(self, value) -> str | None:
        """None when `value` is valid, else the message without the field's name."""
        if value is None and self.default is None:
            return None
        if self.choices is not None:
            if value in self.choices:
                return None
            rule = f"one of {', '.join(map(repr, self.choices))}"
        else:
            if isinstance(value, int) and not isinstance(value, bool) and \
                    self.low <= value <= self.high:
                return None
            rule = f"an integer between {self.low} and {self.high}"
        return (f"must be {rule} ({self.meaning}; {self.default_hint}), "
                f"got {_SHOWN.repr(value)}")


FIELDS: tuple[RequestField, ...] = (
    RequestField("kv_budget", None, "the KV entries the request keeps, a multiple of the block "
                 "size", "leave it out for --budget", 1, MAX_FIELD_INT),
    RequestField("compress_scope", None, "what the request's compressions may evict",
                 "leave it out for --compress-scope", choices=COMPRESS_SCOPES),
    RequestField("priority", 0, "its class in the waiting queue, lower first, under "
                 "--scheduling-policy priority", "leave it out for 0",
                 -MAX_PRIORITY, MAX_PRIORITY),
    RequestField("scoring", None, "the eviction scoring policy of its compressions",
                 "leave it out for --scoring", choices=tuple(SCORING_POLICIES)),
)
BY_NAME = {field.name: field for field in FIELDS}
NAMES = tuple(BY_NAME)


def reason(name: str, value) -> str | None:
    """Why `value` is not a valid `name`, or None."""
    return BY_NAME[name].reason(value)


def copy_fields(target, source) -> None:
    """Give `target` (a `Sequence`) every request field of `source` (a trace request or
    `SamplingParams`): the one place a new field reaches the core from a driver."""
    for name in NAMES:
        setattr(target, name, getattr(source, name))
