"""Who are my peers, and the key-value store we meet in.

Connects to torch.distributed's ``TCPStore`` (rank 0 hosts it, listening on ``MASTER_ADDR``'s interface only;
the launcher's environment comes from ``environment.py``, the store's sockets from ``store_sockets.py``). Every
blocking call takes a timeout and raises ``WaitTimeoutError``; losing the store's host raises ``PeerLostError``.
Every store call is bounded even when the store's host stops answering (torch's client is not: a watchdog shuts
our connection down), and the waits here poll the store so that they can also watch the peers' liveness
(``liveness.py``). Non-goal: process-group collectives.

Trust. With a job token (``TENSORWIRE_JOB_TOKEN``, read by ``config.py``) every value tensorwire puts in
the store is sealed here (``sealing.py``), and every value it reads must open with the same token under the
same key, else ``AuthenticationError`` (the value is not used; a later valid value under that key is). The
store's counters (``add``) cannot carry a MAC, so tensorwire does not decide anything on a counter: barriers
and departures are per-rank sealed records, and each rank claims its rank number once (``compare_set``) at
``init``. Without a token values are stored as they are and the job is unauthenticated (one
``TensorwireWarning`` says so).
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import time
import warnings
from collections.abc import Callable, Iterable
from typing import NoReturn

import torch.distributed as dist

from ..deadlines import CallThread, Deadlines
from ..environment import Environment, hostname
from ..errors import (
    AuthenticationError,
    InvalidArgumentError,
    PeerLostError,
    TensorwireError,
    TensorwireWarning,
    WaitTimeoutError,
)
from ..sealing import seal, unseal
from .listener_queries import who_runs
from .liveness import Liveness
from .store_sockets import local_address, socket_fds

__all__ = ["Rendezvous", "delta", "warn_once"]


def delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


_warned: set[str] = set()


def warn_once(topic: str, message: str, stacklevel: int) -> None:
    if topic not in _warned:
        _warned.add(topic)
        warnings.warn(message, TensorwireWarning, stacklevel=stacklevel + 1)


class Rendezvous:
    """A namespaced view of the TCPStore with bounded waits, sealed values and the barrier built on them.

    Every value tensorwire writes goes through ``set`` and every value it reads through ``get``/``_open``:
    the one place where job-token MACs are made and checked."""

    def __init__(self, env: Environment, timeout_s: float, store: dist.Store | None = None, *,
                 token: bytes | None = None, liveness_s: float = 5.0) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.liveness_s = liveness_s
        self._token = token
        self._owns_store = store is None
        self._claim: bytes | None = None
        self._lost: str | None = None  # why the store connection is gone; every later call raises PeerLostError
        self.between_polls: Callable[[], None] | None = None  # run while a wait sleeps (the inbox's pump)
        self._store_sockets: list[socket.socket] = []  # our client connection(s) to the store, to cut a stuck call
        self._watchdog = Deadlines()  # cuts a store call that outlives its bound (torch's own timeout does not)
        self._calls: CallThread | None = None  # the store calls, where no socket of ours can be cut (see _call)
        if store is None:
            before = socket_fds()
            store = self._connect()
            self._store_sockets = self._sockets_of(store, before)
        # Said once the store answered (a member the directory refuses for want of a token fails with that alone,
        # no warning before it) and once per host (torchrun's ranks of one host would each repeat it).
        if token is None and self.has_peers and env.local_rank == 0:
            warn_once("unauthenticated", (
                "tensorwire: this job is unauthenticated (TENSORWIRE_JOB_TOKEN is not set): any process that reaches "
                f"the store at {env.master_addr}:{env.master_port} can read every rank's memory map (addresses, NIXL "
                "agent metadata, shm file names) and with it READ and WRITE the registered memory over NIXL and send "
                "notifications as a rank, and can forge maps, descriptors and barrier entries; set the same random "
                "TENSORWIRE_JOB_TOKEN on every rank (see the README)"), stacklevel=4)
        if not self._store_sockets:  # a store passed to init, or no /proc here
            self._calls = CallThread("tensorwire-store-calls")
        self._raw = store
        self.store = self._namespaced(store)
        self.env = env = self._claim_identity()
        self.liveness = Liveness(env.rank, env.world_size, liveness_s, local_address(env), token, self._resolve)
        self.set(f"alive/{env.rank}", f"{self.liveness.address[0]} {self.liveness.address[1]}".encode())
        self._joined()

    # --- the meeting interface: what a launcher's world and a fleet each answer their own way ----------------
    @property
    def has_peers(self) -> bool:
        """Others may use this rank's memory (its revocations must be answered, its store authenticated)."""
        raise NotImplementedError

    @property
    def notification_senders(self) -> int:
        """How many senders ``wait_notification(stream=)`` may wait on."""
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        """The ranks of a launcher's world (``InvalidArgumentError`` in a fleet)."""
        raise NotImplementedError

    @property
    def hosts_store(self) -> bool:
        """This rank hosts the store (it stays up until every rank departed)."""
        return False

    def _connect(self) -> dist.Store:
        """This rank's own connection to where it meets (``init`` did not lend a store)."""
        raise NotImplementedError

    def _joined(self) -> None:
        """After the rank is claimed and its liveness address written."""

    def start(self, name: str | None, host: str) -> None:
        """The communicator is ready for peers (its map published, its revocation thread running)."""

    def withdraw(self) -> None:
        """First step of ``close``: stop being findable (a fleet member's name and record go)."""

    def members(self) -> dict:
        """The members present now, by rank (a fleet's)."""
        raise NotImplementedError

    def rank_of(self, name: str, timeout_s: float) -> int:
        """The rank of the present member ``name`` (a fleet's)."""
        raise NotImplementedError

    def barrier(self, timeout_s: float | None = None) -> None:
        """Until every rank entered the same barrier (a launcher's world)."""
        raise NotImplementedError

    def depart(self, timeout_s: float) -> None:
        """This rank is done: give up its rank claim."""
        self._release_rank()

    def _store_name(self) -> str:
        raise NotImplementedError

    def _lost_note(self) -> str:
        """What a lost store means beyond the loss, for its ``PeerLostError``."""
        return ""

    def _namespaced(self, store: dist.Store) -> dist.Store:
        return store

    def _sockets_of(self, store: dist.Store, before: set[int]) -> list[socket.socket]:
        """Our connection(s) to our own ``store``, which the watchdog shuts down to end a call past its bound."""
        return []

    def _use_store(self, store: dist.Store, sockets: list[socket.socket]) -> dist.Store | None:
        """Meet through ``store`` from now on (a new connection to a store that was lost); the one it replaces."""
        old, self._raw, self.store, self._store_sockets = self._raw, store, self._namespaced(store), sockets
        return old

    def _found_again(self) -> None:
        """The store answers again: calls no longer raise the loss."""
        self._lost = None

    def _resolve(self, rank: int) -> tuple[str, int] | None:
        """``rank``'s liveness address from the store, or None while it has not published one."""
        key = f"alive/{rank}"
        if not self.check(key):
            return None
        host, port = self._open(key, self._call(lambda: self.store.get(key), f"reading {key!r}")).decode().split()
        return host, int(port)

    # --- key/value ----------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, sealed with the job token when there is one."""
        if self._token is not None:
            value = seal(self._token, key, value)
        # torch's set does not wait for an answer: without the check a set to a store that is gone "succeeds"
        # and the value is lost. The check is the round trip that says it arrived.
        self._store_sealed(key, value)

    def _store_sealed(self, key: str, value: bytes) -> None:
        self._call(lambda: self.store.set(key, value), f"writing {key!r}")
        if not self._call(lambda: self.store.check([key]), f"confirming {key!r}"):
            raise PeerLostError(f"writing {key!r}: the store at {self.env.master_addr}:{self.env.master_port} "
                                "does not hold the value just written; another process deleted it or the store "
                                "restarted")

    def get(self, key: str, timeout_s: float | None = None, what: str | None = None,
            ranks: tuple[int, ...] = ()) -> bytes:
        """Blocks until ``key`` exists (at most ``timeout_s``; ``PeerLostError`` as soon as one of ``ranks`` is
        gone), then returns its verified value (``AuthenticationError`` when it does not verify; nothing is
        cached, so a later valid value is read)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.wait([key], timeout_s, what or f"waiting for {key!r}", ranks)
        return self._open(key, self._call(lambda: self.store.get(key), f"reading {key!r}"))

    def _open(self, key: str, blob: bytes) -> bytes:
        return unseal(self._token, key, blob)

    def _verifies(self, key: str, blob: bytes) -> bool:
        try:
            self._open(key, blob)
        except AuthenticationError:
            return False
        return True

    def wait(self, keys: list[str], timeout_s: float, what: str, ranks: Iterable[int] = ()) -> None:
        """Until every key exists: ``WaitTimeoutError`` after ``timeout_s``, ``PeerLostError`` once one of
        ``ranks`` (the ranks that would write them) or the store is gone.

        Polls ``check`` (one round trip; sleeps growing with the wait, at most 20 ms) rather than torch's
        ``wait``: a blocked ``wait`` could not look at the peers' liveness, and on a silent link it does not
        return after its own timeout."""
        start = time.monotonic()
        deadline = start + timeout_s
        while not self._call(lambda: self.store.check(keys), what):
            now = time.monotonic()
            for rank in ranks:
                self.liveness.check(rank, what)
            if self.between_polls is not None:
                self.between_polls()
            if now >= deadline:
                raise WaitTimeoutError(
                    f"{what}: not done after {timeout_s:.3g}s; a peer may be slow, stuck or dead. "
                    "Pass a larger timeout= or check the other ranks")
            time.sleep(min(0.02, max(0.0002, (now - start) / 32), max(deadline - now, 0.0)))

    def delete(self, key: str) -> None:
        """Remove ``key`` from the store (bounded, like every store call)."""
        self._call(lambda: self.store.delete_key(key), f"deleting {key!r}")

    def add(self, key: str, amount: int) -> int:
        """The store's counter (unauthenticated: a counter cannot carry a MAC); tensorwire decides nothing on it."""
        return int(self._call(lambda: self.store.add(key, amount), f"adding to {key!r}"))

    def check(self, key: str) -> bool:
        return bool(self._call(lambda: self.store.check([key]), f"checking {key!r}"))

    @property
    def owns_store(self) -> bool:
        """The store connection is tensorwire's own (not a store the user passed to ``init`` and calls too)."""
        return self._owns_store

    def leave(self) -> None:
        """Close this rank's liveness sockets ahead of ``close`` (a rank that does not host the store: the store's
        host stays watchable until every rank departed), so that peers see it gone before its NIXL agent goes and
        send that agent nothing more."""
        if not self.hosts_store:
            self.liveness.close()

    def close(self) -> None:
        """Local: stop watching peers (they learn at once that this rank is gone) and the call watchdog."""
        self.liveness.close()
        self._watchdog.close()
        if self._calls is not None:
            self._calls.close()
        for sock in self._store_sockets:
            sock.close()  # our duplicates of the store connection's descriptor
        self._store_sockets = []
        # Drop the store now rather than with this object (which the communicator's callbacks keep in reference
        # cycles): the last reference to tensorwire's own TCPStore closes its connection and, on rank 0, stops
        # the store's server thread and closes its sockets. A store passed to init stays with its owner.
        self.store = self._raw = None

    # --- ranks ----------------------------------------------------------------------------------
    def _claim_identity(self) -> Environment:
        """Claim this process's rank; the environment with it (a fleet's directory assigns it: see
        ``fleet.py``)."""
        self._claim_rank()
        return self.env

    def _reconnected(self, waiting: bool = True) -> bool:
        """Whether a lost store is back (``waiting``: for a store call, which may take up to its bound to find
        out): a launcher's store that is lost stays lost (a fleet's directory does not: ``fleet.py``)."""
        return False

    def _claim_rank(self) -> None:
        """Take ``rank/<r>`` for this process, atomically (``compare_set`` from empty); a second process with the
        same rank is refused while the first has not closed."""
        key, env = f"rank/{self.env.rank}", self.env
        holder = f"{hostname()} pid {os.getpid()} #{secrets.token_hex(8)}".encode()
        mine = seal(self._token, key, holder) if self._token is not None else holder
        found = self._compare_set(key, b"", mine)
        if found != mine and self._token is not None and found and not self._verifies(key, found):
            # A claim without this job's MAC is not a rank of this job: take the rank over instead of being
            # locked out by it (another claimer of this job racing for it still finds ours and is refused).
            found = self._compare_set(key, found, mine)
        who = None
        if found != mine:
            who = self._open(key, found).decode(errors="replace") if self._verifies(key, found) else "unknown"
        else:
            # The key was empty, but it can be emptied by anyone who reaches the store: a rank that still runs
            # answers on the liveness socket it published (alive/<rank>, sealed). Give the claim back to it.
            who = self._running_holder()
            if who is not None:
                self._compare_set(key, mine, b"")
        if who is not None:
            raise InvalidArgumentError(
                f"init: rank {env.rank} of {env.world_size} is already taken by another process in the job at "
                f"{env.master_addr}:{env.master_port} ({who}); this process ({holder.decode()}) is refused: start "
                "each rank once (check RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK or SLURM_PROCID), or use another "
                "MASTER_PORT if an earlier job still runs there"
            )
        self._claim = mine

    def _running_holder(self) -> str | None:
        """Who still runs as this rank according to its verified ``alive/<rank>`` record and a probe of the
        liveness socket it names (``listener_queries.who_runs``: bounded by ``liveness_s``), or None. A record that
        does not verify, or a socket nobody of this job answers on (the rank closed or died), is no holder."""
        key = f"alive/{self.env.rank}"
        if not self.check(key):
            return None
        blob = self._call(lambda: self.store.get(key), f"reading {key!r}")
        if not self._verifies(key, blob):
            return None
        host, port = self._open(key, blob).decode().split()
        return who_runs((host, int(port)), self.env.rank, self._token, self.liveness_s)

    def _release_rank(self) -> None:
        if self._claim is not None:
            self._compare_set(f"rank/{self.env.rank}", self._claim, b"")
            self._claim = None

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self._call(lambda: self.store.compare_set(key, expected, desired), f"claiming {key!r}"))

    def _call(self, fn, what: str, timeout_s: float | None = None):
        """Run one store call, bounded: torch's client blocks forever in ``add``/``check``/``compare_set`` (and
        after the timeout of ``get``/``wait``) when the store's host stops answering. Past ``liveness_s``
        (``timeout_s + liveness_s`` for a wait) the store counts as lost and the call raises ``PeerLostError``,
        as does every later one.

        On our own ``TCPStore`` a watchdog shuts our connection down, which makes the blocked call return. A
        store passed to ``init`` has no connection we can find (nor one we may shut: the user's own calls use
        it), so its calls run on a thread of their own (``CallThread``) that the caller stops waiting for. The
        trade-off: a call past its bound is abandoned, not ended: that thread stays blocked in it (a daemon), the
        store object is left to its owner in whatever state that call leaves it, and a late answer is never read
        (which is why the store then counts as lost); each call pays a hand-off between two threads (tens of
        microseconds, on ``prepare``'s store round trip, not on ``post``/``wait``)."""
        if self._lost is not None and not self._reconnected():
            raise PeerLostError(f"{what}: {self._lost}")
        bound = self.liveness_s + (timeout_s or 0.0)
        if self._calls is not None:
            try:
                return self._calls.run(fn, bound)
            except TimeoutError as e:
                if self._lost is None:
                    self._lost = self._silent(bound)
                raise PeerLostError(f"{what}: {self._lost}") from e
            except Exception as e:  # noqa: BLE001 - torch's store raises DistStoreError/DistNetworkError/RuntimeError
                self._raise_typed(e, what, timeout_s)
        key = object()
        self._watchdog.arm(key, time.monotonic() + bound, lambda: self._cut(bound))
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - as above
            self._raise_typed(e, what, timeout_s)
        finally:
            self._watchdog.disarm(key)

    def _raise_typed(self, e: Exception, what: str, timeout_s: float | None) -> NoReturn:
        """Raise what a failed store call means: ``PeerLostError`` once the connection is gone (cut by the
        watchdog, or broken), ``WaitTimeoutError`` for the store's own timeout, else ``e`` itself."""
        text = str(e)
        if self._lost is not None:
            raise PeerLostError(f"{what}: {self._lost}") from e
        if isinstance(e, TensorwireError) and not isinstance(e, PeerLostError):
            raise e  # typed at its source (the directory's client): its own words
        if isinstance(e, (getattr(dist, "DistNetworkError", ()), PeerLostError)) or "Connection" in text \
                or "Broken pipe" in text or "connection" in text:
            self._lost = f"lost {self._store_name()} ({text.splitlines()[0] if text else type(e).__name__})"
            self._lost += self._lost_note()
            raise PeerLostError(f"{what}: {self._lost}") from e
        # torch's TCPStore says a wait timed out with DistStoreError (its network failures are DistNetworkError,
        # handled above); other stores passed to init may raise a plain RuntimeError that says so in words.
        if isinstance(e, (getattr(dist, "DistStoreError", ()), TimeoutError)) or "imeout" in text \
                or "timed out" in text:
            seconds = self.timeout_s if timeout_s is None else timeout_s
            raise WaitTimeoutError(
                f"{what}: not done after {seconds:.3g}s; a peer may be slow, stuck or dead. "
                "Pass a larger timeout= or check the other ranks"
            ) from e
        raise e

    def _silent(self, bound_s: float) -> str:
        """Why the store counts as lost when a call got no answer: silence alone cannot tell a stopped or
        overloaded host (still alive) from a dead one or a cut link, so the message names them all."""
        return (f"{self._store_name()} did not answer within {bound_s:.3g}s (stopped, overloaded or unreachable); "
                "if its host is only slow, raise TENSORWIRE_LIVENESS_S")

    def _cut(self, bound_s: float) -> None:
        """The watchdog: the store did not answer within ``bound_s``. Shut our connection down (the blocked call
        returns with an error) and remember why; runs on the watchdog's thread."""
        self._lost = self._silent(bound_s)
        for sock in self._store_sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
