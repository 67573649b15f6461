"""What backends share to move KV-cache blocks by id: the pool layout, the ids bound per post, and the two
copy engines that are not NIXL (a host copy with torch index ops, a GPU gather/scatter kernel).

A block request is prepared once per (operation, local pool, remote pool) and posted many times, each
post with its own ids. ``bind(local_ids, remote_ids, notify)`` queues the ids of the next post; the post
takes them in order, and a post with nothing newly bound repeats the last ids (a replayed CUDA graph rings
the same request again). Backends never see a Python object per block: ids are int64 numpy arrays (host)
or integer tensors on the pool's device.
"""

from __future__ import annotations

import collections
import ctypes
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..descriptors import MemoryKind
from ..errors import BackendUnavailableError, InvalidArgumentError
from .base import Segment, Status, StreamOrderedRequest

__all__ = ["BlockRegion", "BlockLayout", "BlockBindings", "HostBlockRequest", "DeviceBlockRequest", "host_rows",
           "copy_request", "BLOCK_COPY_REQUESTS"]


@dataclass(frozen=True)
class BlockRegion:
    """One view of a pool: block ``b`` is ``[addr + b * stride, + block_bytes)``."""

    addr: int
    stride: int
    block_bytes: int


@dataclass(frozen=True)
class BlockLayout:
    """Where a pool's blocks live in one process: ``num_blocks`` blocks in each region, one memory kind."""

    regions: tuple[BlockRegion, ...]
    num_blocks: int
    kind: MemoryKind
    device_index: int

    def span(self, region: BlockRegion) -> Segment:
        """The bytes from the first to the end of the last block of ``region``."""
        return Segment(region.addr, region.stride * (self.num_blocks - 1) + region.block_bytes, self.kind,
                       self.device_index)

    def spans(self) -> list[Segment]:
        return [self.span(r) for r in self.regions]


class BlockBindings:
    """Ids bound for the posts to come, in posting order; ``advance()`` (at a post) moves to the next binding,
    or keeps the current one when nothing new was bound. ``on_drop`` releases a binding that is done with
    (NIXL's per-post requests)."""

    def __init__(self, on_drop: Callable[[Any], None] | None = None) -> None:
        self._pending: collections.deque = collections.deque()
        self.current: Any = None
        self._on_drop = on_drop

    def bind(self, item: Any) -> None:
        self._pending.append(item)

    def unbind_last(self) -> None:
        """Take back the newest binding if no post took it yet (that post failed)."""
        if self._pending:
            self._drop(self._pending.pop())

    def advance(self) -> None:
        """Make the oldest pending binding current (the one it replaces has completed)."""
        if self._pending:
            replaced, self.current = self.current, self._pending.popleft()
            if replaced is not None:
                self._drop(replaced)

    def clear(self) -> None:
        for item in ([self.current] if self.current is not None else []) + list(self._pending):
            self._drop(item)
        self._pending.clear()
        self.current = None

    def _drop(self, item: Any) -> None:
        if self._on_drop is not None:
            self._on_drop(item)


def host_rows(addr: int, region: BlockRegion, num_blocks: int) -> np.ndarray:
    """``region`` at ``addr`` in this process as a 1-D numpy array of ``num_blocks`` opaque rows (dtype
    ``V<block_bytes>``, stride ``region.stride``): numpy moves each row with one ``memcpy``. It does not own
    the memory: its user keeps the mapping or tensor alive."""
    span = region.stride * (num_blocks - 1) + region.block_bytes
    buffer = (ctypes.c_uint8 * span).from_address(addr)
    return np.ndarray((num_blocks,), dtype=np.dtype((np.void, region.block_bytes)), buffer=buffer,
                      strides=(region.stride,))


class HostBlockRequest:
    """Blocks between host rows, copied inside ``post`` with numpy fancy indexing (a gather of the source rows,
    then a scatter: measured faster on a 2-core VM than torch's index ops, ~4x, and than a Python memmove
    loop)."""

    def __init__(self, destination: list[np.ndarray], source: list[np.ndarray], local_is_destination: bool):
        self.destination, self.source = destination, source
        self.local_is_destination = local_is_destination
        self.bindings = BlockBindings()

    def bind(self, local_ids: np.ndarray, remote_ids: np.ndarray, notify: bytes | None) -> None:
        self.bindings.bind((local_ids, remote_ids))

    event = None  # completes inside post

    def status(self) -> Status:
        return Status.DONE

    def post(self, stream: object = None) -> Status:
        self.bindings.advance()
        local_ids, remote_ids = self.bindings.current
        destination_ids, source_ids = ((local_ids, remote_ids) if self.local_is_destination
                                       else (remote_ids, local_ids))
        for destination, source in zip(self.destination, self.source):
            destination[destination_ids] = source[source_ids]
        return Status.DONE

    def release(self) -> None:
        self.destination, self.source = [], []
        self.bindings.clear()


_CHUNK_BYTES = 4096  # bytes one program moves: 1024 int32 words measured best on an H200 (512-1024)
_NUM_WARPS = 4


class DeviceBlockRequest(StreamOrderedRequest):
    """Blocks between GPU memory of this process and (through CUDA IPC mappings) a peer's, moved by one
    Triton kernel per post on the post's stream. Stream-ordered and CUDA-graph capturable when the ids are
    device tensors (the kernel reads them at run time)."""

    def __init__(self, destination: list[int], source: list[int], regions: list[tuple[int, int, int]],
                 blocks: tuple[int, int], device_index: int, local_is_destination: bool) -> None:
        """``destination``/``source``: per region, the address (in this process) of block 0; ``regions``: per
        region (destination stride, source stride, block bytes); ``blocks``: (destination, source) counts."""
        try:
            from . import block_kernel
        except ImportError as e:
            raise BackendUnavailableError(
                f"block transfers of GPU memory need Triton ({e}); pip install triton (or tensorwire[cuda])") from e
        self._kernel = block_kernel.copy_blocks
        self.device_index = device_index
        self.local_is_destination = local_is_destination
        self.bindings = BlockBindings()
        numbers = destination + source + [n for r in regions for n in r]
        word = 4 if all(n % 4 == 0 for n in numbers) else 1
        self._word_type = torch.int32 if word == 4 else torch.uint8
        self._align = 4 if word == 4 and all(n % 16 == 0 for n in numbers) else 1
        self._chunk = _CHUNK_BYTES // word
        device = torch.device("cuda", device_index)
        self._table = torch.empty((5, len(regions)), dtype=torch.int64, device=device)
        anchor = self._table.data_ptr()
        columns = [[(a - anchor) // word for a in destination], [(a - anchor) // word for a in source],
                   [r[0] // word for r in regions], [r[1] // word for r in regions], [r[2] // word for r in regions]]
        self._table.copy_(torch.tensor(columns, dtype=torch.int64))
        self._anchor = self._table.view(self._word_type)
        self._chunks = -(-max(r[2] for r in regions) // _CHUNK_BYTES)
        self._num_regions, self._blocks = len(regions), blocks
        if self._chunks > 65535 or self._num_regions > 65535:
            raise InvalidArgumentError(
                f"prepare_blocks: {self._num_regions} views of up to {max(r[2] for r in regions)} bytes per block "
                "exceed the kernel's grid (65535 views, 256 MiB per block); use fewer, smaller views")
        self._warm_up(device)

    def _warm_up(self, device: torch.device) -> None:
        """Compile the kernel for both id types now, not inside a later CUDA-graph capture or stream wait:
        ids of -1 move nothing."""
        for dtype in (torch.int32, torch.int64):
            nothing = torch.full((1,), -1, dtype=dtype, device=device)
            self._launch(nothing, nothing, torch.cuda.current_stream(device))

    def bind(self, local_ids: "np.ndarray | torch.Tensor", remote_ids: "np.ndarray | torch.Tensor",
             notify: bytes | None) -> None:
        self.bindings.bind((local_ids, remote_ids))

    def post(self, stream: "torch.cuda.Stream | None") -> Status:
        """Enqueue the kernel for the next binding on ``stream`` (default: the current stream); host ids travel
        first (one pinned copy on that stream)."""
        stream = stream or torch.cuda.current_stream(self.device_index)
        self.bindings.advance()
        local_ids, remote_ids = self.bindings.current
        if isinstance(local_ids, np.ndarray):
            pair = torch.from_numpy(np.stack([local_ids, remote_ids]).astype(np.int32)).pin_memory()
            with torch.cuda.stream(stream):  # allocated for, and copied on, the stream that reads it
                pair = pair.to(stream.device, non_blocking=True)
            local_ids, remote_ids = pair[0], pair[1]  # freed after the launch: the stream's own allocation
        destination_ids, source_ids = ((local_ids, remote_ids) if self.local_is_destination
                                       else (remote_ids, local_ids))
        self._launch(destination_ids, source_ids, stream)
        self.record(stream)
        return Status.IN_PROGRESS

    def _launch(self, destination_ids: torch.Tensor, source_ids: torch.Tensor, stream: "torch.cuda.Stream") -> None:
        destination_blocks, source_blocks = self._blocks
        grid = (destination_ids.numel(), self._num_regions, self._chunks)
        with torch.cuda.device(self.device_index), torch.cuda.stream(stream):
            self._kernel[grid](self._anchor, self._table, destination_ids, source_ids, self._num_regions,
                               destination_blocks, source_blocks, CHUNK=self._chunk, TILE=self._chunk,
                               ALIGN=self._align, num_warps=_NUM_WARPS)

    def release(self) -> None:
        self.bindings.clear()


BLOCK_COPY_REQUESTS = (HostBlockRequest, DeviceBlockRequest)


def copy_request(read: bool, local: BlockLayout, remote: BlockLayout,
                 remote_addrs: list[int]) -> "HostBlockRequest | DeviceBlockRequest":
    """The block request of a transport that copies itself (not NIXL): host rows for host memory, the kernel
    for GPU memory. ``remote_addrs``: where each remote region's block 0 is in this process (the peer's own
    address for ``local``, a mapping's for ``shm`` and ``cuda_ipc``)."""
    local_addrs = [r.addr for r in local.regions]
    (destination, destination_addrs), (source, source_addrs) = (
        ((local, local_addrs), (remote, remote_addrs)) if read else ((remote, remote_addrs), (local, local_addrs)))
    if local.kind is MemoryKind.CPU:
        return HostBlockRequest(
            [host_rows(a, r, destination.num_blocks) for a, r in zip(destination_addrs, destination.regions)],
            [host_rows(a, r, source.num_blocks) for a, r in zip(source_addrs, source.regions)], read)
    regions = [(d.stride, s.stride, d.block_bytes) for d, s in zip(destination.regions, source.regions)]
    return DeviceBlockRequest(destination_addrs, source_addrs, regions, (destination.num_blocks, source.num_blocks),
                              local.device_index, read)
