"""Who is in a fleet: members' names, ranks and records in the directory, and who of them is present.

A fleet member (``tw.init(directory=..., name=...)``) gets its rank from the directory (``Rendezvous``: a number
never reused) and then, here, claims its name and publishes its record. Keys (sealed like every value):

* ``name/<name>`` -> the rank that holds the name, claimed with ``compare_set`` from empty. A name held by a
  member that is no longer present (it died, or its host went) is taken over; one held by a present member is
  refused, so a name is unique among present members and a member started again under its name gets a new rank.
* ``member/<rank>`` -> ``name``, the member's host identity and pid: what ``members()`` lists. Deleted when the
  member leaves (``close``); a member that died leaves its record behind, and is not *present*.

Present: the member's liveness listener (``alive/<rank>``) takes a connection (``network.listening``): a dead
process's port refuses it at once, a gone host's does not answer within the bound. So ``members()`` drops a
dead member within ``liveness_s`` without any connection kept open: a member holds connections only to the peers
it uses. Every lookup costs directory round trips (one per key) and one connect per listed member, made
concurrently; nothing here runs on the transfer path.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .directory_client import DirectoryRendezvous
from .errors import InvalidArgumentError, WaitTimeoutError
from .network import listening

__all__ = ["Member", "Membership"]


@dataclass(frozen=True)
class Member:
    """A member of a fleet as the directory lists it: ``rank`` (unique for the directory's life), ``name``
    (unique among present members), ``host`` (hostname and boot id), ``pid``."""

    rank: int
    name: str
    host: str
    pid: int


class Membership:
    """This member's name and record in the directory, and the lookups of the others. Blocks only for
    directory round trips (bounded like every store call) and, in ``rank_of``, for the name to appear."""

    def __init__(self, rendezvous: DirectoryRendezvous, name: str, host: str) -> None:
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
                return
            found, opened = holder
            rank = _rank(opened)
            if rank is not None and self._present(rank):
                raise InvalidArgumentError(
                    f"init: the name {self.name!r} is held by member rank {rank} of the fleet at "
                    f"{self._rendezvous.where}, which is present; "
                    "give each member its own name (TENSORWIRE_NAME / name=), or close the other one first")
            if self._rendezvous.take_over(key, found, mine):  # its holder is gone (or it was forged, or released)
                return
        raise InvalidArgumentError(f"init: could not claim the name {self.name!r}: other members keep taking it")

    def _present(self, rank: int) -> bool:
        return rank == self.rank or self.present([rank])[rank]

    def present(self, ranks: list[int]) -> dict[int, bool]:
        """For each rank, whether its liveness listener takes a connection now (at most ``liveness_s``)."""
        addresses = {rank: self._rendezvous.address_of(rank) for rank in ranks}
        reachable = listening([a for a in addresses.values() if a is not None], self._rendezvous.liveness_s)
        return {rank: address is not None and address in reachable for rank, address in addresses.items()}

    def members(self) -> dict[int, Member]:
        """The members present now, by rank (this one included). Blocks for directory round trips and one
        concurrent connect per listed member (at most ``liveness_s``)."""
        listed: dict[int, Member] = {}
        for rank in range(self._rendezvous.add("fleet/next_rank", 0)):
            record = self._rendezvous.get_now(f"member/{rank}")
            if record is None:
                continue
            try:
                name, host, pid = record.decode().split("\n")
                listed[rank] = Member(rank, name, host, int(pid))
            except ValueError:
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
