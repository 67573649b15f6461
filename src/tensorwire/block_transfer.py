"""``BlockTransfer``: a prepared block READ or WRITE, posted with any block ids; the ids' checks.

See ``tensorwire.blocks`` for pools and their descriptors. Ids are checked vectorised on the host: out of range,
duplicate destinations and mismatched lengths raise ``InvalidArgumentError`` before anything moves. Ids that
already live on the GPU (a request that ``takes_device_ids``) are not read back by the host (that would wait for
the GPU): the kernel skips ids out of range, so no byte lands outside the pool, and duplicate destinations are the
caller's race.

The checks are on the eager path of every post (10k ids: a few numpy passes, ~17 µs on a 2-core VM): the bounds
are one ``max`` over the ids seen as unsigned, and the duplicate check writes into scratch memory the transfer
keeps (``DestinationIds``) instead of a zeroed array the size of the pool per post.
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

__all__ = ["BlockTransfer", "DestinationIds", "as_ids"]

# A post that names at least 1/_DENSE of the pool marks a bitmap of the pool; a sparser one writes its positions
# (measured on a 2-core VM, 10k ids: the bitmap costs ~0.05 ns per pool block more, the positions ~1.2 ns per id).
_DENSE = 32


class DestinationIds:
    """Finds a block named twice among one post's destination ids, in scratch memory kept across the posts of one
    transfer (a zeroed array the size of the pool per post cost more than the rest of the check). Host memory
    only; not thread-safe, like the transfer that owns it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._marks: np.ndarray | None = None  # bool [num_blocks], all False between posts
        self._slots: np.ndarray | None = None  # int32 [num_blocks]: whatever the last sparse post wrote
        self._positions = np.zeros(0, dtype=np.int32)  # 0, 1, 2, ...: sliced, not made per post

    def repeated(self, ids: np.ndarray) -> bool:
        """Whether an id appears more than once in ``ids`` (1-D int64, each in ``[0, num_blocks)``). Never
        raises for valid ids; O(len(ids)) plus, for a post naming much of the pool, O(num_blocks) bytes."""
        n = len(ids)
        if n * _DENSE >= self.num_blocks:
            if self._marks is None:
                self._marks = np.zeros(self.num_blocks, dtype=np.bool_)
            marks = self._marks
            try:
                marks[ids] = True
                return int(np.count_nonzero(marks)) != n  # fewer marks than ids: one was marked twice
            finally:
                marks.fill(False)  # even when interrupted: a mark left behind would fail a later, valid post
        # Sparse: cost by ids, not by pool. Each id's slot holds one position that named it (numpy does not say
        # which of several), so an id named twice reads back a position other than its own at least once.
        if self._slots is None:
            self._slots = np.empty(self.num_blocks, dtype=np.int32)  # never read where this post did not write
        if len(self._positions) < n:
            self._positions = np.arange(max(n, 2 * len(self._positions)), dtype=np.int32)
        positions = self._positions[:n]
        self._slots[ids] = positions
        return not np.array_equal(self._slots[ids], positions)


def as_ids(ids, num_blocks: int, what: str, device: torch.device | None, unique: bool, *,
           destinations: DestinationIds | None = None) -> np.ndarray | torch.Tensor:
    """``ids`` as a 1-D int64 numpy array checked against ``[0, num_blocks)`` (and for duplicates if
    ``unique``, in ``destinations``' scratch memory when given), or, when ``device`` is given and the ids are an
    integer tensor on it, that tensor unchecked. Host work only: never waits for a GPU unless the ids are a
    tensor on another device than ``device`` (read back)."""
    if isinstance(ids, np.ndarray):
        array = ids
    elif isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise InvalidArgumentError(f"{what}: a {ids.dtype} tensor of shape {tuple(ids.shape)}; pass a 1-D int32 or "
                                       "int64 tensor of block ids")
        if ids.device.type != "cpu":
            if device is not None and ids.device == device:
                return ids
            ids = ids.cpu()  # waits for the GPU: ids for a host pool or a CPU-driven transport belong on the host
        array = ids.numpy()
    elif isinstance(ids, (list, tuple, range)):
        array = np.asarray(ids) if len(ids) else np.zeros(0, dtype=np.int64)
    else:
        raise InvalidArgumentError(f"{what}: got {type(ids).__name__}; pass a 1-D integer tensor, numpy array or list")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what}: {array.dtype} array of shape {array.shape}; pass 1-D integer block ids")
    array = np.ascontiguousarray(array, dtype=np.int64)  # no copy for contiguous int64 ids
    # One pass for both bounds: seen as unsigned, a negative id is larger than any pool.
    if len(array) and int(array.view(np.uint64).max()) >= num_blocks:
        bad = int(np.flatnonzero((array < 0) | (array >= num_blocks))[0])
        raise InvalidArgumentError(f"{what}: id {int(array[bad])} at position {bad} is outside [0, {num_blocks}); the "
                                   f"pool has {num_blocks} blocks")
    if unique and len(array) > 1:
        if destinations is None:
            destinations = DestinationIds(num_blocks)
        if destinations.repeated(array):
            values, counts = np.unique(array, return_counts=True)
            raise InvalidArgumentError(
                f"{what}: destination block {int(values[counts > 1][0])} appears {int(counts.max())} times; each "
                "destination block may be written once per post")
    return array


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
        # The duplicate check's scratch memory, kept across posts, for whichever pool the op writes.
        self._destinations = DestinationIds(pool.num_blocks if core.op is Op.READ else remote.num_blocks)
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
        destinations = self._destinations
        local = as_ids(local_ids, self._pool.num_blocks, "post: local_ids", device, destination_is_local,
                       destinations=destinations)
        remote = as_ids(remote_ids, self._remote.num_blocks, "post: remote_ids", device, not destination_is_local,
                        destinations=destinations)
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
