"""The one error hierarchy of tensorwire.

Every error raised at the public API is a ``TensorwireError`` and also subclasses the builtin that a
caller would naturally catch (``ValueError``, ``RuntimeError``, ``TimeoutError``, ``ConnectionError``).
Messages name the function, the observed values and the fix. Warnings tensorwire issues are a
``TensorwireWarning`` (a ``RuntimeWarning``), so ``warnings.filterwarnings("ignore", category=tw.TensorwireWarning)``
silences ours and nothing else.
"""

from __future__ import annotations

__all__ = [
    "TensorwireError",
    "InvalidArgumentError",
    "BackendUnavailableError",
    "TransferError",
    "WaitTimeoutError",
    "PeerLostError",
    "ClosedError",
    "AuthenticationError",
    "RevokedError",
    "TensorwireWarning",
]


class TensorwireError(Exception):
    """Base class of every tensorwire error."""


class InvalidArgumentError(TensorwireError, ValueError):
    """The caller passed something tensorwire cannot use; nothing was changed."""


class ClosedError(InvalidArgumentError):
    """A closed communicator, registration or transfer was used."""


class RevokedError(ClosedError):
    """The peer deregistered the memory a prepared transfer reaches; the transfer is failed (close it, look the
    descriptors up again and prepare a new one). See ``tensorwire.revocation``."""


class BackendUnavailableError(TensorwireError, RuntimeError):
    """A backend (or the memory kind asked of it) does not work on this machine."""


class TransferError(TensorwireError, RuntimeError):
    """A backend reported a failure while preparing, posting or completing a transfer."""


class WaitTimeoutError(TensorwireError, TimeoutError):
    """A bounded wait ran out of time."""


class PeerLostError(TensorwireError, ConnectionError):
    """A peer rank stopped answering: it exited, crashed or its connection broke."""


class AuthenticationError(TensorwireError, PermissionError):
    """A value in the job's store failed verification against the job token (``TENSORWIRE_JOB_TOKEN``):
    written by a process outside the job, by a rank with another token, or corrupted. It was not used. Also: an
    etcd directory refused this member's credentials (``TENSORWIRE_ETCD_*``), or a TLS certificate did not verify."""


class TensorwireWarning(RuntimeWarning):
    """Base class of every warning tensorwire issues: something went wrong that did not stop the call (a peer's
    departure not recorded, a background thread's failure, a stranger's request dropped). A ``RuntimeWarning``,
    so filters on that class keep catching it."""
