"""Freshness of a peer's memory map: the owner says which epoch is current, so a map written back into the store
(an old sealed value, replayed by a process that reaches the store) is never used.

A sealed map opens for as long as the job token lives, so the store alone cannot tell an old map from the current
one. A rank that revoked memory tells its holders its new map epoch (``revocation.py``); a rank that never met the
owner has had no such word. So in an authenticated job, before ``prepare`` uses a map of a peer at an epoch it has
not confirmed yet (its first contact with the peer, or the peer's map changed), it asks the owner's liveness
listener (``listener_queries.MAP_EPOCH``) on a connection of its own: the owner answers its last published map
epoch, bound under the job token to the asker's fresh nonce (no old answer stands for a new question, and only a
member can make one), and the asker takes it as the floor under that peer's maps: an older map in the store is
refused (``Peers``: ``AuthenticationError`` once the store does not catch up within the bound).

Cost: one TCP round trip to the owner, which answers at once from its revocation thread (``Liveness.serve`` wakes
on the connection): on first contact and after the peer's map changed, never on a ``prepare`` of a map already
confirmed, never on ``post``/``wait``. No store round trip and no NIXL message. Without a token nothing is asked
(such a job trusts its store anyway).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from .errors import PeerLostError, WaitTimeoutError
from .meeting.listener_queries import MAP_EPOCH, ask

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Freshness"]

_EPOCH_FORMAT = struct.Struct("<I")


class Freshness:
    """The asker's side (the owner's is its liveness listener)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def current_epoch(self, rank: int, timeout_s: float) -> int:
        """``rank``'s current map epoch as ``rank`` says it. Blocks for the round trip, at most ``timeout_s``:
        ``WaitTimeoutError``; ``PeerLostError`` when no process of this job answers for ``rank``."""
        what = f"prepare: asking rank {rank} which memory map is current"
        liveness = self._runtime.liveness
        address = liveness.address_of(rank)
        if address is None:
            raise PeerLostError(f"{what}: rank {rank} has published no liveness address (it has not started, or is "
                                "gone)")
        try:
            said = ask(address, MAP_EPOCH, rank, self._runtime.config.job_token, timeout_s)
        except TimeoutError:
            raise WaitTimeoutError(f"{what}: not answered after {timeout_s:.3g}s; rank {rank} is stopped or stuck "
                                   "outside tensorwire. Pass a larger timeout= or check it") from None
        if said is None or len(said) != _EPOCH_FORMAT.size:
            self._runtime.liveness.check(rank, what)  # gone: says so, with the reason
            raise PeerLostError(f"{what}: no process of this job answers for rank {rank} at {address[0]}:"
                                f"{address[1]} (it exited, or another process holds its port)")
        return _EPOCH_FORMAT.unpack(said)[0]
