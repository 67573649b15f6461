"""The embedded directory's wire: the handshake that proves the job token, and the frames that follow it.

Both sides of ``directory.py`` (the server) and ``directory_store.py`` (a member's client) use this module and
nothing else to talk, so the protocol lives in one place.

Handshake (mutual, before any key is read or written; HMAC-SHA256 from the standard library)::

    directory -> member   b"TWD1" | mode (1: the job token is required, 0: an open directory) | nonce_d (32)
    member -> directory   nonce_m (32) | lease_ms (u32) | mac_m (32; empty when open)
    directory -> member   b"\\x01" | mac_d (32; empty when open)    or  b"\\x00" | reason (utf-8), then closes

``mac_m = HMAC(token, "tensorwire directory member/" | nonce_d | nonce_m | lease_ms)`` proves the member holds the
token for this connection alone (a recorded handshake replays against no other nonce); ``mac_d`` (label
"directory/") proves the same of the directory, so a member never writes to a process that merely took the port.
``lease_ms`` is how long the directory keeps this member's keys after its last frame (its heartbeat sends one
every half liveness period). A member without a token, greeted by a directory that requires one, sends the single
byte ``NO_TOKEN`` instead of its hello and closes, so that the directory logs why it left.

Frames after it: ``u32 length | body``. A request body is ``op (1) | fields``, an answer ``status (1) | fields``,
each field ``u32 length | bytes``. Sizes are checked before anything is allocated (``MAX_FRAME``).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

__all__ = [
    "MAGIC", "NO_TOKEN", "NONCE_BYTES", "MAC_BYTES", "MAX_FRAME", "MAX_KEY", "MAX_VALUE", "Op", "Status",
    "member_mac", "directory_mac", "encode", "decode", "LENGTH",
]

MAGIC = b"TWD1"
NO_TOKEN = b"\x00"  # a member's whole answer to a greeting that requires the token it does not have
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_KEY = 1024  # bytes of a key
MAX_VALUE = 16 << 20  # bytes of one value: a member's memory map with its NIXL metadata fits many times over
MAX_FRAME = MAX_VALUE + 2 * MAX_KEY + 64  # a compare_set carries a key and two values' worth at most
LENGTH = struct.Struct("<I")
LEASE = struct.Struct("<I")


class Op:
    """What a request asks (its first byte)."""

    SET, GET, CHECK, ADD, COMPARE_SET, DELETE, LIST, PING, RAISE = range(1, 10)


class Status:
    """How an answer begins: done, the key is missing, refused (the field says why), or ask again after the
    seconds the field gives (a counter during the directory's grace period)."""

    OK, MISSING, REFUSED, WAIT = range(4)


def member_mac(token: bytes, nonce_d: bytes, nonce_m: bytes, lease_ms: int) -> bytes:
    return hmac.new(token, b"tensorwire directory member/" + nonce_d + nonce_m + LEASE.pack(lease_ms),
                    hashlib.sha256).digest()


def directory_mac(token: bytes, nonce_d: bytes, nonce_m: bytes) -> bytes:
    return hmac.new(token, b"tensorwire directory/" + nonce_d + nonce_m, hashlib.sha256).digest()


def encode(head: int, *fields: bytes) -> bytes:
    """One frame: the length, then ``head`` (an op or a status) and each field with its length."""
    body = bytes([head]) + b"".join(LENGTH.pack(len(f)) + f for f in fields)
    return LENGTH.pack(len(body)) + body


def decode(body: bytes) -> tuple[int, list[bytes]] | None:
    """``(head, fields)`` of a frame's body, or None when it is malformed (a field runs past the end)."""
    if not body:
        return None
    fields, at = [], 1
    while at < len(body):
        if at + LENGTH.size > len(body):
            return None
        (size,) = LENGTH.unpack_from(body, at)
        at += LENGTH.size
        if at + size > len(body):
            return None
        fields.append(body[at:at + size])
        at += size
    return body[0], fields
