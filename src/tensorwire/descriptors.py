"""Descriptors of remote memory: small, immutable, versioned values that travel as bytes.

A ``TensorDesc`` names a byte range that some rank registered. It is not a handle: holding one keeps
nothing alive and grants nothing locally. Local memory is owned by a ``Registration`` (see
``registration.py``); a ``TensorDesc`` is what a ``Registration`` shows to other ranks.

Wire format (little endian), ``TensorDesc.pack``::

    header  : magic b"TWD" | format version u8 | record count u32
    record i: rank i32 | memory kind u8 | pad u8 | device index i16 | epoch u32 | addr u64 | nbytes u64
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, replace

from .errors import InvalidArgumentError

__all__ = ["MemoryKind", "TensorDesc"]

_MAGIC = b"TWD"
_FORMAT_VERSION = 1
_HEADER = struct.Struct("<3sBI")
_RECORD = struct.Struct("<iBxhIQQ")


class MemoryKind(enum.IntEnum):
    """Where a byte range lives."""

    CPU = 0
    CUDA = 1

    @property
    def device_type(self) -> str:
        return "cpu" if self is MemoryKind.CPU else "cuda"


@dataclass(frozen=True)
class TensorDesc:
    """A byte range ``[addr, addr + nbytes)`` registered by ``rank``.

    ``epoch`` is the owner's registration epoch when the range was published: a reader holding an
    older view of the owner's memory map refreshes it before touching the range.
    """

    rank: int
    addr: int
    nbytes: int
    kind: MemoryKind
    device_index: int
    epoch: int

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:<index>"`` on the owner's machine."""
        return "cpu" if self.kind is MemoryKind.CPU else f"cuda:{self.device_index}"

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    def narrow(self, offset: int, nbytes: int) -> TensorDesc:
        """The sub-range ``[addr + offset, addr + offset + nbytes)``; must lie inside this one."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise InvalidArgumentError(
                f"TensorDesc.narrow: [{offset}, {offset + nbytes}) is outside the {self.nbytes} bytes "
                f"of this descriptor; give 0 <= offset and offset + nbytes <= {self.nbytes}"
            )
        return replace(self, addr=self.addr + offset, nbytes=nbytes)

    def contains(self, other: TensorDesc) -> bool:
        """Whether ``other`` lies inside this range on the same rank and device."""
        return (
            other.rank == self.rank
            and other.kind == self.kind
            and other.device_index == self.device_index
            and self.addr <= other.addr
            and other.end <= self.end
        )

    @staticmethod
    def pack(descs: list[TensorDesc] | TensorDesc) -> bytes:
        """Serialize descriptors to bytes (``len == 8 + 28 * n``)."""
        descs = [descs] if isinstance(descs, TensorDesc) else list(descs)
        parts = [_HEADER.pack(_MAGIC, _FORMAT_VERSION, len(descs))]
        for d in descs:
            if not isinstance(d, TensorDesc):
                raise InvalidArgumentError(
                    f"TensorDesc.pack: got {type(d).__name__}; pass TensorDesc values (reg.descs)"
                )
            parts.append(_RECORD.pack(d.rank, int(d.kind), d.device_index, d.epoch, d.addr, d.nbytes))
        return b"".join(parts)

    @staticmethod
    def unpack(data: bytes, *, source: str = "TensorDesc.unpack") -> list[TensorDesc]:
        """Inverse of ``pack``; corrupt or foreign bytes raise ``InvalidArgumentError`` whose message starts with
        ``source`` (say where the bytes came from: a store key and rank). The record count is checked against
        the length before anything is allocated."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(
                f"{source}: got {type(data).__name__}; pass the bytes TensorDesc.pack made"
            )
        data = bytes(data)
        if len(data) < _HEADER.size:
            raise InvalidArgumentError(
                f"{source}: {len(data)} bytes is shorter than the {_HEADER.size}-byte header; "
                "the data is truncated or was not made by TensorDesc.pack"
            )
        magic, version, count = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise InvalidArgumentError(
                f"{source}: bad magic {magic!r} (expected {_MAGIC!r}); "
                "the data was not made by TensorDesc.pack"
            )
        if version != _FORMAT_VERSION:
            raise InvalidArgumentError(
                f"{source}: format version {version}, this tensorwire reads {_FORMAT_VERSION}; "
                "use the same tensorwire version on every rank"
            )
        expected = _HEADER.size + count * _RECORD.size
        if len(data) != expected:
            raise InvalidArgumentError(
                f"{source}: {len(data)} bytes for {count} records, expected {expected}; "
                "the data is truncated or corrupt"
            )
        descs = []
        for i in range(count):
            rank, kind, device_index, epoch, addr, nbytes = _RECORD.unpack_from(
                data, _HEADER.size + i * _RECORD.size
            )
            if kind not in (0, 1) or rank < 0:
                raise InvalidArgumentError(
                    f"{source}: record {i} has rank {rank}, memory kind {kind}; the data is corrupt"
                )
            descs.append(TensorDesc(rank, addr, nbytes, MemoryKind(kind), device_index, epoch))
        return descs
