"""Whether a peer is still there, answered in microseconds and learned within ``liveness_s`` seconds.

Each rank listens on one TCP socket (``alive/<rank>`` in the store, sealed like every value) and holds one idle
connection per peer it has to wait for: to rank 0 (the store's host) from ``init`` on, to any other peer from
the first time a wait of this rank depends on it. Nothing is sent on these connections after a short handshake
(below); the kernel watches them:

* a process that exits, crashes or is killed (``kill -9``) has its sockets closed by the kernel, so the peer
  reads end-of-file at once;
* a cut link or a silent host is found by TCP keepalive (``TCP_KEEPIDLE``/``TCP_KEEPINTVL``/``TCP_KEEPCNT``)
  and ``TCP_USER_TIMEOUT``, both derived from ``liveness_s``: the connection fails with ``ETIMEDOUT``.

``check(rank)`` is one non-blocking ``recv(MSG_PEEK)`` (rate-limited per peer), called by the waiters that
already poll (``wait_until``'s sleeping loop, the progress thread's watches, the store polls of ``barrier``
and ``lookup``): no thread of its own, so an idle communicator costs nothing. Pending connections are
accepted from those same calls (the kernel completes the handshake without ``accept``).

The handshake (``liveness_handshake.py``): a connection counts for a rank only once it proved the job token.

Local trouble is not a verdict. A peer counts as gone only on evidence from its side: end-of-file, a reset, a
refused connection or a timeout on its connection. Failing to open a socket here (no descriptor to spare,
``EMFILE``/``ENFILE``, or no memory, ``ENOMEM``/``ENOBUFS``) raises ``TransferError`` from ``check``/``watch``,
saying so and how to fix it, and the next check tries again. A connection is served as it is accepted, and those
that have not finished their handshake are capped per listener (``_MAX_PENDING``; the one silent the longest is
closed): a flood of the port costs a bounded number of descriptors and never crowds out a member that speaks.

Questions. A process that proves the token may ask the listener who runs it or which memory map epoch its rank
published last, on a connection of its own that the listener answers (bound to the asker's nonce) and closes; it
never counts for a rank (``listener_queries``). ``serve`` (the revocation thread runs it) waits on the listener and
its handshakes, so questions and handshakes are answered at once, not at a next poll.

Non-goals: the connections are authenticated once, when they open; after that nothing travels on them to
protect, and whoever sits on the path can still reset one (a denial of service, like deleting store values). A
peer that is alive but stuck (e.g. stopped with SIGSTOP) counts as alive: its waits end with their timeouts.
"""

from __future__ import annotations

import errno
import hmac
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..environment import hostname
from ..errors import PeerLostError, TransferError
from .listener_queries import HELLO, MAP_EPOCH, NONCE_BYTES, PROBE, QUESTION_BYTES, WAKE, answer, asked
from .liveness_handshake import (
    ACCEPTED,
    ANSWER_BYTES,
    MAGIC,
    WAKE_PROOF,
    Handshake,
    Incoming,
    Outgoing,
    answer_mac,
    collected,
    keep_bounded,
    wake_mac,
)
from .peer_sockets import broken, from_peer, local_trouble, read_up_to, send_now, tune

__all__ = ["Liveness", "tune"]

_CHECK_PERIOD_S = 0.01  # a peer's socket is looked at no more often than this
_MAX_PENDING = 64  # accepted connections whose handshake has not finished, per listener: beyond, the oldest goes


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
        self._sockets: dict[int, list[socket.socket]] = {}  # accepted ones once verified; opened ones at once
        self._incoming: list[Incoming] = []  # accepted, not verified yet
        self._outgoing: dict[socket.socket, Outgoing] = {}  # opened, not accepted by the listener yet (token)
        self._offered: set[int] = set()  # ranks whose connection to this one verified (every hello, unauthenticated)
        self._opened: set[int] = set()  # ranks this one opened a connection to (it is among their callers)
        self._lost: dict[int, str] = {}
        self._trouble: dict[int, str] = {}  # why the last try to connect to a rank failed here (no verdict)
        self._who = f"{hostname()} pid {os.getpid()}".encode()  # what a probe is told
        self._next_check: dict[int, float] = {}
        self._next_resolve: dict[int, float] = {}
        self._addresses: dict[int, tuple[str, int]] = {}  # rank -> its listener, as last resolved
        self._lock = threading.Lock()
        self._wake_reader, self._wake_writer = socket.socketpair()  # ends serve()'s wait from this process
        self._wake_reader.setblocking(False)
        self._verified_events = 0  # handshakes verified and pokes proven: what makes serve() report activity
        self.closed = False
        # This rank's last published memory map epoch, for the MAP_EPOCH question (set by the communicator).
        self.map_epoch: Callable[[], int] = lambda: 0

    # --- the public checks ------------------------------------------------------------------------
    def check(self, rank: int, what: str | Callable[[], str]) -> None:
        """Raise ``PeerLostError`` (naming ``what``, a string or a callable that makes one) if ``rank`` is known to
        be gone; otherwise return at once. Rate-limited (a peer's sockets: every ``_CHECK_PERIOD_S`` at most)."""
        reason = self.lost(rank, fresh=rank in self._trouble)
        if reason is None:
            self._raise_trouble(rank, what)
        else:
            what = what() if callable(what) else what
            raise PeerLostError(f"{what}: rank {rank} is gone ({reason}); it exited, crashed, closed its "
                                f"communicator or its network broke (noticed within TENSORWIRE_LIVENESS_S="
                                f"{self.liveness_s:g}s)")

    def lost(self, rank: int, fresh: bool = False) -> str | None:
        """Why ``rank`` is gone, or None while it is alive or not known yet (also while this process cannot open
        a socket to it: ``check`` and ``watch`` raise that). ``fresh`` skips the rate limit."""
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
            self._handshake()
            sockets = self._sockets.get(rank)
            if not sockets:
                self._connect(rank, now)
                sockets = self._sockets.get(rank, [])
            for sock in sockets:
                if sock in self._outgoing:
                    continue  # its handshake looks at it (end-of-file there means "reconnect", not "gone")
                reason = broken(sock)
                if reason is not None:
                    self._lost[rank] = reason
                    return reason
            return self._lost.get(rank)

    def callers(self, settle_s: float = 0.0) -> list[int]:
        """The ranks that opened a verified liveness connection to this one: every rank that may hold a transfer
        to this rank's memory (a rank connects to a peer before it prepares a transfer to it); what a revocation
        must reach. A rank this one only watches itself is not among them. The handshakes under way now that
        claim a rank with a published address (a rank that connected just now) are given up to ``settle_s`` to
        verify or fail first; later ones, and claims of ranks nobody published, are not waited for: a stranger's
        hellos hold a close() once at most."""
        deadline = time.monotonic() + settle_s
        with self._lock:
            if self.closed:
                return sorted(self._offered)
            self._handshake()
            waiting = {p.sock for p in self._incoming if p.rank is not None and not p.probe}
        waiting = {sock for sock in waiting if self._claimed_rank_published(sock)}
        while True:
            with self._lock:
                if self.closed:
                    return sorted(self._offered)
                self._handshake()
                unsettled = [p.sock for p in self._incoming if p.sock in waiting]
                if not unsettled or time.monotonic() >= deadline:
                    return sorted(self._offered)
            try:
                select.select(unsettled, [], [], min(0.01, max(deadline - time.monotonic(), 0.0)))
            except (OSError, ValueError):  # settled and closed meanwhile
                continue

    def _claimed_rank_published(self, sock: socket.socket) -> bool:
        """Whether the rank a pending handshake on ``sock`` claims has published a liveness address."""
        claimed = next((p.rank for p in list(self._incoming) if p.sock is sock), None)
        if claimed is None:
            return False
        try:
            return self.address_of(claimed) is not None
        except Exception:  # noqa: BLE001 - the store unreachable: wait for it as for a rank that may be real
            return True

    def serve(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a connection or a handshake message on this rank's listener (or ``wake()``),
        then move every handshake on and answer every question that arrived. For the thread that keeps this rank
        answering. True when a peer of this job did something (a handshake verified, a proven poke) or
        ``wake()`` was called; a stranger's connections and questions are served but report nothing."""
        with self._lock:
            if self.closed:
                return False
            # Its own handshakes too (a challenge to answer): a listener counts this rank only once it answered.
            sockets = [self._listener, self._wake_reader] + [pending.sock for pending in self._incoming] + \
                list(self._outgoing)
        try:
            readable = select.select(sockets, [], [], timeout_s)[0]
        except (OSError, ValueError):  # a socket closed meanwhile (a handshake settled, or close())
            return False
        with self._lock:
            if self.closed:
                return False
            woken = self._wake_reader in readable
            if woken:
                read_up_to(self._wake_reader, b"", 4096)  # drained: the next wait sleeps again
            before = self._verified_events
            self._handshake()
            return woken or self._verified_events != before

    def wake(self) -> None:
        """End ``serve``'s wait now (from any thread of this process)."""
        try:
            self._wake_writer.send(b"w")
        except OSError:  # closed, or its buffer full of earlier wakes: woken either way
            pass

    def poke(self, rank: int) -> None:
        """Wake ``rank``'s serving thread (a connection to its listener that it closes at once, no answer read):
        what this rank just sent it through a transport's message channel is handled now, not at its next idle
        wake-up. Blocks at most ``liveness_s`` for the TCP handshake; a rank gone or unknown is skipped."""
        address = self.address_of(rank)
        if address is None:
            return
        proof = b""
        if self._token is not None:
            sent_ms = int(time.time() * 1000)
            proof = WAKE_PROOF.pack(sent_ms) + wake_mac(self._token, rank, sent_ms)
        try:
            with socket.create_connection(address, timeout=self.liveness_s) as sock:
                sock.sendall(HELLO.pack(WAKE, rank) + proof)
        except OSError:
            pass  # gone: nothing to wake; its liveness connection tells the waiters

    def address_of(self, rank: int) -> tuple[str, int] | None:
        """``rank``'s listener (the store's record, read once), or None while it has published none."""
        address = self._addresses.get(rank)
        if address is None:
            address = self._resolve(rank)
            if address is not None:
                self._addresses[rank] = address
        return address

    def watch(self, rank: int) -> None:
        """Connect to ``rank`` now (bounded by ``liveness_s``) so that a later wait knows at once if it is gone and
        ``rank`` counts this rank among its callers (its revocations reach this rank): a connection ``rank``
        opened to this one does not tell it so."""
        if rank != self.rank:
            with self._lock:
                if not self.closed and rank not in self._opened:
                    # Resolve now even if a check just found no address (rate-limited there): a rank that prepares a
                    # transfer without connecting is missing from the owner's callers, and its revocations.
                    self._next_resolve.pop(rank, None)
                    self._connect(rank, time.monotonic())
            self.lost(rank, fresh=True)
            self._raise_trouble(rank, "liveness")

    def _raise_trouble(self, rank: int, what: str | Callable[[], str]) -> None:
        """Raise ``TransferError`` if the last try to connect to ``rank`` failed here (no verdict on ``rank``)."""
        trouble = self._trouble.get(rank)
        if trouble is not None:
            what = what() if callable(what) else what
            raise TransferError(f"{what}: cannot open a liveness connection to rank {rank}: {trouble}. This is a "
                                f"local problem, not a verdict on rank {rank}: retry once it is solved")

    # --- connections ------------------------------------------------------------------------------
    def _connect(self, rank: int, now: float) -> None:
        """Open a connection to ``rank`` and send the hello; blocks at most ``liveness_s`` (the TCP handshake,
        which the peer's kernel completes: its process need not be in tensorwire). With a token the listener's
        challenge is answered later, by ``_handshake``."""
        if now < self._next_resolve.get(rank, 0.0) and rank not in self._trouble:
            return
        self._next_resolve[rank] = now + self.liveness_s / 4
        address = self._resolve(rank)
        if address is not None:
            self._addresses[rank] = address
        if address is None:
            return  # not started yet: nothing to say
        sock = None
        try:
            sock = socket.create_connection(address, timeout=self.liveness_s)
            tune(sock, self.liveness_s)
            sock.sendall(HELLO.pack(MAGIC, self.rank))
            sock.setblocking(False)
        except OSError as e:
            if sock is not None:
                sock.close()
            if from_peer(e):
                # It published its address and no longer listens (ECONNREFUSED) or cannot be reached in time.
                self._lost[rank] = f"its liveness socket at {address[0]}:{address[1]} refused or did not answer ({e})"
            else:
                self._trouble[rank] = local_trouble(e)
            return
        self._trouble.pop(rank, None)
        self._sockets.setdefault(rank, []).append(sock)
        self._opened.add(rank)
        if self._token is not None:
            self._outgoing[sock] = Outgoing(rank)

    def _handshake(self) -> None:
        """Move every handshake on as far as what has arrived allows, without blocking: accept pending
        connections, challenge and verify them (listening side), answer challenges (connecting side)."""
        self._accept()
        self._incoming = [pending for pending in self._incoming if not self._verify(pending)]
        for sock, outgoing in list(self._outgoing.items()):
            self._answer_challenge(sock, outgoing)

    def _accept(self) -> None:
        """Accept what is pending (no descriptor to spare: the rest waits in the kernel's backlog), each served at
        once (a member's question or hello comes with it), keeping at most ``_MAX_PENDING`` unfinished ones."""
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # BlockingIOError: none pending; EMFILE and the like: later
                return
            sock.setblocking(False)
            pending = Incoming(sock)
            if not self._verify(pending):  # else settled at once: answered, counted or refused
                keep_bounded(self._incoming, pending, _MAX_PENDING)

    def _verify(self, pending: Incoming) -> bool:
        """One step of an accepted connection's handshake; True once it is settled (counted for its rank, or
        closed). Without a token the hello is taken as it is; with one, the listener sends a fresh nonce and
        counts the connection only when the answer is the HMAC of that nonce and both ranks under the token:
        a hello and answer seen on another connection (replayed) or made without the token do not verify."""
        try:
            if pending.rank is None:
                outcome = self._take_hello(pending)
            elif pending.probe == WAKE:
                outcome = self._take_wake(pending)
            elif pending.probe:
                outcome = self._take_probe(pending)
            else:
                outcome = self._take_answer(pending)
        except OSError:
            outcome = Handshake.REFUSED
        if outcome is Handshake.PENDING and time.monotonic() - pending.since > self.liveness_s:
            outcome = Handshake.REFUSED  # silent too long: a rank that was busy elsewhere reconnects
        if outcome in (Handshake.REFUSED, Handshake.PROBED):
            pending.sock.close()
        return outcome is not Handshake.PENDING

    def _take_hello(self, pending: Incoming) -> Handshake:
        received = collected(pending, HELLO.size)
        if isinstance(received, Handshake):
            return received
        magic, rank = HELLO.unpack(received)
        if magic == WAKE and rank == self.rank:
            if self._token is None:  # an unauthenticated job: a wake is taken as it is
                self._verified_events += 1
                return Handshake.PROBED
            pending.rank, pending.received, pending.probe = rank, b"", magic
            return Handshake.PENDING  # its proof follows
        if magic in (PROBE, MAP_EPOCH) and rank == self.rank:
            pending.rank, pending.received, pending.probe = rank, b"", magic
            return Handshake.PENDING  # its nonce follows
        if magic != MAGIC or not 0 <= rank < self.world_size or rank == self.rank:
            return Handshake.REFUSED  # not a rank of this job
        pending.rank, pending.received = rank, b""
        if self._token is None:  # an unauthenticated job: the hello is all there is to believe
            self._verified_events += 1
            self._offered.add(rank)
            self._sockets.setdefault(rank, []).append(pending.sock)
            return Handshake.COUNTED
        pending.nonce = secrets.token_bytes(NONCE_BYTES)
        send_now(pending.sock, pending.nonce)
        return Handshake.PENDING

    def _take_answer(self, pending: Incoming) -> Handshake:
        received = collected(pending, ANSWER_BYTES)
        if isinstance(received, Handshake):
            return received
        if not hmac.compare_digest(received, answer_mac(self._token, pending.nonce, pending.rank, self.rank)):
            return Handshake.REFUSED  # replayed, or made without this job's token
        send_now(pending.sock, ACCEPTED)
        self._verified_events += 1
        self._offered.add(pending.rank)  # only now: a stranger's hello claiming a rank makes no caller to wait for
        self._sockets.setdefault(pending.rank, []).append(pending.sock)
        return Handshake.COUNTED

    def _take_wake(self, pending: Incoming) -> Handshake:
        """A poke's proof: a time (ms) and its MAC, within a minute of this host's clock (a stranger's wake, or
        one replayed, wakes the thread once but keeps it from polling for a second)."""
        received = collected(pending, WAKE_PROOF.size + ANSWER_BYTES)
        if isinstance(received, Handshake):
            return received
        (sent_ms,) = WAKE_PROOF.unpack_from(received)
        fresh = abs(time.time() * 1000 - sent_ms) < 60_000
        if fresh and hmac.compare_digest(received[WAKE_PROOF.size:], wake_mac(self._token, self.rank, sent_ms)):
            self._verified_events += 1
        return Handshake.PROBED

    def _take_probe(self, pending: Incoming) -> Handshake:
        """Answer a member's question (``listener_queries``), bound to its nonce; a stranger's goes unanswered."""
        received = collected(pending, QUESTION_BYTES(self._token))
        nonce = asked(pending.probe, self._token, self.rank, received) if isinstance(received, bytes) else None
        if nonce is None:
            return received if isinstance(received, Handshake) else Handshake.REFUSED
        payload = self._who if pending.probe == PROBE else struct.pack("<I", self.map_epoch())
        send_now(pending.sock, answer(pending.probe, self._token, nonce, self.rank, payload))
        return Handshake.PROBED

    def _answer_challenge(self, sock: socket.socket, outgoing: Outgoing) -> None:
        """One step of this rank's side of a handshake it opened (with a token): answer the nonce, then wait for
        the listener's acceptance. End-of-file before the acceptance is no proof that the peer is gone (it
        refused the answer, or closed the connection after ``liveness_s`` unanswered because this rank did not
        call into tensorwire): the connection is dropped and the next check reconnects, which a peer that is gone
        refuses."""
        rank = outgoing.rank
        try:
            if not outgoing.answered:
                received = read_up_to(sock, outgoing.received, NONCE_BYTES)
                if received is not None and len(received) == NONCE_BYTES:
                    send_now(sock, answer_mac(self._token, received, self.rank, rank))
                    outgoing.answered, received = True, b""
            else:
                received = read_up_to(sock, outgoing.received, len(ACCEPTED))
                if received == ACCEPTED:
                    del self._outgoing[sock]  # verified: from now on watched like any connection
                    return
                if received:
                    received = None  # not this protocol
        except OSError as e:
            if e.errno == errno.ETIMEDOUT:
                self._lost[rank] = "its host stopped answering: TCP keepalive timed out"
            received = None  # a reset (the listener closed with our answer unread) is settled by reconnecting
        if received is None:
            del self._outgoing[sock]
            self._sockets[rank].remove(sock)
            self._opened.discard(rank)
            sock.close()
            self._next_resolve[rank] = 0.0  # reconnect at the next check
            return
        outgoing.received = received

    def close(self) -> None:
        """Close every socket: peers that watch this rank learn at once that it is gone."""
        with self._lock:
            self.closed = True
            self.wake()
            own = [self._listener, self._wake_reader, self._wake_writer]
            for sock in own + [s for group in self._sockets.values() for s in group] + \
                    [pending.sock for pending in self._incoming]:
                try:
                    sock.close()
                except OSError:
                    pass
            self._sockets.clear()
            self._incoming.clear()
            self._outgoing.clear()
