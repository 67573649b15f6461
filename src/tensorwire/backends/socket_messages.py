"""Messages between the ranks of one host over Unix sockets: the message channel where NIXL is not installed.

Every communicator needs one channel that reaches its peers (notifications of ``shm`` and ``cuda_ipc`` transfers,
revocations). NIXL's agent is that channel where ``nixl`` is installed, and then this transport does not exist.
Without ``nixl`` the only transports that reach other processes are ``shm`` and ``cuda_ipc``, both on one host, so
a channel on one host is enough: each rank listens on a Unix socket in Linux's abstract namespace (no file to clean
up; the name, random, is in the rank's sealed memory map) and opens one stream connection to each peer it sends to.

Wire: one frame per message, ``sender u32 | receiver u32 | sequence u64 | length u32 | message | mac``. With a job
token ``mac = HMAC-SHA256(token, label | header | message)`` (empty without one) and the sequence counts the frames
of one connection from 0: a process without the token can connect to the socket but not forge a frame, and a frame
out of order or for another rank closes its connection. (Nothing on the host but root can read a Unix socket's
traffic, so no frame seen before can be replayed.) A receiver reads what arrived without blocking when its inbox
is polled; a sender writes a whole frame, blocking at most ``liveness_s`` when the receiver stops reading.

Non-goals: moving memory (``memory_kinds`` is empty: never chosen for a transfer); other hosts (that needs NIXL).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import select
import socket
import struct
import threading
from typing import Any

from ..errors import InvalidArgumentError, TransferError
from .base import BackendContext, BackendInfo, Capabilities, Segment
from .nixl_setup import INSTALL_NIXL, nixl_installed

__all__ = ["SocketMessages", "info"]

_HEADER = struct.Struct("<IIQI")  # sender, receiver, sequence, message length
_LABEL = b"tensorwire socket message/"
_NAME_PREFIX = b"\0tensorwire-msg-"
_MAX_MESSAGE = 1 << 20  # a notification is bytes to a few KiB; a frame claiming more is not ours
_MAC_BYTES = hashlib.sha256().digest_size  # with a job token
_MAX_UNPROVEN = 64  # accepted connections without a verified frame yet: beyond, the oldest is closed


def info() -> BackendInfo:
    if nixl_installed():
        return BackendInfo("socket", False, "not needed here: NIXL's agent carries the messages between ranks")
    return BackendInfo("socket", True, "messages between ranks of this host (notifications, revocations) over Unix "
                       "sockets, in place of NIXL's", fix=f"{INSTALL_NIXL} to reach other hosts")


class _Incoming:
    """An accepted connection: its bytes not yet parsed, the sender its first frame proved, the next sequence."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer, self.sender, self.sequence = sock, b"", None, 0


class SocketMessages:
    """The ``MessageChannel`` protocol over Unix sockets of this host. Thread-safe."""

    name = "socket"
    capabilities = Capabilities(memory_kinds=frozenset(), remote=True, stream_ordered=False, same_host_only=True,
                                message_channel=True)

    def __init__(self, rank: int, token: bytes | None, send_timeout_s: float) -> None:
        self.rank, self._token, self._send_timeout_s = rank, token, send_timeout_s
        self._name = _NAME_PREFIX + secrets.token_hex(16).encode()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._name)
        self._listener.listen(socket.SOMAXCONN)
        self._listener.setblocking(False)
        self._addresses: dict[int, bytes] = {}  # rank -> its listener's name, from its map
        self._outgoing: dict[int, tuple[socket.socket, list[int]]] = {}  # rank -> (connection, [next sequence])
        self._incoming: list[_Incoming] = []
        self._send_lock, self._receive_lock = threading.Lock(), threading.Lock()

    @classmethod
    def create(cls, context: BackendContext) -> SocketMessages | None:
        if nixl_installed():
            return None  # NIXL's agent carries the messages
        return cls(context.rank, context.config.job_token, context.config.liveness_s)

    # --- memory: none ----------------------------------------------------------------------------
    def register(self, segment: Segment) -> None:
        return None

    def deregister(self, handle: None) -> None:
        return None

    def metadata(self) -> bytes:
        return self._name

    def load_peer(self, rank: int, metadata: bytes) -> None:
        if not metadata.startswith(_NAME_PREFIX) or len(metadata) > 128:
            raise InvalidArgumentError(f"socket: rank {rank}'s listener name {metadata[:64]!r} is not one of ours")
        with self._send_lock:
            if self._addresses.get(rank) != metadata:  # a new process for that rank: a new connection
                self._drop_outgoing(rank)
                self._addresses[rank] = metadata

    def reaches(self, peer: int, remote: list[Segment]) -> bool:
        return False

    def _carries_no_bytes(self, *args: Any, **kwargs: Any) -> Any:
        # Never reached: no memory kind in its capabilities, so no transfer is ever routed here.
        raise InvalidArgumentError("socket: carries messages only, never a transfer's bytes")

    prepare = prepare_blocks = bind_blocks = post = status = release = _carries_no_bytes

    # --- messages --------------------------------------------------------------------------------
    def loaded_peers(self) -> frozenset[int]:
        return frozenset(self._addresses)

    def send_notification(self, peer: int, message: bytes) -> None:
        """Send ``message`` to ``peer``, after every earlier one. Blocks while the frame is written (at most
        ``liveness_s`` when ``peer`` stops reading); ``TransferError`` when ``peer`` cannot be reached."""
        with self._send_lock:
            try:
                sock, sequence = self._connection(peer)
                header = _HEADER.pack(self.rank, peer, sequence[0], len(message))
                sock.sendall(header + message + self._mac(header, message))
                sequence[0] += 1
            except OSError as e:
                self._drop_outgoing(peer)
                raise TransferError(f"notifying rank {peer}: its message socket refused or broke ({e}); it exited "
                                    "or stopped reading") from e

    def _connection(self, peer: int) -> tuple[socket.socket, list[int]]:
        found = self._outgoing.get(peer)
        if found is None:
            address = self._addresses.get(peer)
            if address is None:
                raise OSError(f"rank {peer}'s memory map was not loaded (no listener name)")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._send_timeout_s)
            try:
                sock.connect(address)
            except OSError:
                sock.close()
                raise
            found = self._outgoing[peer] = (sock, [0])
        return found

    def _drop_outgoing(self, peer: int) -> None:
        found = self._outgoing.pop(peer, None)
        if found is not None:
            found[0].close()

    def notifications(self) -> list[tuple[int, bytes]]:
        """``(sender rank, message)`` of what arrived, in order per sender. Never blocks."""
        with self._receive_lock:
            self._accept()
            if not self._incoming:
                return []
            readable, _, _ = select.select([c.sock for c in self._incoming], [], [], 0)
            arrived: list[tuple[int, bytes]] = []
            for connection in [c for c in self._incoming if c.sock in readable]:
                if not self._read(connection, arrived):
                    connection.sock.close()
                    self._incoming.remove(connection)
            return arrived

    def _accept(self) -> None:
        """Accept what is pending, keeping at most ``_MAX_UNPROVEN`` connections that have not sent a verified
        frame: whoever floods the socket costs this process a bounded number of descriptors. A member's connection
        dropped so before its first frame was read loses that frame (its next send fails and reconnects): a flood
        is a denial of service, as deleting store values is, never a forged message."""
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # none pending (or no descriptor to spare: later)
                return
            sock.setblocking(False)
            self._incoming.append(_Incoming(sock))
            unproven = [c for c in self._incoming if c.sender is None]
            if len(unproven) > _MAX_UNPROVEN:
                unproven[0].sock.close()
                self._incoming.remove(unproven[0])

    def _read(self, connection: _Incoming, arrived: list[tuple[int, bytes]]) -> bool:
        """Take what ``connection`` has and parse its whole frames into ``arrived``; False once it must close
        (end-of-file, or a frame that is not a member's)."""
        try:
            data = connection.sock.recv(1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        connection.buffer += data
        mac_bytes = 0 if self._token is None else _MAC_BYTES
        while len(connection.buffer) >= _HEADER.size:
            header = connection.buffer[:_HEADER.size]
            sender, receiver, sequence, length = _HEADER.unpack(header)
            if length > _MAX_MESSAGE or receiver != self.rank or sequence != connection.sequence or \
                    (connection.sender is not None and sender != connection.sender):
                return False
            end = _HEADER.size + length + mac_bytes
            if len(connection.buffer) < end:
                return True
            message = connection.buffer[_HEADER.size:_HEADER.size + length]
            if not hmac.compare_digest(connection.buffer[_HEADER.size + length:end], self._mac(header, message)):
                return False  # made without this job's token
            connection.buffer, connection.sender = connection.buffer[end:], sender
            connection.sequence += 1
            arrived.append((sender, message))
        return True

    def _mac(self, header: bytes, message: bytes) -> bytes:
        if self._token is None:
            return b""
        return hmac.new(self._token, _LABEL + header + message, hashlib.sha256).digest()

    def close(self) -> None:
        with self._send_lock, self._receive_lock:
            for sock in [self._listener] + [s for s, _ in self._outgoing.values()] + [c.sock for c in self._incoming]:
                sock.close()
            self._outgoing.clear()
            self._incoming.clear()
