"""The liveness listener's handshake: its messages, its states and the connections under way.

The handshake. The connecting rank sends a hello (``b"TWL"``, its rank). Without a job token the listener counts
the connection for that rank at once. With one (``TENSORWIRE_JOB_TOKEN``) the listener answers with a fresh
random nonce, the connecting rank returns ``HMAC-SHA256(token, label | nonce | its rank | the listener's rank)``,
and the listener checks it (``hmac.compare_digest``) before it counts the connection, then says so with one byte;
a connection that fails, or does not finish within ``liveness_s``, is closed. So a hello and answer sniffed from
one connection do not open another (nor one to another rank), and a process without the token is never counted
as a rank: neither can make a rank look gone to the listener by closing its connection. Each side moves the
handshake on from its own polling calls, never blocking on the other: a connecting rank that did not answer in
time (it was busy outside tensorwire) finds its connection closed before the acceptance and simply reconnects;
a peer that is gone refuses that (``ECONNREFUSED``) or does not answer it, and only then counts as gone.

A rank's serving thread is woken by a poke (``WAKE``), which carries the token's proof too (a time and its MAC):
a stranger's wakes are served but do not set the thread polling.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct
import time

from .peer_sockets import read_up_to

__all__ = ["MAGIC", "ANSWER_BYTES", "ACCEPTED", "WAKE_PROOF", "Handshake", "Incoming", "Outgoing", "answer_mac",
           "wake_mac", "collected", "keep_bounded"]

MAGIC = b"TWL"
ANSWER_BYTES = 32  # HMAC-SHA256(token, _ANSWER_LABEL | nonce | connecting rank u32 | listening rank u32)
_ANSWER_LABEL = b"tensorwire liveness answer/"
ACCEPTED = b"K"  # the listener verified the answer: from now on end-of-file means it is gone


WAKE_PROOF = struct.Struct("<Q")  # a poke's time in ms, then its MAC
_WAKE_LABEL = b"tensorwire liveness wake/"


def wake_mac(token: bytes, rank: int, sent_ms: int) -> bytes:
    return hmac.new(token, _WAKE_LABEL + struct.pack("<IQ", rank, sent_ms), hashlib.sha256).digest()


def answer_mac(token: bytes, nonce: bytes, connecting: int, listening: int) -> bytes:
    """The connecting rank's answer to ``nonce``: bound to this challenge, to who connects and to whom (an answer
    seen on one connection opens no other)."""
    message = _ANSWER_LABEL + nonce + struct.pack("<II", connecting, listening)
    return hmac.new(token, message, hashlib.sha256).digest()


class Handshake(enum.Enum):
    PENDING = "pending"  # waiting for the other end's next message
    COUNTED = "counted"  # verified: the connection counts for its rank
    REFUSED = "refused"  # closed: not a rank of this job, a wrong answer, end-of-file or silent too long
    PROBED = "probed"  # a question for this listener's own rank (``listener_queries``), answered and closed


class Incoming:
    """A connection accepted by the listener, until its hello (and, with a token, its answer) has arrived."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.since = sock, time.monotonic()
        self.received = b""
        self.rank: int | None = None  # claimed by the hello
        self.nonce = b""  # the challenge sent (with a token)
        self.probe = b""  # a question's kind (``listener_queries``), not a rank's connection


def keep_bounded(incoming: list[Incoming], pending: Incoming, limit: int) -> None:
    """Add ``pending`` to ``incoming``; over ``limit``, close the one silent the longest (no byte received): a
    flood of idle connections drops its own first, never a member that spoke; a member dropped anyway asks again."""
    incoming.append(pending)
    if len(incoming) > limit:
        silent = next((p for p in incoming if not p.received and p.rank is None), incoming[0])
        incoming.remove(silent)
        silent.sock.close()


def collected(pending: Incoming, size: int) -> bytes | Handshake:
    """The ``size`` bytes ``pending`` sent, once all arrived; else PENDING (more to come) or REFUSED (closed)."""
    received = read_up_to(pending.sock, pending.received, size)
    if received is None:
        return Handshake.REFUSED
    pending.received = received
    return received if len(received) >= size else Handshake.PENDING


class Outgoing:
    """A connection this rank opened, until the listener accepted its answer (with a token)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.received = b""
        self.answered = False
