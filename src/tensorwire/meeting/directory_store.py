"""A fleet member's connection to the embedded directory (``directory.py``): a ``torch.distributed.Store`` that
proves the job token first (``directory_wire``'s handshake) and then asks one request at a time.

Failures are typed here, at their source: a directory that cannot be reached, closes the connection or does not
answer within ``request_s`` raises ``PeerLostError`` (the connection is then unusable: ``fleet.Fleet``
makes a new one); a token that differs from the directory's, or a directory without one where this member has
one (or the reverse), ``AuthenticationError``; a request over one of the directory's bounds, ``InvalidArgumentError``
with the directory's reason. Thread-safe (one lock around each round trip).
"""

from __future__ import annotations

import datetime
import hmac
import secrets
import socket
import threading
import time
import warnings

import torch.distributed as dist

from ..errors import AuthenticationError, InvalidArgumentError, PeerLostError, TensorwireWarning, WaitTimeoutError
from . import directory_wire as wire

__all__ = ["DirectoryStore", "NotYet"]

_SAY_AFTER_S = 3.0  # a directory that does not take connections for this long is said to be missing


class NotYet(Exception):  # noqa: N818 - a signal to the caller, not an error a user sees
    """The directory moves no counter for ``seconds`` more (its grace period after a start): ask again then."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"ask again in {seconds:.3g}s")
        self.seconds = seconds


class DirectoryStore(dist.Store):
    """This member's authenticated connection to the directory at ``host:port``.

    ``token``: the job token (None: an unauthenticated fleet). ``lease_s``: how long the directory keeps this
    member's keys after its last request. ``connect_s``: how long to keep trying to reach the directory (it may
    be starting). ``request_s``: the bound of each round trip. Construction blocks for the connection and the
    handshake (at most ``connect_s + request_s``)."""

    def __init__(self, host: str, port: int, *, token: bytes | None, lease_s: float, connect_s: float,
                 request_s: float) -> None:
        super().__init__()
        self.where = f"tcp://{host}:{port}"
        self._request_s = request_s
        self._lock = threading.Lock()
        deadline = time.monotonic() + connect_s
        while True:
            self.socket = self._connect(host, port, max(deadline - time.monotonic(), 0.0))
            try:
                self.socket.settimeout(request_s)
                self._handshake(token, lease_s)
                break
            except PeerLostError:  # dropped before its verdict (a flood of handshakes): again, within connect_s
                self.socket.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
            except BaseException:
                self.socket.close()
                raise
        self.set_timeout(datetime.timedelta(seconds=request_s))

    def __repr__(self) -> str:
        return f"DirectoryStore({self.where})"

    # --- the connection -------------------------------------------------------------------------------------------
    def _connect(self, host: str, port: int, connect_s: float) -> socket.socket:
        """A connection to the directory, tried again while it does not take connections (it may be starting), for
        at most ``connect_s``; a host name that does not resolve fails at once, and a wait past ``_SAY_AFTER_S``
        says so once (where, and what to check), so a wrong address is not minutes of silence."""
        start = time.monotonic()
        deadline, pause, said = start + connect_s, 0.01, False
        while True:
            try:
                socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (socket.gaierror, UnicodeError) as e:
                raise InvalidArgumentError(f"the directory's host {host!r} ({self.where}) does not resolve here ({e}); "
                                           "check TENSORWIRE_DIRECTORY / directory=") from e
            try:
                sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.05))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as e:
                if time.monotonic() + pause >= deadline:
                    raise PeerLostError(f"could not reach the directory at {self.where} within {connect_s:.3g}s "
                                        f"({e}); is `tensorwire directory` running there?") from e
                if not said and time.monotonic() - start >= _SAY_AFTER_S:
                    said = True
                    warnings.warn(f"tensorwire: still no directory at {self.where} after {_SAY_AFTER_S:g}s ({e}); "
                                  f"trying until {connect_s:.3g}s have passed (init's timeout): check that `tensorwire "
                                  "directory` runs there and TENSORWIRE_DIRECTORY / directory= names its host and "
                                  "port", TensorwireWarning, stacklevel=2)
                time.sleep(pause)
                pause = min(pause * 2, 0.2)

    def _handshake(self, token: bytes | None, lease_s: float) -> None:
        greeting = self._exactly(len(wire.MAGIC) + 1 + wire.NONCE_BYTES, "its greeting")
        if not greeting.startswith(wire.MAGIC):
            raise PeerLostError(f"the process at {self.where} is no tensorwire directory (it greeted with "
                                f"{greeting[:8]!r}); check TENSORWIRE_DIRECTORY / directory=")
        requires_token, nonce_d = greeting[len(wire.MAGIC)] == 1, greeting[len(wire.MAGIC) + 1:]
        if requires_token and token is None:
            self._send(wire.NO_TOKEN, "that it has no job token")  # the directory logs why this member left
            raise AuthenticationError(f"init: the directory at {self.where} admits only members with the fleet's job "
                                      "token, and this process has none; export the fleet's TENSORWIRE_JOB_TOKEN")
        if not requires_token and token is not None:
            raise AuthenticationError(
                f"init: the directory at {self.where} runs without a job token (open to anyone), but this member has "
                "one; start the directory with the fleet's TENSORWIRE_JOB_TOKEN exported")
        nonce_m, lease_ms = secrets.token_bytes(wire.NONCE_BYTES), int(min(lease_s, 3600.0) * 1000)
        mac = wire.member_mac(token, nonce_d, nonce_m, lease_ms) if token is not None else b""
        self._send(nonce_m + wire.LEASE.pack(lease_ms) + mac, "the handshake")
        verdict = self._exactly(1, "its verdict")
        if verdict != b"\x01":
            raise AuthenticationError(f"init: the directory at {self.where} refused this member: the job token "
                                      "(TENSORWIRE_JOB_TOKEN) differs from the fleet's; export the fleet's token")
        if token is not None:
            proof = self._exactly(wire.MAC_BYTES, "its proof")
            if not hmac.compare_digest(proof, wire.directory_mac(token, nonce_d, nonce_m)):
                raise AuthenticationError(f"init: the process at {self.where} could not prove the fleet's job token; "
                                          "it is not the fleet's directory (check TENSORWIRE_DIRECTORY)")

    def _send(self, data: bytes, what: str) -> None:
        try:
            self.socket.sendall(data)
        except OSError as e:
            raise PeerLostError(f"lost the directory at {self.where} sending {what} ({e})") from e

    def _exactly(self, size: int, what: str) -> bytes:
        data = bytearray()
        try:
            while len(data) < size:
                chunk = self.socket.recv(size - len(data))
                if not chunk:
                    raise PeerLostError(f"lost the directory at {self.where}: it closed the connection before "
                                        f"{what}")
                data += chunk
        except PeerLostError:
            raise
        except TimeoutError as e:
            raise PeerLostError(f"the directory at {self.where} did not answer within {self._request_s:.3g}s "
                                f"({what})") from e
        except OSError as e:
            raise PeerLostError(f"lost the directory at {self.where} ({e})") from e
        return bytes(data)

    def _request(self, op: int, *fields: bytes) -> tuple[int, list[bytes]]:
        with self._lock:
            self._send(wire.encode(op, *fields), "a request")
            (size,) = wire.LENGTH.unpack(self._exactly(wire.LENGTH.size, "an answer"))
            if size > wire.MAX_FRAME:
                raise PeerLostError(f"the directory at {self.where} answered with a frame of {size} bytes")
            answer = wire.decode(self._exactly(size, "an answer"))
        if answer is None:
            raise PeerLostError(f"the directory at {self.where} answered with a malformed frame")
        status, values = answer
        if status == wire.Status.REFUSED:
            reason = values[0].decode(errors="replace") if values else "no reason given"
            raise InvalidArgumentError(f"the directory at {self.where} refused the request: {reason}")
        return status, values

    def close(self) -> None:
        self.socket.close()

    # --- the Store calls ------------------------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._request(wire.Op.SET, key.encode(), _bytes(value))

    def get(self, key: str) -> bytes:
        """``key``'s value; ``WaitTimeoutError`` when it is missing (``Rendezvous`` reads keys it saw: this one
        was deleted meanwhile)."""
        status, values = self._request(wire.Op.GET, key.encode())
        if status == wire.Status.MISSING:
            raise WaitTimeoutError(f"get: {key!r} is not in the directory at {self.where}")
        return values[0]

    def check(self, keys: list[str]) -> bool:
        return self._request(wire.Op.CHECK, *(k.encode() for k in keys))[1] == [b"1"]

    def add(self, key: str, amount: int) -> int:
        """The counter moved by ``amount``; ``NotYet`` during the directory's grace period (``amount`` != 0)."""
        status, values = self._request(wire.Op.ADD, key.encode(), str(int(amount)).encode())
        if status == wire.Status.WAIT:
            raise NotYet(float(values[0]))
        return int(values[0])

    def raise_to(self, key: str, floor: int) -> int:
        """The counter raised to at least ``floor`` (never lowered; also in the grace period)."""
        return int(self._request(wire.Op.RAISE, key.encode(), str(int(floor)).encode())[1][0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._request(wire.Op.COMPARE_SET, key.encode(), _bytes(expected), _bytes(desired))[1][0]

    def delete_key(self, key: str) -> bool:
        return self._request(wire.Op.DELETE, key.encode())[1] == [b"1"]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def list_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` with its value: one round trip."""
        values = self._request(wire.Op.LIST, prefix.encode())[1]
        return {values[i].decode(): values[i + 1] for i in range(0, len(values) - 1, 2)}

    def ping(self) -> None:
        """One round trip: keeps this member's lease."""
        self._request(wire.Op.PING)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        timeout_s = self._request_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + timeout_s
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"wait: {keys!r} not in the directory after {timeout_s:.3g}s")
            time.sleep(0.01)

    def num_keys(self) -> int:
        return len(self.list_prefix(""))


def _bytes(value: bytes | str | list[int]) -> bytes:
    # torch hands values from C++ as bytes, from Python as str or bytes, from some bindings as a list of ints.
    return value.encode() if isinstance(value, str) else bytes(value)
