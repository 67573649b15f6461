"""The connector's settings: ``kv_connector_extra_config`` checked once, at construction.

Keys (all optional): ``directory`` (``tcp://HOST:PORT`` of a ``tensorwire directory``, or ``etcd://...``; default
``TENSORWIRE_DIRECTORY``), ``name`` (this instance's member name; default ``TENSORWIRE_NAME``, else
``vllm-<engine id>``; a tensor-parallel worker appends ``-tp<rank>``), ``timeout_s`` (bound of one load's READ and
of joining the fleet; default 30), ``contact_s`` (bound of finding a producer that is not known yet or has left:
its loads fail after it, others' loads go on meanwhile; default 5), ``hold_s`` (how long a producer keeps blocks
nobody read, and how long its handoff is good for: a consumer refuses one within 5 s of expiry; default 120, as
vLLM's NixlConnector holds them until ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import tensorwire as tw
from tensorwire.kv import member_name

__all__ = ["Settings"]

_KEYS = ("directory", "name", "timeout_s", "contact_s", "hold_s")


@dataclass(frozen=True)
class Settings:
    directory: str | None
    name: str
    timeout_s: float
    hold_s: float
    contact_s: float = 5.0

    @staticmethod
    def from_extra_config(extra: dict[str, Any] | None, engine_id: str | None,
                          environment: tuple[str | None, str | None] | None = None) -> Settings:
        """``extra``: ``kv_connector_extra_config``; ``environment``: ``tw.fleet_from_environment()`` (the
        defaults of directory and name). Raises ``tw.InvalidArgumentError`` naming the key and the fix."""
        env_directory, env_name = environment or (None, None)
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS) - {"num_threads"})  # num_threads: NixlConnector's, harmless
        if unknown:
            raise tw.InvalidArgumentError(f"TensorwireConnector: unknown kv_connector_extra_config keys {unknown}; "
                                          f"the keys are {list(_KEYS)}")
        directory = extra.get("directory") or env_directory
        if directory is not None and (not isinstance(directory, str) or "://" not in directory):
            raise tw.InvalidArgumentError(f"TensorwireConnector: directory={directory!r}; give 'tcp://HOST:PORT' (a "
                                          "`tensorwire directory`) or 'etcd://HOST:PORT[,...]'")
        name = extra.get("name") or env_name or f"vllm-{engine_id or 'engine'}"
        if not isinstance(name, str):
            raise tw.InvalidArgumentError(f"TensorwireConnector: name={name!r}; give this instance's member name")
        return Settings(directory, name, _seconds(extra, "timeout_s", 30.0), _seconds(extra, "hold_s", 120.0),
                        _seconds(extra, "contact_s", 5.0))

    def member_name(self, tp_rank: int, tp_size: int) -> str:
        """This worker's name in the fleet: one member per tensor-parallel rank."""
        return member_name(self.name, tp_rank, tp_size)


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise tw.InvalidArgumentError(f"TensorwireConnector: {key}={value!r}; give a positive number of seconds")
    return float(value)
