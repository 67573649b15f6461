"""A loopback transport and a host stand-in for a CUDA stream, so the stream paths run on any machine.

``nixl`` and ``shm`` are driven by the CPU, and a GPU stream meets them in pinned host words: the doorbell a
``post(stream=)`` rings, the done flag and sequence number a ``wait(stream=)`` waits for, the per-sender
counters of ``wait_notification(stream=)``, and the deadlines that release a stream nobody answers. That
protocol is the same whichever transport is underneath, so two stand-ins let it run without a GPU:

* ``FakeBackend`` (transport ``"fake"``): copies between host ranges of this very process, like ``local``, but
  CPU-driven and late on purpose: ``post`` only queues the copy, the first ``status`` poll after it makes it.
  A transfer is therefore in flight after every post, as a NIXL one usually is. ``hold()`` keeps every copy
  in flight until it is left (a slow or stuck peer); ``fail()`` makes the copies fail (a backend error).
  Never chosen by default (``local`` comes first): only ``prepare(..., transport="fake")`` picks it.
* ``HostStream``: a ``cuda.StandInStream`` whose operations (value waits and writes on host words, events,
  host functions standing in for kernels) run in order on a thread of its own, as a GPU front end runs a
  stream's; ``capture()`` records them into a ``HostGraph`` that ``replay()`` enqueues again, as a CUDA graph.

Neither is faster or slower than the real thing in any way that matters: they exist so CI drives the code
that serves streams through a supported path, and the GPU machine runs the same tests on real streams.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .. import cuda
from ..descriptors import MemoryKind
from ..errors import WaitTimeoutError
from .base import BackendContext, BackendInfo, Capabilities, Op, SameProcessMemory, Segment, Status
from .block_copy import BlockBindings, BlockLayout, HostBlockRequest, copy_request

__all__ = ["FakeBackend", "HostStream", "HostGraph", "HostEvent", "hold", "fail", "info"]

_held = threading.Event()  # set while hold() is entered: copies stay in flight
_failing = threading.Event()  # set while fail() is entered: copies end in ERROR


def info() -> BackendInfo:
    return BackendInfo("fake", True, "host loopback completed by a later poll, for tests of the stream paths; "
                       "chosen only by prepare(transport='fake')")


@contextlib.contextmanager
def _while_set(flag: threading.Event) -> Iterator[None]:
    flag.set()
    try:
        yield
    finally:
        flag.clear()


def hold() -> contextlib.AbstractContextManager[None]:
    """Keep every fake copy of this process in flight while inside (a peer that does not answer)."""
    return _while_set(_held)


def fail() -> contextlib.AbstractContextManager[None]:
    """Make every fake copy of this process that completes while inside end in ``Status.ERROR``."""
    return _while_set(_failing)


@dataclass
class _Request:
    copies: list[tuple[int, int, int]]  # (destination, source, nbytes), or a block request's post below
    blocks: HostBlockRequest | None = None
    in_flight: bool = False
    failed: bool = False

    takes_device_ids = False  # host memory only

    @property
    def bindings(self) -> BlockBindings:  # a block request (base.BlockRequest): the host copy's ids
        return self.blocks.bindings


class FakeBackend(SameProcessMemory):
    """The ``Backend`` protocol over host ranges of this process, completed at the first poll after a post."""

    name = "fake"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.CPU}), remote=False, stream_ordered=False,
                                same_process=True)

    @classmethod
    def create(cls, context: BackendContext) -> FakeBackend:
        return cls()

    def prepare(self, op: Op, local: list[Segment], remote: list[Segment], peer: int, notify: bytes | None) -> _Request:
        pairs = zip(remote, local) if op is Op.READ else zip(local, remote)  # (source, destination)
        return _Request([(d.addr, s.addr, d.nbytes) for s, d in pairs])

    def prepare_blocks(self, op: Op, local: BlockLayout, remote: BlockLayout, peer: int) -> _Request:
        return _Request([], copy_request(op is Op.READ, local, remote, [r.addr for r in remote.regions]))

    def bind_blocks(self, request: _Request, local_ids, remote_ids, notify: bytes | None) -> None:
        request.blocks.bind(local_ids, remote_ids, notify)

    def post(self, request: _Request, notify: bytes | None, stream: object = None) -> Status:
        request.in_flight, request.failed = True, False
        return Status.IN_PROGRESS

    def status(self, request: _Request) -> Status:
        if request.in_flight and not _held.is_set():
            request.in_flight = False
            request.failed = _failing.is_set()
            if not request.failed:
                _copy(request)
        if request.in_flight:
            return Status.IN_PROGRESS
        return Status.ERROR if request.failed else Status.DONE

    def release(self, request: _Request) -> None:
        request.copies, request.in_flight = [], False
        if request.blocks is not None:
            request.blocks.release()

    def close(self) -> None:
        pass


def _copy(request: _Request) -> None:
    if request.blocks is not None:
        request.blocks.post()
    for destination, source, nbytes in request.copies:
        ctypes.memmove(destination, source, nbytes)


# --- a stream on the host ------------------------------------------------------------------------

class HostEvent:
    """An event a ``HostStream`` sets when it reaches it; ``query()`` as ``torch.cuda.Event.query``."""

    def __init__(self) -> None:
        self._reached = threading.Event()

    def query(self) -> bool:
        return self._reached.is_set()

    def synchronize(self, timeout: float = 10.0) -> None:
        if not self._reached.wait(timeout):
            raise WaitTimeoutError(f"HostEvent.synchronize: not reached within {timeout}s")


@dataclass
class HostGraph:
    """Operations a ``HostStream`` recorded under ``capture()``; ``replay()`` enqueues them again in order."""

    stream: HostStream
    operations: list[tuple] = field(default_factory=list)

    def replay(self) -> None:
        for operation in self.operations:
            self.stream._enqueue(operation, replaying=True)


_handles = itertools.count(0x7E57_0000)  # distinct from CUDA's legacy default stream handles 0 and 1


def _reached(addr: int, value: int) -> bool:
    """``cuStreamWaitValue32`` GEQ's cyclic comparison: ``(int32)(word - value) >= 0``."""
    return (ctypes.c_uint32.from_address(addr).value - value) & 0xFFFFFFFF < 0x80000000


class HostStream(cuda.StandInStream):
    """A stream run by a host thread: each operation starts after the previous one ended.

    ``wait_value``/``write_value`` act on 32-bit host words (tensorwire's ``cuda.HostWords``), ``launch(fn)``
    runs ``fn`` in stream order (a kernel), ``record_event()`` returns a ``HostEvent``. ``synchronize()``
    blocks until every enqueued operation ran. Close it (or use it as a context manager) to stop the thread."""

    _POLL_S = 50e-6  # how often a value wait looks at its word

    def __init__(self) -> None:
        self.cuda_stream = next(_handles)
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._graph: HostGraph | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="tensorwire-host-stream", daemon=True)
        self._thread.start()

    # --- what tensorwire's cuda module hands a stand-in ------------------------------------------
    def wait_value(self, addr: int, value: int) -> None:
        self._enqueue(("wait", addr, value & 0xFFFFFFFF))

    def write_value(self, addr: int, value: int) -> None:
        self._enqueue(("write", addr, value & 0xFFFFFFFF))

    def record_event(self) -> HostEvent:
        event = HostEvent()
        self._enqueue(("event", event))
        return event

    # --- what a test does with it ----------------------------------------------------------------
    def launch(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the stream gets here (a kernel's place in the stream)."""
        self._enqueue(("launch", fn))

    @contextlib.contextmanager
    def capture(self) -> Iterator[HostGraph]:
        """Record the operations enqueued inside instead of running them (CUDA graph capture)."""
        self._graph = graph = HostGraph(self)
        try:
            yield graph
        finally:
            self._graph = None

    def synchronize(self, timeout: float = 10.0) -> None:
        """Block until every operation enqueued so far ran; ``WaitTimeoutError`` (naming the operation the
        stream is stuck at) after ``timeout`` seconds; raises what a launched function raised."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    stuck = self._queue[0] if self._queue else "the running operation"
                    raise WaitTimeoutError(f"HostStream.synchronize: still at {stuck!r} after {timeout}s")
                self._cond.wait(min(left, 0.01))
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def __enter__(self) -> HostStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _enqueue(self, operation: tuple, replaying: bool = False) -> None:
        if self._graph is not None and not replaying:
            self._graph.operations.append(operation)
            return
        with self._cond:
            self._queue.append(operation)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                operation = self._queue[0]
                self._busy = True
            try:
                self._execute(operation)
            except Exception as e:  # noqa: BLE001 - a failed "kernel": synchronize() raises it
                self._error = e
            finally:
                with self._cond:
                    self._queue.popleft()
                    self._busy = False
                    self._cond.notify_all()

    def _execute(self, operation: tuple) -> None:
        kind = operation[0]
        if kind == "wait":
            while not _reached(operation[1], operation[2]) and not self._closed:
                time.sleep(self._POLL_S)
        elif kind == "write":
            ctypes.c_uint32.from_address(operation[1]).value = operation[2]
        elif kind == "event":
            operation[1]._reached.set()
        else:
            operation[1]()

