"""``cuda.PostStream`` (the stream an eager post enqueues on, kept between posts) and ``cuda.use_device`` (a
thread with no CUDA context gets its device's primary context), with the driver and torch's stream queries stood
in for: the logic that decides what is rebuilt and what is bound, on a machine without a GPU. The real calls run
in the GPU suite (``test_a_thread_that_never_used_cuda_prepares_and_posts``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tensorwire import cuda


class _Driver:
    """The few driver calls ``cuda`` makes here, recording them; a thread's current context is its own."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._current = threading.local()

    def CUstream(self, raw: int):  # noqa: N802 - the driver's name
        self.calls.append(("CUstream", raw))
        return ("handle", raw)

    def cuCtxGetCurrent(self):  # noqa: N802
        self.calls.append(("cuCtxGetCurrent",))
        return 0, getattr(self._current, "ctx", 0)

    def cuDeviceGet(self, index: int):  # noqa: N802
        return 0, index

    def cuDevicePrimaryCtxRetain(self, device: int):  # noqa: N802
        self.calls.append(("retain", device))
        return 0, 100 + device

    def cuCtxSetCurrent(self, ctx: int):  # noqa: N802
        self.calls.append(("set", ctx))
        self._current.ctx = ctx
        return (0,)


@pytest.fixture
def driver(monkeypatch):
    fake = _Driver()
    monkeypatch.setattr(cuda, "driver", lambda: fake)
    monkeypatch.setattr(cuda, "_primary_context", lambda index: fake.cuDevicePrimaryCtxRetain(index)[1])
    return fake


def _stream(raw: int, device: int = 0):
    return SimpleNamespace(cuda_stream=raw, device_index=device)


def test_the_current_stream_is_built_once_while_it_stays_current(driver, monkeypatch):
    current = {"raw": 7}
    built = []

    def current_stream(device):
        built.append(device)
        return _stream(current["raw"], device)

    monkeypatch.setattr(cuda, "_current_raw_stream", lambda device: current["raw"])
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    streams = cuda.PostStream(0)
    first = streams.of()
    assert streams.of() == first and built == [0]  # the same stream: nothing rebuilt
    assert [c for c in driver.calls if c[0] == "CUstream"] == [("CUstream", 7)]
    current["raw"] = 9  # `with torch.cuda.stream(s):` made another stream current
    stream, handle = streams.of()
    assert stream.cuda_stream == 9 and handle == ("handle", 9) and built == [0, 0]


def test_a_stream_given_is_used_as_given(driver, monkeypatch):
    """A stream passed to post(stream=) is the one the event is recorded on, even when its raw handle equals the
    one kept (the legacy default stream is handle 0 on every device)."""
    monkeypatch.setattr(cuda, "_current_raw_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: _stream(0, device))
    streams = cuda.PostStream(0)
    streams.of()
    given = _stream(0, 1)
    stream, handle = streams.of(given)
    assert stream is given and handle == ("handle", 0)
    other = _stream(5)
    assert streams.of(other) == (other, ("handle", 5))


def test_a_thread_without_a_context_gets_the_devices_primary_context_once(driver, monkeypatch):
    """The first driver call on a thread that made no CUDA call binds the device asked for (not the runtime's
    default device 0, which would create a context on a GPU the process may not use); later calls bind nothing."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 2, raising=False)
    seen = {}

    def fresh_thread() -> None:
        with cuda.use_device(2):
            seen["first"] = [c for c in driver.calls if c[0] in ("retain", "set")]
        driver.calls.clear()
        with cuda.use_device(2):
            seen["second"] = list(driver.calls)

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join(10)
    assert seen["first"] == [("retain", 2), ("set", 102)]
    assert seen["second"] == []  # bound once per thread: the usual case makes no driver call
