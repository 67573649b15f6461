"""``BlockTransfer``: a prepared block READ or WRITE, posted with any block ids; the ids' checks.

See ``tensorwire.blocks`` for pools and their descriptors. Ids are checked vectorised on the host: out of range,
duplicate destinations and mismatched lengths raise ``InvalidArgumentError`` before anything moves. Ids that
already live on the GPU (a request that ``takes_device_ids``) are not read back by the host (that would wait for
the GPU): the kernel skips ids out of range, so no byte lands outside the pool, and duplicate destinations are the
caller's race.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .backends.base import Backend, BlockRequest, Op, Status
from .errors import ClosedError, InvalidArgumentError
from .lifetime import Closeable
from .transfer import Transfer

if TYPE_CHECKING:
    from .blocks import BlockPool, BlockPoolDesc
    from .runtime import Runtime

__all__ = ["BlockTransfer", "as_ids"]


def as_ids(ids, num_blocks: int, what: str, device: torch.device | None, unique: bool) -> np.ndarray | torch.Tensor:
    """``ids`` as a 1-D int64 numpy array checked against ``[0, num_blocks)`` (and for duplicates if
    ``unique``), or, when ``device`` is given and the ids are an integer tensor on it, that tensor unchecked."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise InvalidArgumentError(f"{what}: a {ids.dtype} tensor of shape {tuple(ids.shape)}; pass a 1-D int32 or "
                                       "int64 tensor of block ids")
        if ids.device.type != "cpu":
            if device is not None and ids.device == device:
                return ids
            ids = ids.cpu()  # waits for the GPU: ids for a host pool or a CPU-driven transport belong on the host
        array = ids.numpy()
    elif isinstance(ids, np.ndarray):
        array = ids
    elif isinstance(ids, (list, tuple, range)):
        array = np.asarray(ids) if len(ids) else np.zeros(0, dtype=np.int64)
    else:
        raise InvalidArgumentError(f"{what}: got {type(ids).__name__}; pass a 1-D integer tensor, numpy array or list")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what}: {array.dtype} array of shape {array.shape}; pass 1-D integer block ids")
    array = array.astype(np.int64, copy=False)
    # One pass for both bounds: seen as unsigned, a negative id is larger than any pool.
    if len(array) and int(array.view(np.uint64).max()) >= num_blocks:
        bad = int(np.flatnonzero((array < 0) | (array >= num_blocks))[0])
        raise InvalidArgumentError(f"{what}: id {int(array[bad])} at position {bad} is outside [0, {num_blocks}); the "
                                   f"pool has {num_blocks} blocks")
    if unique and len(array) > 1:
        seen = np.zeros(num_blocks, dtype=np.bool_)
        seen[array] = True
        if np.count_nonzero(seen) != len(array):
            values, counts = np.unique(array, return_counts=True)
            raise InvalidArgumentError(
                f"{what}: destination block {int(values[counts > 1][0])} appears {int(counts.max())} times; each "
                "destination block may be written once per post")
    return np.ascontiguousarray(array)


class BlockTransfer(Closeable):
    """A prepared block READ or WRITE between a local pool and one peer's pool, re-postable with any ids.
    Not thread-safe: drive one handle from one thread.

    Attributes: ``op``, ``peer``, ``transport`` (``"cuda_ipc"``, ``"nixl"``, ``"shm"`` or ``"local"``),
    ``bytes_per_block`` (summed over the views)."""

    def __init__(self, core: Transfer, pool: BlockPool, remote: BlockPoolDesc, backend: Backend,
                 request: BlockRequest, runtime: Runtime) -> None:
        self._core = core  # the prepared transfer of ``request``: posts, waits, failures
        self._pool, self._remote = pool, remote
        self._backend, self._request, self._runtime = backend, request, runtime
        self.op, self.peer, self.transport = core.op, core.peer, core.transport
        self.bytes_per_block = sum(pool.block_bytes)
        self._on_device = request.takes_device_ids  # ids that live on the GPU stay there
        self._empty = False  # the last post had no ids
        self.closed = False

    def post(self, local_ids, remote_ids, *, notify: bytes | None = None,
             stream: torch.cuda.Stream | None = None) -> None:
        """Move block ``remote_ids[i]`` of the peer's pool to block ``local_ids[i]`` of ours (READ), or the
        reverse (WRITE), for every i, in every view. Non-blocking; ``stream`` as for ``Transfer.post``.

        ``local_ids``/``remote_ids``: 1-D integer tensors (CPU, or on the pool's GPU for ``cuda_ipc``/``local``),
        numpy arrays or lists, of equal length; bad ids raise ``InvalidArgumentError`` before anything moves.
        ``notify`` (non-empty bytes) reaches the peer after the data. Graph-capturable over ``cuda_ipc``/``local``
        with ids in device tensors (a replay reads their contents then). 0 ids moves nothing."""
        self._check_open("post")
        destination_is_local = self.op is Op.READ
        device = self._pool.device if self._on_device else None
        local = as_ids(local_ids, self._pool.num_blocks, "post: local_ids", device, destination_is_local)
        remote = as_ids(remote_ids, self._remote.num_blocks, "post: remote_ids", device, not destination_is_local)
        if len(local) != len(remote):
            raise InvalidArgumentError(
                f"post: {len(local)} local ids but {len(remote)} remote ids; id i of each pairs up")
        if isinstance(local, torch.Tensor) != isinstance(remote, torch.Tensor):  # one on the GPU, one on the host
            local, remote = (torch.as_tensor(x, device=self._pool.device) for x in (local, remote))
        if notify is not None and (not isinstance(notify, (bytes, bytearray)) or not notify):
            raise InvalidArgumentError(
                f"post: notify must be non-empty bytes, got {notify!r}; pass e.g. notify=b'done'")
        core = self._core
        core.refuse_repost_in_flight("post", "block ")
        if len(local) == 0:
            self._empty = True
            if notify is not None:
                self._runtime.outbox.send_after(self.peer, bytes(notify), lambda: True)
            return
        if stream is not None and not isinstance(local, torch.Tensor) and self._on_device:
            with torch.cuda.stream(stream):
                if torch.cuda.is_current_stream_capturing():
                    raise InvalidArgumentError(
                        "post: ids on the host cannot be captured in a CUDA graph (the graph would keep reading the "
                        "first post's copy); pass local_ids and remote_ids as tensors on the pool's device")
        self._empty = False
        self._backend.bind_blocks(self._request, local, remote, notify)
        core.rebind(notify, len(local) * self.bytes_per_block)
        try:
            core.post(stream=stream)
        except BaseException:
            self._request.bindings.unbind_last()
            raise

    def status(self) -> Status:
        """DONE, IN_PROGRESS or ERROR of the last post; never blocks (see ``Transfer.status``)."""
        self._check_open("status")
        return Status.DONE if self._empty else self._core.status()

    def wait(self, *, timeout: float | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """Complete the last post: block (sleeping) until done, or with ``stream`` return at once and make the
        stream wait. ``WaitTimeoutError`` after ``timeout`` seconds (default: the communicator's)."""
        self._check_open("wait")
        if self._empty:
            self._runtime.timeout(timeout)  # still reject a bad timeout
            return
        self._core.wait(timeout=timeout, stream=stream)

    def close(self) -> None:
        """Release the prepared request (see ``Transfer.close``). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._core.close()
        self._pool.transfers.discard(self)

    def _check_open(self, fn: str) -> None:
        if self.closed:
            raise ClosedError(f"{fn}: the block transfer is closed; prepare a new one with comm.prepare_blocks(...)")
        self._pool.check_open(fn)
        self._core.check_open(fn)

    def _leak_message(self) -> str:
        return (f"a block {self.op.value} to rank {self.peer} was garbage-collected without close(); call close() or "
                "use 'with comm.prepare_blocks(...)'")

    def __repr__(self) -> str:
        return (f"BlockTransfer({self.op.value}, peer={self.peer}, transport={self.transport!r}, "
                f"{self.bytes_per_block} bytes per block{', closed' if self.closed else ''})")
