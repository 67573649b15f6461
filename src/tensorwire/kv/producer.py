"""The producer's side of handoffs: the blocks it holds for consumers, each granted to one claim, freed once every
consumer rank that reads them said so (or the handoff expired).

A hold starts when the engine hands a request off (``hold``) or, if a consumer's claim arrives first (the engine
tells its workers a step later), at that claim. The first claim of a hold is granted and every other one refused
(``taken``): a second consumer, a replayed request, a consumer restarted with a new claim. After the hold is freed
its (request id, issue time) is remembered as ``spent`` until it would have expired, so a read after the blocks
were reused is refused too. The consumer reads only after its grant: nothing moves for a refused claim. A grant
keeps the hold at least ``_READ_LEASE_S`` more, whatever its expiry: the blocks are never freed under a READ.

How many consumer ranks must report is the head map's (``heads.HeadMap.messages_to``): with tensor parallelism D
on the consumer and P here, some ranks read, and ranks nobody reads are released by one consumer rank each.

A thread of its own answers claims and counts reads (an engine idle between requests calls no hook), polling every
``_BUSY_POLL_S`` while something is held, ``_IDLE_POLL_S`` otherwise; the engine takes what was freed with
``released()``, which never blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import tensorwire as tw

from .handoff import Handoff
from .heads import HeadMap, Sharding
from .member import KVMember
from .messages import TO_CONSUMER, TO_PRODUCER, Claim, Done, Grant, parse

__all__ = ["Producer"]

log = logging.getLogger(__name__)

_BUSY_POLL_S = 0.001  # while something is held: a claim waits for this at most (half of it on average)
_IDLE_POLL_S = 0.02
# A granted hold lasts at least this long after its grant, whatever its expiry: a READ under way is never cut by
# the blocks being freed and reused (a consumer that died mid-read holds them this long at most).
_READ_LEASE_S = 60.0
_MAX_SPENT = 65536  # handoffs remembered as spent at most (the oldest forgotten first)


@dataclass
class _Hold:
    issued_at: float
    deadline: float  # monotonic: freed then, read or not
    known: bool  # the engine handed it off (a claim may come first)
    claim: str | None = None
    expected: int = 0  # consumer ranks that must report (once claimed)
    reported: set[int] = field(default_factory=set)  # consumer ranks that did


class Producer:
    """Holds handed-off blocks of ``member``'s pool for their consumers. ``hold_s``: how long a hold nobody reads
    lasts (a handoff's expiry says the same to its consumer)."""

    def __init__(self, member: KVMember, *, hold_s: float = 120.0) -> None:
        self._member, self._hold_s = member, hold_s
        runtime = member.comm.runtime
        self._inbox = runtime.channel(TO_PRODUCER)
        self._outbox = runtime.channel(TO_CONSUMER)
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._spent: dict[tuple[str, float], float] = {}  # (request id, issue time) -> monotonic forget time
        self._freed: set[str] = set()  # freed holds the engine knows, for ``released``
        self._freed_early: dict[str, float] = {}  # freed before the engine handed them off -> when
        self.expired = 0  # holds freed unread, since the start
        self.refused: dict[str, int] = {}  # claims refused, per verdict
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tensorwire-kv-producer-{member.name}"[:60],
                                        daemon=True)
        self._thread.start()

    # --- the engine's calls ---------------------------------------------------------------------------------
    def hold(self, handoff: Handoff) -> None:
        """Keep ``handoff``'s blocks until its consumer read them, or until it expires. Never blocks."""
        now, left = time.monotonic(), max(handoff.expires_at - time.time(), 0.0)
        with self._lock:
            hold = self._holds.get(handoff.request_id)
            if handoff.request_id in self._freed_early:
                del self._freed_early[handoff.request_id]
                self._freed.add(handoff.request_id)
            elif hold is not None and hold.issued_at == handoff.issued_at:
                hold.known, hold.deadline = True, now + left
            else:
                self._holds[handoff.request_id] = _Hold(handoff.issued_at, now + left, True)
        self._wake.set()

    def released(self) -> set[str]:
        """Request ids whose blocks the engine may free now: read by every consumer rank, or expired. Never
        blocks."""
        with self._lock:
            self._expire(time.monotonic())
            freed, self._freed = self._freed, set()
        return freed

    def pending(self) -> int:
        """Holds the engine handed off that are not released yet."""
        with self._lock:
            return sum(1 for h in self._holds.values() if h.known) + len(self._freed)

    def drain(self, bound_s: float) -> None:
        """Wait (bounded) until every handed-off hold was read or expired: a consumer's READ under way is not cut
        by this producer leaving."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline and self.pending():
            self.released()
            time.sleep(0.05)
        if self.pending():
            log.warning("KV producer %s: leaving with %d handed-off request(s) not read (waited %.0fs)",
                        self._member.name, self.pending(), bound_s)

    def close(self) -> None:
        """Stop answering (idempotent). The member is the caller's to close."""
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    # --- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for sender, message in self._inbox.take_all():
                    self._handle(sender, message)
                with self._lock:
                    self._expire(time.monotonic())
                    busy = bool(self._holds)
            except Exception as e:  # noqa: BLE001 - the thread must outlive one bad message or a lost consumer
                log.warning("KV producer %s: handling a consumer's message failed: %s: %s", self._member.name,
                            type(e).__name__, e)
                busy = True
            self._wake.wait(_BUSY_POLL_S if busy else _IDLE_POLL_S)
            self._wake.clear()

    def _handle(self, sender: int, message: bytes) -> None:
        parsed = parse(message)
        if isinstance(parsed, Claim):
            grant = self._claimed(parsed)
            self._outbox.send(sender, grant.encode())
        elif isinstance(parsed, Done):
            with self._lock:
                for request_id, claim in parsed.requests:
                    hold = self._holds.get(request_id)
                    if hold is not None and hold.claim == claim:
                        self._report(request_id, hold, parsed.consumer_rank)
        else:
            log.warning("KV producer %s: a malformed message from rank %d ignored (%d bytes)", self._member.name,
                        sender, len(message))

    def _claimed(self, claim: Claim) -> Grant:
        with self._lock:
            verdicts = {r: self._verdict(r, issued_at, value, claim) for r, issued_at, value in claim.requests}
        for verdict in verdicts.values():
            if verdict != "granted":
                self.refused[verdict] = self.refused.get(verdict, 0) + 1
        return Grant(claim.ticket, verdicts, self._member.heads_outermost)

    def _verdict(self, request_id: str, issued_at: float, value: str, claim: Claim) -> str:
        """Grant ``request_id`` to ``value`` if nobody else holds it (under the lock)."""
        if (request_id, issued_at) in self._spent:
            return "spent"
        hold = self._holds.get(request_id)
        if hold is None:  # the engine tells its workers a step after the handoff: the claim came first
            hold = self._holds[request_id] = _Hold(issued_at, time.monotonic() + self._hold_s, False)
        if hold.issued_at != issued_at:
            return "unknown"  # another handoff of a request id (an engine started again reuses ids)
        if hold.claim is None:
            expected = self._readers(claim.consumer_tp)
            if expected is None:
                return "unknown"
            hold.claim, hold.expected = value, expected
        elif hold.claim != value:
            return "taken"
        hold.deadline = max(hold.deadline, time.monotonic() + _READ_LEASE_S)
        if not claim.read:
            self._report(request_id, hold, claim.consumer_rank)
        return "granted"

    def _readers(self, consumer_tp: int) -> int | None:
        """How many consumer ranks of a consumer at TP ``consumer_tp`` report to this rank (None: no head map)."""
        own = self._member.sharding
        try:
            consumer = Sharding(consumer_tp, own.total_heads, own.replicated)
            return HeadMap(own, consumer).messages_to(self._member.tp_rank)
        except tw.InvalidArgumentError:
            return None

    def _report(self, request_id: str, hold: _Hold, consumer_rank: int) -> None:
        hold.reported.add(consumer_rank)
        if len(hold.reported) >= hold.expected:
            self._free(request_id, hold, read=True)

    def _expire(self, now: float) -> None:
        for request_id, hold in [(r, h) for r, h in self._holds.items() if h.deadline <= now]:
            self._free(request_id, hold, read=False)
        if len(self._spent) > _MAX_SPENT:
            self._spent = {k: t for k, t in self._spent.items() if t > now}
            while len(self._spent) > _MAX_SPENT:
                del self._spent[next(iter(self._spent))]

    def _free(self, request_id: str, hold: _Hold, read: bool) -> None:
        """Under the lock: the hold ends; its handoff is spent until it would have expired (and a while more)."""
        del self._holds[request_id]
        now = time.monotonic()
        self._spent[(request_id, hold.issued_at)] = max(hold.deadline, now) + self._hold_s
        if not read and hold.known:
            self.expired += 1
            log.warning("KV producer %s: request %s not read within its hold; its blocks are freed",
                        self._member.name, request_id)
        if hold.known:
            self._freed.add(request_id)
        else:
            if len(self._freed_early) >= 4096:  # claims for requests never handed off must not grow this
                self._freed_early = {r: t for r, t in self._freed_early.items() if now - t < 60.0}
            self._freed_early[request_id] = now
