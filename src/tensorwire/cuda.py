"""The few CUDA driver calls tensorwire makes itself, through cuda-python, imported lazily.

PyTorch owns the CUDA context (the device's primary context); every call here runs inside ``use_device(index)``
so that context is current on the calling thread, also on a thread that has made no CUDA call yet (a serving
engine's loader thread): the driver API has no context there until the runtime's first call binds one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from typing import Any

from .errors import BackendUnavailableError, InvalidArgumentError, TransferError

__all__ = ["driver", "check", "availability", "use_device", "HostWords", "HostWordSlabs",
           "refuse_legacy_default_stream", "COPY_PIECE_BYTES", "copy_pieces", "enqueue_copies", "enqueue_on",
           "PostStream", "StreamCopies", "StandInStream", "stream_wait_value", "stream_write_value", "record_event"]

# Copies are issued in pieces of at most this many bytes. Measured on an H200: a CUDA graph replays a single
# 1 GiB memcpy node at 0.64x the speed of the same copy issued on a stream, while 256 MiB nodes replay at
# full speed; on a stream the extra calls cost nothing measurable.
COPY_PIECE_BYTES = 256 << 20


@functools.cache
def driver() -> Any:
    """``cuda.bindings.driver`` (cuda-python >= 12.6), or ``BackendUnavailableError`` saying why not."""
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name not in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.cuda"):
                raise BackendUnavailableError(
                    f"cuda-python: importing {name} failed because {e.name!r} is missing; reinstall cuda-python"
                ) from e
    raise BackendUnavailableError("cuda-python is not installed; pip install cuda-python (or tensorwire[cuda])")


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising ``TransferError`` with the error name."""
    cu = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(err)
        raise TransferError(f"{what} failed with {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_THREAD = threading.local()  # ``has_context``: this thread has had a CUDA context current (it keeps one)
_NO_SWITCH = contextlib.nullcontext()


def use_device(device_index: int) -> contextlib.AbstractContextManager:
    """A context manager under which ``device_index``'s primary context is current on the calling thread, for
    driver calls. The usual case (the device current, a context bound) costs two lookups and no CUDA call.

    A thread that has made no CUDA call yet has no context for the driver API (its calls fail with
    ``CUDA_ERROR_INVALID_CONTEXT``), while ``torch.cuda.device(i)`` skips the switch that would bind one when ``i``
    is already the runtime's current device: the first call on such a thread binds ``device_index``'s primary
    context (the one PyTorch uses) itself, not the runtime's default device's, which would create a context on a
    GPU this process may not use."""
    import torch

    _bind_context(device_index)
    if torch._C._cuda_getDevice() == device_index:
        return _NO_SWITCH
    return torch.cuda.device(device_index)


def _bind_context(device_index: int) -> None:
    """Bind ``device_index``'s primary context on this thread if it has had no context yet (``use_device``); the
    usual case is one thread-local lookup."""
    if getattr(_THREAD, "has_context", False):
        return
    cu = driver()
    if not int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")):
        check(cu.cuCtxSetCurrent(_primary_context(device_index)), "cuCtxSetCurrent")
    _THREAD.has_context = True


@functools.cache
def _primary_context(device_index: int) -> Any:
    """The device's primary context, retained once for the life of the process (PyTorch holds it too)."""
    cu = driver()
    device = check(cu.cuDeviceGet(device_index), "cuDeviceGet")
    return check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")


def availability() -> tuple[bool, str]:
    """Whether CUDA and cuda-python are both usable here, and why not."""
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to PyTorch (torch.cuda.is_available() is False)"
    try:
        driver()
    except BackendUnavailableError as e:
        return False, str(e)
    return True, f"{torch.cuda.device_count()} CUDA device(s), cuda-python driver bindings loaded"


def _word_tensor(count: int) -> Any:
    """``count`` zeroed int32 words of pinned host memory; of ordinary memory where there is no CUDA (only a
    ``StandInStream`` can wait on them there)."""
    import torch

    return torch.zeros(count, dtype=torch.int32, pin_memory=torch.cuda.is_available())


class HostWords:
    """A few 32-bit words of pinned host memory that both the CPU and the GPU address.

    With unified addressing (every 64-bit CUDA platform), pinned host memory is mapped into every
    context at the same address, so ``addr(i)`` serves as the device pointer of stream memory operations.
    The CPU reads and stores through a numpy view (plain, untorn 32-bit accesses).
    """

    def __init__(self, count: int, tensor: Any = None) -> None:
        self._tensor = _word_tensor(count) if tensor is None else tensor
        self.values = self._tensor.numpy().view("uint32")  # counters wrap at 2**32, as the GPU compares
        self._base = self._tensor.data_ptr()

    def addr(self, index: int) -> int:
        return self._base + 4 * index


class HostWordSlabs:
    """``HostWords`` of ``count`` words carved from shared pinned slabs, for many small users (one per
    transfer). The first stream memory operation on a pinned allocation costs the driver ~70 µs (measured on
    an H200), so a transfer's first ``wait(stream=)`` paid it when each transfer pinned its own words; with
    slabs it is paid once per slab. Words are never handed out twice: a stream may still wait on a closed
    transfer's words, so reusing them could change what it waits for. A slab is freed with the last
    ``HostWords`` cut from it. Allocates outside any CUDA-graph capture (the caller's duty)."""

    def __init__(self, count: int, per_slab: int = 256) -> None:
        self._count, self._per_slab = count, per_slab
        self._slab = None
        self._next = per_slab
        self._lock = threading.Lock()  # transfers may be prepared from several threads

    def take(self) -> HostWords:
        with self._lock:
            if self._next == self._per_slab:
                self._slab = _word_tensor(self._per_slab * self._count)
                self._next = 0
            start = self._next * self._count
            self._next += 1
            return HostWords(self._count, self._slab[start:start + self._count])


class StandInStream:
    """A stream that is not CUDA's (``backends.fake.HostStream``): the stream operations below hand their
    work to it, so the code that serves streams runs the same on a machine without a GPU. Its
    ``cuda_stream`` is an integer other than the legacy default stream's handles."""

    cuda_stream: int

    def wait_value(self, addr: int, value: int) -> None:
        raise NotImplementedError

    def write_value(self, addr: int, value: int) -> None:
        raise NotImplementedError

    def record_event(self) -> Any:
        raise NotImplementedError


def record_event(stream: Any) -> Any:
    """An event recorded on ``stream`` now (``query()`` tells whether the stream got there)."""
    if isinstance(stream, StandInStream):
        return stream.record_event()
    import torch

    event = torch.cuda.Event()
    event.record(stream)
    return event


def stream_wait_value(stream: Any, addr: int, value: int) -> None:
    """Make ``stream`` wait until the 32-bit word at ``addr`` (pinned host memory, or device memory of this
    or an IPC-mapped peer allocation) reaches ``value``: ``cuStreamWaitValue32`` GEQ, which compares
    cyclically, ``(int32)(word - value) >= 0``. Returns at once; graph-capturable (stream memory operations
    are graph nodes).

    The wait is done by the GPU's front end, not by a kernel: it occupies no SM, and a context blocked in
    it yields its time slice to other processes sharing the GPU (a spinning kernel would hold the GPU for a
    whole time slice, milliseconds). CUDA does not see the dependency it expresses, so the work that
    releases it must not be enqueued behind it in this process (see docs/architecture.md)."""
    if isinstance(stream, StandInStream):
        return stream.wait_value(addr, value)
    _bind_context(stream.device_index)
    cu = driver()
    check(cu.cuStreamWaitValue32(cu.CUstream(stream.cuda_stream), addr, value,
                                 cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")


def copy_pieces(destination: int, source: int, nbytes: int) -> list[tuple[int, int, int]]:
    """``(destination, source, nbytes)`` pointer triples that copy ``nbytes`` in pieces of at most
    ``COPY_PIECE_BYTES``."""
    return [(destination + offset, source + offset, min(COPY_PIECE_BYTES, nbytes - offset))
            for offset in range(0, nbytes, COPY_PIECE_BYTES)]


def enqueue_copies(copies: list[tuple[int, int, int]], stream: Any, device_index: int, what: str) -> None:
    """Enqueue ``cuMemcpyAsync`` of each ``(destination, source, nbytes)`` on ``stream`` (a ``torch.cuda.Stream`` of
    device ``device_index``), for one-off copies; a request posted again and again keeps a ``StreamCopies``.
    Returns at once; graph-capturable."""
    enqueue_on(copies, driver().CUstream(stream.cuda_stream), device_index, what)


def enqueue_on(copies: list[tuple[int, int, int]], handle: Any, device_index: int, what: str) -> None:
    """``enqueue_copies`` on a driver stream handle (``PostStream``)."""
    memcpy = driver().cuMemcpyAsync
    with use_device(device_index):
        for destination, source, nbytes in copies:
            result = memcpy(destination, source, nbytes, handle)
            if result[0]:  # CUDA_SUCCESS is 0
                check(result, f"{what}: cuMemcpyAsync")


class PostStream:
    """The stream a post enqueues on, as PyTorch's object and the driver's handle: the one given, else the device's
    current stream. An eager post's device work is a few enqueues, so what was built for the stream last seen is
    kept: the current stream is read as a raw handle (what Triton's launcher reads) and compared, instead of
    building a ``torch.cuda.Stream`` and a driver handle each time. A stream given is returned as given."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._current_raw: int | None = None  # the device's current stream when last read, and its torch object
        self._current: Any = None
        self._raw: int | None = None  # the stream last posted on, and its driver handle
        self._handle: Any = None

    def of(self, stream: Any = None) -> tuple[Any, Any]:
        """``(torch stream, driver handle)`` for ``stream``, or for the device's current stream when None."""
        if stream is None:
            raw = _current_raw_stream(self.device_index)
            if raw != self._current_raw:
                import torch

                self._current, self._current_raw = torch.cuda.current_stream(self.device_index), raw
            stream = self._current
        raw = stream.cuda_stream
        if raw != self._raw:
            self._handle, self._raw = driver().CUstream(raw), raw
        return stream, self._handle


class StreamCopies:
    """Fixed ``(destination, source, nbytes)`` copies, enqueued as ``cuMemcpyAsync`` on a stream at each post (the
    requests of ``cuda_ipc`` and ``local``). Unified addressing lets one call serve device, peer (IPC-mapped) and
    pinned host pointers, on the copy engines.

    Measured against a Triton copy kernel on an H200 (one process, per copy, CUDA events): equal as graph nodes
    from 4 KiB to 64 MiB (4 KiB: 7.7 µs either way, the replay's own floor), and the eager launch costs ~5 µs of
    CPU here against ~20 µs for the kernel; so the copy engines serve every size."""

    def __init__(self, copies: list[tuple[int, int, int]], device_index: int, what: str) -> None:
        self.copies = copies
        self.device_index = device_index
        self._what = what
        self._streams = PostStream(device_index)

    def enqueue(self, stream: Any = None) -> Any:
        """Enqueue the copies on ``stream`` (default: the device's current stream); returns that stream. Never
        waits; graph-capturable (each copy becomes a memcpy node)."""
        stream, handle = self._streams.of(stream)
        enqueue_on(self.copies, handle, self.device_index, self._what)
        return stream


def _current_raw_stream(device_index: int) -> int:
    """The raw handle of ``device_index``'s current stream (``torch.cuda.current_stream(i).cuda_stream``
    without the Python object)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


_LEGACY_DEFAULT_STREAM_HANDLES = (0, 1)  # the null stream, and CU_STREAM_LEGACY


def refuse_legacy_default_stream(stream: Any, what: str) -> None:
    """Raise ``InvalidArgumentError`` if ``stream`` is CUDA's legacy default stream (handle 0, torch's default
    current stream, or ``CU_STREAM_LEGACY``), for a stream wait (or post) the CPU releases.

    Every blocking stream and every synchronous CUDA call of the process waits for work already queued on the
    legacy default stream. A value wait queued there therefore also holds back the CUDA copies this process
    makes for the very transfer that would release it (UCX stages GPU memory through host buffers when it
    cannot reach it directly): a deadlock, seen on an H200 with a NIXL READ of GPU memory."""
    if stream.cuda_stream in _LEGACY_DEFAULT_STREAM_HANDLES:
        raise InvalidArgumentError(
            f"{what}: the stream is CUDA's legacy default stream (torch's default), and this wait is released by "
            "the CPU: CUDA work this process makes for the transfer itself would queue behind it and never run. "
            "Use a side stream: s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream()) so it follows "
            "the producers; pass stream=s; run the consumers under `with torch.cuda.stream(s):` (or make the "
            "default stream wait for s afterwards)")


def stream_write_value(stream: Any, addr: int, value: int) -> None:
    """Store ``value`` into the 32-bit word at ``addr`` when ``stream`` reaches this point. Graph-capturable."""
    if isinstance(stream, StandInStream):
        return stream.write_value(addr, value)
    _bind_context(stream.device_index)
    cu = driver()
    check(cu.cuStreamWriteValue32(cu.CUstream(stream.cuda_stream), addr, value,
                                  cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")
