"""Values sealed with the job token: what tensorwire puts in the store, bound to the key it is stored under.

``b"TWA" | version u8 | HMAC-SHA256(token, key length u32 | key | value) | value``. ``unseal`` refuses, with
``AuthenticationError`` naming the key and the fix, a value that does not verify; without a token (an
unauthenticated job) values are stored and read as they are. Pure functions: no store, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from .errors import AuthenticationError

__all__ = ["seal", "unseal"]

_SEAL_MAGIC = b"TWA"
_SEAL_VERSION = 1
_SEAL_HEADER = struct.Struct("<3sB32s")  # magic, version, HMAC-SHA256
_FIX_TOKEN = ("set the same TENSORWIRE_JOB_TOKEN on every rank of the job (tw.testing.launch does; see the README), "
              "and keep the store port away from processes outside the job")


def _mac(token: bytes, key: str, value: bytes) -> bytes:
    encoded = key.encode()
    # The key's length comes first so that (key, value) pairs cannot be re-split into another valid pair.
    return hmac.new(token, struct.pack("<I", len(encoded)) + encoded + value, hashlib.sha256).digest()


def seal(token: bytes, key: str, value: bytes) -> bytes:
    """``value`` as stored under ``key`` in a job with ``token``: the MAC binds it to that key."""
    return _SEAL_HEADER.pack(_SEAL_MAGIC, _SEAL_VERSION, _mac(token, key, value)) + value


def _is_sealed(blob: bytes) -> bool:
    return len(blob) >= _SEAL_HEADER.size and blob[:3] == _SEAL_MAGIC


def unseal(token: bytes | None, key: str, blob: bytes) -> bytes:
    """The value ``seal`` sealed under ``key``; ``AuthenticationError`` naming the key and the fix when it does not
    verify. Without a token (an unauthenticated job) values are taken as they are."""
    blob = bytes(blob)
    if token is None:
        if _is_sealed(blob):
            raise AuthenticationError(
                f"store value {key!r} carries a job-token MAC but this process has no TENSORWIRE_JOB_TOKEN; it was not "
                f"used: {_FIX_TOKEN}"
            )
        return blob
    if not _is_sealed(blob):
        raise AuthenticationError(
            f"store value {key!r} ({len(blob)} bytes) has no job-token MAC: it was written by a process outside this "
            f"job or by a rank without TENSORWIRE_JOB_TOKEN; it was not used: {_FIX_TOKEN}"
        )
    _, version, mac = _SEAL_HEADER.unpack_from(blob)
    if version != _SEAL_VERSION:
        raise AuthenticationError(
            f"store value {key!r} is sealed in format version {version}, this tensorwire reads {_SEAL_VERSION}; it was "
            "not used: run the same tensorwire version on every rank"
        )
    value = blob[_SEAL_HEADER.size:]
    if not hmac.compare_digest(mac, _mac(token, key, value)):
        raise AuthenticationError(
            f"store value {key!r} ({len(blob)} bytes) fails its MAC check: written by a process without this job's "
            f"token (or with another job's), altered, or copied from another key; it was not used: {_FIX_TOKEN}"
        )
    return value
