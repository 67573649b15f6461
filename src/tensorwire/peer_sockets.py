"""What a TCP socket says about the process at its other end, for ``liveness``: keepalive settings that make a
silent host fail the socket, the few handshake bytes moved without blocking, and whether a socket error is
evidence from the peer's side (it is gone) or this process's own trouble (no verdict, and the fix)."""

from __future__ import annotations

import errno
import math
import resource
import socket

__all__ = ["tune", "read_up_to", "send_now", "from_peer", "local_trouble", "broken"]

# Errors that say something about the peer: only these on its connection make it gone. Any other failure to
# open or use a socket is this process's (or host's) trouble and no verdict.
_PEER_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
                          errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ENETUNREACH})


def tune(sock: socket.socket, liveness_s: float) -> None:
    """Have the kernel fail ``sock`` with ``ETIMEDOUT`` when the other end stops answering for ~``liveness_s``:
    keepalive probes every ``liveness_s / 4`` seconds on an idle connection, and unacknowledged data or probes
    for longer than ``liveness_s`` abort it."""
    period = max(1, int(liveness_s / 4))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", period), ("TCP_KEEPINTVL", period),
                        ("TCP_KEEPCNT", max(1, math.ceil(liveness_s / period))),
                        ("TCP_USER_TIMEOUT", int(liveness_s * 1000))):
        option = getattr(socket, name, None)
        if option is not None:  # Linux; elsewhere the OS defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def read_up_to(sock: socket.socket, buffer: bytes, size: int) -> bytes | None:
    """``buffer`` with what has arrived on ``sock`` of its first ``size`` bytes, without blocking; None once the
    other end closed (end-of-file). ``OSError`` other than "nothing yet" propagates."""
    if len(buffer) >= size:
        return buffer
    try:
        data = sock.recv(size - len(buffer))
    except (BlockingIOError, InterruptedError):
        return buffer
    return None if data == b"" else buffer + data


def send_now(sock: socket.socket, data: bytes) -> None:
    """Send a few bytes on a non-blocking socket that has sent nothing else yet (they fit in its empty buffer);
    ``OSError`` if they do not go out at once."""
    if sock.send(data) != len(data):
        raise OSError(errno.EAGAIN, "a handshake message did not fit in the socket's buffer")


def from_peer(error: OSError) -> bool:
    """Whether ``error`` on a connection is evidence from the peer's side (else it is local trouble)."""
    return isinstance(error, TimeoutError) or error.errno in _PEER_ERRNOS


def local_trouble(error: OSError) -> str:
    """What a local failure to open a socket means, and the fix."""
    if error.errno == errno.EMFILE:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft * 4, 65536)
        return (f"this process is out of file descriptors (EMFILE: soft limit RLIMIT_NOFILE={soft}, hard {hard}); "
                f"raise it before starting (ulimit -n {wanted}) or close "
                "descriptors it does not need")
    if error.errno == errno.ENFILE:
        return ("this host's file table is full (ENFILE); close descriptors elsewhere or raise the system limit "
                "(sysctl fs.file-max)")
    if error.errno in (errno.ENOMEM, errno.ENOBUFS):
        return (f"this host is out of memory for sockets ({errno.errorcode[error.errno]}); free memory or lower "
                "this process's use")
    return f"{errno.errorcode.get(error.errno, error.errno)}: {error.strerror or error}"


def broken(sock: socket.socket) -> str | None:
    """Why ``sock``'s peer is gone, or None: one non-blocking peek."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as e:
        if e.errno == errno.ETIMEDOUT:
            return "its host stopped answering: TCP keepalive timed out"
        if not from_peer(e):
            return None  # this host's trouble (ENOMEM, ENOBUFS): no verdict on the peer
        return f"its connection failed: {errno.errorcode.get(e.errno, e.errno)}"
    if data == b"":
        return "its process closed the connection"
    return None  # a peer never sends after the handshake; stray bytes do not mean it is gone
