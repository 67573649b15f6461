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

A dead peer. The mapping outlives the peer (its file stays), so a copy never fails by itself: a WRITE would
land in a file no process reads and a READ would return the dead rank's last bytes, both as done. So a
post looks at the peer's liveness (``Liveness.lost``): a WRITE before its copy (no byte goes to a peer known
gone), a READ after it (bytes read while the peer died are not reported as done), and raises
``PeerLostError``. A look costs ~0.15 µs against ~1 µs for a whole 4 KiB post, so a request looks at most
every ``_PEER_LOOK_S`` and a post in between reads the clock only: a peer's death is seen by the posts that
follow within that period plus the liveness view's own delay (a killed process: at once; a cut link: within
``TENSORWIRE_LIVENESS_S``).

Trust. A peer's export names a file this process then writes into, so a forged export must not reach an
arbitrary file. A file is mapped only if it is a regular file reached without following any symbolic link
(every component opened with ``O_NOFOLLOW``), owned by this process's user, still the very file the peer
mapped (``st_dev``, ``st_ino``) and large enough for the exported range. In a job without a job token the
export could come from anyone who reaches the store, so only files directly in ``/dev/shm`` (tensorwire's
own names: where shared tensors of a job live) are mapped there; other shared files take NIXL. With a
token the export is authenticated, and any such file of the peer is mapped.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import stat
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from ..descriptors import MemoryKind
from ..errors import InvalidArgumentError, PeerLostError, TensorwireWarning, TransferError
from .base import BackendContext, BackendInfo, Capabilities, Op, Poster, Segment, Status
from .block_copy import BlockBindings, BlockLayout, HostBlockRequest, copy_request
from .shared_files import SharedFile, in_shared_file, removed_file_of, shared_file_of

__all__ = ["ShmBackend", "SharedFile", "shared_file_of", "removed_file_of", "in_shared_file", "info"]


def info() -> BackendInfo:
    """Usable on Linux (``/proc/self/maps`` finds the file behind a range); only for host memory a same-host
    peer registered inside a shared file mapping."""
    if not os.path.exists("/proc/self/maps"):
        return BackendInfo("shm", False, "no /proc/self/maps here: shared file mappings cannot be found",
                           fix="host memory takes nixl")
    return BackendInfo("shm", True, "host memory a same-host peer registered in a shared file mapping (e.g. "
                                    "/dev/shm): memcpy through a mapping of it")

_EXPORT = struct.Struct("<QQQQQH")  # addr, nbytes, file offset of addr, st_dev, st_ino, length of the path
_SHM_DIRECTORY = "/dev/shm"
_PEER_LOOK_S = 0.01  # a request looks at its peer's liveness at most this often (see the module docstring)
_monotonic = time.monotonic


@dataclass(frozen=True)
class _Export:
    addr: int
    nbytes: int
    file: SharedFile

    def contains(self, s: Segment) -> bool:
        return s.kind is MemoryKind.CPU and self.addr <= s.addr and s.addr + s.nbytes <= self.addr + self.nbytes


@dataclass
class _PeerWatch:
    """A request's look at its peer: ``read`` looks after the copy, a WRITE before it; ``next_look`` is when the
    next post looks (it stays due once the peer is found gone). Written by whichever thread posts."""

    peer: int
    read: bool
    what: str  # "the READ of 4096 bytes with rank 1 over shm"
    next_look: float = 0.0


@dataclass
class _Request:
    copies: list[tuple[int, int, int]]  # (destination address, source address, nbytes) in this process
    watch: _PeerWatch
    blocks: HostBlockRequest | None = None  # a block request's copies instead of ``copies``

    takes_device_ids = False  # host memory only

    @property
    def bindings(self) -> BlockBindings:  # a block request (base.BlockRequest): the host copy's ids
        return self.blocks.bindings


class ShmBackend:
    """The ``Backend`` protocol over shared file mappings between processes of one host.

    Driven by the CPU like NIXL (not stream-ordered): ``post(stream=)`` on a transfer rings the doorbell the
    progress thread answers, so the copy starts only once the stream has produced the bytes."""

    name = "shm"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.CPU}), remote=True, stream_ordered=False,
                                same_host_only=True, same_kind_only=True)

    def __init__(self, *, authenticated: bool = False,
                 peer_lost: Callable[..., str | None] = lambda rank, fresh=False: None) -> None:
        """``peer_lost(rank, fresh=True)``: why ``rank`` is gone, or None (``Liveness.lost``)."""
        self._authenticated = authenticated  # peers' exports come from the job (a job token verified them)
        self._peer_lost = peer_lost
        self._exports: dict[tuple[int, int], _Export] = {}  # (addr, nbytes) -> export, this process
        self._peer_exports: dict[int, list[_Export]] = {}
        self._mapped: dict[tuple[int, _Export], tuple[mmap.mmap, ctypes.Array, int]] = {}  # -> (map, view, base)
        self._warned_removed: set[str] = set()

    @classmethod
    def create(cls, context: BackendContext) -> ShmBackend:
        return cls(authenticated=context.config.job_token is not None, peer_lost=context.peer_lost)

    # --- memory -------------------------------------------------------------------------------
    def register(self, segment: Segment) -> tuple[int, int] | None:
        file = shared_file_of(segment.addr, segment.nbytes)
        if file is None:
            self._warn_if_removed(segment)
            return None  # anonymous or private memory: NIXL carries it
        key = (segment.addr, segment.nbytes)
        self._exports[key] = _Export(segment.addr, segment.nbytes, file)
        return key

    def _warn_if_removed(self, segment: Segment) -> None:  # once per file
        path = removed_file_of(segment.addr, segment.nbytes)
        if path is not None and path not in self._warned_removed:
            self._warned_removed.add(path)
            warnings.warn(f"tensorwire: register: host memory at 0x{segment.addr:x} (+{segment.nbytes}) lies in "
                          f"{path!r}, which was removed after it was mapped: peers on this host take nixl, not shm; "
                          "keep the file until the registration is closed (tw.shared_empty does)",
                          TensorwireWarning, stacklevel=5)

    def deregister(self, handle: tuple[int, int] | None) -> None:
        if handle is not None:
            self._exports.pop(handle, None)

    # --- peers --------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        parts = []
        for e in self._exports.values():
            path = e.file.path.encode()
            parts.append(_EXPORT.pack(e.addr, e.nbytes, e.file.offset, e.file.device, e.file.inode, len(path)) + path)
        return b"".join(parts)

    def load_peer(self, rank: int, metadata: bytes) -> None:
        exports, at = [], 0
        while at < len(metadata):
            if len(metadata) - at < _EXPORT.size:
                raise _bad_export(rank, f"{len(metadata) - at} bytes left at offset {at}, an export takes "
                                        f"{_EXPORT.size} + its path")
            addr, nbytes, offset, device, inode, length = _EXPORT.unpack_from(metadata, at)
            at += _EXPORT.size
            if length > len(metadata) - at:
                raise _bad_export(rank, f"a path of {length} bytes at offset {at}, {len(metadata) - at} are left")
            try:
                path = metadata[at:at + length].decode()
            except UnicodeDecodeError:
                raise _bad_export(rank, f"the path at offset {at} is not UTF-8") from None
            if not _is_plain_absolute(path):
                raise _bad_export(rank, f"path {path!r} is not a plain absolute path")
            exports.append(_Export(addr, nbytes, SharedFile(path, offset, device, inode)))
            at += length
        # Mappings stay until close: a transfer prepared on a range the peer has since deregistered then
        # writes into pages only this process still holds, never into unmapped memory.
        self._peer_exports[rank] = exports

    def reaches(self, peer: int, remote: list[Segment]) -> bool:
        """Whether every remote segment lies in a shared file mapping ``peer`` exported, whose file this
        process finds under the same path and may read and write."""
        exports = self._peer_exports.get(peer, [])
        return all(any(e.contains(s) and ((peer, e) in self._mapped or self._refusal(e) is None) for e in exports)
                   for s in remote)

    def unreached_reason(self, peer: int, remote: list[Segment]) -> str | None:
        """Why ``reaches(peer, remote)`` is false, or None when it is true: a range in no shared file mapping
        ``peer`` exported (anonymous or private memory), or ``refused_file``'s reason."""
        for s in remote:
            if not any(e.contains(s) for e in self._peer_exports.get(peer, [])):
                return (f"rank {peer} registered [0x{s.addr:x}, +{s.nbytes}) outside any shared file mapping "
                        "(anonymous or private memory; tw.shared_empty allocates host memory that shm reaches)")
        return self.refused_file(peer, remote)

    def refused_file(self, peer: int, remote: list[Segment]) -> str | None:
        """Why a range ``peer`` registered in a shared file cannot be reached through that file here (removed
        or replaced since, another user's, ...), or None: the degradation to NIXL worth a warning."""
        for s in remote:
            exports = [e for e in self._peer_exports.get(peer, []) if e.contains(s)]
            refusal = None if any((peer, e) in self._mapped for e in exports) else exports and self._refusal(exports[0])
            if refusal:
                return f"rank {peer}'s file {exports[0].file.path!r} {refusal}"
        return None

    def _refusal(self, export: _Export) -> str | None:
        """Why ``export``'s file must not be mapped here, or None (the file opened and checked, then closed)."""
        try:
            os.close(self._open_checked(export))
        except _Refused as e:
            return str(e)
        return None

    def _open_checked(self, export: _Export) -> int:
        """A read/write descriptor of ``export``'s file after every check of the module docstring, else ``_Refused``."""
        file = export.file
        if not self._authenticated and os.path.dirname(file.path) != os.path.realpath(_SHM_DIRECTORY):
            raise _Refused(f"is not directly in {_SHM_DIRECTORY} and this job has no TENSORWIRE_JOB_TOKEN to "
                           "authenticate the export")
        fd = _open_without_links(file.path)
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise _Refused("is not a regular file")
            if found.st_uid != os.geteuid():
                raise _Refused(f"belongs to uid {found.st_uid}, this process runs as uid {os.geteuid()}")
            if (found.st_dev, found.st_ino) != (file.device, file.inode):
                raise _Refused("here is not the file the peer mapped (another mount namespace, or replaced since)")
            if found.st_size < file.offset + export.nbytes:
                raise _Refused(f"has {found.st_size} bytes, the export reaches byte {file.offset + export.nbytes}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    # --- transfers ----------------------------------------------------------------------------
    def prepare(self, op: Op, local: list[Segment], remote: list[Segment], peer: int, notify: bytes | None) -> _Request:
        copies = []
        for mine, theirs in zip(local, remote):
            pointer = self._pointer(peer, theirs)
            copies.append((mine.addr, pointer, mine.nbytes) if op is Op.READ else (pointer, mine.addr, mine.nbytes))
        nbytes = sum(s.nbytes for s in local)
        return _Request(copies, _PeerWatch(peer, op is Op.READ, f"the {op.value} of {nbytes} bytes with rank {peer}"))

    def prepare_blocks(self, op: Op, local: BlockLayout, remote: BlockLayout, peer: int) -> _Request:
        """Blocks between this process's host pool and a peer's pool in shared files, mapped here."""
        mapped = [self._pointer(peer, remote.span(r)) for r in remote.regions]
        blocks = copy_request(op is Op.READ, local, remote, mapped)
        return _Request([], _PeerWatch(peer, op is Op.READ, f"the block {op.value} with rank {peer}"), blocks)

    def bind_blocks(self, request: _Request, local_ids, remote_ids, notify: bytes | None) -> None:
        request.blocks.bind(local_ids, remote_ids, notify)

    def post(self, request: _Request, notify: bytes | None, stream: object = None) -> Status:
        watch = request.watch
        if not watch.read and _monotonic() >= watch.next_look:
            self._look_at_peer(watch)
        if request.blocks is not None:
            request.blocks.post()
        _copy_all(request.copies)
        if watch.read and _monotonic() >= watch.next_look:
            self._look_at_peer(watch)
        return Status.DONE

    def poster(self, request: _Request, notify: bytes | None) -> Poster:
        """``post`` unbundled for ``Transfer``'s hot path: the copies and the look at the peer bound once, so a
        re-post costs its copies, one clock read and one comparison (``post`` itself serves stream posts)."""
        watch, look = request.watch, self._look_at_peer
        if request.blocks is not None:
            copy = request.blocks.post
        elif len(request.copies) == 1:
            copy = functools.partial(ctypes.memmove, *request.copies[0])
        else:
            copy = functools.partial(_copy_all, request.copies)
        if watch.read:
            def post() -> None:
                copy()
                if _monotonic() >= watch.next_look:
                    look(watch)
        else:
            def post() -> None:
                if _monotonic() >= watch.next_look:
                    look(watch)
                copy()
        return Poster(post, None, lambda _: Status.DONE, lambda e: e)

    def _look_at_peer(self, watch: _PeerWatch) -> None:
        reason = self._peer_lost(watch.peer, fresh=True)
        if reason is not None:
            outcome = "the bytes read are not valid" if watch.read else "nothing was written"
            raise PeerLostError(f"post: {watch.what} over shm: rank {watch.peer} is gone ({reason}), {outcome}; it "
                                "exited, crashed, closed its communicator or its network broke: close the transfer")
        watch.next_look = _monotonic() + _PEER_LOOK_S

    def status(self, request: _Request) -> Status:
        return Status.DONE  # every copy completes inside post

    def release(self, request: _Request) -> None:
        if request.blocks is not None:
            request.blocks.release()
        request.copies = []

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
            try:
                fd = self._open_checked(export)
            except _Refused as e:
                raise TransferError(f"shm: refusing rank {peer}'s shared file {export.file.path!r}: it {e}; pass "
                                    "transport='nixl'") from None
            self._mapped[key] = _map(fd, export.file, export.nbytes, peer)
        return self._mapped[key][2] + (s.addr - export.addr)

    def _unmap(self, key: tuple[int, _Export]) -> None:
        mapping, view, _ = self._mapped.pop(key)
        del view  # the buffer export must go before the map can close
        mapping.close()


def _copy_all(copies: list[tuple[int, int, int]]) -> None:
    for destination, source, nbytes in copies:
        ctypes.memmove(destination, source, nbytes)  # a foreign call: the GIL is released meanwhile


class _Refused(Exception):
    """A peer's shared file fails a check; the message completes "the file ..."."""


def _bad_export(rank: int, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"shm: the shared-file exports in rank {rank}'s memory map are corrupt ({problem}); they were not used: "
        "check that every rank runs the same tensorwire version, and set TENSORWIRE_JOB_TOKEN"
    )


def _is_plain_absolute(path: str) -> bool:
    return (path.startswith("/") and not path.startswith("//") and "\0" not in path
            and os.path.normpath(path) == path and path != "/")


def _open_without_links(path: str) -> int:
    """``path`` opened read/write, walking from ``/`` one component at a time with ``O_NOFOLLOW``: a symbolic
    link anywhere on the way (a planted ``/dev/shm/x -> /etc/passwd``) is refused, not followed."""
    parts = path.split("/")[1:]
    directory_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        directory = os.open("/", directory_flags)
    except OSError as e:
        raise _Refused(f"cannot be reached ({e})") from None
    try:
        for part in parts[:-1]:
            try:
                inner = os.open(part, directory_flags, dir_fd=directory)
            except OSError as e:
                raise _Refused(f"cannot be reached without following a link ({part!r}: {e.strerror})") from None
            os.close(directory)
            directory = inner
        try:
            return os.open(parts[-1], os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=directory)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _Refused("is a symbolic link") from None
            raise _Refused(f"cannot be opened for reading and writing ({e.strerror})") from None
    finally:
        os.close(directory)


def _map(fd: int, file: SharedFile, nbytes: int, peer: int) -> tuple[mmap.mmap, ctypes.Array, int]:
    """``nbytes`` of ``file`` (open as ``fd``, checked; closed here) from its ``offset`` mapped here: (the map, a
    buffer view keeping it exported, the address of the first byte)."""
    start = file.offset - file.offset % mmap.ALLOCATIONGRANULARITY
    length = file.offset + nbytes - start
    try:
        mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    except (OSError, ValueError, OverflowError) as e:  # e.g. the file was truncated below the range
        raise TransferError(f"shm: mapping {length} bytes of rank {peer}'s {file.path!r} failed: {e}; pass "
                            "transport='nixl'") from e
    finally:
        os.close(fd)
    view = (ctypes.c_char * length).from_buffer(mapping)
    return mapping, view, ctypes.addressof(view) + file.offset - start
