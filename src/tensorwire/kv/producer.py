"""The producer's side of handoffs: the blocks it holds for consumers, each granted to one claim, freed once every
consumer rank that reads them said so (or the handoff expired).

A hold starts when the engine hands a request off (``hold``) or, if a consumer's claim arrives first (the engine
tells its workers a step later), at that claim: only for a handoff issued since this producer started and not
expired (a producer started again, or a claim for a handoff long gone, is refused as ``unknown``), and at most
``_MAX_CLAIMED_FIRST`` such holds at once. The first claim of a hold is granted and every other one refused
(``taken``): a second consumer, a replayed request, a consumer restarted with a new claim. After the hold is freed
its (request id, issue time) is remembered as ``spent`` until the handoff expired, so a read after the blocks were
reused is refused too. The consumer reads only after its grant: nothing moves for a refused claim. A grant keeps
the hold at least the consumer's read bound more (its claim says how long), whatever the expiry: the blocks are
never freed under a READ.

How many consumer ranks must report, and which, is the head map's (``heads.HeadMap``): with tensor parallelism D
on the consumer and P here, some ranks read, and a rank nobody reads is released by one consumer rank. A consumer
rank reports with a DONE once its READs completed, or with a release claim.

A thread of its own answers claims and counts reports (an engine idle between requests calls no hook), polling
every ``_BUSY_POLL_S`` while something is held, ``_IDLE_POLL_S`` otherwise; the engine takes what was freed with
``released()``, which never blocks for long: expiries are looked for at most every ``_EXPIRY_SCAN_S``.
"""

from __future__ import annotations

import functools
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
_EXPIRY_SCAN_S = 0.1
_MAX_LEASE_S = 600.0  # the longest read bound a claim may ask for
_MAX_CLAIMED_FIRST = 4096  # holds started by a claim before the engine's hold, at once
_MAX_FREED_EARLY = 4096  # such holds freed before the engine's hold, remembered (the oldest forgotten first)
_MAX_SPENT = 1 << 20  # spent handoffs remembered; past it no claim starts a hold (refused: never forgotten early)
_SPENT_PRUNE_S = 10.0  # how often spent handoffs that expired are forgotten
_CLOCK_SLACK_S = 1.0  # an issue time may be this far ahead of the producer's clock (the engine's other process)
Key = tuple[str, float]  # (request id, issue time): one handoff


@dataclass
class _Hold:
    issued_at: float
    deadline: float  # monotonic: freed then, read or not
    known: bool  # the engine handed it off (a claim may come first)
    claim: str | None = None
    reporters: frozenset[int] = frozenset()  # consumer ranks that must report (once claimed)
    reported: set[int] = field(default_factory=set)  # those that did


class Producer:
    """Holds handed-off blocks of ``member``'s pool for their consumers. ``hold_s``: how long a hold nobody reads
    lasts (a handoff's expiry says the same to its consumer)."""

    def __init__(self, member: KVMember, *, hold_s: float = 120.0) -> None:
        self._member, self._hold_s = member, hold_s
        self._started_at = time.time()
        runtime = member.comm.runtime
        self._inbox = runtime.channel(TO_PRODUCER)
        self._outbox = runtime.channel(TO_CONSUMER)
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._claimed_first = 0  # holds in ``_holds`` the engine has not handed off yet
        self._spent: dict[Key, float] = {}  # -> monotonic time after which the handoff has expired anyway
        self._freed: set[str] = set()  # freed holds the engine knows, for ``released``
        self._freed_early: dict[Key, float] = {}  # freed before the engine handed them off -> when
        self._next_scan = self._next_prune = 0.0
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
        key = (handoff.request_id, handoff.issued_at)
        with self._lock:
            hold = self._holds.get(handoff.request_id)
            if self._freed_early.pop(key, None) is not None:
                self._freed.add(handoff.request_id)
            elif hold is not None and hold.issued_at == handoff.issued_at:
                self._claimed_first -= not hold.known
                hold.known, hold.deadline = True, max(hold.deadline, now + left)  # a grant's lease stays
            else:
                if hold is not None and not hold.known:
                    self._claimed_first -= 1  # a claim for another handoff of this id: the engine's wins
                self._holds[handoff.request_id] = _Hold(handoff.issued_at, now + left, True)
        self._wake.set()

    def released(self) -> set[str]:
        """Request ids whose blocks the engine may free now: read by every consumer rank, or expired. Never
        blocks for long."""
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
                messages = self._inbox.take_all()
            except Exception as e:  # noqa: BLE001 - the thread outlives a failed poll (retried next period)
                log.warning("KV producer %s: polling for messages failed: %s", self._member.name, e)
                messages = []
            for sender, message in messages:
                try:  # one message's failure (a consumer gone before its grant) loses no other
                    self._handle(sender, message)
                except Exception as e:  # noqa: BLE001
                    log.warning("KV producer %s: a message from rank %d failed: %s: %s", self._member.name, sender,
                                type(e).__name__, e)
            with self._lock:
                self._expire(time.monotonic())
                busy = bool(self._holds)
            self._wake.wait(_BUSY_POLL_S if busy else _IDLE_POLL_S)
            self._wake.clear()

    def _handle(self, sender: int, message: bytes) -> None:
        parsed = parse(message)
        if isinstance(parsed, Claim):
            grant = self._claimed(parsed)
            self._outbox.send(sender, grant.encode())  # outside the lock: reaching a new consumer is a round trip
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
        reporters = self._reporters(claim.consumer_tp)  # outside the lock (cached per consumer TP)
        lease = min(max(claim.lease_s, 0.0), _MAX_LEASE_S)
        verdicts = {}
        for request_id, issued_at, value in claim.requests:
            with self._lock:  # per request: the engine's hold() never waits behind a large claim
                verdicts[request_id] = self._verdict(request_id, issued_at, value, claim, reporters, lease)
        for verdict in verdicts.values():
            if verdict != "granted":
                self.refused[verdict] = self.refused.get(verdict, 0) + 1
        return Grant(claim.ticket, verdicts, self._member.shape.order)

    def _verdict(self, request_id: str, issued_at: float, value: str, claim: Claim, reporters: frozenset[int] | None,
                 lease_s: float) -> str:
        """Grant ``request_id`` to ``value`` if nobody else holds it (under the lock)."""
        if (request_id, issued_at) in self._spent:
            return "spent"
        hold = self._holds.get(request_id)
        if hold is None:  # the engine tells its workers a step after the handoff: the claim may come first
            if (not self._fresh(issued_at) or self._claimed_first >= _MAX_CLAIMED_FIRST
                    or len(self._spent) >= _MAX_SPENT):
                return "unknown"
            left = issued_at + self._hold_s - time.time()
            hold = self._holds[request_id] = _Hold(issued_at, time.monotonic() + left, False)
            self._claimed_first += 1
        if hold.issued_at != issued_at or reporters is None:
            return "unknown"  # another handoff of a request id (an engine started again reuses ids)
        if hold.claim is None:
            hold.claim, hold.reporters = value, reporters
        elif hold.claim != value:
            return "taken"
        hold.deadline = max(hold.deadline, time.monotonic() + lease_s)
        if not claim.read:
            self._report(request_id, hold, claim.consumer_rank)
        return "granted"

    def _fresh(self, issued_at: float) -> bool:
        """Whether this producer could have issued a handoff at ``issued_at`` that has not expired."""
        now = time.time()
        return self._started_at - _CLOCK_SLACK_S <= issued_at <= now + _CLOCK_SLACK_S and now < issued_at + self._hold_s

    def _reporters(self, consumer_tp: int) -> frozenset[int] | None:
        """The consumer ranks of a consumer at TP ``consumer_tp`` that report to this rank (None: no head map)."""
        return _reporters(self._member.sharding, self._member.tp_rank, consumer_tp)

    def _report(self, request_id: str, hold: _Hold, consumer_rank: int) -> None:
        if consumer_rank not in hold.reporters:
            return  # not a rank the head map sends here: it counts for nothing
        hold.reported.add(consumer_rank)
        if len(hold.reported) >= len(hold.reporters):
            self._free(request_id, hold, read=True)

    def _expire(self, now: float) -> None:
        if now < self._next_scan:
            return
        self._next_scan = now + _EXPIRY_SCAN_S
        for request_id, hold in [(r, h) for r, h in self._holds.items() if h.deadline <= now]:
            self._free(request_id, hold, read=False)
        if now >= self._next_prune:  # a claim for a handoff that expired is refused as stale (``_fresh``)
            self._next_prune = now + _SPENT_PRUNE_S
            self._spent = {k: t for k, t in self._spent.items() if t > now}

    def _free(self, request_id: str, hold: _Hold, read: bool) -> None:
        """Under the lock: the hold ends; its handoff is spent until it has expired anyway."""
        del self._holds[request_id]
        now = time.monotonic()
        expired_at = now + max(hold.issued_at + self._hold_s - time.time(), 0.0) + 2 * _CLOCK_SLACK_S
        self._spent[(request_id, hold.issued_at)] = expired_at
        if not hold.known:
            self._claimed_first -= 1
            self._freed_early[(request_id, hold.issued_at)] = now
            while len(self._freed_early) > _MAX_FREED_EARLY:
                del self._freed_early[next(iter(self._freed_early))]
            return
        if not read:
            self.expired += 1
            log.warning("KV producer %s: request %s not read within its hold; its blocks are freed",
                        self._member.name, request_id)
        self._freed.add(request_id)


@functools.lru_cache(maxsize=64)
def _reporters(own: Sharding, tp_rank: int, consumer_tp: int) -> frozenset[int] | None:
    try:
        head_map = HeadMap(own, Sharding(consumer_tp, own.total_heads, own.replicated))
    except tw.InvalidArgumentError:
        return None
    readers = head_map.readers_of(tp_rank)
    return frozenset(readers) if readers else frozenset({tp_rank % consumer_tp})
