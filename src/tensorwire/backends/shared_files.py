"""Which file backs a range of this process's memory (``/proc/self/maps``): what the ``shm`` transport exports of a
host range, and what ``tw.in_shared_file`` tells a user. No I/O beyond reading the maps and a ``stat``."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["SharedFile", "shared_file_of", "in_shared_file", "removed_file_of"]


@dataclass(frozen=True)
class SharedFile:
    """Where a range of this process lives: ``path`` at ``offset``, the file being (``device``, ``inode``)."""

    path: str
    offset: int
    device: int
    inode: int

    def is_at_path(self) -> bool:
        """Whether ``path`` names this very regular file here and is readable and writable. A peer on the same
        host but in another mount namespace (a container with its own /dev/shm) may find another file, or
        none, under the same name; it must not copy into that."""
        try:
            found = os.lstat(self.path)
        except OSError:
            return False
        return (stat.S_ISREG(found.st_mode) and (found.st_dev, found.st_ino) == (self.device, self.inode)
                and os.access(self.path, os.R_OK | os.W_OK))


def _mapping_of(addr: int, nbytes: int) -> list[str] | None:
    """The ``/proc/self/maps`` fields (range, perms, offset, dev, inode, path) of the file mapping holding all of
    ``[addr, addr + nbytes)``, or None (anonymous memory, or a range across mappings)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue  # anonymous memory
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= addr and addr + nbytes <= end:
                return [*fields[:5], fields[5].rstrip("\n")]
    return None


def shared_file_of(addr: int, nbytes: int) -> SharedFile | None:
    """The file behind ``[addr, addr + nbytes)`` if the range lies in one ``MAP_SHARED`` mapping of a regular
    file that its path still names, else None (anonymous memory; device files such as ``/dev/nvidia*``,
    which back pinned CUDA host memory; a file removed or replaced since it was mapped)."""
    fields = _mapping_of(addr, nbytes)
    if fields is None or fields[1][3] != "s" or not fields[5].startswith("/"):
        return None
    start = int(fields[0].split("-")[0], 16)
    major, minor = (int(x, 16) for x in fields[3].split(":"))
    file = SharedFile(fields[5], int(fields[2], 16) + (addr - start), os.makedev(major, minor), int(fields[4]))
    return file if file.is_at_path() else None


def in_shared_file(tensor: torch.Tensor) -> bool:
    """Whether a host tensor's bytes lie in one shared mapping of a file that a process of this host can map too
    (``tw.shared_empty``, ``torch.from_file(..., shared=True)``): what the ``shm`` transport needs of a peer's
    memory. False for GPU memory, private memory and a removed file. Never blocks (reads ``/proc/self/maps``)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not os.path.exists("/proc/self/maps"):
        return False
    return shared_file_of(tensor.data_ptr(), tensor.numel() * tensor.element_size()) is not None


def removed_file_of(addr: int, nbytes: int) -> str | None:
    """The path of the shared file behind ``[addr, addr + nbytes)`` when that file was removed after it was
    mapped (the kernel marks the mapping ``(deleted)``): a peer can no longer open it. Else None."""
    fields = _mapping_of(addr, nbytes)
    suffix = " (deleted)"
    if fields is None or fields[1][3] != "s" or not fields[5].endswith(suffix):
        return None
    return fields[5][: -len(suffix)]
