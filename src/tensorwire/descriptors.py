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

__all__ = ["MemoryKind", "TensorDesc", "field_problem", "location_problem"]

_MAGIC = b"TWD"
_FORMAT_VERSION = 1
_HEADER = struct.Struct("<3sBI")
_RECORD = struct.Struct("<iBxhIQQ")
_ADDRESS_LIMIT = 1 << 64  # addresses and sizes are u64 on the wire and in every backend
_EPOCH_LIMIT = 1 << 32
_RANK_LIMIT = 1 << 31
_DEVICE_LIMIT = 1 << 15


class MemoryKind(enum.IntEnum):
    """Where a byte range lives."""

    CPU = 0
    CUDA = 1

    @property
    def device_type(self) -> str:
        return "cpu" if self is MemoryKind.CPU else "cuda"


def field_problem(name: str, value: object, limit: int, low: int = 0) -> str | None:
    """What is wrong with an integer field that must lie in ``[low, limit)`` (``limit`` a power of two: a wire
    width), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} is a {type(value).__name__} ({value!r}), not an int"
    if not low <= value < limit:
        return f"{name} {value} is outside [{low}, 2**{limit.bit_length() - 1})"
    return None


def location_problem(rank: object, kind: object, device_index: object, epoch: object) -> str | None:
    """What is wrong with the owner, memory kind, device and epoch of a descriptor, or None: CPU memory is on
    device -1, CUDA memory on a device index that fits the wire's i16."""
    if not isinstance(kind, MemoryKind):
        return f"kind is {kind!r}; pass tw.MemoryKind.CPU or tw.MemoryKind.CUDA"
    if kind is MemoryKind.CPU and device_index != -1:
        return f"CPU memory with device index {device_index!r} (CPU memory is on device -1)"
    return (field_problem("rank", rank, _RANK_LIMIT)
            or (field_problem("device index", device_index, _DEVICE_LIMIT) if kind is MemoryKind.CUDA else None)
            or field_problem("epoch", epoch, _EPOCH_LIMIT))


@dataclass(frozen=True)
class TensorDesc:
    """A byte range ``[addr, addr + nbytes)`` registered by ``rank``.

    ``epoch`` is the owner's registration epoch when the range was published: a reader holding an
    older view of the owner's memory map refreshes it before touching the range.

    A descriptor is untrusted input (built by hand, or read from the store): construction refuses fields
    that no registration can have (``InvalidArgumentError``), so every later check (``prepare`` compares the
    range with the owner's memory map) and every transport sees a range inside 64-bit memory.
    """

    rank: int
    addr: int
    nbytes: int
    kind: MemoryKind
    device_index: int
    epoch: int

    def __post_init__(self) -> None:
        problem = (location_problem(self.rank, self.kind, self.device_index, self.epoch)
                   or field_problem("addr", self.addr, _ADDRESS_LIMIT)
                   or field_problem("nbytes", self.nbytes, _ADDRESS_LIMIT))
        if problem is None and self.addr + self.nbytes > _ADDRESS_LIMIT:
            problem = f"[0x{self.addr:x}, +{self.nbytes}) ends past 2**64"
        if problem is not None:
            raise InvalidArgumentError(
                f"TensorDesc: {problem}; no registered range looks like this: use the descriptors lookup() or "
                "reg.descs return (narrow() inside them)")

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
            try:
                descs.append(TensorDesc(rank, addr, nbytes, MemoryKind(kind), device_index, epoch))
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"{source}: record {i} is not a valid range ({e}); the data is "
                                           "corrupt") from None
        return descs
