"""The connector's scheduler side (vLLM's EngineCore process): plans loads on the consumer, hands finished
prefills off on the producer. No tensorwire communication happens here: the plan travels to the workers in the
connector metadata, and everything that moves bytes runs there."""

from __future__ import annotations

import logging
from typing import Any

import tensorwire as tw

from .handoff import Handoff, Load, Plan
from .settings import Settings

__all__ = ["SchedulerSide"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines

# A prefill whose request ended this way holds the KV its consumer needs (a cut-off or aborted one does not).
_HANDED_OFF = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class SchedulerSide:
    """Hooks of ``KVConnectorBase_V1``'s scheduler role; ``layout`` is ``layout.fingerprint(vllm_config)``."""

    def __init__(self, settings: Settings, layout: str) -> None:
        self._settings = settings
        self._layout = layout
        self._plan = Plan()

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Consumer: every prompt token past ``num_computed_tokens`` comes from the producer, loaded
        asynchronously. Anything else: none."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Consumer: plan the load into the blocks just allocated for the external tokens (none on a full local
        prefix hit: the load then only tells the producer it may free its blocks). Only once per request."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        try:
            handoff = Handoff.from_params(params)
        except tw.InvalidArgumentError as e:
            log.warning("request %s: computed here, not loaded: %s", request.request_id, e)
            return
        local = tuple(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else ()
        self._plan.loads.append(Load(request.request_id, local, handoff))

    def build_plan(self) -> Plan:
        """This step's loads and holds for the workers; starts the next step's."""
        plan, self._plan = self._plan, Plan()
        return plan

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Producer: keep a finished prefill's blocks (delay_free) until its consumer read them, and hand the
        consumer what it needs in ``kv_transfer_params``. Consumer: a request that ended before its load was
        planned still tells the producer (a load of no blocks), so the producer's blocks are freed."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False
            try:
                self._plan.loads.append(Load(request.request_id, (), Handoff.from_params(params)))
            except tw.InvalidArgumentError:
                pass  # nothing names a producer to tell
            return False, None
        if not params.get("do_remote_decode") or request.status.name not in _HANDED_OFF or not block_ids:
            return False, None
        self._plan.holds[request.request_id] = self._settings.hold_s
        handoff = Handoff(self._settings.name, tuple(block_ids), request.request_id, request.num_computed_tokens,
                          self._layout)
        return True, handoff.to_params()
