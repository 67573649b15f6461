"""Same-host GPU transport: CUDA IPC mappings of peers' registered device memory, copies on a stream.

Each rank exports, for every registered CUDA range, an IPC handle of the allocation that contains it
(``cuIpcGetMemHandle`` on the allocation base) in its metadata. A rank that addresses a peer's range
opens the allocation once (``cuIpcOpenMemHandle``, cached per peer and base, closed on ``close``) and
copies with ``cuMemcpyAsync`` on the caller's stream (``cuda.StreamCopies``): stream-ordered, copy-engine
speed, and CUDA-graph capturable (a captured copy becomes a memcpy node with fixed pointers).

Non-goal: memory from PyTorch's ``expandable_segments`` (VMM) allocator cannot be exported by
``cuIpcGetMemHandle``; such ranges are simply not exported and take the NIXL path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from .. import cuda
from ..descriptors import MemoryKind
from ..errors import TransferError
from .base import (
    BackendContext,
    BackendInfo,
    Capabilities,
    Op,
    Segment,
    Status,
    StreamOrderedCompletion,
    StreamOrderedRequest,
)
from .block_copy import BlockLayout, DeviceBlockRequest, copy_request

__all__ = ["CudaIpcBackend", "info"]


def info() -> BackendInfo:
    """Usable where CUDA and cuda-python are (same-host GPU memory; the peer's allocation must be exportable)."""
    usable, reason = cuda.availability()
    fix = "" if usable else ("pip install cuda-python" if "cuda-python" in reason else "needs a CUDA device")
    return BackendInfo("cuda_ipc", usable, reason, fix=fix)

_EXPORT = struct.Struct("<QQQi64s")  # addr, nbytes, allocation base, device index, IPC handle


@dataclass(frozen=True)
class _Export:
    addr: int
    nbytes: int
    base: int
    device_index: int
    handle: bytes

    def contains(self, s: Segment) -> bool:
        return s.kind is MemoryKind.CUDA and self.addr <= s.addr and s.addr + s.nbytes <= self.addr + self.nbytes


@dataclass
class _Request(StreamOrderedRequest):
    copies: cuda.StreamCopies  # (destination pointer, source pointer, nbytes) in this process, enqueued per post


class CudaIpcBackend(StreamOrderedCompletion):
    """The ``Backend`` protocol over CUDA IPC between processes of one host."""

    name = "cuda_ipc"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.CUDA}), remote=True, stream_ordered=True,
                                same_host_only=True, same_kind_only=True, peer_pointers=True)

    @classmethod
    def create(cls, context: BackendContext) -> CudaIpcBackend | None:
        """None without CUDA or cuda-python (``cuda.availability``)."""
        return cls() if cuda.availability()[0] else None

    def __init__(self) -> None:
        self._cu = cuda.driver()
        self._exports: dict[tuple[int, int], _Export] = {}  # (addr, nbytes) -> export, this process
        self._peer_exports: dict[int, list[_Export]] = {}
        # (peer, base, handle) -> pointer here: a base the peer freed and got back from cudaMalloc comes
        # with a new handle, so it is mapped anew instead of reaching the orphaned pages.
        self._mapped: dict[tuple[int, int, bytes], int] = {}

    # --- memory -------------------------------------------------------------------------------
    def register(self, segment: Segment) -> tuple[int, int] | None:
        if segment.kind is not MemoryKind.CUDA:
            return None
        cu = self._cu
        with cuda.use_device(segment.device_index):
            base, _ = cuda.check(cu.cuMemGetAddressRange(segment.addr), "cuMemGetAddressRange")
            result = cu.cuIpcGetMemHandle(base)
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            return None  # not exportable (e.g. VMM memory): NIXL carries it
        key = (segment.addr, segment.nbytes)
        self._exports[key] = _Export(segment.addr, segment.nbytes, int(base), segment.device_index,
                                     bytes(result[1].reserved))
        return key

    def deregister(self, handle: tuple[int, int] | None) -> None:
        if handle is not None:
            self._exports.pop(handle, None)

    # --- peers --------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return b"".join(_EXPORT.pack(e.addr, e.nbytes, e.base, e.device_index, e.handle)
                        for e in self._exports.values())

    def load_peer(self, rank: int, metadata: bytes) -> None:
        exports = [_Export(*_EXPORT.unpack_from(metadata, o)) for o in range(0, len(metadata), _EXPORT.size)]
        live = {(e.base, e.handle) for e in exports}
        for key in list(self._mapped):
            if key[0] == rank and key[1:] not in live:  # the peer freed that allocation
                self._close_mapping(key)
        self._peer_exports[rank] = exports

    def reaches(self, peer: int, remote: list[Segment]) -> bool:
        """Whether every remote segment lies in memory ``peer`` exported through IPC."""
        exports = self._peer_exports.get(peer, [])
        return all(any(e.contains(s) for e in exports) for s in remote)

    # --- transfers ----------------------------------------------------------------------------
    def prepare(self, op: Op, local: list[Segment], remote: list[Segment], peer: int, notify: bytes | None) -> _Request:
        device_index = local[0].device_index
        copies = []
        for mine, theirs in zip(local, remote):
            pointer = self.pointer(peer, theirs, device_index)
            destination, source = (mine.addr, pointer) if op is Op.READ else (pointer, mine.addr)
            copies += cuda.copy_pieces(destination, source, mine.nbytes)
        return _Request(cuda.StreamCopies(copies, device_index, "cuda_ipc"))

    def prepare_blocks(self, op: Op, local: BlockLayout, remote: BlockLayout, peer: int) -> DeviceBlockRequest:
        """Blocks between this GPU and a same-host peer's pool, mapped here: one kernel per post."""
        remote_addrs = [self.pointer(peer, remote.span(r), local.device_index) for r in remote.regions]
        return copy_request(op is Op.READ, local, remote, remote_addrs)

    def bind_blocks(self, request: DeviceBlockRequest, local_ids, remote_ids, notify: bytes | None) -> None:
        request.bind(local_ids, remote_ids, notify)

    def post(self, request: _Request, notify: bytes | None, stream: torch.cuda.Stream | None = None) -> Status:
        if isinstance(request, DeviceBlockRequest):
            return request.post(stream)
        request.record(request.copies.enqueue(stream))
        return Status.IN_PROGRESS

    def release(self, request: _Request) -> None:
        if isinstance(request, DeviceBlockRequest):
            return request.release()
        request.copies.copies = []

    def close(self) -> None:
        for key in list(self._mapped):
            self._close_mapping(key)
        self._exports.clear()
        self._peer_exports.clear()

    # --- mappings -----------------------------------------------------------------------------
    def pointer(self, peer: int, s: Segment, device_index: int) -> int:
        """``s`` (a range ``peer`` exported) mapped into this process: a device pointer on ``device_index``."""
        export = next((e for e in self._peer_exports.get(peer, []) if e.contains(s)), None)
        if export is None:
            raise TransferError(f"cuda_ipc: rank {peer} exported no IPC handle covering 0x{s.addr:x} (+{s.nbytes})")
        key = (peer, export.base, export.handle)
        if key not in self._mapped:
            handle = self._cu.CUipcMemHandle()
            handle.reserved = export.handle
            flags = self._cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            with cuda.use_device(device_index):
                pointer = cuda.check(self._cu.cuIpcOpenMemHandle(handle, flags),
                                     f"cuda_ipc: opening rank {peer}'s memory")
            self._mapped[key] = int(pointer)
        return self._mapped[key] + (s.addr - export.base)

    def _close_mapping(self, key: tuple[int, int, bytes]) -> None:
        self._cu.cuIpcCloseMemHandle(self._mapped.pop(key))
