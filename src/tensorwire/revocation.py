"""Revocation: when a rank deregisters memory, the transfers its peers prepared to it stop before it returns.

Protocol (notifications on the channel ``b"twrev"``; the owner is the rank that deregisters):

1. The owner publishes its memory map without the ranges (a new ``prepare`` of them fails).
2. It sends ``R <new map epoch> <epochs>`` to every rank that may hold a transfer to them: every rank that
   opened a liveness connection to it (each rank that prepared a transfer to this one connected to it first;
   ``Liveness.callers``). A rank it only connected to itself holds nothing of it and is not asked.
3. A holder handles ``R`` at once, on its revocation thread (below), whatever its user threads do: every
   transfer of it to those epochs is failed (``RevokedError`` from every later call, however tight a
   ``post()``/``wait()`` loop: its CPU post never reaches the backend, and the doorbell of a stream post is
   released without posting); it remembers the epochs and the owner's new map epoch (a later ``prepare`` of a
   revoked registration is refused, and an older map of the owner's, written back into the store, is not
   accepted); it waits (bounded by ``liveness_s``) until none of those transfers is in flight, then answers
   ``A <epochs>``.
4. The owner's ``Registration.close()`` / ``BlockPool.close()`` returns once every such rank has answered or is
   gone, and only then lets the backends release the memory. So when ``close()`` returns no peer can write into
   the memory any more, and the owner may reuse it at once (what a KV cache that frees and reuses blocks needs).
   A rank that stays alive without answering within ``2 * liveness_s`` (stopped, or stuck holding the GIL)
   makes ``close()`` raise ``WaitTimeoutError`` naming it; the memory then stays registered and its tensors
   referenced (*quarantine*) until that rank answers or is gone, or the communicator closes, and must not be
   reused before (a later ``close()`` of the communicator, or the quarantine's own release, lets go).

The revocation thread. A holder must answer while its user threads are busy outside tensorwire, or spin in a
tight loop of transfers that never sleeps, and every rank must answer (the owner cannot tell which of the ranks
it has met hold transfers to it). One daemon thread per communicator with peers, started at ``init``, waits in
``Liveness.serve``, so handshakes and questions to this rank's liveness listener are answered as they arrive, and
pumps the notification inbox when it wakes. An idle rank's thread sleeps: it wakes once per ``liveness_s`` (the
safety net), not 100 times a second. An owner that sends a revocation pokes the holder's listener (``poke``), which
wakes the thread at once; after any wake it pumps every ``_LISTEN_PERIOD_S`` for ``_BUSY_S`` (the notification may
arrive after the poke, over another path). User notifications it pumps are only queued (``wait_notification``
reads them as before). The hot path costs nothing: a revoked transfer's bound post call is
cleared, so its next post takes the slow path, which raises.
"""

from __future__ import annotations

import struct
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import RevokedError, TensorwireWarning, WaitTimeoutError

if TYPE_CHECKING:
    from .peers import Peers
    from .runtime import Runtime

__all__ = ["Revocations", "CHANNEL"]

CHANNEL = b"twrev"
_REVOKE, _ACK = b"R", b"A"
_REVOKE_CLOSING = b"r"  # the owner's communicator closes: revoke, but answer nothing (its agent may be gone)
_LEAVING = b"C"  # the sender's communicator closes and holds no transfer any more: no answer to wait for from it
_LISTEN_PERIOD_S = 0.01  # how often the revocation thread looks for notifications after a wake
_BUSY_S = 1.0  # for how long after a wake: a revocation's notification may arrive after its poke


_SENDING = -1  # in a revocation's waiters while its messages are being sent: not released before they are out


def _message(kind: bytes, numbers: list[int]) -> bytes:
    return CHANNEL + kind + struct.pack(f"<{len(numbers)}I", *numbers)


def _parse(message: bytes) -> tuple[bytes, list[int]]:
    body = message[len(CHANNEL) + 1:]
    count = len(body) // 4
    return message[len(CHANNEL):len(CHANNEL) + 1], list(struct.unpack(f"<{count}I", body[:4 * count]))


class Revocations:
    """One communicator's side of the protocol (both as owner and as holder of transfers): its transfers
    (``runtime.transfers``), messages (``runtime.inbox``, sent through the messenger) and peers' maps (``peers``)."""

    def __init__(self, runtime: Runtime, peers: Peers) -> None:
        self._runtime, self._inbox, self._peers = runtime, runtime.inbox, peers
        self._messenger = runtime.transports.messenger
        self._lock = threading.Lock()
        self._awaiting: dict[tuple[int, ...], set[int]] = {}  # epochs revoked by this rank -> ranks yet to answer
        self._quarantine: dict[tuple[int, ...], Any] = {}  # epochs -> what to release once every rank answered
        self._gone_ranks: set[int] = set()  # ranks that said they are leaving: they hold nothing of ours
        self._next_pump = 0.0
        self._pump_lock = threading.Lock()  # one pump at a time (the revocation thread, waits, the progress thread)
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()

    # --- holder side ------------------------------------------------------------------------------
    def handle(self, sender: int, message: bytes) -> None:
        """A ``twrev`` notification (called by the inbox's pump)."""
        kind, numbers = _parse(message)
        if kind in (_REVOKE, _REVOKE_CLOSING) and numbers:
            map_epoch, epochs = numbers[0], numbers[1:]
            self._peers.revoked(sender, epochs, map_epoch)
            self._revoke_transfers(sender, set(epochs))
            if kind == _REVOKE_CLOSING:
                return
            try:
                self.reach(sender)  # holds nothing of it maybe, but the owner waits for the answer
                self._messenger.send_notification(sender, _message(_ACK, epochs))
            except Exception:  # noqa: BLE001 - the owner is gone or unreachable: nothing to tell
                pass
        elif kind == _ACK:
            self._answered(sender, tuple(numbers))
        elif kind == _LEAVING:
            self._left(sender)

    def leaving(self) -> None:
        """This communicator closes and its transfers are closed: tell the peers it may hold transfers to (whose
        metadata it loaded, and that are alive), so that an owner's close() does not wait for an answer this rank
        may no longer be able to give."""
        for target in sorted(self._messenger.loaded_peers() - {self._runtime.rank}):
            if self._runtime.peer_lost(target, fresh=True) is not None:
                continue
            try:
                self._messenger.send_notification(target, _message(_LEAVING, []))
            except Exception:  # noqa: BLE001 - gone: it waits for nothing from this rank either
                continue

    def _left(self, rank: int) -> None:
        with self._lock:
            self._gone_ranks.add(rank)
        self._stop_waiting_for(lambda r: r == rank)

    def _stop_waiting_for(self, done: Callable[[int], bool]) -> None:
        """Drop the ranks for which ``done(rank)`` from every revocation's waiters; release what waited only
        for them (outside the lock: a release deregisters memory)."""
        released = []
        with self._lock:
            for key, left in list(self._awaiting.items()):
                left -= {rank for rank in left if rank != _SENDING and done(rank)}
                if not left:
                    del self._awaiting[key]
                    released.append(self._quarantine.pop(key, None))
        for release in released:
            if release is not None:
                release()

    def listen(self) -> None:
        """Start the revocation thread (idempotent): from now on revocations are handled within
        ``_LISTEN_PERIOD_S`` whatever the user's threads do."""
        if self._listener is not None or self._runtime.closed:
            return
        self._listener = threading.Thread(target=self._listen, name=f"tensorwire-revocations-{self._runtime.rank}",
                                          daemon=True)
        self._listener.start()

    def _listen(self) -> None:
        liveness, idle_s = self._runtime.liveness, self._runtime.config.liveness_s
        busy_until = time.monotonic() + _BUSY_S
        while not self._stop.is_set():
            try:
                # Waits, waking at once for a connection, a poke or a question to this rank's liveness listener (a
                # peer's handshake, a map epoch asked by freshness.py), which it answers.
                now = time.monotonic()
                if liveness.serve(_LISTEN_PERIOD_S if now < busy_until else idle_s):
                    busy_until = time.monotonic() + _BUSY_S
                if not self._stop.is_set():
                    self.pump(force=True)
            except Exception:  # noqa: BLE001 - a failed pump (a peer gone mid-answer) is retried next period
                continue

    def _revoke_transfers(self, owner: int, epochs: set[int]) -> None:
        bound = self._runtime.config.liveness_s
        revoked = [t for t in list(self._runtime.transfers)
                   if t.peer == owner and t.remote_epochs & epochs and not t.closed]
        for transfer in revoked:
            transfer.revoke(RevokedError(
                f"post: rank {owner} deregistered the memory this {transfer.op.value} reaches (registration "
                f"epoch(s) {sorted(transfer.remote_epochs & epochs)}); the transfer is failed: close it, look the "
                "descriptors up again and prepare a new one"))
        deadline = time.monotonic() + bound
        for transfer in revoked:  # on its way in, or in flight: let it finish before the owner lets go
            while (transfer.posting() or transfer.request_in_flight()) and time.monotonic() < deadline:
                time.sleep(0.0005)

    def pump(self, force: bool = False) -> None:
        """Handle what has arrived (rate-limited to every 10 ms unless ``force``); for waits that sleep anyway.
        Also releases what waited only for ranks that are gone since (a dead rank never answers). Returns at once
        when another thread is pumping (a handler's store wait polls this again: no nesting either)."""
        now = time.monotonic()
        if (now < self._next_pump and not force) or self._runtime.closed or not self._pump_lock.acquire(False):
            return
        try:
            self._next_pump = now + 0.01
            self._inbox.pump()
            if self._awaiting:
                self._sweep()
        finally:
            self._pump_lock.release()

    # --- owner side -------------------------------------------------------------------------------
    def revoke(self, epochs: list[int], map_epoch: int, release: Any, wait: bool = True) -> None:
        """Tell every rank that may hold transfers to ``epochs`` (``map_epoch``: the map just published without
        them), wait until each has answered or is gone, then ``release()`` (backend deregistration, dropping the
        tensors). Blocks: at most ``2 * liveness_s``, else ``WaitTimeoutError`` naming the silent ranks (the
        memory stays quarantined until they answer or are gone). ``wait=False`` (the communicator closes):
        release now; the backends go with the communicator."""
        rank = self._runtime.rank
        key = tuple(sorted(epochs))
        self._revoke_transfers(rank, set(epochs))  # this rank's own transfers to them
        self.pump(force=True)  # answers to earlier revocations: release what they held
        self._sweep()
        with self._lock:
            gone = set(self._gone_ranks)
        targets = set(self._runtime.liveness.callers(settle_s=self._runtime.config.liveness_s)) - {rank} - gone
        # The waiters are registered before the first message goes: an answer may arrive (on the revocation
        # thread) before the last one is sent. _SENDING keeps the entry from being released meanwhile.
        pending = {_SENDING}
        if wait:
            with self._lock:
                self._awaiting[key] = pending
                self._quarantine[key] = release
        for target in sorted(targets):
            try:
                if not wait and target not in self._messenger.loaded_peers():
                    continue  # closing: no store round trips for ranks this one never talked to
                if self._runtime.peer_lost(target, fresh=True) is not None:
                    continue  # gone: it posts nothing more (and NIXL would log a failed send)
                self.reach(target)
                kind = _REVOKE if wait else _REVOKE_CLOSING
                with self._lock:
                    pending.add(target)
                self._messenger.send_notification(target, _message(kind, [map_epoch, *key]))
                if wait:
                    self._runtime.liveness.poke(target)  # its revocation thread may sleep: it answers now
            except Exception as e:  # noqa: BLE001 - a rank that is gone posts nothing more; one alive may
                if not wait or self._runtime.peer_lost(target, fresh=True) is not None:
                    with self._lock:
                        pending.discard(target)
                    continue
                # Alive and not told: its transfers may still write here, so the memory waits for it (an answer,
                # its death, or the timeout's quarantine) instead of being released under it.
                warnings.warn(f"tensorwire: close: could not tell rank {target} to stop its transfers to registration "
                              f"epoch(s) {list(key)} ({type(e).__name__}: {e}); waiting for it", TensorwireWarning,
                              stacklevel=3)
                with self._lock:
                    pending.add(target)
        if not wait:
            release()
            return
        self._answered(_SENDING, key)  # every message is out: released here if every rank answered already
        self._await_answers(key)

    def _await_answers(self, key: tuple[int, ...]) -> None:
        bound = 2 * self._runtime.config.liveness_s
        deadline = time.monotonic() + bound
        pause = 0.0002
        while True:
            self.pump(force=True)
            self._sweep()
            with self._lock:
                left = self._awaiting.get(key)
                if left is None:
                    return
                silent = sorted(left)
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"close: rank(s) {silent} did not acknowledge the revocation of registration epoch(s) "
                    f"{list(key)} within {bound:.3g}s (2 x TENSORWIRE_LIVENESS_S) although alive: stopped, or stuck "
                    "outside Python. Their prepared transfers could still reach this memory, so it stays registered "
                    "(quarantined) until they answer or are gone: do not reuse it before; close() again waits more")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def retry(self, epochs: list[int]) -> bool:
        """For a ``close()`` again after ``revoke`` timed out: wait for the answers once more (False: nothing
        was quarantined under ``epochs``)."""
        with self._lock:  # the key may hold more epochs (pools inside the registration were revoked with it)
            key = next((k for k in self._awaiting if set(epochs) & set(k)), None)
        if key is None:
            return False
        self._await_answers(key)
        return True

    def reach(self, rank: int) -> None:
        """Load ``rank``'s NIXL metadata once if it is not loaded (a store round trip, bounded by the liveness
        period), so a notification can be sent to it."""
        if rank not in self._messenger.loaded_peers():
            self._peers.view(rank, 0, self._runtime.config.liveness_s, confirm=False)

    def _sweep(self) -> None:
        """Ranks that are gone answer no more: release what waited only for them."""
        liveness = self._runtime.liveness
        self._stop_waiting_for(lambda rank: liveness.lost(rank) is not None)

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

    def stop(self) -> None:
        """Stop the revocation thread (the communicator closes; before its backends go)."""
        self._stop.set()
        self._runtime.liveness.wake()
        if self._listener is not None and self._listener is not threading.current_thread():
            self._listener.join(timeout=self._runtime.config.liveness_s + 1.0)

    def close(self) -> None:
        """The communicator closes: the backends went, and what was quarantined goes with them."""
        self.stop()
        with self._lock:
            self._quarantine.clear()
            self._awaiting.clear()
