"""Same-host host-memory transport: peers' registered ranges that live in a shared file mapping, copied
with ``memcpy`` through a mapping of the same file in this process.

UCX moves host memory between two processes of one host with ``process_vm_writev`` (``cma``): 7.5 GB/s on
a 2-core EPYC VM where a ``memcpy`` does 19.6 GB/s. When the peer's range is backed by a file mapped
``MAP_SHARED`` (a file in ``/dev/shm`` or another tmpfs, e.g. ``torch.from_file(path, shared=True, ...)``),
this process can map the same file and copy at ``memcpy`` speed instead.

At ``register`` each host range is looked up in ``/proc/self/maps``; a range inside one shared mapping of
a named file is exported as (address, size, file, offset). A peer maps the file region once (cached per
peer and export, kept until ``close``) and ``post`` copies on the calling thread: the transfer is complete
when ``post`` returns. Ranges of anonymous or private memory are not exported and take NIXL.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import struct
from dataclasses import dataclass

from ..descriptors import MemoryKind
from ..errors import TransferError
from .base import Capabilities, Op, Segment, Status

__all__ = ["ShmBackend", "shared_file_of"]

_EXPORT = struct.Struct("<QQQH")  # addr, nbytes, file offset of addr, length of the path that follows


@dataclass(frozen=True)
class _Export:
    addr: int
    nbytes: int
    offset: int  # of ``addr`` in ``path``
    path: str

    def contains(self, s: Segment) -> bool:
        return s.kind is MemoryKind.CPU and self.addr <= s.addr and s.addr + s.nbytes <= self.addr + self.nbytes


@dataclass
class _Request:
    copies: list[tuple[int, int, int]]  # (destination address, source address, nbytes) in this process


def shared_file_of(addr: int, nbytes: int) -> tuple[str, int] | None:
    """``(path, file offset of addr)`` if ``[addr, addr + nbytes)`` lies in one ``MAP_SHARED`` mapping of a
    regular file of this process, else None (device files such as ``/dev/nvidia*``, which back pinned CUDA
    host memory, are not files a peer could map)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue  # anonymous memory
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not (start <= addr and addr + nbytes <= end):
                continue
            path = fields[5].rstrip("\n")
            shared = fields[1][3] == "s"
            if shared and path.startswith("/") and not path.endswith(" (deleted)") and _is_regular_file(path):
                return path, int(fields[2], 16) + (addr - start)
            return None
    return None


def _is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


class ShmBackend:
    """The ``Backend`` protocol over shared file mappings between processes of one host.

    Driven by the CPU like NIXL (not stream-ordered): ``post(stream=)`` on a transfer rings the doorbell the
    progress thread answers, so the copy starts only once the stream has produced the bytes."""

    name = "shm"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.CPU}), remote=True, stream_ordered=False)

    def __init__(self) -> None:
        self._exports: dict[tuple[int, int], _Export] = {}  # (addr, nbytes) -> export, this process
        self._peer_exports: dict[int, list[_Export]] = {}
        self._mapped: dict[tuple[int, _Export], tuple[mmap.mmap, ctypes.Array, int]] = {}  # -> (map, view, base)

    # --- memory -------------------------------------------------------------------------------
    def register(self, segment: Segment) -> tuple[int, int] | None:
        found = shared_file_of(segment.addr, segment.nbytes)
        if found is None:
            return None  # anonymous or private memory: NIXL carries it
        key = (segment.addr, segment.nbytes)
        self._exports[key] = _Export(segment.addr, segment.nbytes, found[1], found[0])
        return key

    def deregister(self, handle: tuple[int, int] | None) -> None:
        if handle is not None:
            self._exports.pop(handle, None)

    # --- peers --------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        parts = []
        for e in self._exports.values():
            path = e.path.encode()
            parts.append(_EXPORT.pack(e.addr, e.nbytes, e.offset, len(path)) + path)
        return b"".join(parts)

    def load_peer(self, rank: int, metadata: bytes) -> None:
        exports, at = [], 0
        while at < len(metadata):
            addr, nbytes, offset, length = _EXPORT.unpack_from(metadata, at)
            at += _EXPORT.size
            exports.append(_Export(addr, nbytes, offset, metadata[at:at + length].decode()))
            at += length
        # Mappings stay until close: a transfer prepared on a range the peer has since deregistered then
        # writes into pages only this process still holds, never into unmapped memory.
        self._peer_exports[rank] = exports

    def reaches(self, peer: int, remote: list[Segment]) -> bool:
        """Whether every remote segment lies in a shared file mapping ``peer`` exported."""
        exports = self._peer_exports.get(peer, [])
        return all(any(e.contains(s) for e in exports) for s in remote)

    # --- transfers ----------------------------------------------------------------------------
    def prepare(self, op: Op, local: list[Segment], remote: list[Segment], peer: int, notify: bytes | None) -> _Request:
        copies = []
        for mine, theirs in zip(local, remote):
            pointer = self._pointer(peer, theirs)
            copies.append((mine.addr, pointer, mine.nbytes) if op is Op.READ else (pointer, mine.addr, mine.nbytes))
        return _Request(copies)

    def post(self, request: _Request, notify: bytes | None, stream: object = None) -> Status:
        for destination, source, nbytes in request.copies:
            ctypes.memmove(destination, source, nbytes)  # a foreign call: the GIL is released meanwhile
        return Status.DONE

    def status(self, request: _Request) -> Status:
        return Status.DONE  # every copy completes inside post

    def release(self, request: _Request) -> None:
        request.copies = []

    def notifications(self) -> list[tuple[int, bytes]]:
        return []  # notifications to a peer travel through NIXL

    def close(self) -> None:
        for key in list(self._mapped):
            self._unmap(key)
        self._exports.clear()
        self._peer_exports.clear()

    # --- mappings -----------------------------------------------------------------------------
    def _pointer(self, peer: int, s: Segment) -> int:
        """``s`` (a range ``peer`` exported) mapped into this process."""
        export = next((e for e in self._peer_exports.get(peer, []) if e.contains(s)), None)
        if export is None:
            raise TransferError(f"shm: rank {peer} exported no shared mapping covering 0x{s.addr:x} (+{s.nbytes})")
        key = (peer, export)
        if key not in self._mapped:
            start = export.offset - export.offset % mmap.ALLOCATIONGRANULARITY
            length = export.offset + export.nbytes - start
            try:
                fd = os.open(export.path, os.O_RDWR)
            except OSError as e:
                raise TransferError(f"shm: cannot open rank {peer}'s shared file {export.path!r}: {e}; give this "
                                    "process read/write access to it, or pass transport='nixl'") from e
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise TransferError(f"shm: rank {peer}'s {export.path!r} is not a regular file; pass "
                                        "transport='nixl'")
                mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
            finally:
                os.close(fd)
            view = (ctypes.c_char * length).from_buffer(mapping)
            self._mapped[key] = (mapping, view, ctypes.addressof(view) + export.offset - start)
        return self._mapped[key][2] + (s.addr - export.addr)

    def _unmap(self, key: tuple[int, _Export]) -> None:
        mapping, view, _ = self._mapped.pop(key)
        del view  # the buffer export must go before the map can close
        mapping.close()
