"""The consumer's loads, on one thread of their own so that the engine's steps never wait for a producer.

A job is one engine step's loads from one producer: one tensorwire block READ covering every layer of every
block of those requests, whose notification tells the producer which requests it may free. The thread owns every
tensorwire handle it makes (a ``BlockTransfer`` is driven from one thread), and hands results back through a
queue that the engine's ``get_finished`` drains without blocking.
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

__all__ = ["Loader", "LoadResult"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines

POOL_KEY = "vllm-kv"  # under which each worker publishes its block pool


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


class _Producer:
    """A producer worker as this consumer reaches it: its rank and the READ prepared to its pool."""

    def __init__(self, rank: int, transfer: tw.BlockTransfer) -> None:
        self.rank, self.transfer = rank, transfer


class Loader:
    """Runs load jobs in order on a daemon thread. ``submit`` and ``results`` never block."""

    def __init__(self, comm: tw.Communicator, pool: tw.BlockPool, layout: str, tp_rank: int, tp_size: int,
                 timeout_s: float) -> None:
        self._comm, self._pool, self._layout = comm, pool, layout
        self._tp_rank, self._tp_size, self._timeout_s = tp_rank, tp_size, timeout_s
        self._producers: dict[str, _Producer] = {}  # by instance name; this thread's only
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tensorwire-vllm-loader", daemon=True)
        self._thread.start()

    def submit(self, producer: str, loads: list[Load]) -> None:
        self._jobs.put((producer, loads))

    def results(self) -> list[LoadResult]:
        """Every job finished since the last call."""
        done = []
        while True:
            try:
                done.append(self._results.get_nowait())
            except queue.Empty:
                return done

    def close(self, timeout_s: float) -> None:
        """Finish the queued jobs (each bounded by the timeout), then release the transfers. Blocks."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._results.put(self._load(*job))
        for producer in self._producers.values():
            producer.transfer.close()

    def _load(self, instance: str, loads: list[Load]) -> LoadResult:
        started = time.perf_counter()
        try:
            producer, contact_s = self._producers.get(instance), 0.0
            if producer is None:
                producer = self._contact(instance, loads[0].handoff.layout)
                contact_s = time.perf_counter() - started
            local = np.fromiter((b for load in loads for b in load.local_block_ids), dtype=np.int64)
            remote = np.fromiter((b for load in loads for b in load.remote_block_ids()), dtype=np.int64)
            posted = time.perf_counter()
            producer.transfer.post(local, remote, notify=read_message([ld.handoff.request_id for ld in loads]))
            producer.transfer.wait(timeout=self._timeout_s)
            transfer_s = time.perf_counter() - posted
        except tw.TensorwireError as e:
            dropped = self._producers.pop(instance, None)
            if dropped is not None:
                dropped.transfer.close()
            log.warning("TensorwireConnector: loading %d request(s) from %r failed: %s", len(loads), instance, e)
            return LoadResult(loads, f"{type(e).__name__}: {e}")
        return LoadResult(loads, None, len(local), len(local) * producer.transfer.bytes_per_block, transfer_s,
                          contact_s, producer.transfer.transport)

    def _contact(self, instance: str, their_layout: str) -> _Producer:
        """First contact: refuse a producer of another layout, then find its worker and prepare the READ."""
        if their_layout != self._layout:
            raise tw.InvalidArgumentError(
                f"TensorwireConnector: producer {instance!r} serves {their_layout!r}, this consumer "
                f"{self._layout!r}; start both instances with the same model, dtype, block size and tensor "
                "parallelism")
        rank = self._comm.rank_of(member_name(instance, self._tp_rank, self._tp_size), timeout=self._timeout_s)
        remote = self._comm.lookup_blocks(POOL_KEY, rank, timeout=self._timeout_s)
        producer = _Producer(rank, self._comm.prepare_blocks(tw.READ, self._pool, remote))
        self._producers[instance] = producer
        return producer
