"""What travels: the producer's ``kv_transfer_params`` (through the client, to the consumer's request), the
scheduler's per-step plan (to the workers, in the connector metadata) and the consumer's "read" message (to the
producer, as the notification of its READ).

``kv_transfer_params`` keys. The client asks a producer with ``{"do_remote_decode": True}``; the producer's output
carries ``{"do_remote_prefill": True, "remote_member": name, "remote_block_ids": [int], "remote_request_id": str,
"remote_num_tokens": int, "remote_layout": str, "remote_expires_at": float, "remote_seal": str}``, which the
client passes to the consumer unchanged. ``remote_seal`` (where the job has a token) is every other field sealed
with the job token plus the prompt's hash and the issue time: the consumer believes only what it opens.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import tensorwire as tw

__all__ = ["Handoff", "Load", "Plan", "prompt_hash", "read_message", "parse_read_message", "SEAL_CONTEXT"]

SEAL_CONTEXT = "tensorwire.integrations.vllm/handoff/v1"  # what a sealed handoff is, for open_for_job
_READ_PREFIX = b"twvllm1 "  # the consumer read these requests' blocks (or needs none of them)


@dataclass(frozen=True)
class Handoff:
    """A producer's finished prefill, as the consumer receives it in ``kv_transfer_params`` (checked and verified
    by ``params.check_params``): the values here are the ones the producer sealed."""

    member: str  # the producer worker's member name (its tensor-parallel suffix left off)
    block_ids: tuple[int, ...]  # the producer's blocks holding the prompt's KV, in token order
    request_id: str  # the producer's request id (named in the read message)
    num_tokens: int  # prompt tokens whose KV the blocks hold
    layout: str  # the producer's ``layout.fingerprint``
    prompt_hash: str = ""  # ``prompt_hash`` of those tokens
    issued_at: float = 0.0  # the producer's wall clock when it handed the prefill off
    expires_at: float = 0.0  # after this the producer may have freed the blocks (``hold_s`` after issue)

    def sealed_fields(self) -> dict[str, Any]:
        return {"member": self.member, "block_ids": list(self.block_ids), "request_id": self.request_id,
                "num_tokens": self.num_tokens, "layout": self.layout, "prompt_hash": self.prompt_hash,
                "issued_at": self.issued_at, "expires_at": self.expires_at}

    def to_params(self, sealed: bool) -> dict[str, Any]:
        """The producer's ``kv_transfer_params``; ``sealed``: with ``remote_seal``, the handoff sealed with the
        job token (what the consumer believes; the other keys are for people reading them)."""
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_member": self.member,
                  "remote_block_ids": list(self.block_ids), "remote_request_id": self.request_id,
                  "remote_num_tokens": self.num_tokens, "remote_layout": self.layout,
                  "remote_expires_at": self.expires_at}
        if sealed:
            blob = tw.seal_for_job(SEAL_CONTEXT, json.dumps(self.sealed_fields()).encode())
            params["remote_seal"] = base64.urlsafe_b64encode(blob).decode()
        return params


def prompt_hash(token_ids: Any) -> str:
    """What binds a handoff to its prompt: SHA-256 of the token ids."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


@dataclass(frozen=True)
class Load:
    """One consumer request's load: the producer's blocks ``handoff.block_ids`` into ours ``local_block_ids``
    (fewer when our prefix cache already holds the first blocks: then the producer's last ones are read)."""

    request_id: str
    local_block_ids: tuple[int, ...]
    handoff: Handoff | None  # None for a refused one
    refusal: str = ""  # why the request's kv_transfer_params were refused ("" for a load): it fails at once

    def remote_block_ids(self) -> tuple[int, ...]:
        if not self.local_block_ids:
            return ()
        return self.handoff.block_ids[-len(self.local_block_ids):]


@dataclass
class Plan:
    """One engine step's work for the workers (the connector metadata's content)."""

    loads: list[Load] = field(default_factory=list)  # consumer: start these
    holds: dict[str, float] = field(default_factory=dict)  # producer: request id -> seconds to keep its blocks
    refused: list[str] = field(default_factory=list)  # reasons of handoffs refused and recomputed (for the stats)


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
