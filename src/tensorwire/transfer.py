"""``Transfer``: a prepared one-sided READ or WRITE between local tensors and one peer's memory.

Lifecycle: ``comm.prepare(...)`` (expensive, once) -> ``post()`` -> ``status()`` / ``wait()`` ->
``post()`` again ... -> ``close()``. A transfer whose items are all zero bytes completes at once.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from .backends.base import Backend, Op, Status
from .errors import ClosedError, InvalidArgumentError, TransferError
from .progress import wait_until

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Transfer"]


class Transfer:
    """A reusable transfer handle. Not thread-safe: drive one handle from one thread.

    Attributes: ``op`` (READ/WRITE), ``peer`` (remote rank), ``nbytes`` (total), ``transport`` (the backend
    that carries it, e.g. ``"nixl"``).
    """

    def __init__(self, comm: "Communicator", op: Op, peer: int, nbytes: int, backend: Backend | None,
                 request: Any, notify: bytes | None) -> None:
        self._comm = comm
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.transport = backend.name if backend is not None else "none"
        self._backend = backend
        self._request = request  # None when there is nothing to move
        self._notify = notify
        self._state: Status | None = None  # None: never posted
        self.closed = False

    def post(self) -> None:
        """Start the transfer. Non-blocking (a small or same-host transfer may finish inside the call).
        Raises ``InvalidArgumentError`` if it is still in flight; ``TransferError``/``PeerLostError`` if the
        backend refuses it."""
        self._check_open("post")
        if self._state is Status.IN_PROGRESS and self.status() is Status.IN_PROGRESS:
            raise InvalidArgumentError(
                f"post: the {self.op.value} to rank {self.peer} is still in flight; call wait() before posting it again"
            )
        if self._request is None:
            self._state = Status.DONE
            return
        self._state = Status.IN_PROGRESS
        self._state = self._backend.post(self._request, self._notify)
        if self._state is Status.ERROR:
            raise TransferError(f"post: the backend {self.transport} rejected the {self.op.value} to rank {self.peer}")

    def status(self) -> Status:
        """DONE, IN_PROGRESS or ERROR; polls the backend (never blocks)."""
        self._check_open("status")
        if self._state is None:
            raise InvalidArgumentError("status: the transfer was never posted; call post() first")
        if self._state is Status.IN_PROGRESS:
            self._state = self._backend.status(self._request)
        return self._state

    def wait(self, timeout: float | None = None) -> None:
        """Block the calling thread (sleeping, not spinning) until the transfer is done.

        Raises ``WaitTimeoutError`` after ``timeout`` seconds (default: the communicator's),
        ``TransferError`` or ``PeerLostError`` if it failed.
        """
        self._check_open("wait")
        if self._state is None:
            raise InvalidArgumentError("wait: the transfer was never posted; call post() first")
        wait_until(
            lambda: self.status() is not Status.IN_PROGRESS,
            self._comm._timeout(timeout),
            lambda: f"wait: {self.op.value} of {self.nbytes} bytes with rank {self.peer} over {self.transport}",
            self._comm.config,
        )
        if self._state is Status.ERROR:
            raise TransferError(
                f"wait: the {self.op.value} of {self.nbytes} bytes with rank {self.peer} over {self.transport} failed; "
                "the peer may have exited or deregistered the memory"
            )

    def close(self) -> None:
        """Release the backend request (a transfer in flight is cancelled). Idempotent."""
        if self.closed:
            return
        self.closed = True
        request, self._request = self._request, None
        if request is not None:
            self._backend.release(request)
        self._comm._forget_transfer(self)

    def _check_open(self, fn: str) -> None:
        if self.closed:
            raise ClosedError(f"{fn}: the transfer is closed; prepare a new one with comm.prepare(...)")
        self._comm._check_open(fn)

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            warnings.warn(
                f"tensorwire: a {self.op.value} Transfer to rank {self.peer} was garbage-collected without close(); "
                "call close() or use 'with comm.prepare(...)'",
                ResourceWarning, stacklevel=2,
            )
            try:
                self.close()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else (self._state.name if self._state else "prepared")
        return f"Transfer({self.op.value}, peer={self.peer}, nbytes={self.nbytes}, transport={self.transport!r}, {state})"
