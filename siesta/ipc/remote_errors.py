"""Exceptions that cross the process boundary keep their type.

The core names the most specific type of this table that the exception is an instance of;
the server raises that type again, so it can answer ConnectorRetentionError or a ValueError
with a 400 and EngineStateError with a 409. Anything else arrives as ``EngineCoreError``.
"""

from __future__ import annotations

from siesta.brief import bounded
from siesta.config import ConfigError
from siesta.control import ConnectorRetentionError, EngineOverloaded, EngineStateError, RequestRejected
from siesta.ipc.protocol import RemoteError
from siesta.weight_transfer.updater import UpdateFailed


class EngineCoreError(RuntimeError):
    """An unexpected error inside the core while it served a call; the core itself lives on."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing can be served until the server restarts."""


class UnsupportedCallError(ValueError):
    """The core does not know this operation or its arguments (it is older than the server)."""


# Most specific first: the first class an exception is an instance of names it on the wire.
KNOWN_ERRORS: tuple[type[BaseException], ...] = (
    ConnectorRetentionError,
    RequestRejected,
    UpdateFailed,
    EngineOverloaded,
    ConfigError,
    UnsupportedCallError,
    EngineStateError,
    NotImplementedError,
    ValueError,
    EngineCoreError,
)
_BY_NAME = {cls.__name__: cls for cls in KNOWN_ERRORS}


def to_remote(exc: BaseException) -> RemoteError:
    # Bounded: a message quoting a caller's input must not grow with it (siesta.brief).
    for cls in KNOWN_ERRORS:
        if isinstance(exc, cls):
            return RemoteError(type=cls.__name__, message=bounded(str(exc)))
    return RemoteError(type=EngineCoreError.__name__, message=bounded(f"{type(exc).__name__}: {exc}"))


def from_remote(error: RemoteError) -> BaseException:
    """The exception to raise on the server side; unknown type names become EngineCoreError."""
    cls = _BY_NAME.get(error.type, EngineCoreError)
    return cls(error.message)
