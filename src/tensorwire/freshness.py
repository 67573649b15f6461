"""Freshness of a peer's memory map: the owner says which epoch is current, so a map written back into the store
(an old sealed value, replayed by a process that reaches the store) is never used.

A sealed map opens for as long as the job token lives, so the store alone cannot tell an old map from the current
one. A rank that revoked memory tells its holders its new map epoch (``revocation.py``); a rank that never met the
owner has had no such word. So in an authenticated job, before ``prepare`` uses a map of a peer at an epoch it has
not confirmed yet (its first contact with the peer, or the peer's map changed), it asks the owner:

* ``Q <nonce>`` (NIXL notification, channel ``b"twmap"``) to the owner, whose NIXL agent the map just loaded
  proves to be the owner's rank (``backends/nixl.py``: agent names are bound to the rank with the token, and
  notifications from agents that prove no rank are dropped: the channel is authenticated);
* the owner answers ``E <nonce> <epoch>``, its last published map epoch, from its revocation thread (which pumps
  the notification inbox every 10 ms whatever the user's threads do);
* the asking rank takes the answer as the floor under that peer's maps: an older map in the store is refused
  (``Peers``: ``AuthenticationError`` once the store does not catch up within the bound).

Cost: one round trip through both ranks' revocation threads (~10-20 ms) on first contact and after the peer's
map changed, never on a ``prepare`` of a map already confirmed, never on ``post``/``wait``. Without a token
nothing is asked (such a job trusts its store anyway).
"""

from __future__ import annotations

import secrets
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .progress import wait_until

if TYPE_CHECKING:
    from .backends.nixl import NixlBackend
    from .runtime import Runtime

__all__ = ["Freshness", "CHANNEL"]

CHANNEL = b"twmap"
_QUERY, _ANSWER = b"Q", b"E"
_QUERY_FORMAT = struct.Struct("<Q")  # nonce
_ANSWER_FORMAT = struct.Struct("<QI")  # nonce, epoch


class Freshness:
    """One communicator's side of the protocol, as asker (``current_epoch``) and as owner (``handle`` answers).

    ``published_epoch()`` is this rank's last published map epoch; ``reach(rank)`` loads a rank's NIXL metadata
    (without asking it anything) so that an answer can be sent."""

    def __init__(self, runtime: Runtime, nixl: NixlBackend, published_epoch: Callable[[], int],
                 reach: Callable[[int], None]) -> None:
        self._runtime, self._nixl = runtime, nixl
        self._published_epoch, self._reach = published_epoch, reach
        self._lock = threading.Lock()
        self._asked: set[int] = set()  # nonces of the questions in flight: other answers are dropped
        self._answers: dict[int, int] = {}  # nonce -> epoch, as answered

    def current_epoch(self, rank: int, timeout_s: float) -> int:
        """``rank``'s current map epoch as ``rank`` says it (its metadata is loaded). Blocks (sleeping) for the
        round trip, at most ``timeout_s``: ``WaitTimeoutError``; ``PeerLostError`` once ``rank`` is gone."""
        nonce = secrets.randbits(64)
        with self._lock:
            self._asked.add(nonce)
        try:
            self._nixl.send_notification(rank, CHANNEL + _QUERY + _QUERY_FORMAT.pack(nonce))
            runtime = self._runtime
            wait_until(lambda: nonce in self._answers, timeout_s,
                       lambda: f"prepare: rank {rank} did not say which memory map is current", runtime.config,
                       runtime.alive(rank, f"prepare: asking rank {rank} which memory map is current"))
            with self._lock:
                return self._answers.pop(nonce)
        finally:
            with self._lock:
                self._asked.discard(nonce)
                self._answers.pop(nonce, None)

    def handle(self, sender: int, message: bytes) -> None:
        """A ``twmap`` notification (called by the inbox's pump)."""
        kind, body = message[len(CHANNEL):len(CHANNEL) + 1], message[len(CHANNEL) + 1:]
        if kind == _QUERY and len(body) == _QUERY_FORMAT.size:
            (nonce,) = _QUERY_FORMAT.unpack(body)
            try:
                self._reach(sender)
                self._nixl.send_notification(
                    sender, CHANNEL + _ANSWER + _ANSWER_FORMAT.pack(nonce, self._published_epoch()))
            except Exception:  # noqa: BLE001 - the asker is gone or unreachable: its wait ends typed
                pass
        elif kind == _ANSWER and len(body) == _ANSWER_FORMAT.size:
            nonce, epoch = _ANSWER_FORMAT.unpack(body)
            with self._lock:
                if nonce in self._asked:
                    self._answers[nonce] = epoch
