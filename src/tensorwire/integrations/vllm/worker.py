"""The connector's worker side (vLLM's Worker process, one per tensor-parallel rank): vLLM's hooks over
``tensorwire.kv`` (the cache as a fleet member's pool, the producer's holds, the consumer's loads), and the stats."""

from __future__ import annotations

import logging
import threading

import torch

import tensorwire as tw
from tensorwire import kv

from .layout import block_order, pool_views
from .plan import Plan
from .settings import Settings

__all__ = ["WorkerSide", "StatsLog"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines


class StatsLog:
    """Observations since the last ``take``, one entry per load (lists, like NixlConnector's stats). Thread-safe."""

    FIELDS = ("transfer_duration", "contact_duration", "claim_duration", "load_duration", "bytes_transferred",
              "num_blocks", "num_requests", "num_failed_transfers", "num_kv_expired_reqs", "failure_reasons",
              "refused_handoffs")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, list] = {k: [] for k in self.FIELDS}

    def record(self, result: kv.LoadResult) -> None:
        with self._lock:
            if result.error is not None:
                self._data["num_failed_transfers"].append(len(result.loads))
                self._data["failure_reasons"].append(result.reason or "unknown")
                return
            for key, value in (("transfer_duration", result.transfer_s), ("contact_duration", result.contact_s),
                               ("claim_duration", result.claim_s), ("load_duration", result.load_s),
                               ("bytes_transferred", result.num_bytes),
                               ("num_blocks", result.num_blocks), ("num_requests", len(result.loads))):
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
    ``"kv_both"``; ``layout``: ``layout.fingerprint(vllm_config)``; ``sharding``: ``layout.sharding(vllm_config)``;
    ``block_size``: the engine's tokens per block."""

    def __init__(self, settings: Settings, role: str, layout: str, tp_rank: int, sharding: kv.Sharding,
                 block_size: int) -> None:
        self._settings, self._role, self._layout, self._block_size = settings, role, layout, block_size
        self._tp_rank, self._sharding = tp_rank, sharding
        self._member: kv.KVMember | None = None
        self._producer: kv.Producer | None = None
        self._consumer: kv.Consumer | None = None
        self._expired_seen = 0
        self._load_errors: set[int] = set()
        self._failed: list[kv.LoadResult] = []  # loads that failed before reaching the consumer, for ``finished``
        self.stats = StatsLog()
        self.transports: set[str] = set()  # what moved the loads' bytes so far ("" for a failed one)

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Join the fleet, register the KV cache as one block pool and publish it. Blocks (directory, pinning)."""
        if self._settings.directory is None:
            raise tw.InvalidArgumentError(
                "TensorwireConnector: no fleet to join; give kv_connector_extra_config={'directory': "
                "'tcp://HOST:PORT', ...} or set TENSORWIRE_DIRECTORY (a `tensorwire directory`)")
        views = pool_views(kv_caches, num_blocks)
        start, stop = self._sharding.heads(self._tp_rank)
        order = block_order(views, self._block_size, 1 if self._sharding.replicated else stop - start)
        self._member = kv.KVMember(views, instance=self._settings.name, tp_rank=self._tp_rank,
                                   sharding=self._sharding, layout=self._layout, block_size=self._block_size,
                                   order=order, directory=self._settings.directory,
                                   timeout_s=self._settings.timeout_s)
        if self._role != "kv_consumer":
            self._producer = kv.Producer(self._member, hold_s=self._settings.hold_s)
        if self._role != "kv_producer":
            self._consumer = kv.Consumer(self._member, timeout_s=self._settings.timeout_s,
                                         contact_s=self._settings.contact_s)
        unreachable = self._member.unreachable()
        if unreachable is not None:  # said once, at start-up: else clients see 200s while nothing is loaded
            log.warning("TensorwireConnector: %s", unreachable)
        pool = self._member.pool
        log.info("TensorwireConnector: %s is rank %d, heads %d..%d of %d, %d views x %d blocks of %d bytes",
                 self._member.name, self._member.comm.rank, start, stop - 1, self._sharding.total_heads,
                 len(views), pool.num_blocks, sum(pool.block_bytes))

    def start(self, plan: Plan) -> None:
        """Queue this step's loads (one job per producer) and start its holds. Never blocks, never raises: a load
        that cannot start fails (reported by ``finished``), so vLLM never waits for it in vain."""
        try:
            self.stats.record_refused(plan.refused)
            for handoff in plan.holds:
                if self._producer is not None:
                    self._producer.hold(handoff)
            self._submit(plan.loads)
        except Exception as e:  # noqa: BLE001 - raised into vLLM's worker, it would be fatal
            log.exception("TensorwireConnector: starting this step's loads failed")
            self._failed.extend(kv.LoadResult([load], f"{type(e).__name__}: {e}", reason="internal")
                                for load in plan.loads)

    def _submit(self, loads: list[kv.Load]) -> None:
        ready = []
        for load in loads:
            if load.refusal:  # refused by the scheduler's checks, under kv_load_failure_policy="fail"
                self._failed.append(kv.LoadResult([load], f"kv_transfer_params refused ({load.refusal})",
                                                  reason=f"refused:{load.refusal}"))
            elif self._consumer is None:
                log.warning("TensorwireConnector: a %s was asked to load request %s from %r; it loads nothing (start "
                            "the decode instance with kv_role='kv_consumer')", self._role, load.request_id,
                            load.handoff.member)
                self._failed.append(kv.LoadResult([load], f"a {self._role} loads nothing", reason="role"))
            else:
                ready.append(load)
        if ready:
            self._consumer.submit(ready)

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose held blocks may be freed, requests whose load ended). A failed load's blocks go to
        ``load_errors``. Never blocks."""
        recving = set()
        results, self._failed = self._failed, []
        results += self._consumer.take_results() if self._consumer is not None else []
        for result in results:
            self.transports.add(result.transport)
            self.stats.record(result)
            # A load of no blocks only told the producer (vLLM is not waiting for it): not reported.
            recving.update(load.request_id for load in result.loads if load.local_block_ids)
            if result.error is not None:
                self._load_errors.update(b for load in result.loads for b in load.local_block_ids)
        return self._released(), recving

    def _released(self) -> set[str]:
        if self._producer is None:
            return set()
        released = self._producer.released()
        if self._producer.expired > self._expired_seen:
            self.stats.record_expired(self._producer.expired - self._expired_seen)
            self._expired_seen = self._producer.expired
        return released

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Finish queued loads (bounded); a producer first waits (bounded by ``timeout_s``) until the blocks it
        handed off are read or expire, so a consumer's READ under way is not cut by the producer leaving. Then
        leave the fleet. Idempotent."""
        if self._producer is not None:
            self._producer.drain(self._settings.timeout_s)
            self._producer.close()
            self._producer = None
        if self._consumer is not None:
            self._consumer.close(self._settings.timeout_s)
            self._consumer = None
        if self._member is not None:
            self._member.close()
            self._member = None
