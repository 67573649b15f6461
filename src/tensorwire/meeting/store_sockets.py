"""The sockets around torch's ``TCPStore``: rank 0's listening socket bound to ``MASTER_ADDR``'s address only,
our client connection to the store (found in ``/proc/self/fd``, so that a watchdog can cut a stuck call), and
this host's address on the route to the store's host (where the liveness listener binds).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from dataclasses import dataclass

from ..environment import Environment
from ..errors import InvalidArgumentError, PeerLostError

__all__ = ["ListenerWords", "STORE_WORDS", "listen_socket", "socket_fds", "store_client_sockets", "local_address"]


@dataclass(frozen=True)
class ListenerWords:
    """The words of the command whose listener ``listen_socket`` makes: what the user set (an environment variable,
    a flag), so that a refusal names what to change."""

    failed: str  # what could not be done: "init: rank 0 cannot host the store"
    address: str  # the address as the user set it, ``{!r}`` for its value: "MASTER_ADDR={!r}"
    port: str  # what to change for another port: "MASTER_PORT"
    host: str  # the machine it listens on: "rank 0's host"


STORE_WORDS = ListenerWords("init: rank 0 cannot host the store", "MASTER_ADDR={!r}", "MASTER_PORT", "rank 0's host")

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def listen_socket(addr: str, port: int, words: ListenerWords = STORE_WORDS) -> tuple[socket.socket | None, str]:
    """A listening socket on ``addr``'s address for the store to use, or (None, why not) when the store has to
    listen on every interface as torch's ``TCPStore`` does by itself (it binds the wildcard address and has no
    bind-address option; it does accept a socket we bound, ``master_listen_fd``)."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        return None, f"{words.address.format(addr)} does not resolve here ({e})"
    ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
    if ip.is_loopback and addr.lower() not in _LOOPBACK_NAMES and not _is_ip_literal(addr):
        # e.g. Debian's /etc/hosts maps the host's own name to 127.0.1.1, while other hosts resolve it to the
        # host's real address: listening on loopback would shut them out.
        return None, (f"{words.address.format(addr)} resolves to the loopback address {ip} on {words.host}, but "
                      "other hosts may resolve it to a real address")
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own socket
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise InvalidArgumentError(
                f"{words.failed}: port {port} on {addr} is in use (EADDRINUSE); choose another {words.port}"
            ) from e
        if e.errno == errno.EADDRNOTAVAIL:  # e.g. a public address that NAT maps to this host
            return None, f"{words.address.format(addr)} ({ip}) is not an address of {words.host}"
        raise PeerLostError(f"{words.failed}: listening on {addr}:{port} failed ({e})") from e
    return sock, ""


def _is_ip_literal(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return False
    return True


def socket_fds() -> set[int]:
    """The descriptors of this process that are sockets (empty where /proc is missing)."""
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:  # the listing's own descriptor is closed by now, and others may close meanwhile
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except OSError:
            continue
    return found


def store_client_sockets(before: set[int], port: int) -> list[socket.socket]:
    """Our new client connection(s) to the store (peer port == the store's port), as socket objects over
    duplicated descriptors: shutting one down ends a call blocked on the connection. Empty where /proc is missing."""
    found = []
    for fd in sorted(socket_fds() - before):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            peer = sock.getpeername()
        except OSError:
            peer = None
        if sock.type == socket.SOCK_STREAM and isinstance(peer, tuple) and len(peer) >= 2 and peer[1] == port:
            found.append(sock)
        else:
            sock.close()  # our duplicate only
    return found


def local_address(env: Environment) -> str:
    """This host's address on the route to the store's host (for the liveness listener)."""
    if env.rank == 0 and not env.agent_store and not env.fleet:
        try:
            return socket.getaddrinfo(env.master_addr, None, type=socket.SOCK_STREAM)[0][4][0]
        except OSError:
            pass
    try:
        family = socket.AF_INET6 if ":" in env.master_addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((env.master_addr, env.master_port or 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"

