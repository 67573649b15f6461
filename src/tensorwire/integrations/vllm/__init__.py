"""tensorwire as a vLLM KV connector: prefill and decode instances of vLLM exchange KV-cache blocks through a
tensorwire fleet (``tensorwire directory``), one block request per load.

    KVTransferConfig(kv_connector="TensorwireConnector", kv_connector_module_path="tensorwire.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={"directory": "tcp://HOST:PORT", "name": "prefill-0"})

``TensorwireConnector`` (connector.py) is what vLLM loads; it imports vLLM, so it is imported on first use of the
name: ``settings`` / ``plan`` / ``layout`` (plain values) can be used without vLLM installed. Everything that is
not vLLM's (handoffs, their checks and single use, holds, loads, heterogeneous TP) is ``tensorwire.kv``.
Modules: settings.py (kv_connector_extra_config), plan.py (the scheduler's per-step plan for the workers),
layout.py (the KV cache as block views, the fingerprint both sides compare, the heads' sharding), scheduler.py
(the scheduler-side hooks: vLLM's request states), worker.py (the worker-side hooks), stats.py
(``get_kv_connector_stats``), connector.py (the ``KVConnectorBase_V1``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TensorwireConnector"]


def __getattr__(name: str) -> Any:
    if name == "TensorwireConnector":
        from .connector import TensorwireConnector

        return TensorwireConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
