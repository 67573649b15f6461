"""A rank's memory map: what a peer needs to address this rank's registered memory, as one store value.

Published under ``tensorwire/memmap/<rank>`` on every register/deregister. Wire format (little endian)::

    epoch u32 | section count u16 | sections: (name length u16, data length u32, name, data)* |
    the registered ranges as ``TensorDesc.pack`` bytes

Sections: ``host`` (hostname + boot id: equal for the processes of one machine) and one per backend
(its ``metadata()``: NIXL agent metadata, CUDA IPC handles).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .bootstrap import hostname
from .descriptors import TensorDesc

__all__ = ["MemoryMap", "PeerView", "host_identity"]

_HEADER = struct.Struct("<IH")  # epoch, number of sections
_SECTION_HEADER = struct.Struct("<HI")  # name length, data length


@dataclass
class MemoryMap:
    epoch: int
    sections: dict[str, bytes]
    regions: list[TensorDesc]

    def pack(self) -> bytes:
        parts = [_HEADER.pack(self.epoch, len(self.sections))]
        for name, data in self.sections.items():
            encoded = name.encode()
            parts += [_SECTION_HEADER.pack(len(encoded), len(data)), encoded, data]
        parts.append(TensorDesc.pack(self.regions))
        return b"".join(parts)

    @staticmethod
    def epoch_of(blob: bytes) -> int:
        """The epoch alone, without parsing the rest (the common case: nothing changed)."""
        return _HEADER.unpack_from(blob)[0]

    @staticmethod
    def unpack(blob: bytes) -> "MemoryMap":
        epoch, count = _HEADER.unpack_from(blob)
        offset, sections = _HEADER.size, {}
        for _ in range(count):
            name_length, data_length = _SECTION_HEADER.unpack_from(blob, offset)
            offset += _SECTION_HEADER.size
            name = blob[offset:offset + name_length].decode()
            offset += name_length
            sections[name] = blob[offset:offset + data_length]
            offset += data_length
        return MemoryMap(epoch, sections, TensorDesc.unpack(blob[offset:]))


@dataclass
class PeerView:
    """This process's view of a peer: the epoch it loaded, the peer's host, its registered ranges."""

    epoch: int
    host: str
    regions: list[TensorDesc]


def host_identity() -> str:
    """Same value for every process of one machine (hostname + boot id), different across machines."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{hostname()}/{f.read().strip()}"
    except OSError:
        return hostname()
