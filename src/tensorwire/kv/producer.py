"""The producer's side of handoffs: the blocks it holds for consumers, each granted to one claim, freed once every
consumer rank that reads them said so (or the handoff expired).

A hold starts when the engine hands a request off (``hold``) or, if a consumer's claim arrives first (the engine
tells its workers a step later), at that claim: only for a handoff issued since this producer started and not
expired (a producer started again, or a claim for a handoff long gone, is refused as ``unknown``), and at most
``_MAX_CLAIMED_FIRST`` such holds per claiming rank at once, one already read or released counting until the engine
handed it off or it expired (one member's made-up claims never refuse another's, nor fill the spent handoffs).
The first claim of a hold is granted and every other one refused (``taken``): a second consumer, a replayed request,
a consumer restarted with a new claim. After the hold is freed its (request id, issue time) is remembered as
``spent`` until the handoff expired, so a read after the blocks were reused is refused too. The consumer reads only
after its grant: nothing moves for a refused claim.

Leases. A grant keeps the hold at least the consumer's READ bound more (its first granted claim says how long, at
most ``_MAX_LEASE_S``), whatever the expiry: the blocks are never freed under a READ. Nothing keeps it longer: a claim
granted again (the same consumer asking again, or a token holder renewing) extends it to at most the handoff's expiry
plus that READ bound, and once every rank granted under the claim is gone from the fleet (the communicator's liveness
view, looked at every ``_PRESENCE_SCAN_S``) the hold ends ``_GONE_GRACE_S`` later.

How many consumer ranks must report, and which, is the head map's (``heads.HeadMap``): with tensor parallelism D
on the consumer and P here, some ranks read, and a rank nobody reads is released by one consumer rank. A consumer
rank reports with a DONE once its READs completed, or with a release claim. This rank's readers are an arithmetic
progression of consumer ranks, computed in O(1) per claim (``_readers``): a claim naming a consumer TP of 4096
costs what one of TP 1 costs, and a hold remembers who reported as bits of that progression.

A thread of its own answers claims and counts reports (an engine idle between requests calls no hook). The
communicator's message channels deliver by polling (no wake-up on arrival): the thread polls again at once after a
message, then ever less often while none comes, up to ``_CLAIM_POLL_S`` while something is held and ``_IDLE_POLL_S``
otherwise. The engine takes what was freed with ``released()``, which never blocks for long: expiries are looked
for at most every ``_EXPIRY_SCAN_S``. Malformed messages and failed ones are logged once per sender, then counted in
one line every ``_WARN_EVERY_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from .handoff import Handoff
from .heads import Sharding
from .member import KVMember
from .messages import TO_CONSUMER, TO_PRODUCER, Claim, Done, Grant, parse

__all__ = ["Producer"]

log = logging.getLogger(__name__)

_FIRST_POLL_S = 0.0001  # after a message: the next poll; doubled while nothing arrives, up to one of these two
_CLAIM_POLL_S = 0.001  # while something is held: a claim waits for this at most
_IDLE_POLL_S = 0.02
_EXPIRY_SCAN_S = 0.1
_PRESENCE_SCAN_S = 1.0  # how often the ranks holds were granted to are looked for in the fleet
_GONE_GRACE_S = 2.0  # a hold whose every claimant is gone ends this much later (a READ already on the wire)
_MAX_LEASE_S = 600.0  # the longest read bound a claim may ask for
_MAX_CLAIMED_FIRST = 1024  # holds started by one rank's claims before the engine's hold, at once
_MAX_FREED_EARLY = 4096  # such holds freed before the engine's hold, remembered (the oldest forgotten first)
_MAX_SPENT = 1 << 20  # spent handoffs remembered; past it no claim starts a hold (refused: never forgotten early)
_SPENT_PRUNE_S = 10.0  # how often spent handoffs that expired are forgotten
_CLOCK_SLACK_S = 1.0  # an issue time may be this far ahead of the producer's clock (the engine's other process)
_WARN_EVERY_S = 60.0  # past the first per sender, malformed or failed messages are counted in one line this often
_MAX_WARNED = 4096  # senders remembered as warned about (then everyone is again)
Key = tuple[str, float]  # (request id, issue time): one handoff


@dataclass
class _Hold:
    issued_at: float
    expires: float  # monotonic: the handoff's expiry (the engine's, or issue time + hold_s before it handed off)
    deadline: float  # monotonic: freed then, read or not (the expiry, or a grant's lease past it)
    known: bool  # the engine handed it off (a claim may come first)
    starter: int | None = None  # the rank whose claim started it before the engine's hold (counted against it)
    claim: str | None = None
    lease_s: float = 0.0  # the first grant's READ bound: no grant keeps the hold past ``expires`` plus this
    reporters: range = range(0)  # consumer ranks that must report (once claimed)
    reported: int = 0  # those that did, as bits of their index in ``reporters``
    claimants: set[int] = field(default_factory=set)  # the ranks granted under ``claim``


class Producer:
    """Holds handed-off blocks of ``member``'s pool for their consumers. ``hold_s``: how long a hold nobody reads
    lasts (a handoff's expiry says the same to its consumer)."""

    def __init__(self, member: KVMember, *, hold_s: float = 120.0) -> None:
        self._member, self._hold_s = member, hold_s
        self._started_at = time.time()
        runtime = member.comm.runtime
        self._runtime = runtime
        self._inbox = runtime.channel(TO_PRODUCER)
        self._outbox = runtime.channel(TO_CONSUMER)
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        # rank -> holds its claims started that the engine has not handed off, and their spent handoffs until the
        # engine handed them off or they expired: a rank that claims and releases made-up handoffs fills its own quota
        self._claimed_first: dict[int, int] = {}
        self._spent_early: dict[Key, int] = {}  # such spent handoffs -> the rank they count against
        self._spent: dict[Key, float] = {}  # -> monotonic time after which the handoff has expired anyway
        self._freed: set[str] = set()  # freed holds the engine knows, for ``released``
        self._freed_early: dict[Key, float] = {}  # freed before the engine handed them off -> when
        self._next_scan = self._next_prune = self._next_presence = 0.0
        self._warnings = _Warnings(member.name)
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
            starter = self._spent_early.pop(key, None)
            if starter is not None:
                self._uncount(starter)
            hold = self._holds.get(handoff.request_id)
            if self._freed_early.pop(key, None) is not None:
                self._freed.add(handoff.request_id)
            elif hold is not None and hold.issued_at == handoff.issued_at:
                self._handed_off(hold)
                hold.expires = now + left  # the engine's expiry is the handoff's
                hold.deadline = max(hold.deadline, hold.expires)  # a grant's lease stays
            else:
                if hold is not None:
                    self._handed_off(hold)  # a claim for another handoff of this id: the engine's wins
                self._holds[handoff.request_id] = _Hold(handoff.issued_at, now + left, now + left, True)
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
        pause = _FIRST_POLL_S
        while not self._stop.is_set():
            try:
                messages = self._inbox.take_all()
            except Exception as e:  # noqa: BLE001 - the thread outlives a failed poll (retried next period)
                self._warnings.warn(None, f"polling for messages failed: {e}")
                messages = []
            for sender, message in messages:
                try:  # one message's failure (a consumer gone before its grant) loses no other
                    self._handle(sender, message)
                except Exception as e:  # noqa: BLE001
                    self._warnings.warn(sender, f"a message failed: {type(e).__name__}: {e}")
            now = time.monotonic()
            if now >= self._next_presence:
                self._next_presence = now + _PRESENCE_SCAN_S
                self._look_for_claimants()
            with self._lock:
                self._expire(now)
                holding = bool(self._holds)
            # No wake-up on arrival: poll again soon after traffic, then ever less often (an idle one ~50 times a s).
            pause = _FIRST_POLL_S if messages else min(2 * pause, _CLAIM_POLL_S if holding else _IDLE_POLL_S)
            if self._wake.wait(pause):
                self._wake.clear()
                pause = _FIRST_POLL_S  # hold(): its claim may be on its way

    def _handle(self, sender: int, message: bytes) -> None:
        parsed = parse(message)
        if isinstance(parsed, Claim):
            grant = self._claimed(sender, parsed)
            self._outbox.send(sender, grant.encode())  # outside the lock: reaching a new consumer is a round trip
        elif isinstance(parsed, Done):
            with self._lock:
                for request_id, claim in parsed.requests:
                    hold = self._holds.get(request_id)
                    if hold is not None and hold.claim == claim:
                        self._report(request_id, hold, parsed.consumer_rank)
        else:
            self._warnings.warn(sender, f"a malformed message ignored ({len(message)} bytes)")

    def _claimed(self, sender: int, claim: Claim) -> Grant:
        reporters = _readers(self._member.sharding, self._member.tp_rank, claim.consumer_tp)  # O(1)
        lease = min(max(claim.lease_s, 0.0), _MAX_LEASE_S)
        verdicts = {}
        for request_id, issued_at, value in claim.requests:
            with self._lock:  # per request: the engine's hold() never waits behind a large claim
                verdicts[request_id] = self._verdict(sender, request_id, issued_at, value, claim, reporters, lease)
        for verdict in verdicts.values():
            if verdict != "granted":
                self.refused[verdict] = self.refused.get(verdict, 0) + 1
        return Grant(claim.ticket, verdicts, self._member.shape.order)

    def _verdict(self, sender: int, request_id: str, issued_at: float, value: str, claim: Claim,
                 reporters: range | None, lease_s: float) -> str:
        """Grant ``request_id`` to ``value`` if nobody else holds it (under the lock)."""
        if (request_id, issued_at) in self._spent:
            return "spent"
        if reporters is None:
            return "unknown"  # no head map between the two engines: nothing to hold for it
        hold = self._holds.get(request_id)
        now = time.monotonic()
        if hold is None:  # the engine tells its workers a step after the handoff: the claim may come first
            if (not self._fresh(issued_at) or self._claimed_first.get(sender, 0) >= _MAX_CLAIMED_FIRST
                    or len(self._spent) >= _MAX_SPENT):
                return "unknown"
            expires = now + issued_at + self._hold_s - time.time()
            hold = self._holds[request_id] = _Hold(issued_at, expires, expires, False, starter=sender)
            self._claimed_first[sender] = self._claimed_first.get(sender, 0) + 1
        if hold.issued_at != issued_at:
            return "unknown"  # another handoff of a request id (an engine started again reuses ids)
        if hold.claim is None:
            hold.claim, hold.reporters, hold.lease_s = value, reporters, lease_s
        elif hold.claim != value:
            return "taken"
        hold.claimants.add(sender)
        # At least the READ bound from now, never past the expiry plus the first grant's bound: renewing pins nothing.
        hold.deadline = max(hold.deadline, min(now, hold.expires) + hold.lease_s)
        if not claim.read:
            self._report(request_id, hold, claim.consumer_rank)
        return "granted"

    def _fresh(self, issued_at: float) -> bool:
        """Whether this producer could have issued a handoff at ``issued_at`` that has not expired."""
        now = time.time()
        return self._started_at - _CLOCK_SLACK_S <= issued_at <= now + _CLOCK_SLACK_S and now < issued_at + self._hold_s

    def _report(self, request_id: str, hold: _Hold, consumer_rank: int) -> None:
        if consumer_rank not in hold.reporters:
            return  # not a rank the head map sends here: it counts for nothing
        hold.reported |= 1 << hold.reporters.index(consumer_rank)
        if hold.reported == (1 << len(hold.reporters)) - 1:
            self._free(request_id, hold, read=True)

    def _look_for_claimants(self) -> None:
        """End the holds whose every claimant is gone from the fleet (``_GONE_GRACE_S`` from now). The liveness
        view is asked outside the lock: a first look at a rank may connect to it."""
        with self._lock:
            ranks = {r for h in self._holds.values() for r in h.claimants}
        gone = set()
        for rank in ranks:
            try:
                if self._runtime.peer_lost(rank) is not None:
                    gone.add(rank)
            except Exception as e:  # noqa: BLE001 - no verdict on this rank this time
                self._warnings.warn(rank, f"looking for it in the fleet failed: {type(e).__name__}: {e}")
        if not gone:
            return
        end = time.monotonic() + _GONE_GRACE_S
        with self._lock:
            for hold in self._holds.values():
                if hold.claimants and hold.claimants <= gone:
                    hold.deadline = min(hold.deadline, end)

    def _handed_off(self, hold: _Hold) -> None:
        """Under the lock: ``hold`` no longer counts against the rank whose claim started it."""
        if hold.starter is not None:
            self._uncount(hold.starter)
            hold.starter = None
        hold.known = True

    def _uncount(self, rank: int) -> None:
        left = self._claimed_first[rank] - 1
        if left:
            self._claimed_first[rank] = left
        else:
            del self._claimed_first[rank]

    def _expire(self, now: float) -> None:
        if now < self._next_scan:
            return
        self._next_scan = now + _EXPIRY_SCAN_S
        for request_id, hold in [(r, h) for r, h in self._holds.items() if h.deadline <= now]:
            self._free(request_id, hold, read=False)
        if now >= self._next_prune:  # a claim for a handoff that expired is refused as stale (``_fresh``)
            self._next_prune = now + _SPENT_PRUNE_S
            self._spent = {k: t for k, t in self._spent.items() if t > now}
            for key in [k for k in self._spent_early if k not in self._spent]:
                self._uncount(self._spent_early.pop(key))

    def _free(self, request_id: str, hold: _Hold, read: bool) -> None:
        """Under the lock: the hold ends; its handoff is spent until it has expired anyway."""
        del self._holds[request_id]
        now = time.monotonic()
        expired_at = now + max(hold.issued_at + self._hold_s - time.time(), 0.0) + 2 * _CLOCK_SLACK_S
        self._spent[(request_id, hold.issued_at)] = expired_at
        if not hold.known:
            if hold.starter is not None:  # it still counts against its starter, until handed off or expired
                self._spent_early[(request_id, hold.issued_at)] = hold.starter
            self._freed_early[(request_id, hold.issued_at)] = now
            while len(self._freed_early) > _MAX_FREED_EARLY:
                del self._freed_early[next(iter(self._freed_early))]
            return
        if not read:
            self.expired += 1
            log.warning("KV producer %s: request %s not read within its hold; its blocks are freed",
                        self._member.name, request_id)
        self._freed.add(request_id)


class _Warnings:
    """Warnings about what other ranks sent: the first per sender at once, then a count of the rest every
    ``_WARN_EVERY_S`` (one line for all senders), so a flood costs a few log lines."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._warned: set[int | None] = set()
        self._unsaid: dict[int | None, int] = {}  # sender -> warnings not logged since the last count
        self._next_count = 0.0

    def warn(self, sender: int | None, what: str) -> None:
        """Log ``what`` about a message from rank ``sender`` (None: about this rank's own polling)."""
        now = time.monotonic()
        if sender not in self._warned:
            if len(self._warned) >= _MAX_WARNED:
                self._warned.clear()
            self._warned.add(sender)
            source = "its own poll" if sender is None else f"rank {sender}"
            log.warning("KV producer %s: %s: %s (more such are counted every %.0fs)", self._name, source, what,
                        _WARN_EVERY_S)
            self._next_count = max(self._next_count, now + _WARN_EVERY_S)
            return
        if len(self._unsaid) < _MAX_WARNED or sender in self._unsaid:
            self._unsaid[sender] = self._unsaid.get(sender, 0) + 1
        if now >= self._next_count:
            self._next_count = now + _WARN_EVERY_S
            counts, self._unsaid = self._unsaid, {}
            log.warning("KV producer %s: %d more malformed or failed message(s) ignored, per rank: %s", self._name,
                        sum(counts.values()), dict(list(counts.items())[:16]))


def _readers(own: Sharding, tp_rank: int, consumer_tp: int) -> range | None:
    """The consumer ranks of a consumer at TP ``consumer_tp`` that report to rank ``tp_rank`` of ``own``: those
    ``HeadMap(own, consumer).readers_of(tp_rank)`` names, or the one that releases it (``tp_rank mod
    consumer_tp``) when none reads from it; None where the two engines have no head map (a consumer TP that does not
    split the heads evenly, or neither divides the other's). O(1): always an arithmetic progression (the unit tests
    hold it to ``HeadMap`` over every small case)."""
    size, heads = own.tp_size, own.total_heads
    if size % consumer_tp and consumer_tp % size:
        return None
    if own.replicated:  # consumer rank d reads the whole cache from producer rank d mod P
        found = range(tp_rank, consumer_tp, size)
    elif (consumer_tp <= heads and heads % consumer_tp) or (consumer_tp > heads and consumer_tp % heads):
        return None
    elif size <= heads:  # this rank holds heads [first, stop), each its only replica: every rank holding one reads
        first, stop = own.heads(tp_rank)
        if consumer_tp <= heads:
            per_rank = heads // consumer_tp
            found = range(first // per_rank, (stop - 1) // per_rank + 1)
        else:
            copies = consumer_tp // heads
            found = range(first * copies, stop * copies)
    else:  # this rank is replica ``turn`` of one head; the consumer ranks needing it take the replicas in turn
        replicas = size // heads
        head, turn = divmod(tp_rank, replicas)
        if consumer_tp <= heads:
            holder = head // (heads // consumer_tp)
            found = range(holder, holder + 1) if turn == 0 else range(0)
        else:
            copies = consumer_tp // heads
            found = range(head * copies + turn, (head + 1) * copies, replicas)
    return found if found else range(tp_rank % consumer_tp, tp_rank % consumer_tp + 1)
