"""The consumer's loads, off the engine's thread so that its steps never wait for a producer.

A job is one engine step's loads from one producer instance. Each producer instance has a lane: a thread of its own
running its jobs in order and owning its transfers (a transfer is driven from one thread), so a producer slow to
answer or to be found delays only its own loads. Results come back through one queue that the engine drains
without blocking.

A job, at consumer rank d of an engine at tensor parallelism D, from a producer at P (the handoff says which):
  1. the head map (``heads.HeadMap``) says which producer ranks hold d's heads (``reads``) and which it only
     releases; each is found in the fleet at first contact (bounded by ``contact_s``; one that left fails at once
     until a member under its name is listed again);
  2. one CLAIM to each of them (``messages.py``), the GRANTs awaited together: the producer grants each handoff to
     one claim, so a replayed or second consumer's load fails here (``replayed``), and nothing it read is used;
  3. posted together with the claims (once each source's order of rows is known from a first grant), one block
     READ per source and part for all the job's granted requests (``shapes.BlockPlan``: the rows of a
     head range when the TP sizes differ, one part per producer block inside a larger consumer block or per consumer
     block inside a larger producer block; HND blocks of one size on both sides: one descriptor per block per
     source), then the DONE that lets the producer free the blocks once every consumer rank reported.

A lane never dies: any exception becomes the failure of that job, with a reason (a short word, counted in the
stats) and one log line.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass

import tensorwire as tw

from .grants import GrantBox
from .handoff import Load
from .heads import HeadMap, Sharding
from .member import KVMember
from .messages import TO_CONSUMER, TO_PRODUCER, Claim, Done, Grant
from .sources import LoadFailed, Source

__all__ = ["Consumer", "LoadResult", "LoadFailed", "MAX_LANES"]

log = logging.getLogger(__name__)

MAX_LANES = 64  # producer instances this consumer reaches at once; loads naming more fail ("lanes")
_REFUSED = {"taken": "replayed", "spent": "replayed", "unknown": "unknown"}
_CONFIRM_S = 0.25  # how often a lane waiting for grants asks whether a silent source is gone


@dataclass(frozen=True)
class LoadResult:
    """The outcome of one job: ``error`` is None on success (then the blocks hold the producer's KV)."""

    loads: list[Load]
    error: str | None
    num_blocks: int = 0
    num_bytes: int = 0
    transfer_s: float = 0.0  # post + wait of the READs (they go out with the claims once a source's order is known)
    contact_s: float = 0.0  # finding the producer ranks and preparing the transfers (first contact only; else 0)
    claim_s: float = 0.0  # the claims' round trip (single use's check, overlapped with the READs)
    transport: str = ""  # what moved the bytes: "cuda_ipc" (GPU caches, one host), "nixl", "shm"
    reason: str = ""  # a failure's kind, for the stats: "layout", "replayed", "departed", "lost", "timeout"...
    load_s: float = 0.0  # from the claims to the end of the last READ: what the load cost the request


def _reason(error: BaseException) -> str:
    if isinstance(error, LoadFailed):
        return error.reason
    if isinstance(error, tw.PeerLostError):
        return "lost"
    if isinstance(error, tw.WaitTimeoutError):
        return "timeout"
    return "transfer" if isinstance(error, tw.TensorwireError) else "internal"


class _Lane:
    """One producer instance's jobs, in order, on a thread of its own; everything here is that thread's only."""

    def __init__(self, consumer: Consumer, instance: str) -> None:
        self.consumer, self.instance = consumer, instance
        self.sources: dict[tuple[int, int], Source] = {}  # (producer TP, producer rank) -> its source
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"tensorwire-kv-load-{instance}"[:60], daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (loads := self.jobs.get()) is not None:
            try:
                results = self._load(loads)
            except Exception as e:  # noqa: BLE001 - a lane never dies: this job fails, the next ones run
                results = [self._failed(loads, e)]
            for result in results:
                self.consumer.results.put(result)
        for source in self.sources.values():
            source.drop()

    def _load(self, loads: list[Load]) -> list[LoadResult]:
        """The job's results: one for the loads granted (and read), one per reason for those refused."""
        head_map = self._head_map(loads)
        rank = self.consumer.member.tp_rank
        reads = head_map.reads(rank)
        contacts = sorted({r.producer_rank for r in reads} | set(head_map.releases(rank)))
        sources, contact_s = self._contact(loads, contacts)
        claimed = time.perf_counter()
        granted, refused, moved, claim_s, transfer_s = self._claim_and_read(loads, reads, sources)
        read = [ld for ld in granted if ld.local_block_ids]
        if read:
            self._done(read, reads, sources)
        results = [self._refused(group, reason) for reason, group in refused.items()]
        if granted:
            blocks = sum(len(ld.local_block_ids) for ld in granted)
            transport = next((s.transport for s in sources.values() if s.transport), "")
            results.append(LoadResult(granted, None, blocks, moved, transfer_s, contact_s, claim_s, transport,
                                      load_s=time.perf_counter() - claimed))
        return results

    def _contact(self, loads: list[Load], ranks: list[int]) -> tuple[dict[int, Source], float]:
        """The producer ranks ``ranks`` of the job's instance, each found and its pool looked up (bounded, once);
        and how long that took where one was new (else 0)."""
        started = time.perf_counter()
        producer_tp = loads[0].handoff.producer_tp
        first = any((producer_tp, p) not in self.sources for p in ranks)
        sources = {p: self._source(producer_tp, p) for p in ranks}
        for source in sources.values():
            source.contact(loads[0].handoff.layout)
        return sources, time.perf_counter() - started if first else 0.0

    def _claim_and_read(self, loads: list[Load], reads: list, sources: dict[int, Source]) -> tuple:
        """Claim ``loads`` at every source and READ their blocks: (granted, refused by reason, bytes, claim s,
        READ s). Raises ``LoadFailed`` (or the READ's error) once every READ posted has ended.

        Single use at no round trip: the READs go out with the claims, and their bytes count only once every source
        granted. A refused load's blocks are reported failed (the engine recomputes or fails them; nothing of what
        landed there is used), and every READ is waited for before anything is reported, so that no byte lands in
        blocks the engine has taken back. A source's first load learns its order of rows from its grant: that one
        READ waits for the grants."""
        claimed = time.perf_counter()
        tickets = self._send_claims(loads, sources, {r.producer_rank for r in reads})
        early = all(sources[read.producer_rank].order is not None for read in reads)
        reading = [ld for ld in loads if ld.local_block_ids]
        moved, posted_at = 0, time.perf_counter()
        try:
            if early and reading:
                moved = sum(sources[read.producer_rank].post(read, reading) for read in reads)
            granted, refused, changed = self._grants_of(loads, tickets, sources, early)
            claim_s = time.perf_counter() - claimed
            if not early:
                reading = [ld for ld in granted if ld.local_block_ids]
                posted_at = time.perf_counter()
                moved = sum(sources[read.producer_rank].post(read, reading) for read in reads) if reading else 0
        finally:
            read_error = self._wait_reads(reads, sources) if reading else None
        transfer_s = time.perf_counter() - posted_at
        if refused:
            self._release([ld for group in refused.values() for ld in group], sources)
        if changed:
            self._release(granted, sources)
            raise LoadFailed("layout", f"the producer's order of rows changed under the READ ({'; '.join(changed)}): "
                             "its engine restarted with another KV cache layout; the next loads use the new one")
        if read_error is not None:
            raise read_error
        return granted, refused, moved, claim_s, transfer_s

    def _release(self, loads: list[Load], sources: dict[int, Source]) -> None:
        """Loads refused somewhere are read nowhere: the sources that granted them may free their blocks now
        rather than at expiry (a release under the same claim; where it was refused it changes nothing).
        Not answered: their grants are discarded by ticket."""
        member = self.consumer.member
        release = Claim(secrets.token_hex(8), tuple((ld.handoff.request_id, ld.handoff.issued_at, ld.claim)
                                                    for ld in loads), False, member.sharding.tp_size, member.tp_rank,
                        self.consumer.read_bound_s).encode()
        for source in sources.values():
            source.send(release)

    def _refused(self, loads: list[Load], reason: str) -> LoadResult:
        error = (f"LoadFailed: the producer refused {len(loads)} handoff(s) ({reason}): each is read once, by one "
                 "consumer, before it expires")
        log.warning("KV consumer: loading %d request(s) from %r failed (%s): %s", len(loads), self.instance, reason,
                    error)
        return LoadResult(loads, error, reason=reason)

    def _head_map(self, loads: list[Load]) -> HeadMap:
        member = self.consumer.member
        handoff = loads[0].handoff
        if handoff.layout != member.layout:
            raise LoadFailed("layout", f"producer {self.instance!r} serves {handoff.layout!r}, this consumer "
                             f"{member.layout!r}; start both with the same model and KV dtype")
        own = member.sharding
        try:
            return HeadMap(Sharding(handoff.producer_tp, own.total_heads, own.replicated), own)
        except tw.InvalidArgumentError as e:
            raise LoadFailed("tp", str(e)) from None

    def _source(self, producer_tp: int, producer_rank: int) -> Source:
        key = (producer_tp, producer_rank)
        if key not in self.sources:
            consumer = self.consumer
            self.sources[key] = Source(consumer.member, consumer.to_producers, (consumer.timeout_s, consumer.contact_s),
                                       self.instance, producer_rank, producer_tp, consumer.transport)
        return self.sources[key]

    def _send_claims(self, loads: list[Load], sources: dict[int, Source], readers: set[int]) -> dict[str, int]:
        """Claim every load at every source (a release where this rank reads nothing from it, or the load needs
        no blocks); returns ticket -> producer rank. Never waits."""
        member = self.consumer.member
        tickets: dict[str, int] = {}
        for p, source in sources.items():
            for read in (True, False):
                chosen = [ld for ld in loads if read == (p in readers and bool(ld.local_block_ids))]
                if chosen:
                    ticket = secrets.token_hex(8)
                    claim = Claim(ticket, tuple((ld.handoff.request_id, ld.handoff.issued_at, ld.claim)
                                                for ld in chosen), read, member.sharding.tp_size, member.tp_rank,
                                  self.consumer.read_bound_s)
                    source.send(claim.encode())
                    tickets[ticket] = p
        return tickets

    def _grants_of(self, loads: list[Load], tickets: dict[str, int], sources: dict[int, Source],
                   posted: bool) -> tuple[list[Load], dict[str, list[Load]], list[str]]:
        """Wait for every grant of ``tickets``. Returns (loads granted everywhere, the refused ones by reason, the
        sources whose order of rows changed). ``posted``: the READs went out under each source's last known order;
        a grant naming another one (the producer restarted with another cache layout) makes them all wrong."""
        verdicts: dict[str, list[str]] = {}
        changed = []
        for grant in self._grants(tickets, sources):
            for request_id, verdict in grant.verdicts.items():
                verdicts.setdefault(request_id, []).append(verdict)
            source = sources[tickets[grant.ticket]]
            if posted and source.order != grant.order:
                changed.append(f"{source.member!r} now {grant.order}, was {source.order}")
            source.order = grant.order
        granted, refused = [], {}
        for ld in loads:
            bad = [v for v in verdicts.get(ld.handoff.request_id, ["unknown"]) if v != "granted"]
            if bad:
                refused.setdefault(_REFUSED[bad[0]], []).append(ld)
            else:
                granted.append(ld)
        return granted, refused, changed

    def _grants(self, tickets: dict[str, int], sources: dict[int, Source]) -> list[Grant]:
        """The grants of ``tickets`` (ticket -> producer rank), in any order. Sleeps between looks; bounded by the
        consumer's ``timeout_s`` (``LoadFailed("timeout")``); a source found gone fails it within the liveness
        bound (``lost``)."""
        consumer = self.consumer
        box, runtime = consumer.grants, consumer.member.comm.runtime
        deadline = time.monotonic() + consumer.timeout_s
        waiting, grants, pause = dict(tickets), [], 2e-5
        confirm_at = time.monotonic() + _CONFIRM_S
        box.expect({ticket: sources[p].rank for ticket, p in waiting.items()})
        try:
            while True:
                for grant in box.take(set(waiting)):
                    grants.append(grant)
                    del waiting[grant.ticket]
                if not waiting:
                    return grants
                if time.monotonic() >= confirm_at:
                    confirm_at = time.monotonic() + _CONFIRM_S
                    for p in set(waiting.values()):
                        # Confirmed by the directory, which drops a dead member within the liveness bound: a
                        # liveness false alarm under load must not fail a live producer's load (nor mark it gone).
                        reason = runtime.peer_lost(sources[p].rank)
                        if reason is not None and not sources[p].listed():
                            raise LoadFailed("lost", f"producer {sources[p].member!r} (rank {sources[p].rank}) is "
                                             f"gone ({reason}) with a claim unanswered")
                if time.monotonic() >= deadline:
                    for p in set(waiting.values()):
                        sources[p].check_alive()
                    raise LoadFailed("timeout", f"{len(waiting)} claim(s) to {self.instance!r} not answered within "
                                     f"{consumer.timeout_s:g}s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        finally:
            box.forget(set(waiting))

    def _wait_reads(self, reads: list, sources: dict[int, Source]) -> BaseException | None:
        """Wait for every source's READs (each bounded); the first failure, returned, not raised: every READ is
        waited for first."""
        error = None
        for p in dict.fromkeys(read.producer_rank for read in reads):
            try:
                sources[p].wait()
            except Exception as e:  # noqa: BLE001 - the job fails with it once every READ has ended
                error = error or e
        return error

    def _done(self, loads: list[Load], reads: list, sources: dict[int, Source]) -> None:
        """Tell each source read from that it may free ``loads``' blocks (DONE, only now: a READ retried after a
        failure must not find the blocks reused)."""
        done = Done(tuple((ld.handoff.request_id, ld.claim) for ld in loads), self.consumer.member.tp_rank).encode()
        for p in dict.fromkeys(read.producer_rank for read in reads):
            sources[p].send(done)

    def _failed(self, loads: list[Load], error: BaseException) -> LoadResult:
        reason = _reason(error)
        if reason in ("lost", "timeout", "transfer", "internal"):
            for source in self.sources.values():
                source.failed(reason)
        log.warning("KV consumer: loading %d request(s) from %r failed (%s): %s: %s", len(loads), self.instance,
                    reason, type(error).__name__, error)
        return LoadResult(loads, f"{type(error).__name__}: {error}", reason=reason)


class Consumer:
    """Runs load jobs for ``member``'s pool, in order per producer instance, on one thread per instance.
    ``submit`` and ``take_results`` never block; ``load`` does (for a plain program). ``transport``: the one the
    READs take (``prepare_blocks``'s ``transport=``: ``"nixl"`` between GPU caches of one host, say); None: the
    fastest that reaches the producer."""

    def __init__(self, member: KVMember, *, timeout_s: float = 30.0, contact_s: float = 5.0,
                 transport: str | None = None) -> None:
        self.member, self.timeout_s, self.contact_s = member, timeout_s, contact_s
        self.transport = transport
        # How long a READ may run after its grant: its wait, and one more on a fresh transfer (``Source.wait``).
        self.read_bound_s = 2 * timeout_s + 5.0
        self.grants = GrantBox(member.comm.runtime.channel(TO_CONSUMER))  # grants come here, for every lane
        self.to_producers = member.comm.runtime.channel(TO_PRODUCER)  # claims go there
        self.results: queue.Queue = queue.Queue()
        self._lanes: dict[str, _Lane] = {}  # by producer instance name; the submitting thread's only

    def submit(self, loads: list[Load]) -> None:
        """Queue ``loads`` (each with a handoff), one job per producer instance."""
        by_instance: dict[str, list[Load]] = {}
        for ld in loads:
            by_instance.setdefault(ld.handoff.member, []).append(ld)
        for instance, jobs in by_instance.items():
            lane = self._lanes.get(instance)
            if lane is None:
                if len(self._lanes) >= MAX_LANES:
                    log.warning("KV consumer: loading %d request(s) from %r failed (lanes): this consumer already "
                                "reaches %d producers", len(jobs), instance, MAX_LANES)
                    self.results.put(LoadResult(jobs, f"more than {MAX_LANES} producers", reason="lanes"))
                    continue
                lane = self._lanes[instance] = _Lane(self, instance)
            lane.jobs.put(jobs)

    def take_results(self) -> list[LoadResult]:
        """Every job finished since the last call. Never blocks."""
        done = []
        while True:
            try:
                done.append(self.results.get_nowait())
            except queue.Empty:
                return done

    def load(self, loads: list[Load]) -> list[LoadResult]:
        """``submit`` and wait for these jobs' results (bounded: each job is). Blocks."""
        self.submit(loads)
        wanted = {ld.request_id for ld in loads}
        deadline = time.monotonic() + self.timeout_s * 4 + self.contact_s  # each step of a job is bounded
        results = []
        while wanted:
            try:
                result = self.results.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise tw.WaitTimeoutError(f"Consumer.load: {len(wanted)} load(s) not done in time") from None
            wanted -= {ld.request_id for ld in result.loads}
            results.append(result)
        return results

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the queued jobs (each bounded), then release the transfers; waits at most ``timeout_s``."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for lane in self._lanes.values():
            lane.jobs.put(None)
        for lane in self._lanes.values():
            lane.thread.join(max(deadline - time.monotonic(), 0.0))
