"""The connector's worker side (vLLM's Worker process, one per tensor-parallel rank): the fleet member, the KV
cache registered once as a block pool, the consumer's loads and the producer's held blocks."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

import torch

import tensorwire as tw

from .handoff import Load, Plan, parse_read_message
from .layout import pool_views
from .loader import POOL_KEY, Loader, LoadResult
from .settings import Settings

__all__ = ["WorkerSide", "StatsLog"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines

_READ_EARLY_S = 60.0  # a hold follows its read by one engine step: a minute is ample


class StatsLog:
    """Observations since the last ``take``, one entry per load (lists, like NixlConnector's stats). Thread-safe."""

    FIELDS = ("transfer_duration", "contact_duration", "bytes_transferred", "num_blocks", "num_requests",
              "num_failed_transfers", "num_kv_expired_reqs", "failure_reasons", "refused_handoffs")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, list] = {k: [] for k in self.FIELDS}

    def record(self, result: LoadResult) -> None:
        with self._lock:
            if result.error is not None:
                self._data["num_failed_transfers"].append(len(result.loads))
                self._data["failure_reasons"].append(result.reason or "unknown")
                return
            for key, value in (("transfer_duration", result.transfer_s), ("contact_duration", result.contact_s),
                               ("bytes_transferred", result.num_bytes), ("num_blocks", result.num_blocks),
                               ("num_requests", len(result.loads))):
                self._data[key].append(value)

    def record_refused(self, reasons: list[str]) -> None:
        """Handoffs refused by the scheduler's checks (recomputed, or failed as loads too)."""
        with self._lock:
            self._data["refused_handoffs"].extend(reasons)

    def record_expired(self, count: int) -> None:
        with self._lock:
            self._data["num_kv_expired_reqs"].append(count)

    def take(self) -> dict[str, list] | None:
        """The observations so far (None if there are none), and start afresh."""
        with self._lock:
            if not any(self._data.values()):
                return None
            data, self._data = self._data, {k: [] for k in self.FIELDS}
            return data


class WorkerSide:
    """Hooks of ``KVConnectorBase_V1``'s worker role. ``role``: ``"kv_producer"``, ``"kv_consumer"`` or
    ``"kv_both"``; ``layout``: ``layout.fingerprint(vllm_config)``."""

    def __init__(self, settings: Settings, role: str, layout: str, tp_rank: int, tp_size: int) -> None:
        self._settings, self._role, self._layout = settings, role, layout
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._comm: tw.Communicator | None = None
        self._pool: tw.BlockPool | None = None
        self._loader: Loader | None = None
        self._holds: dict[str, float] = {}  # producer: request id -> monotonic deadline of its blocks
        # read before this worker learnt of the hold (a step apart): request id -> when; kept a while only
        self._read_early: dict[str, float] = {}
        self._load_errors: set[int] = set()
        self._failed: list[LoadResult] = []  # loads that failed before reaching the loader, for ``finished``
        self.stats = StatsLog()
        self.transports: set[str] = set()  # what moved the loads' bytes so far ("" for a failed one)

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Join the fleet, register the KV cache as one block pool and publish it. Blocks (directory, pinning)."""
        views = pool_views(kv_caches, num_blocks)
        name = self._settings.member_name(self._tp_rank, self._tp_size)
        if self._settings.directory is None:
            raise tw.InvalidArgumentError(
                "TensorwireConnector: no fleet to join; give kv_connector_extra_config={'directory': "
                "'tcp://HOST:PORT', ...} or set TENSORWIRE_DIRECTORY (a `tensorwire directory`)")
        self._comm = tw.init(directory=self._settings.directory, name=name, timeout=self._settings.timeout_s)
        self._pool = self._comm.register_blocks(views)
        self._comm.publish_blocks(POOL_KEY, self._pool)
        if self._role != "kv_producer":
            self._loader = Loader(self._comm, self._pool, self._layout, self._tp_rank, self._tp_size,
                                  self._settings.timeout_s, self._settings.contact_s)
        log.info("TensorwireConnector: %s is rank %d, %d views x %d blocks of %d bytes", name, self._comm.rank,
                 len(views), self._pool.num_blocks, sum(self._pool.block_bytes))

    def start(self, plan: Plan) -> None:
        """Queue this step's loads (one job per producer) and note its holds. Never blocks, never raises: a load
        that cannot start fails (reported by ``finished``), so vLLM never waits for it in vain."""
        try:
            self.stats.record_refused(plan.refused)
            now = time.monotonic()
            for request_id, hold_s in plan.holds.items():
                if self._read_early.pop(request_id, None) is not None:
                    self._holds[request_id] = 0.0  # reported as sent at the next get_finished
                else:
                    self._holds[request_id] = now + hold_s
            self._submit(plan.loads)
        except Exception as e:  # noqa: BLE001 - raised into vLLM's worker, it would be fatal
            log.exception("TensorwireConnector: starting this step's loads failed")
            self._failed.extend(LoadResult([load], f"{type(e).__name__}: {e}", reason="internal")
                                for load in plan.loads)

    def _submit(self, loads: list[Load]) -> None:
        by_producer: dict[str, list[Load]] = defaultdict(list)
        for load in loads:
            if load.refusal:  # refused by the scheduler's checks, under kv_load_failure_policy="fail"
                self._failed.append(LoadResult([load], f"kv_transfer_params refused ({load.refusal})",
                                               reason=f"refused:{load.refusal}"))
            elif self._loader is None:
                log.warning("TensorwireConnector: a %s was asked to load request %s from %r; it loads nothing (start "
                            "the decode instance with kv_role='kv_consumer')", self._role, load.request_id,
                            load.handoff.member)
                self._failed.append(LoadResult([load], f"a {self._role} loads nothing", reason="role"))
            else:
                by_producer[load.handoff.member].append(load)
        for producer, producer_loads in by_producer.items():
            self._loader.submit(producer, producer_loads)

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose held blocks may be freed, requests whose load ended). A failed load's blocks go to
        ``load_errors``. Never blocks."""
        recving = set()
        results, self._failed = self._failed, []
        results += self._loader.take_results() if self._loader is not None else []
        for result in results:
            self.transports.add(result.transport)
            self.stats.record(result)
            # A load of no blocks only told the producer (vLLM is not waiting for it): not reported.
            recving.update(load.request_id for load in result.loads if load.local_block_ids)
            if result.error is not None:
                self._load_errors.update(b for load in result.loads for b in load.local_block_ids)
        return self._released(), recving

    def _drain(self, bound_s: float) -> None:
        deadline = time.monotonic() + bound_s
        try:
            while self._holds and self._comm is not None and time.monotonic() < deadline:
                self._released()
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - leaving must go on
            log.warning("TensorwireConnector: waiting for handed-off blocks to be read failed: %s", e)
        if self._holds:
            log.warning("TensorwireConnector: leaving with %d handed-off request(s) not read (waited %.0fs)",
                        len(self._holds), bound_s)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _released(self) -> set[str]:
        if self._comm is None or (not self._holds and self._role == "kv_consumer"):
            return set()
        for _, message in self._comm.poll_notifications():
            for request_id in parse_read_message(message) or ():
                if request_id in self._holds:
                    self._holds[request_id] = 0.0
                else:
                    self._note_read_early(request_id)
        now = time.monotonic()
        released = {r for r, deadline in self._holds.items() if deadline <= now}
        expired = sum(1 for r in released if self._holds[r] > 0.0)
        if expired:
            log.warning("TensorwireConnector: %d request(s) not read within hold_s=%.0fs; their blocks are freed",
                        expired, self._settings.hold_s)
            self.stats.record_expired(expired)
        for request_id in released:
            del self._holds[request_id]
        return released

    def _note_read_early(self, request_id: str) -> None:
        """Remember a read of a hold not started yet; a consumer naming requests that never come (a stale or
        repeated message) must not grow this without bound: entries older than a minute are forgotten."""
        now = time.monotonic()
        if len(self._read_early) >= 1024:
            self._read_early = {r: t for r, t in self._read_early.items() if now - t < _READ_EARLY_S}
        self._read_early[request_id] = now

    def close(self) -> None:
        """Finish queued loads (bounded); a producer first waits (bounded by ``timeout_s``) until the blocks it
        handed off are read or expire, so a consumer's READ under way is not cut by the producer leaving. Then
        leave the fleet. Idempotent."""
        self._drain(self._settings.timeout_s)
        if self._loader is not None:
            self._loader.close(self._settings.timeout_s)
            self._loader = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._comm is not None:
            self._comm.close()
            self._comm = None
