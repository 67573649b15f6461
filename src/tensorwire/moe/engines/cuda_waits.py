"""The ``wait`` of the ``"cuda"`` engine's steps on a GPU: stream memory operations, watched by a watchdog.

Non-goals: the waits of transfers (``tensorwire.transfer``); the flag layout (``kernels/nvlink.py``).
"""

from __future__ import annotations

import time
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ... import cuda
from ...errors import TensorwireWarning
from ..rows import next_power_of_two

if TYPE_CHECKING:
    from ...communicator import Communicator

__all__ = ["StreamWaits"]


class StreamWaits:
    """The current stream waits until each of ``count`` flag words (32-bit, 8 bytes apart from
    ``first_word`` of the space) reaches ``target`` (stream memory operations: graph-capturable, no SM busy),
    then ``consume_flags`` subtracts ``target`` from each. Returns at once (no host sync).

    Watchdog: an eager (not captured) wait is watched by the progress thread; if the stream has not passed
    it within the communicator's ``timeout_s``, the watchdog stores the targets itself (on a stream of its
    own) so that the GPU goes on, and sets ``timed_out``: from then on the engine refuses every call (the
    flags no longer match the peers'). The deadline counts from when the wait was enqueued. Closing the
    engine (``Communicator.close`` does) opens every eager wait still pending the same way. A replayed graph
    is not watched.
    """

    def __init__(self, comm: Communicator, kernels: ModuleType) -> None:
        self._comm, self._kernels = comm, kernels
        self._release_stream = None
        # Eager waits whose watchdog has not seen them passed: {key: (event, addresses, target)}. Only the
        # progress thread queries the events (a query on the calling thread would count as a host sync).
        self._pending: dict[int, tuple[torch.cuda.Event, list[int], int]] = {}
        self.timed_out = False

    def __call__(self, space: torch.Tensor, first_word: int, target: int, count: int) -> None:
        stream = torch.cuda.current_stream()
        addresses = [space.data_ptr() + 8 * (first_word + i) for i in range(count)]
        for address in addresses:
            cuda.stream_wait_value(stream, address, target)
        self._kernels.consume_flags[(1,)](space_ptr=space.view(torch.int64), first_word=first_word, target=target,
                                          count=count, BLOCK=next_power_of_two(count))
        if not torch.cuda.is_current_stream_capturing():
            self._watch(stream, addresses, target)

    def _watch(self, stream, addresses: list[int], target: int) -> None:
        if self._release_stream is None:
            self._release_stream = torch.cuda.Stream(device=stream.device)  # never the stream that waits
        passed = torch.cuda.Event()
        passed.record(stream)
        waiting = (passed, addresses, target)
        key = id(waiting)
        self._pending[key] = waiting
        timeout_s = self._comm.timeout_s
        deadline = time.monotonic() + timeout_s

        def watchdog() -> bool:
            if passed.query():
                self._pending.pop(key, None)
                return True
            if time.monotonic() < deadline:
                return False
            self._pending.pop(key, None)
            self._force_open([waiting], f"a GPU wait was not released within {timeout_s:.3g}s (a peer is stuck or "
                                        "dead)")
            return True

        self._comm.runtime.engine.watch(watchdog, on_error=self._watchdog_failed)

    def _force_open(self, waits: list, why: str) -> None:
        """Store the awaited values from a stream of our own, so the waiting streams go on; the engine is
        unusable from then on."""
        self.timed_out = True  # before the stores: a host sync that returns sees it
        cu = cuda.driver()
        with torch.cuda.device(self._release_stream.device):  # the context current on this thread
            handle = cu.CUstream(self._release_stream.cuda_stream)
            for _, addresses, target in waits:
                for address in addresses:
                    cuda.check(cu.cuMemsetD32Async(address, target, 1, handle), "cuMemsetD32Async")
        warnings.warn(f"tensorwire: engine='cuda': {why}; forced it open, MoE calls on this communicator raise "
                      "from now on", TensorwireWarning, stacklevel=2)

    def _watchdog_failed(self, error: Exception) -> None:
        self.timed_out = True
        warnings.warn(f"tensorwire: engine='cuda': the watchdog could not open a GPU wait: {error}", TensorwireWarning,
                      stacklevel=2)

    def release(self) -> bool:
        """Open every eager wait the stream has not passed (the engine closes). True if there was one."""
        waits = [w for w in list(self._pending.values()) if not w[0].query()]
        self._pending.clear()
        if waits:
            self._force_open(waits, f"{len(waits)} GPU wait(s) were still pending when the communicator closed")
        return bool(waits)
