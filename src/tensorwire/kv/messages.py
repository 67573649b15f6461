"""The messages between a consumer rank and a producer rank, on two communicator channels: ``TO_PRODUCER``
(claims, dones) and ``TO_CONSUMER`` (grants), so an engine that is both reads each where it belongs.

    consumer rank d -> producer rank p   CLAIM  {ticket, requests: [[request id, issued_at, claim], ...], read: bool,
                                                  consumer_tp: D, consumer_rank: d, lease_s: its READ's bound}
    producer rank p -> consumer rank d   GRANT  {ticket (the claim's), order: "HND" | "NHD",
                                                  verdicts: {request id: "granted" | "taken" | "spent" | "unknown"}}
    consumer rank d -> producer rank p   DONE   {requests: [[request id, claim], ...], consumer_rank: d}
                                                  (sent once its READs completed: never before a retried one)

A CLAIM with ``read`` false is a release (a rank the head map does not read from this producer rank, or a load
that needs no blocks): it counts as that consumer rank's DONE at once. Every message comes from a member of the
job (the channel is authenticated), but a bug or an old version there must not break the producer: ``parse``
returns None for anything malformed, and sizes are bounded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .handoff import WIRE_VERSION
from .shapes import ORDERS

__all__ = ["TO_PRODUCER", "TO_CONSUMER", "Claim", "Grant", "Done", "parse", "MAX_REQUESTS"]

# The channels of KV handoffs (the wire version is in the names; neither is a prefix of the other).
TO_PRODUCER = b"twkv%dp" % WIRE_VERSION
TO_CONSUMER = b"twkv%dc" % WIRE_VERSION
MAX_REQUESTS = 4096  # requests one message names at most (one engine step's loads from one producer)
_MAX_BYTES = 1 << 20
_MAX_ID_CHARS = 256
VERDICTS = ("granted", "taken", "spent", "unknown")


@dataclass(frozen=True)
class Claim:
    ticket: str  # echoed by the grant: a late grant of an earlier claim is not taken for this one's
    requests: tuple[tuple[str, float, str], ...]  # (producer request id, its issue time, the consumer's claim)
    read: bool  # False: a release, counted as done at once
    consumer_tp: int
    consumer_rank: int
    lease_s: float = 60.0  # how long after the grant its READ may still run (the producer keeps the blocks)

    def encode(self) -> bytes:
        return _encode(TO_PRODUCER, "claim", {"ticket": self.ticket, "requests": [list(r) for r in self.requests],
                                              "read": self.read, "consumer_tp": self.consumer_tp,
                                              "consumer_rank": self.consumer_rank, "lease_s": self.lease_s})


@dataclass(frozen=True)
class Grant:
    ticket: str
    verdicts: dict[str, str]  # producer request id -> one of VERDICTS
    order: str  # the producer rank's blocks' order of rows (``shapes.ORDERS``: "HND" heads outermost, or "NHD")

    def encode(self) -> bytes:
        return _encode(TO_CONSUMER, "grant", {"ticket": self.ticket, "verdicts": self.verdicts, "order": self.order})


@dataclass(frozen=True)
class Done:
    requests: tuple[tuple[str, str], ...]  # (producer request id, the consumer's claim)
    consumer_rank: int

    def encode(self) -> bytes:
        return _encode(TO_PRODUCER, "done", {"requests": [list(r) for r in self.requests],
                                             "consumer_rank": self.consumer_rank})


def _encode(channel: bytes, kind: str, body: dict[str, Any]) -> bytes:
    return channel + b" " + json.dumps({"kind": kind, **body}, separators=(",", ":")).encode()


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _MAX_ID_CHARS


def _count(value: Any, low: int, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= high


def _seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value <= 3600


def _requests(value: Any, width: int) -> list | None:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_REQUESTS:
        return None
    if not all(isinstance(r, list) and len(r) == width for r in value):
        return None
    return value


def _claim(body: dict) -> Claim | None:
    requests = _requests(body.get("requests"), 3)
    if requests is None or not _text(body.get("ticket")) or not isinstance(body.get("read"), bool):
        return None
    if not _count(body.get("consumer_tp"), 1, 4096):
        return None
    if not _count(body.get("consumer_rank"), 0, body["consumer_tp"] - 1) or not _seconds(body.get("lease_s")):
        return None
    for request_id, issued_at, claim in requests:
        if not (_text(request_id) and _text(claim) and not isinstance(issued_at, bool)
                and isinstance(issued_at, (int, float)) and math.isfinite(issued_at)):
            return None
    return Claim(body["ticket"], tuple((r, float(t), c) for r, t, c in requests), body["read"], body["consumer_tp"],
                 body["consumer_rank"], float(body["lease_s"]))


def _grant(body: dict) -> Grant | None:
    verdicts = body.get("verdicts")
    if not _text(body.get("ticket")) or not isinstance(verdicts, dict) or len(verdicts) > MAX_REQUESTS:
        return None
    if body.get("order") not in ORDERS:
        return None
    if not all(_text(k) and v in VERDICTS for k, v in verdicts.items()):
        return None
    return Grant(body["ticket"], dict(verdicts), body["order"])


def _done(body: dict) -> Done | None:
    requests = _requests(body.get("requests"), 2)
    if requests is None or not _count(body.get("consumer_rank"), 0, 4095):
        return None
    if not all(_text(r) and _text(c) for r, c in requests):
        return None
    return Done(tuple((r, c) for r, c in requests), body["consumer_rank"])


_PARSERS = {"claim": _claim, "grant": _grant, "done": _done}


def parse(message: bytes) -> Claim | Grant | Done | None:
    """The message, or None for one that is not a well-formed KV message of this version."""
    channel = TO_PRODUCER if message.startswith(TO_PRODUCER + b" ") else TO_CONSUMER
    if not message.startswith(channel + b" ") or len(message) > _MAX_BYTES:
        return None
    try:
        body = json.loads(message[len(channel) + 1:])
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        return None
    kind = body.get("kind") if isinstance(body, dict) else None
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    return parser(body) if parser is not None else None
