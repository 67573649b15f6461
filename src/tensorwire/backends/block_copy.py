"""What backends share to move KV-cache blocks by id: the pool layout, the ids bound per post, and the two
copy engines that are not NIXL (host memory: one memmove per run of blocks; GPU memory: one Triton kernel).

A block request is prepared once per (operation, local pool, remote pool) and posted many times, each
post with its own ids. ``bind(local_ids, remote_ids, notify)`` queues the ids of the next post; the post
takes them in order, and a post with nothing newly bound repeats the last ids (a replayed CUDA graph rings
the same request again). Backends never see a Python object per block: ids are int64 numpy arrays (host)
or integer tensors on the pool's device.
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cuda import PostStream, enqueue_on, use_device
from ..descriptors import MemoryKind
from ..errors import BackendUnavailableError, InvalidArgumentError
from .base import Segment, Status, StreamOrderedRequest

__all__ = ["BlockRegion", "BlockLayout", "BlockBindings", "HostBlockRequest", "DeviceBlockRequest", "runs",
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


def runs(destination_ids: np.ndarray, source_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where runs of ids consecutive on both sides start, and how long they are (vectorised)."""
    breaks = np.flatnonzero((np.diff(destination_ids) != 1) | (np.diff(source_ids) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    return starts, np.diff(np.concatenate((starts, [len(destination_ids)])))


class HostBlockRequest:
    """Blocks between host memory of this process (``destination``/``source``: per region, the address of
    block 0 here, which may be a mapping of a peer's file), copied inside ``post``: one ``memmove`` per run of
    blocks consecutive on both sides (a run is one range when the region is dense). Measured on a 2-core VM,
    10k x 16 KiB random blocks: ~2x the time of one contiguous ``memmove`` of the same bytes; numpy's fancy
    indexing (gather, then scatter) took ~3.5x, torch's ``index_select`` + ``index_copy_`` ~6x."""

    event = None  # completes inside post
    takes_device_ids = False

    def __init__(self, destination: list[int], source: list[int], regions: list[tuple[int, int, int]],
                 local_is_destination: bool) -> None:
        self.destination, self.source, self.regions = destination, source, regions
        self.local_is_destination = local_is_destination
        self.bindings = BlockBindings()

    def bind(self, local_ids: np.ndarray, remote_ids: np.ndarray, notify: bytes | None) -> None:
        self.bindings.bind((local_ids, remote_ids))

    def status(self) -> Status:
        return Status.DONE

    def post(self, stream: object = None) -> Status:
        self.bindings.advance()
        local_ids, remote_ids = self.bindings.current
        destination_ids, source_ids = ((local_ids, remote_ids) if self.local_is_destination
                                       else (remote_ids, local_ids))
        starts, lengths = runs(destination_ids, source_ids)
        destination_starts, source_starts = destination_ids[starts], source_ids[starts]
        memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies
        for destination, source, (destination_stride, source_stride, block_bytes) in zip(
                self.destination, self.source, self.regions):
            if destination_stride == source_stride == block_bytes:  # dense: a run is one range
                copies = zip((destination + destination_starts * block_bytes).tolist(),
                             (source + source_starts * block_bytes).tolist(), (lengths * block_bytes).tolist())
            else:
                copies = zip((destination + destination_ids * destination_stride).tolist(),
                             (source + source_ids * source_stride).tolist(), [block_bytes] * len(destination_ids))
            for destination_addr, source_addr, nbytes in copies:
                memmove(destination_addr, source_addr, nbytes)
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

    takes_device_ids = True

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
        self._staging = _IdStaging(device)
        self._streams = PostStream(device_index)
        self._compiled: dict[tuple, Any] = {}  # (id dtypes, id alignments) -> Triton's compiled kernel (_launch)
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

    def bind(self, local_ids: np.ndarray | torch.Tensor, remote_ids: np.ndarray | torch.Tensor,
             notify: bytes | None) -> None:
        self.bindings.bind((local_ids, remote_ids))

    def post(self, stream: torch.cuda.Stream | None) -> Status:
        """Enqueue the kernel for the next binding on ``stream`` (default: the current stream); host ids travel
        first (one pinned copy on that stream)."""
        stream, handle = self._streams.of(stream)
        self.bindings.advance()
        local_ids, remote_ids = self.bindings.current
        slot = None
        if isinstance(local_ids, np.ndarray):
            slot, local_ids, remote_ids = self._staging.stage(local_ids, remote_ids, stream, handle)
        destination_ids, source_ids = ((local_ids, remote_ids) if self.local_is_destination
                                       else (remote_ids, local_ids))
        self._launch(destination_ids, source_ids, stream)
        self.record(stream)
        if slot is not None:
            slot.event.record(stream)  # the slot may be rewritten once the kernel has read it
        return Status.IN_PROGRESS

    def _launch(self, destination_ids: torch.Tensor, source_ids: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """One kernel on ``stream``. Triton's JIT binds and specialises every argument on each call (~40 µs of
        Python); its specialisation here depends only on the two id tensors' dtypes and 16-byte alignment (the
        rest is fixed per request), so the compiled kernel is kept per such key and launched directly, with the
        constexprs in the order Triton's own launch passes them. The first launch of a key, and any launch while
        another device is current, go through the JIT."""
        destination_blocks, source_blocks = self._blocks
        grid = (destination_ids.numel(), self._num_regions, self._chunks)
        args = (self._anchor, self._table, destination_ids, source_ids, self._num_regions, destination_blocks,
                source_blocks, self._chunk, self._chunk, self._align)
        key = (destination_ids.dtype, source_ids.dtype, destination_ids.data_ptr() % 16 == 0,
               source_ids.data_ptr() % 16 == 0)
        compiled = self._compiled.get(key)
        if compiled is not None and torch._C._cuda_getDevice() == self.device_index:
            with use_device(self.device_index):  # a thread with no context yet gets the device's
                compiled[grid](*args, stream=stream.cuda_stream)
            return
        with torch.cuda.device(self.device_index), torch.cuda.stream(stream):
            kernel = self._kernel[grid](*args[:7], CHUNK=self._chunk, TILE=self._chunk, ALIGN=self._align,
                                        num_warps=_NUM_WARPS)
        if hasattr(kernel, "run") and hasattr(kernel, "__getitem__"):  # a CompiledKernel (Triton >= 3)
            self._compiled[key] = kernel

    def release(self) -> None:
        self.bindings.clear()


class _Slot:
    """``words`` int32 of pinned host memory and as many on the device: one post's local then remote ids."""

    def __init__(self, words: int, device: torch.device) -> None:
        self.host = torch.empty(words, dtype=torch.int32, pin_memory=True)
        self.host_array = self.host.numpy()  # the same pinned bytes, written by numpy without torch's dispatch
        self.device = torch.empty(words, dtype=torch.int32, device=device)
        self.host_addr, self.device_addr = self.host.data_ptr(), self.device.data_ptr()
        self.event = torch.cuda.Event()
        self.used = False
        self.kept = False  # one of the staging's kept slots (else a one-off, freed by torch after its copy)

    def free(self) -> bool:
        return not self.used or self.event.query()


class _IdStaging:
    """Pinned host and device buffers for ids given on the host, reused across posts (a fresh pinned
    allocation per post cost more than the rest of ``post``). A slot is rewritten only once the kernel that
    read it has run (its event); with every slot busy a new one is made, up to ``_MAX_SLOTS``, then a
    one-off slot that torch frees once its copies ran (never a wait on the CPU)."""

    _MAX_SLOTS = 8

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._slots: list[_Slot] = []

    def stage(self, local_ids: np.ndarray, remote_ids: np.ndarray, stream: torch.cuda.Stream,
              handle: Any) -> tuple[_Slot, torch.Tensor, torch.Tensor]:
        """Copy the ids into a slot (int64 to int32, one vectorised cast each) and enqueue its host-to-device copy
        on ``stream`` (``handle``: its driver handle); their device views, int32, 16-byte aligned."""
        n = len(local_ids)
        # The remote ids start on a 16-byte boundary whatever n is: the kernel compiled at warm-up assumes aligned
        # ids, and a misaligned view would go through Triton's JIT (and compile another variant) inside the post.
        half = -(-n // 4) * 4
        slot = self._slot(2 * half, stream)
        slot.host_array[:n], slot.host_array[half:half + n] = local_ids, remote_ids
        if slot.kept:
            # One cuMemcpyAsync: torch's copy_ under a stream context cost more than the kernel's launch.
            enqueue_on([(slot.device_addr, slot.host_addr, 4 * (half + n))], handle, self._device.index,
                       "post: copying block ids to the GPU")
        else:  # a one-off slot: torch's copy keeps its pinned buffer alive until the copy has run
            with torch.cuda.stream(stream):
                slot.device[:half + n].copy_(slot.host[:half + n], non_blocking=True)
        slot.used = True
        return slot, slot.device[:n], slot.device[half:half + n]

    def _slot(self, words: int, stream: torch.cuda.Stream) -> _Slot:
        # The first free slot of at least ``words`` int32, querying no more events than it takes to find it: in the
        # eager loop of post then wait, slot 0 is free again at every post.
        free = []
        for i, s in enumerate(self._slots):
            if s.free():
                if s.host.numel() >= words:
                    return s
                free.append(i)
        with torch.cuda.stream(stream):  # a new slot's device buffer belongs to the stream that reads it
            slot = _Slot(1 << max(11, (words - 1).bit_length()), self._device)
        if len(self._slots) < self._MAX_SLOTS:
            self._slots.append(slot)
            slot.kept = True
        elif free:  # a free slot too small for these ids makes room (nothing reads it any more)
            self._slots[free[0]].kept = False
            self._slots[free[0]] = slot
            slot.kept = True
        return slot


BLOCK_COPY_REQUESTS = (HostBlockRequest, DeviceBlockRequest)


def copy_request(read: bool, local: BlockLayout, remote: BlockLayout,
                 remote_addrs: list[int]) -> HostBlockRequest | DeviceBlockRequest:
    """The block request of a transport that copies itself (not NIXL): host rows for host memory, the kernel
    for GPU memory. ``remote_addrs``: where each remote region's block 0 is in this process (the peer's own
    address for ``local``, a mapping's for ``shm`` and ``cuda_ipc``)."""
    local_addrs = [r.addr for r in local.regions]
    (destination, destination_addrs), (source, source_addrs) = (
        ((local, local_addrs), (remote, remote_addrs)) if read else ((remote, remote_addrs), (local, local_addrs)))
    regions = [(d.stride, s.stride, d.block_bytes) for d, s in zip(destination.regions, source.regions)]
    if local.kind is MemoryKind.CPU:
        return HostBlockRequest(destination_addrs, source_addrs, regions, read)
    return DeviceBlockRequest(destination_addrs, source_addrs, regions, (destination.num_blocks, source.num_blocks),
                              local.device_index, read)
