"""Host tensors in shared files, which a peer on this host reaches through the ``shm`` transport, and the
lifetime of those files: nothing tensorwire creates in ``/dev/shm`` outlives its process.

``shared_empty(shape, dtype=)`` allocates an uninitialised host tensor in a new file of ``/dev/shm`` mapped
``MAP_SHARED`` (a peer maps the same file and copies with ``memcpy``). The file belongs to the tensor: it is
removed when the returned tensor is freed, at interpreter exit (a normal end, an uncaught exception, Ctrl-C)
and, for a process that ended without either (SIGKILL, a crash), by the next tensorwire process on this host:
``remove_orphans`` runs in every ``tw.init``, in ``testing.launch`` once its ranks are gone, and in
``tensorwire doctor --clean``.

A file's name says whose it is: ``tensorwire-<pid namespace>-<pid>-<random>``. ``remove_orphans`` removes
the files of this user whose process is gone; the pid namespace keeps a process of another container that
shares this ``/dev/shm`` from judging pids that mean nothing to it. A pid reused since its process died keeps
the file until a later sweep (the safe side: a live process's file is never removed).

Non-goals: files the user created (only tensorwire's names are touched), other tmpfs mounts.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import weakref
from collections.abc import Sequence

import torch

from .errors import BackendUnavailableError, InvalidArgumentError

__all__ = ["SHM_DIRECTORY", "shared_empty", "owned_file_name", "orphans", "remove_orphans"]

SHM_DIRECTORY = "/dev/shm"
_PREFIX = "tensorwire-"
_OWNED = re.compile(r"^tensorwire-(\d+)-(\d+)-[0-9a-f]+$")


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (``pid:[4026531836]``), 0 where /proc does not say."""
    try:
        return int(os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return 0


def owned_file_name(directory: str = SHM_DIRECTORY) -> str:
    """A new path in ``directory`` named as this process's own (``remove_orphans`` removes it once the process
    is gone). Creates nothing."""
    return os.path.join(directory, f"{_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}")


def shared_empty(shape: int | Sequence[int], *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` in a new ``/dev/shm`` file that it owns: peers on
    this host that read or write it after ``comm.register`` take the ``shm`` transport (a ``memcpy``).

    The file is removed when the returned tensor is freed (keep it, not only a view of it, for as long as
    peers may reach it), at exit, or after a crash by the next tensorwire process on the host. Does not block.
    Raises ``InvalidArgumentError`` for a bad shape or dtype, ``BackendUnavailableError`` when ``/dev/shm``
    is missing or has not the room (touching a page past a full tmpfs would kill the process with SIGBUS).
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not dims or not all(isinstance(d, int) and d > 0 for d in dims):
        raise InvalidArgumentError(f"shared_empty: shape={shape!r}; give positive ints, e.g. (1024, 4096)")
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"shared_empty: dtype={dtype!r}; give a torch.dtype, e.g. torch.bfloat16")
    numel = math.prod(dims)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    _check_room(nbytes)
    path = owned_file_name()
    tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(dims)
    weakref.finalize(tensor, _remove, path)  # also runs at interpreter exit
    return tensor


def _check_room(nbytes: int) -> None:
    if not os.path.isdir(SHM_DIRECTORY):
        raise BackendUnavailableError(f"shared_empty: no {SHM_DIRECTORY} on this machine; allocate with "
                                      "torch.empty instead (peers then take nixl)")
    status = os.statvfs(SHM_DIRECTORY)
    free = status.f_bavail * status.f_frsize
    if nbytes > free:
        raise BackendUnavailableError(
            f"shared_empty: {nbytes} bytes do not fit in {SHM_DIRECTORY} ({free} bytes free); free room there "
            "(tensorwire doctor --clean removes what dead processes left) or allocate with torch.empty")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def orphans(directory: str = SHM_DIRECTORY) -> list[str]:
    """The files in ``directory`` that tensorwire processes of this user and pid namespace created and that
    outlived their process. Does not block (one directory listing)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    namespace, uid, found = _pid_namespace(), os.geteuid(), []
    for name in names:
        match = _OWNED.match(name)
        if match is None or int(match[1]) != namespace or _alive(int(match[2])):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == uid:
                found.append(path)
        except OSError:
            continue  # removed meanwhile
    return found


def remove_orphans(directory: str = SHM_DIRECTORY) -> list[str]:
    """Remove ``orphans(directory)``; the paths removed. Never raises for a file another process removed
    meanwhile. Does not block."""
    removed = []
    for path in orphans(directory):
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs. A zombie does not: a killed launcher's ranks stay zombies where nothing
    reaps orphans (a container whose first process does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: judged alive, the safe side
