"""The embedded directory: a small key-value server in a process of its own (``tensorwire directory``).

A fleet's members meet here (``tw.init(directory="tcp://HOST:PORT", name=...)``): it holds their sealed records
(ranks, names, memory maps, liveness addresses) and nothing else. It is the control plane only: transfers go peer
to peer and do not touch it. It listens on ``HOST``'s interface only and keeps one number on disk (its state file:
the rank counter's high-water mark, ``directory_keys.py``).

Trust. Started with the job token (``TENSORWIRE_JOB_TOKEN``), it serves only a process that proves it holds the
token on that connection (``directory_wire``'s handshake): a stranger cannot read, write, delete, list or count
anything, and learns nothing, not even member names. Without a token it is open (one warning at start), as an
unauthenticated job is.

Presence is a lease. Every key a member writes belongs to its connection: when the connection ends (the process
died: its kernel closes it at once) or stays silent past the lease the member asked for (its host went: two
liveness periods), the member's keys go. So what the directory lists is what live members wrote; a name is free
the moment its holder is gone. Counters (``add``) belong to the member that moved them last and go with it; the rank
counter is the directory's own (``directory_keys.py``: moved by joins only, bounded, kept above every rank handed
out across restarts by its state file). It does not move during a grace period after the start (``grace_s``: joins
wait; ``tensorwire directory`` gives twice the liveness period, the members' lease), in which the members of a
restarted directory reconnect and put their keys back.

What a request does is ``directory_operations.py``. Bounds (``Limits``): sessions (in all, and per member: a member
is a name at a host, and a host's sessions that hold no name are bounded, its oldest dropped over the bound, so a
process with the token that opens session after session drops its own, ``_Server._make_room``), handshakes pending
(in all and per host), the time a handshake may take, value and key sizes, keys and bytes held, keys per member,
names per host. Each refusal answers the caller with the reason where it can and is logged (at most once a second
per kind, with a count). Non-goals: replication (use etcd where one process is not enough) and keeping its contents
(other than the rank counter's mark) across its own restart.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import resource
import secrets
import signal
import threading
from collections import Counter

from .. import config as config_module
from ..errors import InvalidArgumentError
from . import directory_wire as wire
from .directory_keys import Keys, Limits, RankCounter
from .directory_keys import Session as _Session
from .directory_operations import Operations, Refusals
from .store_sockets import ListenerWords, listen_socket

__all__ = ["Directory", "Limits", "serve"]

log = logging.getLogger("tensorwire.directory")
_LIMITS = Limits()
# Where it listens is set with ``tensorwire directory --host/--port`` (or ``Directory(host, port)``): its refusals
# name those, not the launcher's MASTER_ADDR/MASTER_PORT.
_LISTENER_WORDS = ListenerWords("directory: cannot listen", "--host {!r}", "--port (0 picks a free one)",
                                "this machine")


class _Server:
    """The asyncio side: handshakes, sessions and the operations, on one event loop (one thread)."""

    def __init__(self, token: bytes | None, limits: Limits, grace_s: float, ranks: RankCounter) -> None:
        self.token, self.limits = token, limits
        self.keys = Keys(limits)
        self.refused = Refusals()
        self.operations = Operations(limits, self.keys, ranks, grace_s, self.refused)
        self.connections = 0
        self.sessions: dict[_Session, asyncio.Task] = {}  # admitted, oldest first -> the task serving it
        self.pending: dict[asyncio.Task, str] = {}  # handshakes under way, oldest first -> the caller's host
        self.pending_per_host: Counter[str] = Counter()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host = str((writer.get_extra_info("peername") or ("?",))[0])
        self.connections += 1
        try:
            # Sessions and pending handshakes are each bounded by dropping their oldest (below): this bound is
            # reached only by connections still being torn down.
            if self.connections > self.limits.connections + self.limits.pending_handshakes:
                self.refused("a connection", f"from {host}: {self.connections - 1} connections are open")
                return
            session = await self._admit(reader, writer, host)
            if session is None:
                return
            full = self._make_room(session)
            if full is not None:
                await self._turn_away(reader, writer, session, full)
                return
            self.sessions[session] = asyncio.current_task()
            try:
                await self._serve(reader, writer, session)
            finally:
                self.sessions.pop(session, None)
                self.keys.end(session)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.CancelledError):
            pass  # gone, silent past its lease, or the directory stops: the session ends
        except Exception as e:  # noqa: BLE001 - a request no check foresaw ends its session, never the directory
            self.refused("a session", f"from {host}: {type(e).__name__}: {e}")
        finally:
            self.connections -= 1
            writer.close()

    async def _admit(self, reader, writer, host: str) -> _Session | None:
        """The handshake, bounded in time and in how many may be pending: a session, or None (refused).

        Over a bound, the oldest pending handshake (of that host, or of all) is dropped, not the new one: a
        member completes its handshake in a round trip, so a flood of idle connections drops its own, never
        the members that keep arriving."""
        me = asyncio.current_task()
        if self.pending_per_host[host] >= self.limits.pending_per_host:
            self._drop_oldest(lambda other: other == host, f"from {host}: too many handshakes pending from there")
        if len(self.pending) >= self.limits.pending_handshakes:
            self._drop_oldest(lambda other: True, f"from {host}: too many handshakes pending")
        self.pending[me] = host
        self.pending_per_host[host] += 1
        try:
            return await asyncio.wait_for(self._handshake(reader, writer, host), self.limits.handshake_s)
        except asyncio.TimeoutError:
            self.refused("a handshake", f"from {host}: not done within {self.limits.handshake_s:g}s")
            return None
        finally:
            self._forget(me)

    def _make_room(self, new: _Session) -> str | None:
        """Room for ``new`` (just admitted, holding no name yet) among the sessions: None, or why it is turned away.

        A member is a name at a host: a session that holds a name (``name/<name>``) is one, bounded by one per name
        and ``Limits.names_per_host`` (``directory_keys``); sessions that hold none are their host's, at most
        ``Limits.unnamed_per_host`` of them: over it, that host's oldest one goes, so a process with the token that
        opens session after session drops its own, never another host's nor a member's. Over ``Limits.connections``
        in all, the oldest session without a name of the host holding the most such goes; only a directory full
        of named members turns a newcomer away, saying so."""
        limits, host = self.limits, new.peer
        unnamed = [s for s in self.sessions if s.peer == host and not s.name_claims]
        if len(unnamed) >= limits.unnamed_per_host:
            self._drop(unnamed[0], f"from {host}: {len(unnamed)} sessions from there hold no name, the directory's "
                                   "limit per host; dropped the oldest of them")
        if len(self.sessions) < limits.connections:
            return None
        per_host = Counter(s.peer for s in self.sessions if not s.name_claims)
        if not per_host:
            return (f"the directory is full: it serves {len(self.sessions)} members (sessions holding a name), its "
                    f"limit; close members that are no longer needed, or start another directory for a new fleet")
        busiest, count = per_host.most_common(1)[0]
        oldest = next(s for s in self.sessions if s.peer == busiest and not s.name_claims)
        self._drop(oldest, f"{len(self.sessions)} sessions are open, the directory's limit; dropped the oldest of "
                           f"the {count} without a name from {busiest} (the host holding the most)")
        return None

    def _drop(self, session: _Session, why: str) -> None:
        """End ``session`` (its keys go with it as its task ends)."""
        self.refused("a session", why)
        self.sessions.pop(session).cancel()

    async def _turn_away(self, reader, writer, session: _Session, why: str) -> None:
        """Answer the first request of an admitted session with ``why`` (REFUSED) and close: its member's client
        raises ``InvalidArgumentError`` with the reason, not a lost directory."""
        self.refused("a session", f"from {session.peer}: {why}")
        request = await asyncio.wait_for(self._frame(reader, writer, session), self.limits.handshake_s)
        if request is not None:
            writer.write(wire.encode(wire.Status.REFUSED, why.encode()))
            await writer.drain()

    def _forget(self, task: asyncio.Task) -> None:
        host = self.pending.pop(task, None)
        if host is not None:
            self.pending_per_host[host] -= 1
            if not self.pending_per_host[host]:
                del self.pending_per_host[host]

    def _drop_oldest(self, matches, why: str) -> None:
        for task, host in self.pending.items():  # oldest first
            if matches(host):
                self.refused("a handshake", why)
                self._forget(task)
                task.cancel()
                return

    async def _handshake(self, reader, writer, host: str) -> _Session | None:
        nonce_d = secrets.token_bytes(wire.NONCE_BYTES)
        writer.write(wire.MAGIC + bytes([self.token is not None]) + nonce_d)
        await writer.drain()
        mac_bytes = wire.MAC_BYTES if self.token is not None else 0
        try:
            hello = await reader.readexactly(wire.NONCE_BYTES + wire.LEASE.size + mac_bytes)
        except asyncio.IncompleteReadError as e:
            if e.partial == wire.NO_TOKEN:  # a member without one left; anything else gone at the greeting is silent
                self.refused("a member without a job token", f"from {host}: TENSORWIRE_JOB_TOKEN is not set there")
                return None
            raise
        nonce_m = hello[:wire.NONCE_BYTES]
        (lease_ms,) = wire.LEASE.unpack_from(hello, wire.NONCE_BYTES)
        if self.token is not None:
            if not hmac.compare_digest(hello[-mac_bytes:], wire.member_mac(self.token, nonce_d, nonce_m, lease_ms)):
                self.refused("a member with another job token", f"from {host}: its token differs from the directory's")
                writer.write(b"\x00the job token differs from the fleet directory's")
                await writer.drain()
                return None
            writer.write(b"\x01" + wire.directory_mac(self.token, nonce_d, nonce_m))
        else:
            writer.write(b"\x01")
        await writer.drain()
        low, high = self.limits.lease_s
        return _Session(host, min(max(lease_ms / 1000.0, low), high))

    async def _serve(self, reader, writer, session: _Session) -> None:
        while True:
            # A member's heartbeat speaks every half liveness period: silence past its lease means it is gone. The
            # bound covers the whole frame: a member stalled mid-frame is as silent as one that sends nothing.
            request = await asyncio.wait_for(self._frame(reader, writer, session), session.lease_s)
            answer = self.operations.answer(request, session) if request is not None else None
            if answer is None:
                self.refused("a request", f"from {session.peer}: malformed")
                return
            writer.write(answer)
            await writer.drain()

    async def _frame(self, reader, writer, session: _Session) -> tuple[int, list[bytes]] | None:
        """The next request, None when it is malformed or over the frame's bound (the session ends)."""
        (size,) = wire.LENGTH.unpack(await reader.readexactly(wire.LENGTH.size))
        if size > wire.MAX_FRAME:
            self.refused("a request", f"from {session.peer}: a frame of {size} bytes")
            writer.write(wire.encode(wire.Status.REFUSED, f"a request of {size} bytes is over the directory's "
                                                          f"{wire.MAX_FRAME}".encode()))
            await writer.drain()
            return None
        return wire.decode(await reader.readexactly(size))


class Directory:
    """A running directory: ``address`` is ``tcp://HOST:PORT``; ``close()`` stops it. Context manager.

    ``token``: the job token members must prove (default: ``TENSORWIRE_JOB_TOKEN``; None: an open directory).
    ``grace_s``: for how long after the start counters do not move (joins wait; members already in a fleet reconnect and
    put their ranks back meanwhile): give a restarted directory its members' heartbeat period, ``tensorwire directory``
    does; with a new ``state`` file (no rank ever handed out here) there is none (``grace_s`` attribute: the one in
    force). ``state``: the file that keeps the rank counter's high-water mark, so that a restarted directory never hands
    out a rank twice (None: none); held for this directory alone until ``close()`` (``directory_state.StateFile``: a
    link, a FIFO, a folder of another user's, a second directory on it or a disk that refuses the first mark raise
    ``InvalidArgumentError`` here, naming the path and the fix). Serves on a thread of its own; construction returns
    once it listens."""

    _DEFAULT = object()

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: bytes | None | object = _DEFAULT,
                 limits: Limits = _LIMITS, grace_s: float = 0.0, state: str | None = None) -> None:
        listener, why_not = listen_socket(host, port, _LISTENER_WORDS)
        if listener is None:
            raise InvalidArgumentError(f"directory: cannot listen on {host}:{port} ({why_not}); choose another "
                                       "--host (an address of this machine) or --port")
        try:
            ranks = RankCounter(state)  # InvalidArgumentError: what is in the way at which path, and the fix
        except BaseException:
            listener.close()
            raise
        self.host, self.port = host, listener.getsockname()[1]
        self.token = config_module.load().job_token if token is Directory._DEFAULT else token
        if self.token is None:
            log.warning("tensorwire directory at %s is open: TENSORWIRE_JOB_TOKEN is not set, so any process that "
                        "reaches its port can read and change the fleet's records; start it with the fleet's token",
                        self.address)
        self._ranks = ranks
        if state is not None and not ranks.known:
            grace_s = 0.0  # a new state file: no member ever got a rank here, none has one to put back
        self.grace_s = grace_s
        self._server = _Server(self.token, limits, grace_s, ranks)
        self._loop = asyncio.new_event_loop()
        self._stopped = asyncio.Event()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(listener, started), name="tensorwire-directory",
                                        daemon=True)
        self._thread.start()
        started.wait(30)

    def _run(self, listener, started: threading.Event) -> None:
        async def main() -> None:
            server = await asyncio.start_server(self._server.handle, sock=listener, limit=wire.MAX_FRAME + 16)
            started.set()
            async with server:
                await self._stopped.wait()
            sessions = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in sessions:
                task.cancel()
            await asyncio.gather(*sessions, return_exceptions=True)

        try:
            self._loop.run_until_complete(main())
        finally:
            started.set()
            self._loop.close()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving (idempotent; members see the directory lost). Blocks until its thread ended."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout=10)
        self._ranks.close()

    def __enter__(self) -> Directory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(host: str, port: int, announce=print, grace_s: float | None = None, state: str | None = None) -> None:
    """Run a directory until SIGINT/SIGTERM. Blocks. ``grace_s`` (default twice ``TENSORWIRE_LIVENESS_S``, the
    members' lease): joins wait that long after the start, so that a restart never hands a newcomer the rank of a
    live member that has not put it back yet. ``state``: the rank counter's high-water mark (see ``Directory``)."""
    grace_s = 2 * config_module.load().liveness_s if grace_s is None else grace_s
    logging.basicConfig(format="%(message)s")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # one descriptor per member: take what the system allows, the bounds do the rest
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Directory(host, port, grace_s=grace_s, state=state) as directory:
        trust = "members prove the job token" if directory.token is not None else "OPEN: no job token"
        kept = f"ranks kept in {state}" if state else "no state file: ranks follow the clock"
        announce(f"tensorwire directory at {directory.address} (members join with "
                 f"TENSORWIRE_DIRECTORY={directory.address}; {trust}; joins wait {directory.grace_s:g}s after the "
                 "start; "
                 f"{kept})")
        while not stop.wait(3600):
            pass
