"""A fleet member's ``Rendezvous``: the directory assigns its rank, holds its claims, and may come back empty.

What a fleet member needs of its directory beyond a launcher rank's store (``bootstrap.py``): a rank proposed by
the directory's counter and claimed (never reused), keys claimed and given back exactly (``claim`` /
``take_over`` / ``release``: a name), reads that do not wait (``get_now``), and survival of the directory's loss.
The directory is the control plane only: lost, every call raises ``PeerLostError`` naming it (prepared transfers do
not use it), the next call reconnects once it is back, and the heartbeat thread (one round trip every half
``liveness_s``) puts back what this member wrote when the directory came back empty (restarted): its claims, its
values, a rank counter past its own rank. Everything written goes through ``Rendezvous``'s sealing.

The directory is the embedded one (``tcp://``: torch's ``TCPStore`` client, ``directory.py``) or an etcd cluster
(``etcd://``: ``etcd_store.py``, which fails over between its endpoints by itself). In etcd this member's keys
live under its lease, which the heartbeat keeps alive: a member that died leaves etcd within twice
``liveness_s``, and one whose lease expired while it could not reach etcd (no quorum for longer than the TTL)
writes its keys again under a new lease, as into an embedded directory that came back empty.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch.distributed as dist

from .bootstrap import Rendezvous, _delta
from .environment import Environment
from .errors import AuthenticationError, InvalidArgumentError, PeerLostError, TensorwireError
from .etcd_store import EtcdStore
from .sealing import seal
from .store_sockets import socket_fds, store_client_sockets

__all__ = ["DirectoryRendezvous"]


class DirectoryRendezvous(Rendezvous):
    """A ``Rendezvous`` whose store is a fleet's directory (``env.fleet``)."""

    def __init__(self, env: Environment, timeout_s: float, *, token: bytes | None = None,
                 liveness_s: float = 5.0) -> None:
        self._claims: dict[str, bytes] = {}  # keys taken with claim()/take_over() -> the exact bytes written
        self._written: dict[str, bytes] = {}  # values as written (sealed): put back into a directory that lost them
        self._next_reconnect = 0.0
        self._etcd_lease_lost = False  # found expired while reconnecting: its keys are written again
        self._reconnecting = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._stopping = threading.Event()
        # etcd: the lease outlives two missed heartbeats; a call gives up before Rendezvous's bound (liveness_s).
        self._etcd = EtcdStore(env.etcd, lease_ttl_s=2 * liveness_s, request_s=0.8 * liveness_s) if env.etcd else None
        super().__init__(env, timeout_s, self._etcd, token=token, liveness_s=liveness_s)

    def _namespaced(self, store: dist.Store) -> dist.Store:
        return store if store is self._etcd else super()._namespaced(store)  # etcd's keys carry the prefix already

    @property
    def where(self) -> str:
        """The directory, as ``init``'s ``directory=`` names it."""
        if self._etcd is not None:
            return "etcd://" + ",".join(self._etcd.endpoints)
        return f"tcp://{self.env.master_addr}:{self.env.master_port}"

    def _claim_identity(self) -> Environment:
        """A fleet member's rank: the directory's next number (``add``: a counter, so unauthenticated; it only
        proposes), claimed like a launcher's rank. A number already claimed (a race, or a counter an outsider set
        back) is skipped, so ranks are unique for the directory's life and never reused."""
        for _ in range(64):
            proposed = self.add("fleet/next_rank", 1) - 1
            if proposed < 0:
                continue
            self.env = dataclasses.replace(self.env, rank=proposed)
            try:
                self._claim_rank()
            except InvalidArgumentError:
                continue
            return self.env
        raise PeerLostError(f"init: no free member rank in the directory {self.where} after 64 tries; its counter "
                            "is being tampered with")

    def _store_sealed(self, key: str, value: bytes) -> None:
        self._written[key] = value
        super()._store_sealed(key, value)

    def get_now(self, key: str) -> bytes | None:
        """``key``'s opened value if it is there and opens, else None. Two round trips; never waits."""
        if not self.check(key):
            return None
        blob = self._call(lambda: self.store.get(key), f"reading {key!r}")
        try:
            return self._open(key, blob)
        except AuthenticationError:
            return None

    def claim(self, key: str, value: bytes) -> tuple[bytes, bytes | None] | None:
        """Take ``key`` for ``value`` if it is empty (atomically, sealed): None when taken, else what holds it
        (the raw bytes, for ``take_over``, and the opened value, None if it does not open)."""
        mine = seal(self._token, key, value) if self._token is not None else value
        found = self._compare_set(key, b"", mine)
        if found == mine:
            self._claims[key] = mine
            return None
        return found, (self._open(key, found) if self._verifies(key, found) else None)

    def take_over(self, key: str, found: bytes, value: bytes) -> bool:
        """Replace exactly ``found`` (``claim``'s answer) by ``value``; False when someone changed it meanwhile."""
        mine = seal(self._token, key, value) if self._token is not None else value
        if self._compare_set(key, found, mine) == mine:
            self._claims[key] = mine
            return True
        return False

    def release(self, key: str) -> None:
        """Give back what ``claim``/``take_over`` took, unless someone has taken it over since."""
        mine = self._claims.pop(key, None)
        if mine is not None:
            self._compare_set(key, mine, b"")

    def delete(self, key: str) -> None:
        self._written.pop(key, None)
        super().delete(key)

    def address_of(self, rank: int) -> tuple[str, int] | None:
        """``rank``'s liveness address from its sealed ``alive/<rank>`` record, or None (none, or forged)."""
        value = self.get_now(f"alive/{rank}")
        if value is None:
            return None
        try:
            host, port = value.decode().split()
            return host, int(port)
        except ValueError:
            return None

    # --- the directory comes back -------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """A fleet member's thread that looks at its directory every half ``liveness_s`` (one round trip):
        reconnects to a directory that was lost, and puts this member's values back into one that came back
        empty (restarted), so the fleet is whole again within the liveness bound. Stopped by ``close``."""
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._beat, name=f"tensorwire-directory-{self.env.rank}",
                                               daemon=True)
            self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat (before this member leaves: it would put the records back)."""
        self._stopping.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=2 * self.liveness_s + 1.0)

    def _beat(self) -> None:
        while not self._stopping.wait(self.liveness_s / 2):
            try:
                if self._lost is not None:
                    self._reconnected(waiting=False)
                elif not self._lease_kept() or not self.check(f"member/{self.env.rank}"):
                    self._restore()
            except Exception:  # noqa: BLE001 - down: found down again next time; nothing here may end the thread
                continue

    def _lease_kept(self) -> bool:
        """Keep this member's etcd lease alive; False when it had expired (its keys are gone). True for the
        embedded directory (no leases)."""
        if self._etcd is None:
            return True
        return bool(self._call(self._etcd.keep_alive, "keeping this member's etcd lease alive"))

    def _reconnected(self, waiting: bool = True) -> bool:
        """A fleet member whose directory was lost: connect again and put its values back; True once connected. A
        launcher's store that is lost stays lost.

        The heartbeat tries at most once per half ``liveness_s`` and never waits (``waiting=False``). A store call
        (``waiting``) takes the outcome of an attempt under way, or makes one itself however recent the last one
        was: a call right after the directory came back must not fail on the memory of a failed attempt made
        while it was coming back (an etcd cluster electing its leader). Either way within one ``liveness_s``, the
        bound of the call."""
        if not self._owns_store and self._etcd is None:
            return False
        now = time.monotonic()
        if not self._reconnecting.acquire(blocking=False):
            if waiting and self._reconnecting.acquire(timeout=self.liveness_s):  # an attempt was under way
                self._reconnecting.release()
            return self._lost is None
        try:
            if self._lost is None:  # another thread connected meanwhile
                return True
            if not waiting and now < self._next_reconnect:
                return False
            return self._connect_again(now)
        finally:
            self._reconnecting.release()

    def _connect_again(self, now: float) -> bool:
        self._next_reconnect = now + self.liveness_s / 2
        if self._etcd is not None:  # no connection to make: back once a quorum answers (bounded like every call)
            try:
                if not self._calls.run(self._etcd.keep_alive, self.liveness_s):
                    self._etcd_lease_lost = True
            except Exception:  # noqa: BLE001 - still no quorum: the caller raises with the reason kept
                return False
        else:
            before = socket_fds()
            try:
                store = dist.TCPStore(self.env.master_addr, self.env.master_port, None, is_master=False,
                                      timeout=_delta(self.liveness_s), wait_for_workers=False)
            except Exception:  # noqa: BLE001 - still down: the caller raises with the reason kept
                return False
            self._raw, self.store = store, dist.PrefixStore("tensorwire/", store)
            self._store_sockets = store_client_sockets(before, store.port)
        self._lost = None
        try:
            if self._etcd_lease_lost or not self.check(f"member/{self.env.rank}"):
                self._restore()
                self._etcd_lease_lost = False
        except TensorwireError:
            return False
        return True

    def _restore(self) -> None:
        """Put this member's values back into a directory that lost them: its claims (from empty only: a
        claim someone else made meanwhile stands), its records, and a rank counter past its own rank."""
        for key, mine in [(f"rank/{self.env.rank}", self._claim), *self._claims.items()]:
            if mine is not None:
                self._compare_set(key, b"", mine)
        for key, value in list(self._written.items()):
            self._call(lambda k=key, v=value: self.store.set(k, v), f"restoring {key!r}")
        behind = self.env.rank + 1 - self.add("fleet/next_rank", 0)
        if behind > 0:
            self.add("fleet/next_rank", behind)

    def _store_name(self) -> str:
        return f"the directory {self.where}" if self._etcd is not None else super()._store_name()

    def close(self) -> None:
        """Local, plus in etcd one bounded round trip: this member's lease is revoked, so its keys leave at once
        (skipped while etcd does not answer: they expire)."""
        self.stop_heartbeat()
        if self._etcd is not None and self._lost is None and self._calls is not None:
            try:
                self._call(self._etcd.revoke, "revoking this member's etcd lease")
            except TensorwireError:
                pass
        super().close()
