"""The consumer's loads, off the engine's thread so that its steps never wait for a producer.

A job is one engine step's loads from one producer: one tensorwire block READ covering every layer of every
block of those requests, whose notification tells the producer which requests it may free. Each producer has a
lane: a thread of its own running its jobs in order, owning its ``BlockTransfer`` (a transfer is driven from one
thread), so a producer slow to answer or to be found delays only its own loads. Results come back through one
queue that the engine's ``get_finished`` drains without blocking.

A lane never dies: any exception becomes the failure of that job, with a reason (a short word, counted in the
stats) and one log line. Finding a producer is bounded by ``contact_s``; one that left (its transfer lost, or not
found) is remembered, and a later job naming it fails at once unless the directory lists a new member under its
name (started again), which is contacted afresh.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

import tensorwire as tw

from .handoff import Load, read_message
from .settings import member_name

__all__ = ["Loader", "LoadResult", "LoadFailed"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines

POOL_KEY = "vllm-kv"  # under which each worker publishes its block pool
MAX_LANES = 64  # producers this consumer reaches at once; loads naming more fail ("lanes")
_PRESENCE_S = 0.2  # how long a departed producer's name is looked up before its job fails
# A lost producer still listed under its rank is taken as gone this long: the directory forgets a dead member
# within TENSORWIRE_LIVENESS_S, so one listed after this is alive (its loss was a false alarm) and is contacted again.
_DEPARTED_S = 15.0


@dataclass(frozen=True)
class LoadResult:
    """The outcome of one job: ``error`` is None on success (then the blocks hold the producer's KV)."""

    loads: list[Load]
    error: str | None
    num_blocks: int = 0
    num_bytes: int = 0
    transfer_s: float = 0.0  # post + wait of the READ
    contact_s: float = 0.0  # finding the producer and preparing the transfer (first contact only; else 0)
    transport: str = ""  # what moved the bytes: "cuda_ipc" (GPU caches, one host), "nixl", "shm"
    reason: str = ""  # a failure's kind, for the stats: "layout", "departed", "unreachable", "lost", "timeout"...


class LoadFailed(Exception):
    """A job's failure with its ``reason`` (``LoadResult.reason``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _reason(error: BaseException) -> str:
    if isinstance(error, LoadFailed):
        return error.reason
    if isinstance(error, tw.PeerLostError):
        return "lost"
    if isinstance(error, tw.WaitTimeoutError):
        return "timeout"
    return "transfer" if isinstance(error, tw.TensorwireError) else "internal"


class _Lane:
    """One producer's jobs, in order, on a thread of its own; everything here is that thread's only."""

    def __init__(self, loader: Loader, instance: str) -> None:
        self.loader, self.instance = loader, instance
        self.member = member_name(instance, loader.tp_rank, loader.tp_size)
        self.transfer: tw.BlockTransfer | None = None
        self.rank = -1  # its rank at the last contact
        self.departed_rank: int | None = None  # the rank it had when it left (-1: never found)
        self.departed_at = 0.0  # monotonic time it was found gone
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"tensorwire-vllm-load-{instance}"[:60], daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (loads := self.jobs.get()) is not None:
            try:
                result = self._load(loads)
            except Exception as e:  # noqa: BLE001 - a lane never dies: this job fails, the next ones run
                result = self._failed(loads, e)
            self.loader.results.put(result)
        self._drop()

    def _load(self, loads: list[Load]) -> LoadResult:
        started = time.perf_counter()
        contact_s = 0.0
        first = self.transfer is None
        if first:
            self.transfer = self._contact(loads[0].handoff.layout)
            contact_s = time.perf_counter() - started
        local = np.fromiter((b for load in loads for b in load.local_block_ids), dtype=np.int64)
        remote = np.fromiter((b for load in loads for b in load.remote_block_ids()), dtype=np.int64)
        posted = time.perf_counter()
        try:
            self._read(local, remote, loads)
        except tw.TensorwireError as e:
            # The first READ to a producer sets up its transport's connection; on a loaded box that can miss its
            # bound while the producer is fine. Once more on a fresh transfer, if it is still listed: a READ
            # only rewrites our own blocks of these requests, so repeating it is harmless.
            if not first or time.perf_counter() - started >= self.loader.timeout_s or not self._listed(self.rank):
                raise
            log.info("TensorwireConnector: the first READ from %r failed, once more: %s", self.member, e)
            self._drop()
            self.transfer = self._prepare(self.rank)
            self._read(local, remote, loads)
        transfer_s = time.perf_counter() - posted
        return LoadResult(loads, None, len(local), len(local) * self.transfer.bytes_per_block, transfer_s,
                          contact_s, self.transfer.transport)

    def _read(self, local: np.ndarray, remote: np.ndarray, loads: list[Load]) -> None:
        self.transfer.post(local, remote, notify=read_message([ld.handoff.request_id for ld in loads]))
        self.transfer.wait(timeout=self.loader.timeout_s)

    def _contact(self, their_layout: str) -> tw.BlockTransfer:
        """First contact: refuse a producer of another layout, then find its worker (bounded by ``contact_s``;
        at once for one that left and was not started again) and prepare the READ."""
        loader = self.loader
        if their_layout != loader.layout:
            raise LoadFailed("layout", f"producer {self.instance!r} serves {their_layout!r}, this consumer "
                             f"{loader.layout!r}; start both instances with the same model, dtype, block size and "
                             "tensor parallelism")
        bound = loader.contact_s if self.departed_rank is None else _PRESENCE_S
        try:
            rank = loader.comm.rank_of(self.member, timeout=bound)
        except tw.WaitTimeoutError:
            self.departed_rank = -1 if self.departed_rank is None else self.departed_rank
            self.departed_at = time.monotonic()
            raise LoadFailed("unreachable", f"no member {self.member!r} in the fleet within {bound:g}s; is the "
                             "producer running, under that name, in this directory?") from None
        if rank == self.departed_rank and time.monotonic() - self.departed_at < _DEPARTED_S:
            raise LoadFailed("departed", f"producer {self.member!r} (rank {rank}) left; its handoffs are recomputed "
                             "until it is started again")
        self.rank = rank  # if it is lost during the contact, this rank is the one that left
        transfer = self._prepare(rank)
        self.departed_rank = None
        return transfer

    def _prepare(self, rank: int) -> tw.BlockTransfer:
        """The READ to ``rank``'s pool. First contact asks the producer itself (liveness, its map's epoch); on a
        2-core box running several engines its answer can miss the bound (a load failed so under CI's load), so a
        producer still listed under its name is asked again until ``timeout_s``: only this lane waits."""
        loader = self.loader
        deadline = time.monotonic() + loader.timeout_s
        while True:
            try:
                remote = loader.comm.lookup_blocks(POOL_KEY, rank, timeout=loader.contact_s)
                return loader.comm.prepare_blocks(tw.READ, loader.pool, remote)
            except (tw.WaitTimeoutError, tw.PeerLostError) as e:
                if time.monotonic() >= deadline or not self._listed(rank):
                    raise
                log.info("TensorwireConnector: first contact with %r (rank %d) failed, again: %s", self.member,
                         rank, e)
                time.sleep(0.5)  # a dead producer refuses at once: do not spin until the directory forgets it

    def _listed(self, rank: int) -> bool:
        """Whether the directory still lists ``rank`` under the producer's name."""
        try:
            return self.loader.comm.rank_of(self.member, timeout=_PRESENCE_S) == rank
        except tw.WaitTimeoutError:
            return False

    def _failed(self, loads: list[Load], error: BaseException) -> LoadResult:
        reason = _reason(error)
        if reason == "lost":
            self.departed_rank, self.departed_at = self.rank, time.monotonic()
        if reason in ("lost", "timeout", "transfer", "internal"):
            self._drop()  # contacted afresh by the next job
        log.warning("TensorwireConnector: loading %d request(s) from %r failed (%s): %s: %s", len(loads),
                    self.instance, reason, type(error).__name__, error)
        return LoadResult(loads, f"{type(error).__name__}: {error}", reason=reason)

    def _drop(self) -> None:
        if self.transfer is not None:
            try:
                self.transfer.close()
            except Exception as e:  # noqa: BLE001 - a transfer to a dead producer may fail to close; go on
                log.debug("TensorwireConnector: closing the transfer to %r: %s", self.instance, e)
            self.transfer = None


class Loader:
    """Runs load jobs, in order per producer, on one thread per producer. ``submit`` and ``results`` never block."""

    def __init__(self, comm: tw.Communicator, pool: tw.BlockPool, layout: str, tp_rank: int, tp_size: int,
                 timeout_s: float, contact_s: float = 5.0) -> None:
        self.comm, self.pool, self.layout = comm, pool, layout
        self.tp_rank, self.tp_size, self.timeout_s, self.contact_s = tp_rank, tp_size, timeout_s, contact_s
        self.results: queue.Queue = queue.Queue()
        self._lanes: dict[str, _Lane] = {}  # by producer instance name; the engine thread's only

    def submit(self, producer: str, loads: list[Load]) -> None:
        lane = self._lanes.get(producer)
        if lane is None:
            if len(self._lanes) >= MAX_LANES:
                log.warning("TensorwireConnector: loading %d request(s) from %r failed (lanes): this consumer "
                            "already reaches %d producers", len(loads), producer, MAX_LANES)
                self.results.put(LoadResult(loads, f"more than {MAX_LANES} producers", reason="lanes"))
                return
            lane = self._lanes[producer] = _Lane(self, producer)
        lane.jobs.put(loads)

    def take_results(self) -> list[LoadResult]:
        """Every job finished since the last call."""
        done = []
        while True:
            try:
                done.append(self.results.get_nowait())
            except queue.Empty:
                return done

    def close(self, timeout_s: float) -> None:
        """Finish the queued jobs (each bounded), then release the transfers; waits at most ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        for lane in self._lanes.values():
            lane.jobs.put(None)
        for lane in self._lanes.values():
            lane.thread.join(max(deadline - time.monotonic(), 0.0))
