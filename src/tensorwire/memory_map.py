"""A rank's memory map: what a peer needs to address this rank's registered memory, as one store value.

Published under ``tensorwire/memmap/<rank>`` on every register/deregister. Wire format (little endian)::

    epoch u32 | section count u16 | sections: (name length u16, data length u32, name, data)* |
    the registered ranges as ``TensorDesc.pack`` bytes

Sections: ``host`` (hostname + boot id: equal for the processes of one machine) and one per backend
(its ``metadata()``: NIXL agent metadata, CUDA IPC handles).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from .descriptors import TensorDesc
from .environment import hostname
from .errors import InvalidArgumentError, TensorwireError

__all__ = ["MemoryMap", "PeerView", "host_identity", "typed_decoding"]

_HEADER = struct.Struct("<IH")  # epoch, number of sections
_SECTION_HEADER = struct.Struct("<HI")  # name length, data length


def _corrupt(source: str, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{source}: {problem}; the value is corrupt or was not written by tensorwire. It was not used: check that "
        "every rank runs the same tensorwire version, and set TENSORWIRE_JOB_TOKEN so that forged values are "
        "refused before they are decoded"
    )


@contextlib.contextmanager
def typed_decoding(source: str) -> Iterator[None]:
    """Turns what a decoder of a store value raises from deep inside (``struct.error``, ``UnicodeDecodeError``,
    ``KeyError``, ``IndexError``, ``ValueError``) into ``InvalidArgumentError`` naming ``source``; tensorwire's
    own errors pass as they are."""
    try:
        yield
    except TensorwireError:
        raise
    except (struct.error, ValueError, KeyError, IndexError, OverflowError) as e:  # UnicodeDecodeError is a ValueError
        raise _corrupt(source, f"decoding failed ({type(e).__name__}: {e})") from e


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
    def epoch_of(blob: bytes, source: str = "MemoryMap.epoch_of") -> int:
        """The epoch alone, without parsing the rest (the common case: nothing changed)."""
        if len(blob) < _HEADER.size:
            raise _corrupt(source, f"{len(blob)} bytes is shorter than the {_HEADER.size}-byte header")
        return _HEADER.unpack_from(blob)[0]

    @staticmethod
    def unpack(blob: bytes, source: str = "MemoryMap.unpack") -> MemoryMap:
        """Inverse of ``pack``. Every length is checked against the bytes that are there before anything is
        sliced or allocated; a map without a UTF-8 ``host`` section, with a section twice, or with bytes left over
        raises ``InvalidArgumentError`` naming ``source`` (e.g. the key and rank it was read from)."""
        blob = bytes(blob)
        epoch = MemoryMap.epoch_of(blob, source)
        count = _HEADER.unpack_from(blob)[1]
        offset, sections = _HEADER.size, {}
        for i in range(count):
            if len(blob) - offset < _SECTION_HEADER.size:
                raise _corrupt(source, f"section {i} of {count} starts past the end ({len(blob)} bytes)")
            name_length, data_length = _SECTION_HEADER.unpack_from(blob, offset)
            offset += _SECTION_HEADER.size
            if name_length + data_length > len(blob) - offset:
                raise _corrupt(source, f"section {i} claims {name_length} + {data_length} bytes, "
                                       f"{len(blob) - offset} are left")
            try:
                name = blob[offset:offset + name_length].decode()
            except UnicodeDecodeError:
                raise _corrupt(source, f"section {i} has a name that is not UTF-8") from None
            if name in sections:
                raise _corrupt(source, f"section {name!r} appears twice")
            offset += name_length
            sections[name] = blob[offset:offset + data_length]
            offset += data_length
        host = sections.get("host")
        if host is None:
            raise _corrupt(source, f"no 'host' section (found {sorted(sections)})")
        try:
            host.decode()
        except UnicodeDecodeError:
            raise _corrupt(source, "the 'host' section is not UTF-8") from None
        return MemoryMap(epoch, sections, TensorDesc.unpack(blob[offset:], source=source))


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
