"""Revocation: when a rank deregisters memory, the transfers its peers prepared to it stop before they can
write into it.

Protocol (notifications on the channel ``b"twrev"``; the owner is the rank that deregisters):

1. The owner publishes its memory map without the ranges (a new ``prepare`` of them fails).
2. It sends ``R <epochs>`` to every rank that may hold a transfer to them: every rank it has a liveness
   connection with, or that opened one (each rank that prepared a transfer to this one connected to it first;
   ``Liveness.peers``), or whose NIXL metadata it loaded.
3. A rank handles ``R`` when it next pumps its notifications (any wait that sleeps: transfer waits,
   ``wait_notification``, ``prepare``; the progress thread's notification watches). Every transfer of it to
   those epochs is failed (``RevokedError`` from every later call: its CPU post never reaches the backend, and
   the doorbell of a stream post is released without posting); it waits (bounded) until none of them is in
   flight, then answers ``A <epochs>``.
4. The owner does not wait: it keeps the tensors and their backend registrations (*quarantine*) until every
   such rank has answered (handled by whichever of its threads pumps notifications next: its waits, its next
   deregistration) or is gone, or the communicator closes; then it releases them from the backends and drops
   the tensors.

So a late write lands in memory that is still allocated, never in freed memory, and ``Registration.close`` never
blocks on a peer. A rank busy outside tensorwire is not stopped before it handles the revocation (a check on
every post would cost the hot path); its transfer fails at the first post after that.

Bounds. The owner's deregistration returns without waiting for any peer (a store round trip to publish the map,
one notification per rank). The memory is released by the owner's first sleeping wait (or next deregistration)
after the last rank answered (a rank answers from its own first sleeping wait after ``R`` arrived) or is gone
(a dead rank is noticed within ``liveness_s`` by those same waits), and at the latest when the owner's
communicator closes. There is no timeout: a rank that stays alive without calling into tensorwire keeps the
memory quarantined for as long as it is silent, because its prepared transfer could still post, and once the
backends let go of the memory nothing stops those bytes (UCX's cma and CUDA IPC write to the address itself,
and the allocator reuses it). ``quarantined()`` counts such deregistrations.

The hot path costs nothing: a revoked transfer's bound post call is cleared, so its next post takes the
slow path, which raises.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from .backends.base import Status
from .errors import RevokedError

if TYPE_CHECKING:
    from .backends.nixl import NixlBackend
    from .peers import Peers
    from .progress import Inbox
    from .runtime import Runtime

__all__ = ["Revocations", "CHANNEL"]

CHANNEL = b"twrev"
_REVOKE, _ACK = b"R", b"A"


def _message(kind: bytes, epochs: list[int]) -> bytes:
    return CHANNEL + kind + struct.pack(f"<{len(epochs)}I", *epochs)


def _parse(message: bytes) -> tuple[bytes, list[int]]:
    body = message[len(CHANNEL) + 1:]
    count = len(body) // 4
    return message[len(CHANNEL):len(CHANNEL) + 1], list(struct.unpack(f"<{count}I", body[:4 * count]))


class Revocations:
    """One communicator's side of the protocol (both as owner and as holder of transfers): its transfers
    (``runtime.transfers``), notifications (``inbox``, sent through ``nixl``) and peers' maps (``peers``)."""

    def __init__(self, runtime: Runtime, inbox: Inbox, nixl: NixlBackend, peers: Peers) -> None:
        self._runtime, self._inbox, self._nixl, self._peers = runtime, inbox, nixl, peers
        self._lock = threading.Lock()
        self._awaiting: dict[tuple[int, ...], set[int]] = {}  # epochs revoked by this rank -> ranks yet to answer
        self._quarantine: dict[tuple[int, ...], Any] = {}  # epochs -> what to release once every rank answered
        self._next_pump = 0.0
        self._pumping = False

    # --- holder side ------------------------------------------------------------------------------
    def handle(self, sender: int, message: bytes) -> None:
        """A ``twrev`` notification (called by the inbox's pump)."""
        kind, epochs = _parse(message)
        if kind == _REVOKE:
            self._revoke_transfers(sender, set(epochs))
            try:
                self._reach(sender)  # holds nothing of it maybe, but the owner waits for the answer
                self._nixl.send_notification(sender, _message(_ACK, epochs))
            except Exception:  # noqa: BLE001 - the owner is gone or unreachable: nothing to tell
                pass
        elif kind == _ACK:
            self._answered(sender, tuple(epochs))

    def _revoke_transfers(self, owner: int, epochs: set[int]) -> None:
        bound = self._runtime.config.liveness_s
        revoked = [t for t in list(self._runtime.transfers)
                   if t.peer == owner and t._remote_epochs & epochs and not t.closed]
        for transfer in revoked:
            transfer._revoke(RevokedError(
                f"post: rank {owner} deregistered the memory this {transfer.op.value} reaches (registration "
                f"epoch(s) {sorted(transfer._remote_epochs & epochs)}); the transfer is failed: close it, look the "
                "descriptors up again and prepare a new one"))
        deadline = time.monotonic() + bound
        for transfer in revoked:  # in flight: let it finish before the owner lets go of the memory
            backend, request = transfer._backend, transfer._request
            while request is not None and time.monotonic() < deadline:
                try:
                    if backend.status(request) is not Status.IN_PROGRESS:
                        break
                except Exception:  # noqa: BLE001 - failed: nothing more lands
                    break
                time.sleep(0.0005)

    def pump(self) -> None:
        """Handle what has arrived (rate-limited: at most every 10 ms); for waits that sleep anyway. Also
        releases what waited only for ranks that are gone since (a dead rank never answers, and the owner may
        never deregister again)."""
        now = time.monotonic()
        if now >= self._next_pump and not self._runtime.closed and not self._pumping:
            self._next_pump = now + 0.01
            self._pumping = True  # a handler's store wait polls this again: do not nest
            try:
                self._inbox.pump()
                if self._awaiting:
                    self._sweep()
            finally:
                self._pumping = False

    # --- owner side -------------------------------------------------------------------------------
    def revoke(self, epochs: list[int], release: Any, wait: bool = True) -> None:
        """Tell every rank that may hold transfers to ``epochs``, and ``release()`` (backend deregistration,
        dropping the tensors) once all of them have answered or are gone: at once when none may hold any, else
        from the pump that handles the last answer. Never blocks on a peer. ``wait=False`` (the communicator
        closes): release now; the backends go with the communicator."""
        rank = self._runtime.rank
        key = tuple(sorted(epochs))
        self._revoke_transfers(rank, set(epochs))  # this rank's own transfers to them
        self._inbox.pump()  # answers to earlier revocations: release what they held
        self._sweep()
        targets = (set(self._runtime.liveness.peers()) | set(self._nixl.loaded_peers())) - {rank}
        pending = set()
        for target in sorted(targets):
            try:
                if not wait and target not in self._nixl.loaded_peers():
                    continue  # closing: no store round trips for ranks this one never talked to
                self._reach(target)
                self._nixl.send_notification(target, _message(_REVOKE, list(key)))
                pending.add(target)
            except Exception:  # noqa: BLE001 - gone or unreachable: it posts nothing more
                continue
        if not wait or not pending:
            release()
            return
        with self._lock:
            self._awaiting[key] = pending
            self._quarantine[key] = release

    def _reach(self, rank: int) -> None:
        """Load ``rank``'s NIXL metadata once if it is not loaded (a store round trip, bounded by the liveness
        period), so a notification can be sent to it."""
        if rank not in self._nixl.loaded_peers():
            self._peers.view(rank, 0, self._runtime.config.liveness_s)

    def _sweep(self) -> None:
        """Ranks that are gone answer no more: release what waited only for them."""
        liveness, released = self._runtime.liveness, []
        with self._lock:
            for key, left in list(self._awaiting.items()):
                left -= {rank for rank in left if liveness.lost(rank) is not None}
                if not left:
                    del self._awaiting[key]
                    released.append(self._quarantine.pop(key, None))
        for release in released:
            if release is not None:
                release()

    def quarantined(self) -> int:
        """How many deregistrations still wait for a peer's answer (their memory is kept)."""
        with self._lock:
            return len(self._quarantine)

    def _answered(self, rank: int, key: tuple[int, ...]) -> None:
        release = None
        with self._lock:
            left = self._awaiting.get(key)
            if left is None:
                return
            left.discard(rank)
            if not left:
                self._awaiting.pop(key, None)
                release = self._quarantine.pop(key, None)
        if release is not None:
            release()

    def close(self) -> None:
        """The communicator closes: the backends go, and what was quarantined with them."""
        with self._lock:
            self._quarantine.clear()
            self._awaiting.clear()
