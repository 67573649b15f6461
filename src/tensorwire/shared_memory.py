"""Host tensors in shared files, which a peer on this host reaches through the ``shm`` transport, and the
lifetime of those files: nothing tensorwire creates in ``/dev/shm`` outlives its process.

``shared_empty(shape, dtype=)`` allocates an uninitialised host tensor in a new file of ``/dev/shm`` mapped
``MAP_SHARED`` (a peer maps the same file and copies with ``memcpy``). The file belongs to the tensor: it is
removed when the returned tensor is freed, at interpreter exit (a normal end, an uncaught exception, Ctrl-C),
on SIGTERM or SIGHUP (a handler removes this process's files, then lets the signal end the process as it
would have), and, for a process that ended without any of these (SIGKILL, a crash, ``os._exit``), by the next
tensorwire process on this host: ``remove_orphans`` runs in every ``tw.init`` and ``shared_empty``, in
``testing.launch`` once its ranks are gone, and in ``tensorwire doctor`` and the benchmarks.

A file's name says whose it is: ``tensorwire-<pid namespace>-<pid>-<start time>-<random>``, the start time
being the process's, in clock ticks since boot (``/proc/<pid>/stat``). ``remove_orphans`` removes the files of
this user whose process is gone: no process has that pid, or the one that has it started at another time (the
pid was reused), or it is a zombie. The pid namespace keeps a process of another container that shares this
``/dev/shm`` from judging pids that mean nothing to it. A file named without a start time (an older tensorwire)
is judged by its pid alone. A live process's file is never removed.

Non-goals: files the user created (only tensorwire's names are touched), other tmpfs mounts.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import signal
import threading
import weakref
from collections.abc import Sequence

import torch

from .errors import BackendUnavailableError, InvalidArgumentError

__all__ = ["SHM_DIRECTORY", "shared_empty", "owned_file_name", "orphans", "remove_orphans", "remove_own_files",
           "remove_files_of", "start_time"]

SHM_DIRECTORY = "/dev/shm"
_PREFIX = "tensorwire-"
# namespace, pid, start time (absent in the names of older versions), random
_OWNED = re.compile(r"^tensorwire-(\d+)-(\d+)-(?:(\d+)-)?[0-9a-f]+$")
# The signals whose default action ends a process without running exit handlers; a handler that removes this
# process's files first is installed for each where nobody installed one (still SIG_DFL).
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_own_files: set[str] = set()  # the paths this process created and has not removed yet
_own_lock = threading.RLock()  # reentrant: the signal handler may run while the main thread holds it
_handlers_installed = False


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (``pid:[4026531836]``), 0 where /proc does not say."""
    try:
        return int(os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return 0


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``); None where
    /proc does not say (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owned_file_name(directory: str = SHM_DIRECTORY) -> str:
    """A new path in ``directory`` named as this process's own (``remove_orphans`` removes it once the process
    is gone). Creates nothing."""
    pid = os.getpid()
    owner = f"{_pid_namespace()}-{pid}-{start_time(pid) or 0}"
    return os.path.join(directory, f"{_PREFIX}{owner}-{secrets.token_hex(8)}")


def shared_empty(shape: int | Sequence[int], *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` in a new ``/dev/shm`` file that it owns: peers on
    this host that read or write it after ``comm.register`` take the ``shm`` transport (a ``memcpy``).

    The file is removed when the returned tensor is freed (keep it, not only a view of it, for as long as
    peers may reach it), at exit, on SIGTERM or SIGHUP, or after a crash by the next tensorwire process on the
    host. The first call on the main thread installs the SIGTERM and SIGHUP handler that does so, for each of the
    two still at its default action (the process still dies of the signal). Does not block.
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
    remove_orphans()  # what killed processes left may be what keeps this allocation from fitting
    _check_room(nbytes)
    path = owned_file_name()
    _remove_on_ending_signals()
    with _own_lock:
        _own_files.add(path)  # before the file exists: a signal in between finds nothing to remove, not a leak
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
    with _own_lock:
        _own_files.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_own_files() -> None:
    """Remove every file this process created that is still there (its tensors stay mapped and usable; a peer
    that has not mapped one yet can no longer). For the ends that skip exit handlers: a signal handler, and a
    process about to ``os._exit``. Does not block; never raises for a file removed meanwhile."""
    with _own_lock:
        paths = list(_own_files)
        _own_files.clear()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            continue


def _remove_on_ending_signals() -> None:
    """Install, once and from the main thread only (Python's rule for signal handlers), a handler of SIGTERM and
    SIGHUP that removes this process's files and then ends it by the same signal, as its default action would
    have. A signal someone else handles (a server's own SIGTERM handler) is left alone: that code decides how
    the process ends, and its exit handlers remove the files."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    _handlers_installed = True
    for number in _ENDING_SIGNALS:
        if signal.getsignal(number) is signal.SIG_DFL:
            signal.signal(number, _end_by_signal)


def _forget_parent_files() -> None:
    """In a forked child: the files so far are the parent's, not this process's to remove (and the lock may have
    been held by a parent's thread that does not exist here)."""
    global _own_lock
    _own_lock = threading.RLock()
    _own_files.clear()


os.register_at_fork(after_in_child=_forget_parent_files)


def _end_by_signal(number: int, _frame: object) -> None:
    """Remove this process's files, then die of signal ``number`` (its exit status says so, as before)."""
    remove_own_files()
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


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
        if match is None or int(match[1]) != namespace:
            continue
        if _alive(int(match[2]), None if match[3] is None else int(match[3])):
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


def remove_files_of(pid: int, started: int | None) -> list[str]:
    """Remove the files of this user that process ``pid`` of this pid namespace, started at ``started`` (clock
    ticks, ``start_time``; None: judged by the pid alone), created; the paths removed. For a launcher that killed
    that process: it runs no more code, yet may still be alive a while as the kernel tears it down (unmapping a
    large pool), and ``remove_orphans`` spares a live process's files. Does not block."""
    try:
        names = os.listdir(SHM_DIRECTORY)
    except OSError:
        return []
    namespace, uid, removed = _pid_namespace(), os.geteuid(), []
    for name in names:
        match = _OWNED.match(name)
        if match is None or (int(match[1]), int(match[2])) != (namespace, pid):
            continue
        if started is not None and match[3] is not None and int(match[3]) not in (0, started):
            continue  # another process that had the same pid
        path = os.path.join(SHM_DIRECTORY, name)
        try:
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue  # removed meanwhile
    return removed


def _alive(pid: int, started: int | None) -> bool:
    """Whether the process that created a file still runs: process ``pid`` exists, is not a zombie (a killed
    launcher's ranks stay zombies where nothing reaps orphans: a container whose first process does not) and,
    where the name recorded it, started at ``started`` (else the pid was reused by another process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: /proc still tells its state and start
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return not os.path.isdir("/proc/self")  # gone meanwhile; without /proc: judged alive, the safe side
    if fields[0] == "Z":
        return False
    return started in (None, 0) or int(fields[19]) == started
