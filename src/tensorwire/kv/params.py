"""The checks of a consumer request's handoff params (``Handoff.to_params``): everything in them comes from the
client.

``check_params`` runs where the engine first hands the params over (vLLM: ``get_num_new_matched_tokens``), before the
scheduler is told to wait for a load: a value of the wrong type, out of range, inconsistent with the prompt or the block
sizes (one must divide the other), of another layout, or a handoff that does not open with the job token, was altered,
was issued for another prompt or has expired raises ``HandoffRefused`` naming the field, the value and the reason (a
short word for the stats). Nothing else escapes: the hooks turn a refusal into a recompute or a failed request.

What the consumer then uses is the sealed handoff, never the plaintext fields: those only have to agree with it.
Replays (one handoff used twice, by this consumer or another one) are refused by the producer, which grants each
handoff to one claim (``producer.py``).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import tensorwire as tw

from .handoff import SEAL_CONTEXT, Handoff, prompt_hash
from .shapes import MAX_BLOCK_RATIO, MAX_BLOCK_SIZE

__all__ = ["HandoffRefused", "check_params", "MAX_BLOCK_ID", "EXPIRY_MARGIN_S"]

MAX_BLOCK_ID = 2**31 - 1  # no engine has more blocks; ids past it are refused before any arithmetic
MAX_TP_SIZE = 4096  # tensor-parallel sizes past it are refused before any arithmetic
_MAX_NAME_CHARS = 256
_MAX_SEAL_CHARS = 1 << 20  # a sealed handoff of 2 k blocks is ~20 KiB
# A handoff this close to its expiry is refused: the producer frees the blocks at expiry (and reuses them), and
# the READ comes a few engine steps after the check.
EXPIRY_MARGIN_S = 5.0


class HandoffRefused(tw.InvalidArgumentError):
    """A request's ``kv_transfer_params`` that are not used; ``reason`` is a short word for the stats
    (``params``, ``layout``, ``prompt``, ``forged``, ``altered``, ``expired``, ``replayed``, ``role``)."""

    def __init__(self, reason: str, field: str, value: Any, why: str) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        super().__init__(f"KV handoff: kv_transfer_params {field}={shown} refused ({reason}): {why}")
        self.reason, self.field = reason, field


def _string(params: dict, field: str, limit: int = _MAX_NAME_CHARS) -> str:
    value = params.get(field)
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise HandoffRefused("params", field, value, f"give the producer's value, a printable string of 1 to {limit} "
                                                     "characters")
    return value


def _integer(params: dict, field: str, low: int, high: int) -> int:
    value = params.get(field)
    # bool is an int to Python, and a float (1e400, 2.5) must not be truncated into a plausible count.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HandoffRefused("params", field, value, f"give an integer in [{low}, {high}]")
    return value


def _block_ids(params: dict, count: int) -> tuple[int, ...]:
    value = params.get("remote_block_ids")
    if not isinstance(value, list) or len(value) != count:
        raise HandoffRefused("params", "remote_block_ids", value,
                             f"give the producer's list of {count} block ids (one per block of the prompt)")
    for block in value:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block <= MAX_BLOCK_ID:
            raise HandoffRefused("params", "remote_block_ids", value,
                                 f"block id {block!r} is not an integer in [0, {MAX_BLOCK_ID}]")
    if len(set(value)) != len(value):
        raise HandoffRefused("params", "remote_block_ids", value, "a block id repeats")
    return tuple(value)


def _plaintext(params: dict, prompt_token_ids: list[int], block_size: int, layout: str) -> Handoff:
    """The handoff the plaintext fields describe, checked field by field against the prompt and this engine."""
    if params.get("do_remote_prefill") is not True:
        raise HandoffRefused("params", "do_remote_prefill", params.get("do_remote_prefill"), "give true")
    member = _string(params, "remote_member")
    request_id = _string(params, "remote_request_id")
    their_layout = _string(params, "remote_layout", 4096)
    if their_layout != layout:
        raise HandoffRefused("layout", "remote_layout", their_layout,
                             f"this consumer serves {layout!r}; start both instances with the same model and KV "
                             "dtype")
    num_tokens = _integer(params, "remote_num_tokens", 1, max(len(prompt_token_ids), 1))
    if num_tokens != len(prompt_token_ids):
        raise HandoffRefused("prompt", "remote_num_tokens", num_tokens,
                             f"this request's prompt has {len(prompt_token_ids)} tokens; send the same prompt to both")
    their_block_size = _integer(params, "remote_block_size", 1, MAX_BLOCK_SIZE)
    small, large = sorted((their_block_size, block_size))
    if large % small or large // small > MAX_BLOCK_RATIO:
        raise HandoffRefused("layout", "remote_block_size", their_block_size,
                             f"this consumer's blocks hold {block_size} tokens: neither size divides the other, or "
                             f"one is over {MAX_BLOCK_RATIO} times the other; start the engines with block sizes "
                             "where one is a small multiple of the other")
    blocks = _block_ids(params, math.ceil(num_tokens / their_block_size))
    producer_tp = _integer(params, "remote_tp_size", 1, MAX_TP_SIZE) if "remote_tp_size" in params else 1
    expires_at, issued_at = _time(params, "remote_expires_at"), _time(params, "remote_issued_at")
    return Handoff(member, blocks, request_id, num_tokens, layout, prompt_hash(prompt_token_ids), issued_at,
                   expires_at, producer_tp, block_size=their_block_size)


def _time(params: dict, field: str) -> float:
    value = params.get(field, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HandoffRefused("params", field, value, "give the producer's value, a finite number")
    return float(value)


def _opened(params: dict) -> dict[str, Any]:
    """The sealed handoff's fields; ``HandoffRefused("forged")`` for a seal that does not open."""
    seal = params.get("remote_seal")
    if not isinstance(seal, str) or not seal or len(seal) > _MAX_SEAL_CHARS:
        raise HandoffRefused("forged", "remote_seal", seal, "this job seals every handoff: pass the producer's "
                                                            "kv_transfer_params unchanged")
    try:
        fields = json.loads(tw.open_for_job(SEAL_CONTEXT, base64.urlsafe_b64decode(seal.encode("ascii"))))
    except (binascii.Error, UnicodeError, ValueError, tw.AuthenticationError) as e:
        raise HandoffRefused("forged", "remote_seal", seal, f"it does not open with this job's token ({e})") from None
    if not isinstance(fields, dict):
        raise HandoffRefused("forged", "remote_seal", seal, "it opens to no handoff")
    return fields


def check_params(params: Any, prompt_token_ids: list[int], block_size: int, layout: str, *, sealed: bool,
                 now: float) -> Handoff:
    """The handoff of a consumer request's ``kv_transfer_params``, checked against its prompt (token ids), this
    engine's ``block_size`` (the producer's, ``remote_block_size``, may differ where one divides the other) and
    ``layout``, and (``sealed``: the job has a token) verified: the sealed handoff
    opens, agrees with every plaintext field, was issued for this prompt and has not expired at ``now`` (wall
    clock). Raises ``HandoffRefused``; nothing else. No I/O (the job token is read from the environment)."""
    if not isinstance(params, dict):
        raise HandoffRefused("params", "kv_transfer_params", params, "give a JSON object")
    claimed = _plaintext(params, prompt_token_ids, block_size, layout)
    if not sealed:
        if claimed.expires_at and claimed.expires_at <= now + EXPIRY_MARGIN_S:
            raise HandoffRefused("expired", "remote_expires_at", claimed.expires_at, "the producer may have freed "
                                 "these blocks; send the prompt to the producer again")
        return claimed
    fields = _opened(params)
    for field, value in claimed.sealed_fields().items():
        if field == "issued_at" or fields.get(field) == value:
            continue
        if field == "prompt_hash":
            raise HandoffRefused("prompt", "prompt_token_ids", f"{len(prompt_token_ids)} tokens", "the producer "
                                 "handed this prefill off for another prompt; send the same prompt to both")
        raise HandoffRefused("altered", f"remote_{field}", value, f"the producer sealed {fields.get(field)!r}: the "
                             "params were altered; pass the producer's kv_transfer_params unchanged")
    issued_at = fields.get("issued_at")
    if isinstance(issued_at, bool) or not isinstance(issued_at, (int, float)):
        raise HandoffRefused("forged", "remote_seal", params.get("remote_seal"), "the sealed handoff has no issue time")
    if claimed.expires_at <= now + EXPIRY_MARGIN_S:
        raise HandoffRefused("expired", "remote_expires_at", claimed.expires_at,
                             f"it expires {claimed.expires_at - now:.1f}s from now (less than {EXPIRY_MARGIN_S:g}s "
                             "left): the producer may free its blocks before they are read; send the prompt to the "
                             "producer again")
    return Handoff(**{**claimed.sealed_fields(), "block_ids": claimed.block_ids, "issued_at": float(issued_at)})
