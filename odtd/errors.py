"""The errors odtd raises.

The library raises; only the ``odtd.cli`` package and ``odtd.daemon.service`` print, translating an
``OdtdError`` into one ``Error: ...`` line and a non-zero exit status.
"""


class OdtdError(Exception):
    """Base of every error odtd reports to a person.

    The message says what failed, the offending value, and the fix.
    """


class ConfigError(OdtdError):
    """The daemon configuration (``odtd.yaml``) or a command-line value is invalid."""


class PolicyError(OdtdError):
    """A policy file is invalid or a session is not admissible under it."""


class StoreError(OdtdError):
    """The state directory or its SQLite database cannot be used."""


class IngestError(OdtdError):
    """An ingest source cannot be read at all (single bad files are quarantined instead)."""


class ModelError(OdtdError):
    """A model name, weights file or model version is unknown or damaged."""


class TelemetryUnavailable(OdtdError):
    """A telemetry backend cannot run on this machine; the message says why and the fix."""


class TrainerFailed(OdtdError):
    """The trainer worker crashed, was killed, timed out or reported an error.

    Attributes:
        oom: the worker ran out of memory (TensorFlow's ResourceExhausted, MemoryError, or the
            kernel's OOM killer), so a smaller batch may succeed.
    """

    def __init__(self, message: str, oom: bool = False) -> None:
        super().__init__(message)
        self.oom = oom


class SessionBusy(OdtdError):
    """Another session already holds the session lock."""


class DaemonUnavailable(OdtdError):
    """No daemon answers on the control socket."""
