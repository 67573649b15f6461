"""Whether a peer is still there, answered in microseconds and learned within ``liveness_s`` seconds.

Each rank listens on one TCP socket (``alive/<rank>`` in the store, sealed like every value) and holds one idle
connection per peer it has to wait for: to rank 0 (the store's host) from ``init`` on, to any other peer from
the first time a wait of this rank depends on it. Nothing is sent on these connections after a short hello;
the kernel watches them:

* a process that exits, crashes or is killed (``kill -9``) has its sockets closed by the kernel, so the peer
  reads end-of-file at once;
* a cut link or a silent host is found by TCP keepalive (``TCP_KEEPIDLE``/``TCP_KEEPINTVL``/``TCP_KEEPCNT``)
  and ``TCP_USER_TIMEOUT``, both derived from ``liveness_s``: the connection fails with ``ETIMEDOUT``.

``check(rank)`` is one non-blocking ``recv(MSG_PEEK)`` (rate-limited per peer), called by the waiters that
already poll (``wait_until``'s sleeping loop, the progress thread's watches, the store polls of ``barrier``
and ``lookup``): no thread of its own, so an idle communicator costs nothing. Pending connections are
accepted from those same calls (the kernel completes the handshake without ``accept``).

Non-goals: this does not authenticate the peer beyond a hello that carries a MAC of the rank under the job
token (a replayed hello is possible for whoever can sniff the network), and a peer that is alive but stuck
(e.g. stopped with SIGSTOP) counts as alive: its waits end with their timeouts.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import socket
import struct
import threading
import time
from collections.abc import Callable

from .errors import PeerLostError

__all__ = ["Liveness", "tune"]

_HELLO = struct.Struct("<3sI16s")  # magic, rank, MAC of the rank under the job token (zeros without one)
_MAGIC = b"TWL"
_CHECK_PERIOD_S = 0.01  # a peer's socket is looked at no more often than this


def tune(sock: socket.socket, liveness_s: float) -> None:
    """Have the kernel fail ``sock`` with ``ETIMEDOUT`` when the other end stops answering for ~``liveness_s``:
    keepalive probes every ``liveness_s / 4`` seconds on an idle connection, and unacknowledged data or probes
    for longer than ``liveness_s`` abort it."""
    period = max(1, int(liveness_s / 4))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", period), ("TCP_KEEPINTVL", period),
                        ("TCP_KEEPCNT", max(1, math.ceil(liveness_s / period))),
                        ("TCP_USER_TIMEOUT", int(liveness_s * 1000))):
        option = getattr(socket, name, None)
        if option is not None:  # Linux; elsewhere the OS defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _mac(token: bytes | None, rank: int) -> bytes:
    if token is None:
        return bytes(16)
    return hmac.new(token, b"liveness/" + str(rank).encode(), hashlib.sha256).digest()[:16]


class Liveness:
    """One rank's view of which peers are alive. Thread-safe (user threads and the progress thread check)."""

    def __init__(self, rank: int, world_size: int, liveness_s: float, host: str, token: bytes | None,
                 resolve: Callable[[int], tuple[str, int] | None]) -> None:
        self.rank, self.world_size, self.liveness_s = rank, world_size, liveness_s
        self._token, self._resolve = token, resolve
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        tune(self._listener, liveness_s)  # inherited by accepted sockets
        self._listener.bind((host, 0))
        self._listener.listen(socket.SOMAXCONN)
        self._listener.setblocking(False)
        self.address = (host, self._listener.getsockname()[1])
        self._sockets: dict[int, list[socket.socket]] = {}
        self._hellos: list[tuple[socket.socket, float]] = []  # accepted, hello not read yet
        self._lost: dict[int, str] = {}
        self._next_check: dict[int, float] = {}
        self._next_resolve: dict[int, float] = {}
        self._lock = threading.Lock()
        self.closed = False

    # --- the public checks ------------------------------------------------------------------------
    def check(self, rank: int, what: str | Callable[[], str]) -> None:
        """Raise ``PeerLostError`` (naming ``what``, a string or a callable that makes one) if ``rank`` is known to
        be gone; otherwise return at once. Rate-limited: a peer's sockets are looked at every ``_CHECK_PERIOD_S``
        at most."""
        reason = self.lost(rank)
        if reason is not None:
            what = what() if callable(what) else what
            raise PeerLostError(f"{what}: rank {rank} is gone ({reason}); it exited, crashed, closed its "
                                f"communicator or its network broke (noticed within TENSORWIRE_LIVENESS_S="
                                f"{self.liveness_s:g}s)")

    def lost(self, rank: int, fresh: bool = False) -> str | None:
        """Why ``rank`` is gone, or None while it is alive or not known yet. ``fresh`` skips the rate limit."""
        if rank == self.rank or self.closed:
            return None
        reason = self._lost.get(rank)
        if reason is not None:
            return reason
        now = time.monotonic()
        if not fresh and now < self._next_check.get(rank, 0.0):
            return None
        with self._lock:
            if self.closed:
                return None
            self._next_check[rank] = now + _CHECK_PERIOD_S
            self._accept()
            sockets = self._sockets.get(rank)
            if not sockets:
                self._connect(rank, now)
                sockets = self._sockets.get(rank, [])
            for sock in sockets:
                reason = _broken(sock)
                if reason is not None:
                    self._lost[rank] = reason
                    return reason
            return self._lost.get(rank)

    def peers(self) -> list[int]:
        """The ranks this rank has a liveness connection with (it watches them, or they watch it)."""
        with self._lock:
            if not self.closed:
                self._accept()
            return [rank for rank, sockets in self._sockets.items() if sockets]

    def watch(self, rank: int) -> None:
        """Connect to ``rank`` now (bounded by ``liveness_s``) so that a later wait knows at once if it is gone."""
        if rank != self.rank:
            self.lost(rank, fresh=True)

    # --- connections ------------------------------------------------------------------------------
    def _connect(self, rank: int, now: float) -> None:
        if now < self._next_resolve.get(rank, 0.0):
            return
        self._next_resolve[rank] = now + self.liveness_s / 4
        address = self._resolve(rank)
        if address is None:
            return  # not started yet: nothing to say
        try:
            sock = socket.create_connection(address, timeout=self.liveness_s)
            tune(sock, self.liveness_s)
            sock.sendall(_HELLO.pack(_MAGIC, self.rank, _mac(self._token, self.rank)))
            sock.setblocking(False)
        except OSError as e:
            # It published its address and no longer listens (ECONNREFUSED) or cannot be reached in time.
            self._lost[rank] = f"its liveness socket at {address[0]}:{address[1]} refused or did not answer ({e})"
            return
        self._sockets.setdefault(rank, []).append(sock)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            sock.setblocking(False)
            self._hellos.append((sock, time.monotonic()))
        waiting = []
        for sock, since in self._hellos:
            try:
                hello = sock.recv(_HELLO.size, socket.MSG_PEEK)
            except BlockingIOError:
                hello = None
            except OSError:
                sock.close()
                continue
            if hello is not None and len(hello) == _HELLO.size:
                sock.recv(_HELLO.size)
                magic, rank, mac = _HELLO.unpack(hello)
                if (magic == _MAGIC and 0 <= rank < self.world_size
                        and hmac.compare_digest(mac, _mac(self._token, rank))):
                    self._sockets.setdefault(rank, []).append(sock)
                else:
                    sock.close()  # not a rank of this job
            elif hello == b"" or time.monotonic() - since > self.liveness_s:
                sock.close()
            else:
                waiting.append((sock, since))
        self._hellos = waiting

    def close(self) -> None:
        """Close every socket: peers that watch this rank learn at once that it is gone."""
        with self._lock:
            self.closed = True
            for sock in [self._listener] + [s for group in self._sockets.values() for s in group] + \
                    [s for s, _ in self._hellos]:
                try:
                    sock.close()
                except OSError:
                    pass
            self._sockets.clear()
            self._hellos.clear()


def _broken(sock: socket.socket) -> str | None:
    """Why ``sock``'s peer is gone, or None: one non-blocking peek."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as e:
        if e.errno == errno.ETIMEDOUT:
            return "its host stopped answering: TCP keepalive timed out"
        return f"its connection failed: {errno.errorcode.get(e.errno, e.errno)}"
    if data == b"":
        return "its process closed the connection"
    return None  # a peer never sends after the hello; stray bytes do not mean it is gone
