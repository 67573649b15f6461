"""Questions any process may ask a rank's liveness listener, each on a connection of its own that the listener
answers and closes (it never counts as a rank's connection):

* ``PROBE`` (``b"TWP"``): who runs the listener (host and pid), told only to an asker that proves the token. A
  process about to claim a rank asks whether the process published for that rank still runs (``bootstrap``).
* ``MAP_EPOCH`` (``b"TWF"``): the memory map epoch the rank published last. A rank about to use a peer's map
  from the store asks whether it is current (``freshness``).

Wire: the asker sends ``kind | the listener's rank (u32) | a fresh 16-byte nonce | proof``, where with a job token
``proof = HMAC-SHA256(token, "question/" | label(kind) | nonce | rank)`` (empty without one); the listener answers
only a question whose proof verifies (a stranger's connection is closed unanswered: it learns nothing, not even
who runs the listener) with ``kind | mac | payload`` and closes, where ``mac = HMAC-SHA256(token, label(kind) |
nonce | rank | payload)`` (empty without a token). The nonce binds an answer to its question: an answer seen before
stands for no other question, and only a holder of the token can make one. A question that found its connection
closed before an answer (a flood of the listener's port drops the connections that are silent the longest, and an
asker's may be among them) is asked again on a fresh connection, within the same bound. The listener answers from
its polling (``Liveness.serve``, run by the revocation thread, wakes on the connection), so a question costs a
round trip.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["PROBE", "MAP_EPOCH", "WAKE", "HELLO", "NONCE_BYTES", "QUESTION_BYTES", "answer", "answering", "ask",
           "asked", "who_runs"]

HELLO = struct.Struct("<3sI")  # kind (or a rank's connection, liveness.py), the listener's rank
PROBE, MAP_EPOCH = b"TWP", b"TWF"
WAKE = b"TWW"  # no question: wakes the listener's serving thread (``Liveness.poke``); closed unanswered
_LABELS = {PROBE: b"tensorwire liveness probe/", MAP_EPOCH: b"tensorwire map epoch/"}
NONCE_BYTES = 16
_MAC_BYTES = 32
_MAX_REPLY = 3 + _MAC_BYTES + 256
_TRIES = 3  # connections a question may take: one dropped by a flood is asked again


def QUESTION_BYTES(token: bytes | None) -> int:  # noqa: N802 - a size, as the constants beside it
    """What follows a question's hello: its nonce and, with a token, the asker's proof."""
    return NONCE_BYTES + (0 if token is None else _MAC_BYTES)


def _proof(kind: bytes, token: bytes | None, nonce: bytes, rank: int) -> bytes:
    if token is None:
        return b""
    return hmac.new(token, b"question/" + _LABELS[kind] + nonce + struct.pack("<I", rank), hashlib.sha256).digest()


def asked(kind: bytes, token: bytes | None, rank: int, received: bytes) -> bytes | None:
    """The nonce of a question ``received`` (``QUESTION_BYTES`` long) of ``rank``, or None when its proof does not
    verify under ``token`` (a stranger, or a question replayed from another rank)."""
    nonce, proof = received[:NONCE_BYTES], received[NONCE_BYTES:]
    return nonce if hmac.compare_digest(proof, _proof(kind, token, nonce, rank)) else None


def _mac(kind: bytes, token: bytes, nonce: bytes, rank: int, payload: bytes) -> bytes:
    return hmac.new(token, _LABELS[kind] + nonce + struct.pack("<I", rank) + payload, hashlib.sha256).digest()


def answer(kind: bytes, token: bytes | None, nonce: bytes, rank: int, payload: bytes) -> bytes:
    """The listener's reply to question ``kind`` with ``nonce``, asked of ``rank`` (its own)."""
    return kind + (b"" if token is None else _mac(kind, token, nonce, rank, payload)) + payload


def ask(address: tuple[str, int], kind: bytes, rank: int, token: bytes | None, timeout_s: float) -> bytes | None:
    """Ask ``rank``'s listener at ``address`` question ``kind``: the payload of its answer, or None when no
    process of this job listens there (refused, unreachable, or no answer that verifies under ``token`` on any of
    ``_TRIES`` connections: the port belongs to someone else). Raises ``TimeoutError`` when a process accepts the
    connection but does not answer within ``timeout_s`` (stopped, or busy outside tensorwire). Blocks at most
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for _ in range(_TRIES):
        said, accepted = _ask_once(address, kind, rank, token, deadline)
        if said is not None or not accepted or time.monotonic() >= deadline:
            return said
    return None


def _ask_once(address, kind: bytes, rank: int, token: bytes | None, deadline: float) -> tuple[bytes | None, bool]:
    """One question on a connection of its own: (the verified payload or None, whether a process accepted)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        sock = socket.create_connection(address, timeout=max(deadline - time.monotonic(), 0.001))
    except OSError:  # refused, unreachable, or nothing accepted in time
        return None, False
    reply = b""
    with sock:
        try:
            sock.sendall(HELLO.pack(kind, rank) + nonce + _proof(kind, token, nonce, rank))
            while len(reply) < _MAX_REPLY:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                data = sock.recv(_MAX_REPLY - len(reply))
                if not data:
                    break
                reply += data
        except TimeoutError:
            raise
        except OSError:
            return None, True
    mac_bytes = 0 if token is None else _MAC_BYTES
    if not reply.startswith(kind) or len(reply) <= len(kind) + mac_bytes:
        return None, True
    mac, payload = reply[len(kind):len(kind) + mac_bytes], reply[len(kind) + mac_bytes:]
    if token is not None and not hmac.compare_digest(mac, _mac(kind, token, nonce, rank, payload)):
        return None, True
    return payload, True


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


def answering(addresses: dict[int, tuple[str, int]], token: bytes | None, timeout_s: float, *,
              busy_counts: bool = False) -> set[int]:
    """The ranks whose listener at their address answers ``PROBE`` as that rank of this job (verified under
    ``token``), asked all at once. A process that merely took a dead member's port cannot answer: it is not that
    member. One that accepts the connection but says nothing within ``timeout_s`` counts only with
    ``busy_counts`` (a live member too busy to answer, where taking it for gone would do harm: its name taken
    over). Blocks at most about ``timeout_s``."""
    if not addresses:
        return set()

    def answers(rank: int) -> bool:
        for _ in range(2):  # once more: a flood on its port may have dropped our question, not its answer
            try:
                if ask(addresses[rank], PROBE, rank, token, timeout_s / 2) is not None:
                    return True
            except TimeoutError:
                if busy_counts:
                    return True
        return False

    with ThreadPoolExecutor(max_workers=min(32, len(addresses)), thread_name_prefix="tensorwire-probe") as pool:
        return {rank for rank, ok in zip(addresses, pool.map(answers, addresses)) if ok}
