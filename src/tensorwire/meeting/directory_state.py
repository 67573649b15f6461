"""The embedded directory's state file: the one number it keeps on disk (the rank counter's high-water mark,
``directory_keys.RankCounter``), and nothing a stray file or another directory can turn against it.

Where: ``--state FILE``, by default ``~/.local/state/tensorwire/directory-HOST-PORT.rank`` (``default_path``: the
address as well as the port, so two directories on one host, 127.0.0.1:29700 and 127.0.0.2:29700, never share one).
The file lives in a directory of the directory process's own: created ``0700`` where missing, and refused where it is
a symbolic link, not this user's, or writable by group or others (anyone who can write there can plant a link).

How, so that no file in the way hangs, redirects or lowers it:

* one directory per file: ``FILE.lock`` is held (``flock``) for the directory's life; a second one is refused at
  start, naming the file, so two never lower each other's mark;
* read with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` to be a regular file: a symbolic link, a FIFO (whose
  plain ``open`` blocks until a writer comes) or a device is refused at start with the path and the fix;
* written to ``FILE.tmp`` opened ``O_CREAT | O_EXCL | O_NOFOLLOW`` (whatever was at that name is removed first: the
  name is ours, a link planted there is unlinked, never followed), flushed to disk, renamed over ``FILE`` (a rename
  replaces a link, never writes through it), the directory flushed after.

Errors: at start ``StateFile`` raises ``InvalidArgumentError`` saying what is at which path and what to do;
``write`` raises ``OSError`` (a full disk, a directory made read-only since), which the rank counter turns into a
refused join (logged), never a lowered mark. Blocks only for the disk.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat

from ..errors import InvalidArgumentError

__all__ = ["StateFile", "default_path"]

_MARK_BYTES = 64  # a mark is at most 19 digits and a newline; more is no state file of ours


def default_path(host: str, port: int) -> str:
    """``~/.local/state/tensorwire/directory-HOST-PORT.rank`` for a directory listening on ``host:port`` (characters
    other than letters, digits, ``.`` and ``-`` in ``host`` become ``_``: ``::1`` gives ``__1``)."""
    safe_host = re.sub(r"[^A-Za-z0-9.-]", "_", host) or "_"
    return os.path.expanduser(f"~/.local/state/tensorwire/directory-{safe_host}-{port}.rank")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "no regular file"


class StateFile:
    """The state file at ``path``, held for this process until ``close()`` (idempotent). ``mark``: the number it
    held at start, None where there was no file. Construction creates the folder where missing, takes the lock and
    reads the mark; raises ``InvalidArgumentError`` (the path, what is wrong, the fix) instead of blocking."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.folder = os.path.dirname(self.path)
        self._temporary = self.path + ".tmp"
        self._check_folder()
        self._lock = self._take_lock()
        try:
            self._clear_temporary()
            self.mark = self._read()
        except BaseException:
            self.close()
            raise

    def _refuse(self, what: str, fix: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"directory: cannot keep the rank counter's mark in {self.path}: {what}; {fix}")

    def _check_folder(self) -> None:
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            info = os.lstat(self.folder)
        except OSError as e:
            raise self._refuse(f"its folder {self.folder} cannot be made ({e})",
                               "pass --state a file in a folder this user owns") from e
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise self._refuse(f"its folder {self.folder} is {_kind(info.st_mode)}",
                               "pass --state a file in a real folder of this user's (not a link to one)")
        if info.st_uid != os.geteuid():
            raise self._refuse(f"its folder {self.folder} belongs to uid {info.st_uid}, not to this process "
                               f"(uid {os.geteuid()})", "pass --state a file in a folder this user owns")
        if info.st_mode & 0o022:
            raise self._refuse(f"its folder {self.folder} is writable by others (mode {info.st_mode & 0o7777:o}), who "
                               "could plant a link in place of the file",
                               f"run chmod go-w {self.folder}, or pass --state a file in a folder of this user's own")

    def _open_regular(self, path: str, flags: int, mode: int = 0o600) -> int:
        """A descriptor of the regular file at ``path``, never through a link, never blocking on a FIFO."""
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
        except OSError as e:
            try:
                kind = _kind(os.lstat(path).st_mode)
            except OSError:
                kind = None
            if kind is not None and kind != "no regular file":
                raise self._refuse(f"{path} is {kind}", f"remove it (rm {path}) or pass --state another file") from e
            raise self._refuse(f"{path} cannot be opened ({e})",
                               "pass --state a file this user can read and write") from e
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise self._refuse(f"{path} is {_kind(info.st_mode)}", f"remove it (rm {path}) or pass --state another "
                                                                   "file")
        return fd

    def _take_lock(self) -> int:
        lock_path = self.path + ".lock"
        fd = self._open_regular(lock_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise self._refuse(f"another directory keeps its mark there (it holds {lock_path})",
                               "give each directory a --state of its own (the default names its address and port)"
                               ) from e
        return fd

    def _clear_temporary(self) -> None:
        """Whatever is at the temporary name (a leftover of a run killed mid-write, a planted link) is removed: the
        name is this file's own, and its next write must create it afresh."""
        try:
            os.unlink(self._temporary)
        except FileNotFoundError:
            pass
        except IsADirectoryError as e:
            raise self._refuse(f"{self._temporary} is a directory", f"remove it (rmdir {self._temporary})") from e
        except OSError as e:
            raise self._refuse(f"{self._temporary} cannot be removed ({e})",
                               "pass --state a file in a folder this user can write") from e

    def _read(self) -> int | None:
        try:
            os.lstat(self.path)
        except FileNotFoundError:
            return None
        fd = self._open_regular(self.path, os.O_RDONLY)
        try:
            text = os.read(fd, _MARK_BYTES + 1).decode(errors="replace").strip()
        finally:
            os.close(fd)
        if not text.isdigit() or len(text) > _MARK_BYTES:
            raise self._refuse(f"it holds {text[:40]!r}, not a rank",
                               f"remove it (rm {self.path}; ranks then follow the clock) or pass --state another file")
        return int(text)

    def write(self, mark: int) -> None:
        """Put ``mark`` on disk durably (new file, flushed, renamed over, folder flushed). Raises ``OSError`` where
        the disk refuses (full, read-only); the file on disk then still holds the previous mark."""
        self._remove_temporary()  # a failed write's leftover
        fd = os.open(self._temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            data = f"{mark}\n".encode()
            if os.write(fd, data) != len(data):
                raise OSError(f"a short write to {self._temporary} (is the disk full?)")
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._remove_temporary()
            raise
        os.close(fd)
        os.replace(self._temporary, self.path)
        folder = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)

    def _remove_temporary(self) -> None:
        try:
            os.unlink(self._temporary)
        except OSError:
            pass  # none there; or it cannot go, and the write that follows says why

    def close(self) -> None:
        """Let the file go (another directory may take it). Idempotent."""
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            os.close(lock)
