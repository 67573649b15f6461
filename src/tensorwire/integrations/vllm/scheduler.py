"""The connector's scheduler side (vLLM's EngineCore process): checks and plans loads on the consumer, hands
finished prefills off (sealed) on the producer. No tensorwire communication happens here: the plan travels to the
workers in the connector metadata, and everything that moves bytes runs there.

An exception raised from these hooks is fatal to vLLM's EngineCore, and a request told to wait for a load that
is never reported stays parked for ever with its blocks held: so each hook catches everything, and a request's
``kv_transfer_params`` are judged once, in ``num_new_matched_tokens``, before vLLM is told "async". A refused one
is recomputed here (``kv_load_failure_policy="recompute"``) or planned as a load that fails at once (``"fail"``).
Each load carries a claim made here, once for all workers: the producer grants a handoff to one claim, so a
replayed request (here or at another consumer, or after a restart) fails its load instead of reading reused blocks.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from tensorwire.kv import Handoff, HandoffRefused, Load, check_params, new_claim, prompt_hash

from .plan import Plan
from .settings import Settings

__all__ = ["SchedulerSide"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines

# A prefill whose request ended this way holds the KV its consumer needs (a cut-off or aborted one does not).
_HANDED_OFF = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class SchedulerSide:
    """Hooks of ``KVConnectorBase_V1``'s scheduler role. ``layout``: ``layout.fingerprint(vllm_config)``; ``role``:
    ``kv_producer`` / ``kv_consumer`` / ``kv_both``; ``policy``: ``kv_load_failure_policy``; ``sealed``: the job
    has a token (handoffs are sealed by producers and must open at consumers); ``tp_size``: this engine's tensor
    parallelism (named in its handoffs)."""

    def __init__(self, settings: Settings, layout: str, *, role: str = "kv_both", block_size: int = 16,
                 policy: str = "fail", sealed: bool = False, tp_size: int = 1) -> None:
        self._settings, self._layout, self._role = settings, layout, role
        self._block_size, self._policy, self._sealed, self._tp_size = block_size, policy, sealed, tp_size
        self._plan = Plan()
        self._verdicts: dict[str, Handoff | HandoffRefused] = {}  # request id -> its judged params, until alloc

    # --- consumer -------------------------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Consumer: every prompt token past ``num_computed_tokens`` comes from the producer, loaded
        asynchronously, if the request's handoff passes ``check_params``. Anything else: none. Never raises."""
        try:
            params = request.kv_transfer_params
            if not params or not isinstance(params, dict) or params.get("do_remote_prefill") in (None, False):
                return 0, False
            verdict = self._verdicts.get(request.request_id)
            if verdict is None:
                verdict = self._verdicts[request.request_id] = self._judge(request, params)
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count <= 0 or (isinstance(verdict, HandoffRefused) and (self._policy != "fail"
                                                                       or verdict.reason == "role")):
                # A producer sent decode params is served like any request: under "fail" vLLM would answer 500,
                # and no connector hook runs where a 4xx could be answered (vLLM's API server).
                return 0, False
            return count, True  # a refused one under "fail": after_alloc plans a load that fails at once
        except Exception:
            log.exception("TensorwireConnector: request %s: judging kv_transfer_params failed; computed here",
                          getattr(request, "request_id", "?"))
            return 0, False

    def _judge(self, request: Any, params: dict) -> Handoff | HandoffRefused:
        """The request's handoff, or why it is refused (logged once, counted in the stats)."""
        try:
            if self._role == "kv_producer":
                raise HandoffRefused("role", "do_remote_prefill", params.get("do_remote_prefill"),
                                     "this instance is a producer (kv_role='kv_producer') and loads nothing; send "
                                     "the producer's output params to the decode instance")
            handoff = check_params(params, list(request.prompt_token_ids or ()), self._block_size, self._layout,
                                   sealed=self._sealed, now=time.time())
            if handoff.member == self._settings.name:
                raise HandoffRefused("params", "remote_member", handoff.member, "it names this consumer itself")
            return handoff
        except HandoffRefused as refused:
            what = "failed (kv_load_failure_policy='fail')" if self._policy == "fail" else "computed here"
            log.warning("request %s: %s; %s", request.request_id, refused, what)
            self._plan.refused.append(refused.reason)
            return refused

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Consumer: plan the load into the blocks just allocated for the external tokens (none on a full local
        prefix hit: the load then only tells the producer it may free its blocks). Only once per request."""
        try:
            verdict = self._verdicts.pop(request.request_id, None)
            if verdict is None:
                return
            request.kv_transfer_params["do_remote_prefill"] = False  # judged and planned: never again
            local = tuple(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else ()
            needed = math.ceil(verdict.num_tokens / self._block_size) if isinstance(verdict, Handoff) else 0
            if isinstance(verdict, Handoff) and len(local) > needed:
                log.warning("TensorwireConnector: request %s: %d blocks allocated for %d tokens (%d blocks) handed "
                            "off; failed", request.request_id, len(local), verdict.num_tokens, needed)
                verdict = HandoffRefused("params", "remote_block_ids", list(verdict.block_ids), "too few blocks")
            if isinstance(verdict, HandoffRefused):
                if local:
                    self._plan.loads.append(Load(request.request_id, local, None, verdict.reason))
                return
            self._plan.loads.append(Load(request.request_id, local, verdict, claim=new_claim()))
        except Exception:
            log.exception("TensorwireConnector: request %s: planning its load failed", request.request_id)

    def build_plan(self) -> Plan:
        """This step's loads and holds for the workers; starts the next step's."""
        plan, self._plan = self._plan, Plan()
        return plan

    # --- both -----------------------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Producer: keep a finished prefill's blocks (delay_free) until its consumer read them, and hand the
        consumer the sealed handoff in ``kv_transfer_params``. Consumer: a verified request that ended before its
        load was planned still tells the producer (a load of no blocks), so the producer's blocks are freed.
        Never raises."""
        try:
            return self._finished(request, block_ids)
        except Exception:
            log.exception("TensorwireConnector: request %s: finishing it failed; its blocks are freed",
                          getattr(request, "request_id", "?"))
            return False, None

    def _finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        verdict = self._verdicts.pop(request.request_id, None)
        if not params or not isinstance(params, dict):
            return False, None
        if params.get("do_remote_prefill") not in (None, False):
            if verdict is None and self._role != "kv_producer":
                verdict = self._unjudged(request, params)  # aborted before the scheduler looked at it
            params["do_remote_prefill"] = False
            if isinstance(verdict, Handoff):
                self._plan.loads.append(Load(request.request_id, (), verdict, claim=new_claim()))
            return False, None
        if (self._role == "kv_consumer" or params.get("do_remote_decode") is not True
                or request.status.name not in _HANDED_OFF or not block_ids):
            return False, None
        handoff = self._handoff(request, block_ids)
        if handoff is None:
            return False, None
        self._plan.holds.append(handoff)
        return True, handoff.to_params(self._sealed)

    def _unjudged(self, request: Any, params: dict) -> Handoff | None:
        """The handoff of a request that ended before its params were judged (aborted while waiting), so that the
        producer frees its blocks now rather than at expiry; None (quietly: nothing is loaded) if they fail."""
        try:
            return check_params(params, list(request.prompt_token_ids or ()), self._block_size, self._layout,
                                sealed=self._sealed, now=time.time())
        except HandoffRefused:
            return None

    def _handoff(self, request: Any, block_ids: list[int]) -> Handoff | None:
        """What the producer computed for the request: its prompt's tokens (not the sampled one) and their blocks."""
        prompt = list(request.prompt_token_ids or ())
        num_tokens = min(request.num_computed_tokens, len(prompt))
        blocks = tuple(block_ids[:math.ceil(num_tokens / self._block_size)])
        if num_tokens <= 0 or len(blocks) * self._block_size < num_tokens:
            return None
        now = time.time()
        return Handoff(self._settings.name, blocks, request.request_id, num_tokens, self._layout,
                       prompt_hash(prompt[:num_tokens]), now, now + self._settings.hold_s, self._tp_size,
                       block_size=self._block_size)
