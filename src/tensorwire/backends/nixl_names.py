"""NIXL agent names that prove their rank: ``tw<rank>-<nonce>-<tag>``, ``tag = HMAC-SHA256(token, label | rank |
nonce)`` truncated to 128 bits (see ``backends/nixl.py``: who may load metadata and send notifications).
Pure functions."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

__all__ = ["agent_name", "member_rank"]

_NAME_LABEL = b"tensorwire nixl agent/"
_NAME = re.compile(r"tw(\d{1,9})-([0-9a-f]{16})(?:-([0-9a-f]{32}))?")


def _tag(token: bytes, rank: int, nonce: str) -> str:
    return hmac.new(token, _NAME_LABEL + f"{rank}/{nonce}".encode(), hashlib.sha256).hexdigest()[:32]


def agent_name(rank: int, token: bytes | None) -> str:
    """A fresh agent name for ``rank``: unguessable, and with ``token`` a proof that its maker holds the token."""
    nonce = secrets.token_hex(8)
    return f"tw{rank}-{nonce}" + (f"-{_tag(token, rank, nonce)}" if token is not None else "")


def member_rank(name: str | bytes, token: bytes | None) -> int | None:
    """The rank an agent name proves (with ``token``: its tag verifies), or None for a name no member makes."""
    try:
        name = name.decode() if isinstance(name, bytes) else name
    except UnicodeDecodeError:
        return None
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    rank, nonce, tag = int(match[1]), match[2], match[3]
    if token is None:
        return rank if tag is None else None
    if tag is None or not hmac.compare_digest(tag, _tag(token, rank, nonce)):
        return None
    return rank
