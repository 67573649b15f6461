"""``TensorwireConnector``: vLLM's ``KVConnectorBase_V1`` over tensorwire (see the class docstring)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import tensorwire as tw

from .layout import REQUIRED_ORDER, fingerprint, sharding
from .plan import Plan
from .scheduler import SchedulerSide
from .settings import Settings
from .stats import TensorwireKVConnectorStats, TensorwirePromMetrics
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ["TensorwireConnector", "TensorwireConnectorMetadata"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines


class TensorwireConnectorMetadata(KVConnectorMetadata):
    """One engine step's ``Plan``, from the scheduler to every worker."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan


class TensorwireConnector(KVConnectorBase_V1):
    """Disaggregated prefill/decode over tensorwire: the decode instance (``kv_consumer``) READs the prompt's KV
    blocks from the prefill instance (``kv_producer``) that computed them, both members of a tensorwire fleet
    (``kv_connector_extra_config={"directory": "tcp://HOST:PORT", "name": ...}``, see ``settings.py``). On one
    host with GPU caches the READ is one Triton kernel over CUDA IPC, across hosts one NIXL request, on the CPU
    one NIXL request: always one request for all layers of all blocks of a step's requests from one producer rank.
    Prefill and decode may run different tensor-parallel sizes (and MLA models): each decode rank reads its heads
    from the prefill ranks that hold them (``tensorwire.kv``).

    The client sends a prompt to the producer with ``kv_transfer_params={"do_remote_decode": True}`` and
    ``max_tokens=1``, then to the consumer with the producer output's ``kv_transfer_params`` (``handoff.py``):
    the handoff, sealed with the job token. The client is not trusted: ``params.py`` checks every field, and the
    consumer reads only blocks of a handoff it opened, for the prompt it serves, before it expires, and only once
    the producer granted it the handoff: each handoff is read once, by one consumer.
    No hook raises: a hostile or broken request is recomputed or failed (``kv_load_failure_policy``), never
    left waiting, and never stops the engine.

    Scheduler side (EngineCore process):
      - ``get_num_new_matched_tokens``: consumer: the request's ``kv_transfer_params`` are judged (once); if
        they pass, every prompt token not computed locally is loaded from the producer, asynchronously.
      - ``update_state_after_alloc``: consumer: plans that load into the blocks just allocated.
      - ``build_connector_meta``: the step's loads and the producer's new holds, for the workers.
      - ``request_finished``: producer: keeps the blocks (delay_free) and returns ``kv_transfer_params``
        naming its member, block ids, request id and layout fingerprint; consumer: an unscheduled request still
        releases the producer's blocks.
    Worker side (Worker process, one per tensor-parallel rank):
      - ``register_kv_caches``: joins the fleet, registers the KV cache once as a block pool (block i = block i of
        every layer) and publishes it.
      - ``start_load_kv``: hands the step's loads to the loader (one thread per producer, one READ per producer
        per step, with a notification naming the producer's requests) and starts the holds' clocks; never blocks.
      - ``wait_for_layer_load`` / ``save_kv_layer`` / ``wait_for_save``: nothing: loads complete before their
        request is scheduled, and the producer's blocks are read in place, not saved.
      - ``get_finished``: loads that ended (failed ones too) and held requests whose consumer's READ
        notification arrived, or whose ``hold_s`` passed.
      - ``get_block_ids_with_load_errors``: blocks of failed loads (a producer gone, unreachable or leaving, a
        handoff refused under ``"fail"``): vLLM then recomputes them or fails the request, per
        ``kv_load_failure_policy``.
      - ``get_kv_connector_stats``: bytes, blocks, transfer and first-contact time per load; failed loads and
        refused handoffs, counted per reason.
      - ``shutdown``: finishes queued loads, waits for handed-off blocks to be read (both bounded), leaves the
        fleet.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        self._settings = Settings.from_extra_config(transfer_config.kv_connector_extra_config,
                                                    transfer_config.engine_id, tw.fleet_from_environment())
        layout = fingerprint(vllm_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self._settings, layout, role=transfer_config.kv_role, block_size=vllm_config.cache_config.block_size,
                policy=getattr(transfer_config, "kv_load_failure_policy", "fail"), sealed=_job_can_seal(),
                tp_size=tp_size)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(self._settings, transfer_config.kv_role, layout,
                                      get_tensor_model_parallel_rank() if tp_size > 1 else 0, sharding(vllm_config),
                                      vllm_config.cache_config.block_size)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """What the connector asks vLLM for: heads outermost in a block (``HND``) for a head-split cache, so that a
        head range of a block is one byte range (one descriptor per block and view across TP sizes); nothing for
        MLA (no head split). An engine that cannot honour it still works: its order is read from the cache's
        strides and ``tensorwire.kv`` pairs rows across orders (more descriptors per block)."""
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        return REQUIRED_ORDER

    # --- worker side --------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, TensorwireConnectorMetadata):
            self._worker.start(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker.finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def get_kv_connector_stats(self) -> TensorwireKVConnectorStats | None:
        data = self._worker.stats.take() if self._worker is not None else None
        return None if data is None else TensorwireKVConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TensorwireKVConnectorStats:
        return TensorwireKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TensorwirePromMetrics:
        """The connector's Prometheus metrics on vLLM's ``/metrics`` (``stats.py`` lists them)."""
        return TensorwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # --- scheduler side -----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> TensorwireConnectorMetadata:
        return TensorwireConnectorMetadata(self._scheduler.build_plan())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)


def _job_can_seal() -> bool:
    """Whether handoffs are sealed (the job has a token); without one any client can name any blocks: said once."""
    try:
        tw.seal_for_job("tensorwire.integrations.vllm/probe", b"")
        return True
    except tw.AuthenticationError:
        log.warning("TensorwireConnector: no TENSORWIRE_JOB_TOKEN: handoffs are not sealed, so a client can make the "
                    "decode instance read any producer blocks it names (other users' KV); set the same token on "
                    "both instances")
        return False
