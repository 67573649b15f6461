"""Freshness of a peer's memory map: the owner says which epoch is current, so a map written back into the store
(an old sealed value, replayed by a process that reaches the store) is never used.

A sealed map opens for as long as the job token lives, so the store alone cannot tell an old map from the current
one. A rank that revoked memory tells its holders its new map epoch (``revocation.py``); a rank that never met the
owner has had no such word. So in an authenticated job, before ``prepare`` uses a map of a peer at an epoch it has
not confirmed yet (its first contact with the peer, or the peer's map changed), it asks the owner:

* ``Q <nonce>`` (NIXL notification, channel ``b"twmap"``) to the owner, whose NIXL agent the map just loaded
  names (the first transfer needs that connection anyway);
* the owner's revocation thread (it pumps the notification inbox every 10 ms whatever the user's threads do)
  answers in the store: ``fresh/<owner>/<nonce>`` -> its last published map epoch, sealed like every value, so
  only a member can write it and, bound to a fresh nonce in its key, no old answer can stand for it. Answering in
  the store spares the owner a NIXL connection back to the asker (a second handshake of tens of ms);
* the asker reads and deletes the answer and takes it as the floor under that peer's maps: an older map in the
  store is refused (``Peers``: ``AuthenticationError`` once the store does not catch up within the bound).

Cost: the owner's thread period plus three store round trips, on first contact and after the peer's map changed,
never on a ``prepare`` of a map already confirmed, never on ``post``/``wait``. Without a token nothing is asked
(such a job trusts its store anyway).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Freshness", "CHANNEL"]

CHANNEL = b"twmap"
_QUERY = b"Q"
_QUERY_FORMAT = struct.Struct("<Q")  # nonce
_EPOCH_FORMAT = struct.Struct("<I")  # the answer in the store


class Freshness:
    """One communicator's side of the protocol, as asker (``current_epoch``) and as owner (``handle`` answers).

    ``published_epoch()`` is this rank's last published map epoch."""

    def __init__(self, runtime: Runtime, published_epoch: Callable[[], int]) -> None:
        self._runtime, self._rendezvous = runtime, runtime.store
        self._published_epoch = published_epoch

    def current_epoch(self, rank: int, timeout_s: float) -> int:
        """``rank``'s current map epoch as ``rank`` says it (its metadata is loaded). Blocks (sleeping) for the
        round trip, at most ``timeout_s``: ``WaitTimeoutError``; ``PeerLostError`` once ``rank`` is gone."""
        nonce = secrets.randbits(64)
        key = f"fresh/{rank}/{nonce:016x}"
        self._runtime.transports.messenger.send_notification(rank, CHANNEL + _QUERY + _QUERY_FORMAT.pack(nonce))
        answer = self._rendezvous.get(key, timeout_s, f"prepare: asking rank {rank} which memory map is current",
                                      ranks=(rank,))
        try:
            self._rendezvous.delete(key)
        except Exception:  # noqa: BLE001 - a store without deletes keeps an 8-byte answer: harmless
            pass
        if len(answer) != _EPOCH_FORMAT.size:
            raise ValueError(f"prepare: rank {rank}'s answer has {len(answer)} bytes")
        return _EPOCH_FORMAT.unpack(answer)[0]

    def handle(self, sender: int, message: bytes) -> None:
        """A ``twmap`` notification (called by the inbox's pump): answer it in the store."""
        kind, body = message[len(CHANNEL):len(CHANNEL) + 1], message[len(CHANNEL) + 1:]
        if kind != _QUERY or len(body) != _QUERY_FORMAT.size:
            return
        (nonce,) = _QUERY_FORMAT.unpack(body)
        try:
            self._rendezvous.set(f"fresh/{self._runtime.rank}/{nonce:016x}",
                                 _EPOCH_FORMAT.pack(self._published_epoch()))
        except Exception:  # noqa: BLE001 - the store is gone: the asker's wait ends typed
            pass
