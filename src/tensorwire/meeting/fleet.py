"""A fleet member's ``Rendezvous``: the directory assigns its rank, holds its claims, and may come back empty.

What a fleet member needs of its directory beyond a launcher rank's store (``world.py``): a rank proposed by
the directory's counter and claimed (never reused), keys claimed and given back exactly (``claim`` /
``take_over`` / ``release``: a name), reads that do not wait (``get_now``), and survival of the directory's loss.
The directory is the control plane only: lost, every call raises ``PeerLostError`` naming it (prepared transfers do
not use it), the next call reconnects once it is back, and the heartbeat thread (one round trip every half
``liveness_s``) puts back what this member wrote when the directory came back empty (restarted): its claims, its
values, a rank counter past its own rank. Everything written goes through ``Rendezvous``'s sealing.

The directory is the embedded one (``tcp://``: ``directory_store.py``'s authenticated connection to ``directory.py``)
or an etcd cluster (``etcd://``: ``etcd_store.py``, which fails over between its endpoints by itself), each behind
one link (``directory_links.py``: where, keep alive, reconnect, release), so nothing here branches on the kind.
Either way this member's keys live under its lease, which the heartbeat keeps alive: the embedded directory keeps
them while the connection lives and speaks at least every twice ``liveness_s``; etcd's lease has that TTL. A member
that died leaves the directory at once (embedded) or within twice ``liveness_s`` (etcd), and one whose lease ended
while it could not reach the directory writes its keys again under a new lease, as into a directory that came back
empty.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import NoReturn

import torch.distributed as dist

from ..environment import OPEN_WORLD, Environment
from ..errors import AuthenticationError, InvalidArgumentError, PeerLostError, TensorwireError, WaitTimeoutError
from ..sealing import seal
from .directory_links import link_for
from .directory_store import DirectoryStore, NotYet
from .etcd_access import EtcdAccess
from .membership import Member, Membership
from .rendezvous import Rendezvous

__all__ = ["Fleet"]

_STREAM_SENDERS = 1024  # members a fleet member may wait for with wait_notification(stream=)


class Fleet(Rendezvous):
    """A fleet member's ``Rendezvous`` (``env.fleet``): its store is the fleet's directory, its rank the
    directory's, its name and record claimed in ``start`` (``membership.py``)."""

    def __init__(self, env: Environment, timeout_s: float, *, token: bytes | None = None,
                 liveness_s: float = 5.0, etcd_access: EtcdAccess | None = None) -> None:
        self._claims: dict[str, bytes] = {}  # keys taken with claim()/take_over() -> the exact bytes written
        self._written: dict[str, bytes] = {}  # values as written (sealed): put back into a directory that lost them
        self._next_reconnect = 0.0
        self._lease_lost = False  # found expired while reconnecting (etcd): its keys are written again
        self._reconnecting = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._membership: Membership | None = None
        self._stopping = threading.Event()
        self._link = link_for(env, token, liveness_s, etcd_access)  # the embedded directory or etcd
        super().__init__(env, timeout_s, self._link.store, token=token, liveness_s=liveness_s)

    _superseded: str | None = None  # why this member lost its name to another: the directory is lost to it

    # --- the meeting interface -------------------------------------------------------------------------------
    has_peers = True
    notification_senders = _STREAM_SENDERS

    @property
    def world_size(self) -> int:
        raise InvalidArgumentError(
            f"world_size: {self.env.name!r} is a member of a fleet, whose members come and go; use comm.members() "
            "for who is present now and comm.rank_of(name) to find one")

    def start(self, name: str | None, host: str) -> None:
        """Claim the name and write the record (last: once listed, peers may prepare transfers to this member at
        once), then keep the lease with the heartbeat."""
        self._membership = Membership(self, self.env.name, host)
        self.start_heartbeat()

    def withdraw(self) -> None:
        """The record and the name go first: ``members()`` elsewhere stops listing this member at once."""
        self.stop_heartbeat()
        if self._membership is not None:
            self._membership.leave()

    def members(self) -> dict[int, Member]:
        return self._started("members").members()

    def rank_of(self, name: str, timeout_s: float) -> int:
        return self._started("rank_of").rank_of(name, timeout_s)

    def barrier(self, timeout_s: float | None = None) -> None:
        raise InvalidArgumentError(
            "barrier: a fleet has no fixed world to wait for; wait for the members you need with "
            "comm.rank_of(name) and exchange readiness through publish()/lookup() or notifications")

    def _started(self, fn: str) -> Membership:
        if self._membership is None:
            raise InvalidArgumentError(f"{fn}: this member has not joined its fleet yet (the communicator is "
                                       "being made)")
        return self._membership

    def _lost_note(self) -> str:
        return ("; transfers with members already connected go on, and calls that need the directory work again "
                "once it is back")

    # --- the directory ------------------------------------------------------------------------------------------

    def _connect(self) -> dist.Store:
        """This member's connection to its directory, tried for init's timeout while it does not take any."""
        return self._link.connect(self.timeout_s)

    def _sockets_of(self, store: dist.Store, before: set[int]) -> list[socket.socket]:
        return self._link.sockets(store)

    @property
    def token(self) -> bytes | None:
        """The job token (the probes of ``membership.py`` verify answers with it)."""
        return self._token

    def listed(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` whose value opens, with its opened value: one round trip."""
        found = self._call(lambda: self.store.list_prefix(prefix), f"listing {prefix!r}")
        opened = {}
        for key, blob in found.items():
            try:
                opened[key] = self._open(key, blob)
            except AuthenticationError:
                continue
        return opened

    @property
    def where(self) -> str:
        """The directory, as ``init``'s ``directory=`` names it."""
        return self._link.where

    def _claim_identity(self) -> Environment:
        """A fleet member's rank: the directory's next number (``add``: a counter, so unauthenticated; it only
        proposes), claimed like a launcher's rank. A number already claimed (a race, or a counter an outsider set
        back) is skipped, so ranks are unique for the directory's life and never reused."""
        deadline = time.monotonic() + self.timeout_s
        for _ in range(64):
            try:
                proposed = self.add("fleet/next_rank", 1) - 1
            except NotYet as e:  # a directory just started: the members it had put their ranks back first
                if time.monotonic() + e.seconds > deadline:
                    raise WaitTimeoutError(
                        f"init: the directory {self.where} started moments ago and lets the members it had put their "
                        f"ranks back first ({e.seconds:.3g}s more, past this init's timeout); pass a larger "
                        "timeout= or start the directory before its members") from None
                time.sleep(e.seconds)
                continue
            if not 0 <= proposed < OPEN_WORLD:
                raise PeerLostError(f"init: the directory {self.where} proposed rank {proposed}, outside the ranks a "
                                    f"member can hold (0..{OPEN_WORLD - 1}): its rank counter (fleet/next_rank) was "
                                    "moved past them by a process with write access to it; reset that key")
            self.env = dataclasses.replace(self.env, rank=proposed)
            try:
                self._claim_rank()
            except InvalidArgumentError:
                continue
            return self.env
        raise PeerLostError(f"init: no free member rank in the directory {self.where} after 64 tries: the 64 ranks "
                            "its counter proposed were each claimed already (by members joining at once, or claims "
                            "made ahead of the counter); try again")

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
                else:
                    self._claims_held()
            except Exception:  # noqa: BLE001 - down: found down again next time; nothing here may end the thread
                continue

    def _lease_kept(self) -> bool:
        """Keep this member's lease alive; False when it had expired (its keys are gone)."""
        return bool(self._call(self._link.keep_alive, "keeping this member's lease alive"))

    def _reconnected(self, waiting: bool = True) -> bool:
        """A fleet member whose directory was lost: connect again and put its values back; True once connected. A
        launcher's store that is lost stays lost.

        The heartbeat tries at most once per half ``liveness_s`` and never waits (``waiting=False``). A store call
        (``waiting``) takes the outcome of an attempt under way, or makes one itself however recent the last one
        was: a call right after the directory came back must not fail on the memory of a failed attempt made
        while it was coming back (an etcd cluster electing its leader). Either way within one ``liveness_s``, the
        bound of the call."""
        if self._superseded is not None:
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
        try:
            store, lease_lost = self._link.reconnect(lambda fn, s: self._calls.run(fn, s), self.liveness_s)
        except Exception:  # noqa: BLE001 - still down (no quorum, another token): the caller raises the reason kept
            return False
        self._lease_lost = self._lease_lost or lease_lost
        if store is not None:
            old = self._use_store(store, self._link.sockets(store))
            if isinstance(old, DirectoryStore):
                old.close()
        self._found_again()
        try:
            if self._lease_lost or not self.check(f"member/{self.env.rank}"):
                self._restore()
                self._lease_lost = False
        except TensorwireError:
            return False
        return True

    def _restore(self) -> None:
        """Put this member's values back into a directory that lost them: its claims (from empty only: a
        claim someone else made meanwhile stands), then, only if every claim is still its own, its records and a
        rank counter past its own rank. A claim someone else holds now (its name, taken while this member was
        stalled past its lease) means this member was superseded: it writes nothing back (its record would make
        a second present member of that name) and every later directory call raises (``_supersede``)."""
        for key, mine in [(f"rank/{self.env.rank}", self._claim), *self._claims.items()]:
            if mine is not None and self._compare_set(key, b"", mine) != mine:
                self._supersede(key)
        for key, value in list(self._written.items()):
            self._call(lambda k=key, v=value: self.store.set(k, v), f"restoring {key!r}")
        try:
            self._call(lambda: self.store.raise_to("fleet/next_rank", self.env.rank + 1), "restoring the rank counter")
        except InvalidArgumentError:
            pass  # the directory kept its counter's mark (a state file): no rank of this member is above it

    def _claims_held(self) -> bool:
        """Whether every claim of this member still holds its own value (one round trip per claim: its name). A
        claim that went (deleted by another process) or holds a value that does not open (forged) is put back; one
        that another member holds with its record written means this member was superseded (``_supersede``
        raises). One held by a member without a record is left for the next heartbeat: a newcomer that found the
        claim empty gives it back once it sees this member present (``membership``)."""
        for key, mine in list(self._claims.items()):
            found = self._call(lambda k=key: self.store.get(k) if self.store.check([k]) else None, f"reading {key!r}")
            if found == mine:
                continue
            if not found or not self._verifies(key, found):
                self._compare_set(key, found or b"", mine)
                continue
            holder = self._open(key, found).decode(errors="replace")
            if holder.isdigit() and self.check(f"member/{holder}"):
                self._supersede(key)
        return True

    def _supersede(self, key: str) -> NoReturn:
        """Another member holds ``key`` (this member's name) now: give back what this member still holds in the
        directory and make every later directory call raise ``PeerLostError`` saying so. Never returns."""
        why = (f"{self.env.name!r} (rank {self.env.rank}) was superseded in the fleet at {self.where}: another "
               f"member holds {key!r} now (this process was stopped or cut off past its lease of "
               f"{2 * self.liveness_s:g}s, or the claim was deleted, and the name was taken meanwhile); this "
               "communicator no longer belongs to the fleet: close it and init again (under another name, or once "
               "the other member left)")
        for other, mine in [(f"rank/{self.env.rank}", self._claim), *self._claims.items()]:
            if other != key and mine is not None:
                try:
                    self._compare_set(other, mine, b"")
                except TensorwireError:
                    pass
        self._claims.clear()
        self._written.clear()
        self._claim = None
        self._superseded = why
        self._lost = why
        self._stopping.set()
        raise PeerLostError(why)

    def _store_name(self) -> str:
        return f"the directory {self.where}"

    def close(self) -> None:
        """Local, plus where the directory needs it (etcd) one bounded round trip: this member's lease is revoked,
        so its keys leave at once (skipped while it does not answer: they expire)."""
        self.stop_heartbeat()
        if self._lost is None and self.store is not None:
            try:
                self._call(self._link.release, "releasing this member's lease")
            except TensorwireError:
                pass
        super().close()
