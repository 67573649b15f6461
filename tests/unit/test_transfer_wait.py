"""``Transfer.wait()`` on a stream-ordered transport (``cuda_ipc``, ``local`` on a GPU) polls the copies' event
alone; what other threads did meanwhile must still reach the caller, and the wait must not keep the transfer alive.

The backend is a stand-in whose copies "run" for a few polls of their event: the layer under test is the
transfer's, not the transport's (the real transports run in the conformance suite, on a GPU for these two).
"""

from __future__ import annotations

import gc
import weakref

import pytest

from tensorwire.backends.base import Capabilities, Op, Status
from tensorwire.config import Config
from tensorwire.descriptors import MemoryKind
from tensorwire.errors import ClosedError, RevokedError, TransferError
from tensorwire.transfer import Transfer


class _Event:
    """Fires after ``polls`` queries; ``on_poll`` runs at each (what another thread does meanwhile)."""

    def __init__(self, polls: int, on_poll=lambda: None) -> None:
        self.left, self.on_poll = polls, on_poll

    def query(self) -> bool:
        self.on_poll()
        self.left -= 1
        return self.left < 0


class _StreamOrderedBackend:
    name = "stand-in"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.CUDA}), remote=True, stream_ordered=True)

    def __init__(self) -> None:
        self.event = _Event(0)

    def post(self, request, notify, stream=None) -> Status:
        return Status.IN_PROGRESS

    def status(self, request) -> Status:
        return Status.DONE if self.event.left < 0 else Status.IN_PROGRESS

    def completion_event(self, request):
        return self.event

    def release(self, request) -> None:
        pass


class _Runtime:
    rank, closed = 0, False
    timeout_s = 5.0
    config = Config(timeout_s=5.0, progress_wakeup_ms=10.0, spin_us=50.0, max_sleep_us=1000.0)

    def __init__(self) -> None:
        self.transfers: set = set()
        self.described: list[str] = []

    def timeout(self, timeout):
        return self.timeout_s if timeout is None else timeout

    def check_open(self, fn: str) -> None:
        if self.closed:
            raise ClosedError(f"{fn}: closed")

    def alive(self, rank, what):
        def alive() -> None:
            self.described.append(what())

        return alive


def _transfer(runtime: _Runtime, backend: _StreamOrderedBackend) -> Transfer:
    return Transfer(runtime, Op.READ, 1, 4096, backend, request=object(), notify=None)


def test_a_wait_returns_once_the_copies_event_fired():
    backend = _StreamOrderedBackend()
    transfer = _transfer(_Runtime(), backend)
    backend.event = _Event(polls=3)
    transfer.post()
    transfer.wait(timeout=5)
    assert backend.event.left < 0 and transfer.status() is Status.DONE


def test_a_revocation_during_the_wait_is_raised_once_the_copies_ran():
    """The owner deregistered the memory while the copy ran (the revocation thread failed the transfer): the wait
    must raise the revocation, not report success, and so must every later call."""
    backend = _StreamOrderedBackend()
    transfer = _transfer(_Runtime(), backend)
    revoked = RevokedError("post: rank 1 deregistered the memory this READ reaches")
    backend.event = _Event(polls=3, on_poll=lambda: transfer.revoke(revoked) if backend.event.left == 1 else None)
    transfer.post()
    with pytest.raises(RevokedError, match="deregistered"):
        transfer.wait(timeout=5)
    assert backend.event.left < 0  # it waited for the copy first: nothing is in flight when it raises
    with pytest.raises(RevokedError):
        transfer.wait(timeout=5)


def test_a_failure_kept_by_another_thread_during_the_wait_is_raised():
    backend = _StreamOrderedBackend()
    transfer = _transfer(_Runtime(), backend)
    kept = TransferError("the progress thread saw this transfer fail")
    backend.event = _Event(polls=2, on_poll=lambda: transfer.shared.fail(kept) if backend.event.left == 1 else None)
    transfer.post()
    with pytest.raises(TransferError, match="progress thread"):
        transfer.wait(timeout=5)


def test_a_communicator_closed_during_the_wait_is_raised():
    backend = _StreamOrderedBackend()
    runtime = _Runtime()
    transfer = _transfer(runtime, backend)

    def close_runtime() -> None:
        runtime.closed = True

    backend.event = _Event(polls=2, on_poll=close_runtime)
    transfer.post()
    with pytest.raises(ClosedError):
        transfer.wait(timeout=5)


def test_a_wait_keeps_no_reference_to_its_transfer():
    """A transfer dropped without close() after a wait that slept is freed when its last reference goes, not
    at the next garbage collection (its request holds device buffers)."""
    backend = _StreamOrderedBackend()
    runtime = _Runtime()
    runtime.config = Config(timeout_s=5.0, progress_wakeup_ms=10.0, spin_us=0.0, max_sleep_us=100.0)
    transfer = _transfer(runtime, backend)
    backend.event = _Event(polls=50)
    transfer.post()
    transfer.wait(timeout=5)
    assert runtime.described and runtime.described[-1].startswith("wait: READ of 4096 bytes with rank 1")
    gone = weakref.ref(transfer)
    gc.disable()
    try:
        with pytest.warns(ResourceWarning):
            del transfer
        assert gone() is None
    finally:
        gc.enable()
