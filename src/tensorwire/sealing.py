"""Values sealed with the job token: encrypted and authenticated, bound to the key they are stored under.

``b"TWE" | version u8 | nonce (12 bytes) | AES-256-GCM(value) with its 16-byte tag``. The cipher key is derived
from the job token with HKDF-SHA256 (so the token itself never keys anything directly and other uses of it,
such as the liveness handshake's HMAC, get independent keys); the associated data is the store key, length
first, so a value copied under another key does not open. Encryption, not only a MAC: a memory map carries
addresses, NIXL agent metadata (UCX worker addresses, remote keys) and shm file names, which are exactly what
a process outside the job needs to reach our memory; sealed, the store shows it only sizes.

``unseal`` refuses, with ``AuthenticationError`` naming the key and the fix, a value that does not open. Without
a token (an unauthenticated job) values are stored and read as they are. Freshness (an old sealed value written
back) is not decided here: a sealed value opens for as long as the token lives; the readers that care
(memory maps) compare what they open with what they have seen and with what the owner says.

Pure functions over ``cryptography``'s AEAD: no store, no I/O. Not in scope: hiding value sizes.
"""

from __future__ import annotations

import functools
import os
import struct

from .errors import AuthenticationError

__all__ = ["seal", "unseal", "seal_for_job", "open_for_job", "SEALED_OVERHEAD"]

_MAGIC = b"TWE"
_VERSION = 2
_HEADER = struct.Struct("<3sB12s")  # magic, version, GCM nonce
_TAG_BYTES = 16
SEALED_OVERHEAD = _HEADER.size + _TAG_BYTES  # bytes a sealed value adds to its plaintext
_KEY_INFO = b"tensorwire/store-values/aes-256-gcm/v2"
_FIX_TOKEN = ("set the same TENSORWIRE_JOB_TOKEN on every rank of the job (tw.testing.launch does; see the README), "
              "and keep the store port away from processes outside the job")


@functools.lru_cache(maxsize=8)
def _cipher(token: bytes):
    """The AEAD keyed from ``token`` (derived once per token: HKDF costs more than a seal)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KEY_INFO).derive(token)
    return AESGCM(key)


def _associated(key: str) -> bytes:
    encoded = key.encode()
    # The key's length comes first so that (key, value) pairs cannot be re-split into another valid pair.
    return struct.pack("<I", len(encoded)) + encoded


def seal(token: bytes, key: str, value: bytes) -> bytes:
    """``value`` encrypted and authenticated for ``key`` in a job with ``token`` (a fresh random nonce each call:
    96 bits, so a collision needs ~2^48 values under one token)."""
    nonce = os.urandom(12)
    return _HEADER.pack(_MAGIC, _VERSION, nonce) + _cipher(token).encrypt(nonce, bytes(value), _associated(key))


def _is_sealed(blob: bytes) -> bool:
    return len(blob) >= SEALED_OVERHEAD and blob[:3] == _MAGIC


def unseal(token: bytes | None, key: str, blob: bytes) -> bytes:
    """The value ``seal`` sealed under ``key``; ``AuthenticationError`` naming the key and the fix when it does not
    open. Without a token (an unauthenticated job) values are taken as they are."""
    from cryptography.exceptions import InvalidTag

    blob = bytes(blob)
    if token is None:
        if _is_sealed(blob):
            raise AuthenticationError(
                f"store value {key!r} is sealed with a job token but this process has no TENSORWIRE_JOB_TOKEN; it was "
                f"not used: {_FIX_TOKEN}"
            )
        return blob
    if not _is_sealed(blob):
        raise AuthenticationError(
            f"store value {key!r} ({len(blob)} bytes) is not sealed: it was written by a process outside this job or "
            f"by a rank without TENSORWIRE_JOB_TOKEN; it was not used: {_FIX_TOKEN}"
        )
    _, version, nonce = _HEADER.unpack_from(blob)
    if version != _VERSION:
        raise AuthenticationError(
            f"store value {key!r} is sealed in format version {version}, this tensorwire reads {_VERSION}; it was not "
            "used: run the same tensorwire version on every rank"
        )
    try:
        return _cipher(token).decrypt(nonce, blob[_HEADER.size:], _associated(key))
    except InvalidTag:
        raise AuthenticationError(
            f"store value {key!r} ({len(blob)} bytes) does not open with this job's token: written by a process "
            f"without it (or with another job's), altered, or copied from another key; it was not used: {_FIX_TOKEN}"
        ) from None


def _job_token(fn: str) -> bytes:
    from . import config

    token = config.load().job_token
    if token is None:
        raise AuthenticationError(f"{fn}: this process has no TENSORWIRE_JOB_TOKEN, so nothing can be sealed for the "
                                  f"job; {_FIX_TOKEN}")
    return token


def seal_for_job(context: str, value: bytes) -> bytes:
    """``value`` encrypted and authenticated with this job's token (``TENSORWIRE_JOB_TOKEN``), bound to
    ``context`` (a name of what the value is, e.g. ``"myapp/ticket/v1"``): only a process of the job opens it, with
    ``open_for_job`` and the same ``context``. For values a job hands out through parties outside it (a client, a
    router) and must get back unaltered. Raises ``AuthenticationError`` where the process has no job token."""
    return seal(_job_token("seal_for_job"), "job-value/" + context, value)


def open_for_job(context: str, blob: bytes) -> bytes:
    """The value ``seal_for_job(context, value)`` sealed in this job; ``AuthenticationError`` for a blob that does
    not open (forged, altered, sealed for another context or job) or where the process has no job token."""
    return unseal(_job_token("open_for_job"), "job-value/" + context, blob)
