"""User-facing errors.

Every mistake a user can make (bad trace, bad config, bad model, infeasible memory) raises a
`ZipageError` subclass whose message names the field and the fix. The CLI prints the message
without a traceback and exits with status 2; anything else is a bug in Zipage.

A request that can never be served under the configuration (a prompt longer than
--max-model-len, or needing more blocks than exist) is not an error of the run: it fails alone
with its reason (`Sequence.error`, requests.csv) while the others run, and the CLI exits 3.
"""


class ZipageError(Exception):
    """Base class of every error a user can cause."""


class ConfigError(ZipageError):
    """A knob has an invalid value or the knobs contradict each other."""


class FieldError(ConfigError):
    """One named field of a request (or a knob) has a value this deployment cannot take: `field`
    names it, so a server can report it as the error's `param` without reading the message."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


class MemoryPlanError(ZipageError):
    """The memory available cannot hold the requested configuration."""


class TraceError(ZipageError):
    """A trace file is malformed: the message names the request and the field."""


class UnknownModelError(ZipageError):
    """A model name, path or preset could not be resolved."""
