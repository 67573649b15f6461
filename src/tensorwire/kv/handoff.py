"""What travels between a producer (prefill) and a consumer (decode) engine: the handoff, through the client.

A ``Handoff`` is what a producer instance holds for one request: its member name, tensor-parallel size, block ids
and block size, request id, prompt length and hash, the layout fingerprint, issue and expiry times. Its client form
(``to_params``) is a dict of ``remote_*`` keys plus ``remote_seal``: every field sealed with the job token under
one versioned KV wire tag (``SEAL_CONTEXT``). The consumer believes only what it opens (``params.check_params``).

``Load`` is one consumer request's load of a handoff into its own blocks, with the consumer's ``claim``: a random
value made once per load by whoever plans it (a scheduler), the same at every consumer rank. The producer grants a
handoff to the first claim it sees and refuses every other one (``producer.py``): a second consumer, or the same one
restarted, cannot read it again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import tensorwire as tw

__all__ = ["Handoff", "Load", "SEAL_CONTEXT", "WIRE_VERSION", "prompt_hash", "new_claim", "member_name"]

# The one version of everything tensorwire.kv puts on a wire (the sealed handoff, the claim/grant/done channels):
# engines of two versions refuse each other's handoffs instead of misreading them.
WIRE_VERSION = 3
SEAL_CONTEXT = f"tensorwire.kv/handoff/v{WIRE_VERSION}"  # what a sealed handoff is, and its version


@dataclass(frozen=True)
class Handoff:
    """A producer's finished prefill, as the consumer receives it (checked and opened by ``params.check_params``)."""

    member: str  # the producer instance's name (``member_name`` adds each tensor-parallel rank's suffix)
    block_ids: tuple[int, ...]  # the producer's blocks holding the prompt's KV, in token order
    request_id: str  # the producer's request id (named in the claim and the read messages)
    num_tokens: int  # prompt tokens whose KV the blocks hold
    layout: str  # the producer's layout fingerprint (model, KV heads, dtype; not its TP or block size)
    prompt_hash: str = ""  # ``prompt_hash`` of those tokens
    issued_at: float = 0.0  # the producer's wall clock when it handed the prefill off
    expires_at: float = 0.0  # after this the producer frees the blocks (its ``hold_s`` after issue)
    producer_tp: int = 1  # the producer instance's tensor-parallel size: which members hold the heads
    block_size: int = field(kw_only=True)  # tokens per producer block: block_ids has ceil(num_tokens / it)

    def sealed_fields(self) -> dict[str, Any]:
        return {"member": self.member, "block_ids": list(self.block_ids), "request_id": self.request_id,
                "num_tokens": self.num_tokens, "layout": self.layout, "prompt_hash": self.prompt_hash,
                "issued_at": self.issued_at, "expires_at": self.expires_at, "producer_tp": self.producer_tp,
                "block_size": self.block_size}

    def to_params(self, sealed: bool) -> dict[str, Any]:
        """The client form (an engine's ``kv_transfer_params``); ``sealed``: with ``remote_seal``, the handoff
        sealed with the job token (what the consumer believes; the other keys are for people reading them)."""
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_member": self.member,
                  "remote_block_ids": list(self.block_ids), "remote_request_id": self.request_id,
                  "remote_num_tokens": self.num_tokens, "remote_layout": self.layout,
                  "remote_expires_at": self.expires_at, "remote_issued_at": self.issued_at,
                  "remote_tp_size": self.producer_tp, "remote_block_size": self.block_size}
        if sealed:
            blob = tw.seal_for_job(SEAL_CONTEXT, json.dumps(self.sealed_fields()).encode())
            params["remote_seal"] = base64.urlsafe_b64encode(blob).decode()
        return params


def prompt_hash(token_ids: Any) -> str:
    """What binds a handoff to its prompt: SHA-256 of the token ids."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


def new_claim() -> str:
    """A consumer's claim on one handoff: 128 random bits, made once per load and given to every consumer rank."""
    return secrets.token_hex(16)


def member_name(instance: str, tp_rank: int, tp_size: int) -> str:
    """A tensor-parallel rank's member name in the fleet: the instance's own name at TP 1."""
    return instance if tp_size == 1 else f"{instance}-tp{tp_rank}"


@dataclass(frozen=True)
class Load:
    """One consumer request's load: the producer's blocks ``handoff.block_ids`` into ours ``local_block_ids``
    (fewer when our prefix cache already holds the first blocks: then the producer's last ones are read; none:
    the load only releases the producer's blocks). ``claim``: ``new_claim()``, the same at every consumer rank."""

    request_id: str
    local_block_ids: tuple[int, ...]
    handoff: Handoff | None  # None for a refused one
    refusal: str = ""  # why the request's params were refused ("" for a load): it fails at once
    claim: str = ""

    def remote_block_ids(self) -> tuple[int, ...]:
        if not self.local_block_ids:
            return ()
        return self.handoff.block_ids[-len(self.local_block_ids):]
