"""Questions any process may ask a rank's liveness listener, each on a connection of its own that the listener
answers and closes (it never counts as a rank's connection):

* ``PROBE`` (``b"TWP"``): who runs the listener (host and pid). A process about to claim a rank asks whether the
  process published for that rank still runs (``bootstrap``).
* ``MAP_EPOCH`` (``b"TWF"``): the memory map epoch the rank published last. A rank about to use a peer's map
  from the store asks whether it is current (``freshness``).

Wire: the asker sends ``kind | the listener's rank (u32) | a fresh 16-byte nonce``; the listener answers
``kind | mac | payload`` and closes, where with a job token ``mac = HMAC-SHA256(token, label(kind) | nonce | rank |
payload)`` (empty without one). The nonce binds an answer to its question: an answer seen before stands for no
other question, and only a holder of the token can make one. The listener answers from its polling
(``Liveness.serve``, run by the revocation thread, wakes on the connection), so a question costs a round trip.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time

__all__ = ["PROBE", "MAP_EPOCH", "HELLO", "NONCE_BYTES", "answer", "ask", "who_runs"]

HELLO = struct.Struct("<3sI")  # kind (or a rank's connection, liveness.py), the listener's rank
PROBE, MAP_EPOCH = b"TWP", b"TWF"
_LABELS = {PROBE: b"tensorwire liveness probe/", MAP_EPOCH: b"tensorwire map epoch/"}
NONCE_BYTES = 16
_MAC_BYTES = 32
_MAX_REPLY = 3 + _MAC_BYTES + 256


def _mac(kind: bytes, token: bytes, nonce: bytes, rank: int, payload: bytes) -> bytes:
    return hmac.new(token, _LABELS[kind] + nonce + struct.pack("<I", rank) + payload, hashlib.sha256).digest()


def answer(kind: bytes, token: bytes | None, nonce: bytes, rank: int, payload: bytes) -> bytes:
    """The listener's reply to question ``kind`` with ``nonce``, asked of ``rank`` (its own)."""
    return kind + (b"" if token is None else _mac(kind, token, nonce, rank, payload)) + payload


def ask(address: tuple[str, int], kind: bytes, rank: int, token: bytes | None, timeout_s: float) -> bytes | None:
    """Ask ``rank``'s listener at ``address`` question ``kind``: the payload of its answer, or None when no
    process of this job listens there (refused, reset, closed, unreachable, or an answer that does not verify
    under ``token``: the port belongs to someone else). Raises ``TimeoutError`` when a process accepts the
    connection but does not answer within ``timeout_s`` (stopped, or busy outside tensorwire). Blocks at most
    ``timeout_s``."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection(address, timeout=timeout_s)
    except TimeoutError:
        return None  # nothing accepted the connection in time: unreachable
    except OSError:
        return None
    reply = b""
    with sock:
        try:
            sock.sendall(HELLO.pack(kind, rank) + nonce)
            while len(reply) < _MAX_REPLY:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                data = sock.recv(_MAX_REPLY - len(reply))
                if not data:
                    break
                reply += data
        except TimeoutError:
            raise
        except OSError:
            return None
    mac_bytes = 0 if token is None else _MAC_BYTES
    if not reply.startswith(kind) or len(reply) <= len(kind) + mac_bytes:
        return None
    mac, payload = reply[len(kind):len(kind) + mac_bytes], reply[len(kind) + mac_bytes:]
    if token is not None and not hmac.compare_digest(mac, _mac(kind, token, nonce, rank, payload)):
        return None
    return payload


def who_runs(address: tuple[str, int], rank: int, token: bytes | None, timeout_s: float) -> str | None:
    """Who runs the liveness listener of ``rank`` at ``address`` (host and pid, as it says), or None when no
    process of this job listens there any more. A listener that accepts the connection but does not answer within
    ``timeout_s`` counts as running. Blocks at most ``timeout_s``."""
    where = f"{address[0]}:{address[1]}"
    try:
        who = ask(address, PROBE, rank, token, timeout_s)
    except TimeoutError:
        return (f"a process whose liveness socket at {where} accepts connections but did not answer within "
                f"{timeout_s:g}s (stopped, or busy outside tensorwire)")
    if who is None:
        return None
    verified = "authenticated with the job token" if token is not None else "unauthenticated job"
    return f"{who.decode(errors='replace')}, whose liveness socket at {where} answered ({verified})"
