"""What travels: the producer's ``kv_transfer_params`` (through the client, to the consumer's request), the
scheduler's per-step plan (to the workers, in the connector metadata) and the consumer's "read" message (to the
producer, as the notification of its READ).

``kv_transfer_params`` keys. The client asks a producer with ``{"do_remote_decode": True}``; the producer's output
carries ``{"do_remote_prefill": True, "remote_member": name, "remote_block_ids": [int], "remote_request_id": str,
"remote_num_tokens": int, "remote_layout": str}``, which the client passes to the consumer unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import tensorwire as tw

__all__ = ["Handoff", "Load", "Plan", "read_message", "parse_read_message"]

_READ_PREFIX = b"twvllm1 "  # the consumer read these requests' blocks (or needs none of them)


@dataclass(frozen=True)
class Handoff:
    """A producer's finished prefill, as the consumer receives it in ``kv_transfer_params``."""

    member: str  # the producer worker's member name (its tensor-parallel suffix left off)
    block_ids: tuple[int, ...]  # the producer's blocks holding the prompt's KV, in token order
    request_id: str  # the producer's request id (named in the read message)
    num_tokens: int  # prompt tokens whose KV the blocks hold
    layout: str  # the producer's ``layout.fingerprint``

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_member": self.member,
                "remote_block_ids": list(self.block_ids), "remote_request_id": self.request_id,
                "remote_num_tokens": self.num_tokens, "remote_layout": self.layout}

    @staticmethod
    def from_params(params: dict[str, Any]) -> Handoff:
        """Inverse of ``to_params``; a missing or mistyped key raises ``tw.InvalidArgumentError``."""
        try:
            handoff = Handoff(params["remote_member"], tuple(int(b) for b in params["remote_block_ids"]),
                              str(params["remote_request_id"]), int(params["remote_num_tokens"]),
                              params["remote_layout"])
        except (KeyError, TypeError, ValueError) as e:
            raise tw.InvalidArgumentError(
                f"TensorwireConnector: kv_transfer_params {params!r} lack or mistype {e}; pass the producer's "
                "output kv_transfer_params to the consumer unchanged") from None
        if not isinstance(handoff.member, str) or not isinstance(handoff.layout, str):
            raise tw.InvalidArgumentError(f"TensorwireConnector: kv_transfer_params {params!r} name no producer; "
                                          "pass the producer's output kv_transfer_params unchanged")
        return handoff


@dataclass(frozen=True)
class Load:
    """One consumer request's load: the producer's blocks ``handoff.block_ids`` into ours ``local_block_ids``
    (fewer when our prefix cache already holds the first blocks: then the producer's last ones are read)."""

    request_id: str
    local_block_ids: tuple[int, ...]
    handoff: Handoff

    def remote_block_ids(self) -> tuple[int, ...]:
        if not self.local_block_ids:
            return ()
        return self.handoff.block_ids[-len(self.local_block_ids):]


@dataclass
class Plan:
    """One engine step's work for the workers (the connector metadata's content)."""

    loads: list[Load] = field(default_factory=list)  # consumer: start these
    holds: dict[str, float] = field(default_factory=dict)  # producer: request id -> seconds to keep its blocks


def read_message(producer_request_ids: list[str]) -> bytes:
    """The notification of a consumer's READ: the producer may free these requests' blocks."""
    return _READ_PREFIX + json.dumps(producer_request_ids).encode()


def parse_read_message(message: bytes) -> list[str] | None:
    """The request ids of a ``read_message``, or None for a message that is not one."""
    if not message.startswith(_READ_PREFIX):
        return None
    try:
        ids = json.loads(message[len(_READ_PREFIX):])
    except ValueError:
        return None
    return [str(i) for i in ids] if isinstance(ids, list) else None
