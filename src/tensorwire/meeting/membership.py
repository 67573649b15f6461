"""Who is in a fleet: members' names, ranks and records in the directory, and who of them is present.

A fleet member (``tw.init(directory=..., name=...)``) gets its rank from the directory (``Rendezvous``: a number
never reused) and then, here, claims its name and publishes its record. Keys (sealed like every value):

* ``name/<name>`` -> the rank that holds the name, claimed with ``compare_set`` from empty. A name held by a
  member that is no longer present (it died, or its host went) is taken over; one held by a present member is
  refused, so a name is unique among present members and a member started again under its name gets a new rank.
* ``member/<rank>`` -> ``name``, the member's host identity and pid: what ``members()`` lists. Deleted when the
  member leaves (``close``); a member that died leaves its record behind, and is not *present*.

Present: the member's keys are in the directory (they live as long as its lease: its connection to the embedded
directory, its etcd lease; a member that died loses them at once, one whose host went within two liveness periods)
AND its liveness listener (``alive/<rank>``) answers a probe as that rank of this job (``listener_queries``:
bound to a fresh nonce, MACed with the job token), so a process that took a dead member's port is not that member.
``members()`` costs one directory round trip (the ``member/`` records listed at once) and one concurrent probe per
listed member: O(members present), whatever the directory's history. Nothing here runs on the transfer path.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidArgumentError, WaitTimeoutError
from .listener_queries import answering

__all__ = ["Member", "Membership"]


@dataclass(frozen=True)
class Member:
    """A member of a fleet as the directory lists it: ``rank`` (unique for the directory's life), ``name``
    (unique among present members), ``host`` (hostname and boot id), ``pid``."""

    rank: int
    name: str
    host: str
    pid: int


class Directory(Protocol):
    """What membership asks of a fleet member's rendezvous (``fleet.Fleet``)."""

    env: Any
    where: str
    liveness_s: float
    token: bytes | None

    def claim(self, key: str, value: bytes) -> tuple[bytes, bytes | None] | None: ...
    def take_over(self, key: str, found: bytes, value: bytes) -> bool: ...
    def release(self, key: str) -> None: ...
    def set(self, key: str, value: bytes) -> None: ...
    def delete(self, key: str) -> None: ...
    def check(self, key: str) -> bool: ...
    def get_now(self, key: str) -> bytes | None: ...
    def listed(self, prefix: str) -> dict[str, bytes]: ...
    def address_of(self, rank: int) -> tuple[str, int] | None: ...


class Membership:
    """This member's name and record in the directory, and the lookups of the others. Blocks only for
    directory round trips (bounded like every store call) and, in ``rank_of``, for the name to appear."""

    def __init__(self, rendezvous: Directory, name: str, host: str) -> None:
        self._rendezvous = rendezvous
        self.rank = rendezvous.env.rank
        self.name = name
        self._claim_name()
        self._record = f"{name}\n{host}\n{os.getpid()}".encode()
        rendezvous.set(f"member/{self.rank}", self._record)

    def _claim_name(self) -> None:
        key, mine = f"name/{self.name}", str(self.rank).encode()
        for _ in range(8):
            holder = self._rendezvous.claim(key, mine)
            if holder is None:
                self._no_present_namesake()
                return
            found, opened = holder
            if found and opened is None:
                raise InvalidArgumentError(
                    f"init: the name {self.name!r} in the fleet at {self._rendezvous.where} is held by a claim this "
                    "member's job token cannot open (written by a process with another TENSORWIRE_JOB_TOKEN, or "
                    "forged); it is not taken over while its holder's lease lasts: check that every member has the "
                    "fleet's token, or choose another name")
            rank = _rank(opened)
            if rank is not None and self._present(rank):
                raise InvalidArgumentError(
                    f"init: the name {self.name!r} is held by member rank {rank} of the fleet at "
                    f"{self._rendezvous.where}, which is present; "
                    "give each member its own name (TENSORWIRE_NAME / name=), or close the other one first")
            if self._rendezvous.take_over(key, found, mine):  # its holder is gone (or it was forged, or released)
                return
        raise InvalidArgumentError(f"init: could not claim the name {self.name!r}: other members keep taking it")

    def _no_present_namesake(self) -> None:
        """After the name's claim was found empty: if a present member's record still says this name (its claim
        was deleted by another process; its heartbeat puts it back), give the claim back and refuse, so that two
        present members never share a name. One directory round trip; a probe only for a record of this name."""
        for key, record in self._rendezvous.listed("member/").items():
            rank = _rank(key.rsplit("/", 1)[1].encode())
            if rank is None or rank == self.rank or record.split(b"\n", 1)[0] != self.name.encode():
                continue
            if self._present(rank):
                self._rendezvous.release(f"name/{self.name}")
                raise InvalidArgumentError(
                    f"init: the name {self.name!r} is held by member rank {rank} of the fleet at "
                    f"{self._rendezvous.where}, which is present (its name's claim had been deleted; it puts it back "
                    "at its next heartbeat); give each member its own name (TENSORWIRE_NAME / name=), or close the "
                    "other one first")

    def _present(self, rank: int) -> bool:
        """Whether ``rank`` runs: one too busy to answer counts (its name is not taken from it)."""
        return rank == self.rank or self.present([rank], busy_counts=True)[rank]

    def present(self, ranks: list[int], busy_counts: bool = False) -> dict[int, bool]:
        """For each rank, whether it answers as that rank of this job now (at most ``liveness_s``; a listener that
        accepts but does not answer counts only with ``busy_counts``: see ``listener_queries.answering``)."""
        addresses = {rank: self._rendezvous.address_of(rank) for rank in ranks}
        known = {rank: address for rank, address in addresses.items() if address is not None}
        answered = answering(known, self._rendezvous.token, self._rendezvous.liveness_s, busy_counts=busy_counts)
        return {rank: rank in answered for rank in ranks}

    def members(self) -> dict[int, Member]:
        """The members present now, by rank (this one included). Blocks for one directory round trip and one
        concurrent probe per listed member (at most ``liveness_s``)."""
        listed: dict[int, Member] = {}
        for key, record in self._rendezvous.listed("member/").items():
            try:
                rank = int(key.rsplit("/", 1)[1])
                name, host, pid = record.decode().split("\n")
                listed[rank] = Member(rank, name, host, int(pid))
            except (ValueError, UnicodeDecodeError):
                continue  # not a record a member wrote (an unauthenticated fleet)
        others = [rank for rank in listed if rank != self.rank]
        present = self.present(others) if others else {}
        return {rank: member for rank, member in listed.items() if rank == self.rank or present[rank]}

    def rank_of(self, name: str, timeout_s: float) -> int:
        """The rank of the present member named ``name``; waits (sleeping, bounded by ``timeout_s``) until one
        is: ``WaitTimeoutError`` naming it otherwise."""
        if name == self.name:
            return self.rank
        deadline = time.monotonic() + timeout_s
        pause = 0.005
        while True:
            rank = _rank(self._rendezvous.get_now(f"name/{name}"))
            if rank is not None and self._rendezvous.check(f"member/{rank}") and self._present(rank):
                return rank
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"rank_of: no member named {name!r} is present in the fleet at {self._rendezvous.where} after "
                    f"{timeout_s:.3g}s; is it started with that name "
                    "(TENSORWIRE_NAME / name=) and the same directory? Pass a larger timeout= to wait longer")
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 0.1)

    def leave(self) -> None:
        """Remove this member's record and give its name back (``members()`` elsewhere drops it at once)."""
        self._rendezvous.delete(f"member/{self.rank}")
        self._rendezvous.release(f"name/{self.name}")


def _rank(value: bytes | None) -> int | None:
    """A rank as a name claim holds it; None for an empty (released) or foreign value."""
    try:
        return int(value.decode()) if value else None
    except (UnicodeDecodeError, ValueError):
        return None
