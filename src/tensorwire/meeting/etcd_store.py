"""A fleet's directory in etcd: a ``torch.distributed.Store`` over an etcd cluster (``etcd3gw``, etcd's v3 JSON
gateway over HTTP).

What a fleet member's ``Rendezvous`` (``meeting/fleet.py``) calls of its store, as etcd requests: ``set`` (a
put), ``get`` / ``check`` (linearizable ranges: a value read was committed by a quorum), ``compare_set`` and ``add``
(transactions that compare the value, or the revision read, so of two members racing for a key one wins),
``delete_key``. Keys live under ``tensorwire/<fleet>/``, ``<fleet>`` derived from the job token (``fleet_prefix``:
fleets with different tokens share no key, not even a name's claim); values arrive sealed by ``Rendezvous``
(with a job token etcd holds ciphertext bound to its key, as the embedded directory does).

Leases. Everything this store writes with ``set`` / ``compare_set`` is attached to one lease of ``lease_ttl_s``
that the member keeps alive (``keep_alive``, from its heartbeat every half liveness period), so the keys of a
member that died leave etcd by themselves within the TTL, and ``close`` revokes it (they leave at once). Counters
(``add``: the rank counter) carry no lease: ranks are never reused, so the counter outlives every member. A lease
that expired meanwhile (the member could not reach etcd for the TTL) is replaced by a new one at the next write,
and ``keep_alive`` says so, so that the member writes its keys again.

Failures. Each call is bounded by ``request_s`` over all its requests. A request to an endpoint that refuses or
does not answer goes to the next one, so a cluster that lost a minority of its nodes answers as before. When no
endpoint answers within the bound (etcd has no quorum: its live nodes hold every request; or every node is down
or unreachable) the call raises ``PeerLostError`` saying what each endpoint did. A write that timed out may still
be applied by etcd later; every call here is safe to repeat (puts, compares on the value or the revision read).

Credentials (``etcd_access.py``). With a user and password, the store authenticates (``/v3/auth/authenticate``) at
its first request and sends the token with every request; etcd's tokens expire (``--auth-token-ttl``, 300 s by
default, counted from their last use), so a request that etcd answers "invalid auth token" (gRPC ``UNAUTHENTICATED``)
authenticates again, once, and is repeated. With TLS the requests go over https, verified against the CA given (or
the system's), with a client certificate when one is given (etcd's ``--client-cert-auth``). Wrong credentials, a
user without permission on ``tensorwire/``, a certificate that does not verify either way: ``AuthenticationError``
at once (no other endpoint is tried), saying what to check; the password is never shown.

Not thread-safe by design beyond one lock: ``Rendezvous`` makes every call from its one call thread. Non-goals:
watches (members poll, as on the embedded directory); certificate revocation. Values stay sealed with the job
token whatever etcd's own access control.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch.distributed as dist

from ..errors import AuthenticationError, BackendUnavailableError, PeerLostError
from .etcd_access import (
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    NOT_FOUND,
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    USER_EMPTY,
    EtcdAccess,
    grpc_code,
    tls_failure,
)

__all__ = ["EtcdStore", "fleet_prefix"]

PREFIX = "tensorwire/"


def fleet_prefix(token: bytes | None) -> str:
    """The key prefix (under ``tensorwire/``) of the fleet whose job token is ``token``: a MAC of a fixed label, so
    it names the fleet without telling anything of the token; ``open`` for fleets without one."""
    if token is None:
        return "open"
    return hmac.new(token, b"tensorwire etcd fleet prefix", hashlib.sha256).hexdigest()[:32]


def _client_module():
    try:
        import etcd3gw
        import etcd3gw.exceptions
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] == "etcd3gw":
            raise BackendUnavailableError(
                "init: directory='etcd://...' needs the etcd client, which is not installed; "
                "pip install 'tensorwire[etcd]' (or etcd3gw)") from e
        raise
    return etcd3gw


def _session(access: EtcdAccess):
    """An HTTP session (``requests``, etcd3gw's own dependency) presenting the client certificate, if any."""
    import requests

    session = requests.Session()
    if access.cert is not None:
        session.cert = (access.cert, access.key) if access.key is not None else access.cert
    return session


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: bytes | str | list[int]) -> bytes:
    # torch hands values from C++ as bytes, from Python as str or bytes, from some bindings as a list of ints.
    return value.encode() if isinstance(value, str) else bytes(value)


def _ranged(response: dict) -> tuple[bytes, int] | None:
    """The value and mod revision of the one key a range (or a transaction's range) found, or None."""
    kvs = response.get("kvs") or []
    if not kvs:
        return None
    # The gateway leaves out fields at their default: an empty value has no "value".
    return base64.b64decode(kvs[0].get("value", "")), int(kvs[0].get("mod_revision", 0))


class EtcdStore(dist.Store):
    """The keys of one fleet in the etcd cluster at ``endpoints`` (``(host, port)`` of its client URLs).

    ``fleet``: the fleet's own key prefix under ``tensorwire/`` (``fleet_prefix``: derived from the job token, so
    fleets with different tokens never see each other's keys). ``lease_ttl_s``: the TTL of this member's lease
    (rounded up to whole seconds; keep it alive with ``keep_alive`` at least every half TTL). ``request_s``: the
    bound of every call. ``access``: credentials and TLS (``InvalidArgumentError`` here for a certificate file that
    does not load). Every call blocks for its round trips (about a millisecond each on a local network), at most
    ``request_s``."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, lease_ttl_s: float, request_s: float,
                 access: EtcdAccess | None = None, fleet: str = "") -> None:
        super().__init__()
        self._prefix = f"{PREFIX}{fleet}/" if fleet else PREFIX
        etcd3gw = _client_module()
        self._errors = etcd3gw.exceptions
        self._access = access = access or EtcdAccess()
        access.check_files()
        # api_path given: the client does not ask the version first (etcd >= 3.4 serves /v3/).
        self._clients = [etcd3gw.Etcd3Client(host, port, protocol=access.protocol, api_path="/v3/",
                                             session=_session(access)) for host, port in endpoints]
        self._token: str | None = None  # etcd's token for access.user; "" where etcd turned out to need none
        # Given with every request: requests lets REQUESTS_CA_BUNDLE override a session's own CA, not a request's.
        self._tls = {"verify": access.ca} if access.ca is not None else {}
        self.endpoints = [f"{host}:{port}" for host, port in endpoints]
        self._preferred = 0  # the endpoint that answered last: asked first
        self._ttl = max(2, math.ceil(lease_ttl_s))
        self._request_s = request_s
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._lease_reported: int | None = None  # the lease keep_alive last found this member's keys under
        self.set_timeout(datetime.timedelta(seconds=request_s))

    def __repr__(self) -> str:
        return f"EtcdStore({','.join(self.endpoints)})"

    # --- requests ---------------------------------------------------------------------------------------------
    def _post(self, path: str, payload: dict, deadline: float) -> dict:
        """One request, to the first endpoint that answers; ``PeerLostError`` when none did by ``deadline``."""
        failures: dict[str, str] = {}
        waited: dict[str, float] = {}  # per endpoint, over the attempts of this request
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise PeerLostError(f"no answer within {self._request_s:.3g}s (an earlier call still waits for etcd)")
        try:
            while True:
                count = len(self._clients)
                for i in range(count):
                    index = (self._preferred + i) % count
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PeerLostError(self._unanswered(failures))
                    client = self._clients[index]
                    client.timeout = max(remaining / (count - i), 0.01)  # what is left, shared by the endpoints left
                    endpoint, began = self.endpoints[index], time.monotonic()
                    try:
                        result = self._send(index, path, payload)
                    except (self._errors.ConnectionFailedError, self._errors.ConnectionTimeoutError) as e:
                        typed = tls_failure(e, self._access, endpoint) if self._access.tls else None
                        if typed is not None:  # the same on every endpoint: no use trying the others
                            raise typed from None
                        waited[endpoint] = waited.get(endpoint, 0.0) + time.monotonic() - began
                        failures[endpoint] = self._why(e, waited[endpoint])
                        continue
                    self._preferred = index
                    return result
                time.sleep(min(0.02, max(deadline - time.monotonic(), 0.0)))
        finally:
            self._lock.release()

    def _send(self, index: int, path: str, payload: dict) -> dict:
        """One request to endpoint ``index``, authenticated first where credentials are given and no token is
        held; an expired token is renewed once. ``AuthenticationError`` where etcd refuses this member."""
        client = self._clients[index]
        if self._token is None and self._access.password is not None:
            self._authenticate(index)
        try:
            return client.post(client.get_url(path), json=payload, **self._tls)
        except self._errors.Etcd3Exception as e:
            if isinstance(e, (self._errors.ConnectionFailedError, self._errors.ConnectionTimeoutError)):
                raise  # the endpoint did not answer: _post tries the next
            code, error = grpc_code(e.detail_text)
            expired = code == UNAUTHENTICATED or (code == INVALID_ARGUMENT and error == USER_EMPTY)
            if not (expired and self._access.password is not None):
                self._raise_refused(index, e)
        # The token expired (unused for --auth-token-ttl) or etcd enabled authentication since: a new one, once.
        self._authenticate(index)
        try:
            return client.post(client.get_url(path), json=payload, **self._tls)
        except self._errors.Etcd3Exception as e:
            if isinstance(e, (self._errors.ConnectionFailedError, self._errors.ConnectionTimeoutError)):
                raise
            self._raise_refused(index, e)

    def _authenticate(self, index: int) -> None:
        """Trade the user and password for a token (one request to endpoint ``index``; the token is good on every
        endpoint of the cluster), sent with every later request."""
        client, access = self._clients[index], self._access
        try:
            # No stale token along: the request that fetches a new one must not be refused for the old one.
            answer = client.post(client.get_url("/auth/authenticate"), headers={"Authorization": None}, **self._tls,
                                 json={"name": access.user, "password": access.password})
        except self._errors.Etcd3Exception as e:
            if isinstance(e, (self._errors.ConnectionFailedError, self._errors.ConnectionTimeoutError)):
                raise
            code, error = grpc_code(e.detail_text)
            if code == FAILED_PRECONDITION:  # etcd has authentication disabled: nothing to send
                self._use_token("")
                return
            if code == INVALID_ARGUMENT:
                raise AuthenticationError(
                    f"etcd: {self.endpoints[index]} refused etcd user {access.user!r} ({error}); check the user "
                    "(TENSORWIRE_ETCD_USER or etcd://USER@...) and its password (TENSORWIRE_ETCD_PASSWORD or "
                    "TENSORWIRE_ETCD_PASSWORD_FILE) against etcd's users (etcdctl user list)") from None
            raise
        self._use_token(str(answer.get("token", "")))

    def _use_token(self, token: str) -> None:
        self._token = token
        for client in self._clients:
            if token:
                client.session.headers["Authorization"] = token
            else:
                client.session.headers.pop("Authorization", None)

    def _raise_refused(self, index: int, e: Exception) -> NoReturn:
        """Raise ``AuthenticationError`` where etcd's answer ``e`` refuses this member, else ``e`` itself."""
        refused = self._refused(index, *grpc_code(getattr(e, "detail_text", None)))
        if refused is None:
            raise e
        raise refused from None

    def _refused(self, index: int, code: int | None, error: str) -> AuthenticationError | None:
        """The ``AuthenticationError`` of an etcd answer that refuses this member, or None for any other."""
        endpoint, user = self.endpoints[index], self._access.user
        who = f"etcd user {user!r}" if user else "the etcd user of this member's client certificate (its CN)"
        if code == PERMISSION_DENIED:
            return AuthenticationError(
                f"etcd: {endpoint} denied {who} access to the keys under {PREFIX!r} ({error}); grant the user a "
                f"role with readwrite permission on that prefix (etcdctl role grant-permission ROLE readwrite "
                f"--prefix=true {PREFIX})")
        if code == UNAUTHENTICATED or (code == INVALID_ARGUMENT and error == USER_EMPTY):
            if self._access.password is not None:
                return AuthenticationError(f"etcd: {endpoint} refused the token it just gave {who} ({error}); "
                                           "check etcd's --auth-token setting and its logs")
            return AuthenticationError(
                f"etcd: {endpoint} has authentication enabled and this member gave no credentials ({error}); set "
                "TENSORWIRE_ETCD_USER and TENSORWIRE_ETCD_PASSWORD (or TENSORWIRE_ETCD_PASSWORD_FILE), or a client "
                "certificate (TENSORWIRE_ETCD_CERT, TENSORWIRE_ETCD_KEY) where etcd runs with --client-cert-auth")
        return None

    def _why(self, e: Exception, waited_s: float) -> str:
        detail = getattr(e, "detail_text", None) or str(e)
        if "etcdserver:" in detail:  # the node answered: no leader, timed out waiting for a quorum, ...
            return detail[detail.index("etcdserver:"):].split('"')[0]
        if isinstance(e, self._errors.ConnectionTimeoutError):
            return f"no answer in {waited_s:.2g}s"
        if "refused" in detail:
            return "connection refused"
        return detail.splitlines()[0][:120] if detail else type(e).__name__

    def _unanswered(self, failures: dict[str, str]) -> str:
        said = "; ".join(f"{endpoint}: {why}" for endpoint, why in failures.items()) or "no request made"
        hint = ""
        if not self._access.tls and any(why != "connection refused" and not why.startswith(("no answer", "etcdserver"))
                                        for why in failures.values()):
            hint = "; if etcd serves TLS, give etcds://... or TENSORWIRE_ETCD_CA"  # TLS ports drop plain http
        return (f"no etcd endpoint answered within {self._request_s:.3g}s: etcd has no quorum (its live nodes hold "
                f"every request) or its nodes are down or unreachable ({said}){hint}")

    def _deadline(self) -> float:
        return time.monotonic() + self._request_s

    def _txn(self, payload: dict, deadline: float) -> dict:
        return self._post("/kv/txn", payload, deadline)

    def _range(self, key: str, deadline: float) -> tuple[bytes, int] | None:
        return _ranged(self._post("/kv/range", {"key": _b64((self._prefix + key).encode())}, deadline))

    # --- the lease ---------------------------------------------------------------------------------------------
    def _leased(self, write: Callable[[int], dict], deadline: float) -> dict:
        """``write(lease)`` under this member's lease, granted at first use and again when it expired."""
        for _ in range(2):
            lease = self._lease
            if lease is None:
                lease = int(self._post("/lease/grant", {"TTL": self._ttl, "ID": 0}, deadline)["ID"])
                if self._lease_reported is None:
                    self._lease_reported = lease  # the first lease: nothing to write again
                self._lease = lease
            try:
                return write(lease)
            except self._errors.Etcd3Exception as e:
                if grpc_code(getattr(e, "detail_text", None))[0] != NOT_FOUND:  # "requested lease not found"
                    raise
                self._lease = None  # it expired (etcd unreachable for its TTL): a new one, once
        return write(self._lease)

    def keep_alive(self) -> bool:
        """Refresh this member's lease (one round trip). False when its keys were lost since the last call: the
        lease expired (then the next write takes a new one) or was replaced; the caller writes its keys again."""
        if self._lease is not None:
            answer = self._post("/lease/keepalive", {"ID": self._lease}, self._deadline())
            if int(answer.get("result", {}).get("TTL", -1)) <= 0:
                self._lease = None
        kept = self._lease is not None and self._lease == self._lease_reported
        if self._lease is not None:
            self._lease_reported = self._lease
        return kept or self._lease_reported is None

    def revoke(self) -> None:
        """Revoke this member's lease: every key it wrote leaves etcd at once (the counters stay)."""
        if self._lease is not None:
            lease, self._lease = self._lease, None
            self._post("/kv/lease/revoke", {"ID": lease}, self._deadline())

    # --- the Store calls ---------------------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        put, deadline = {"key": _b64((self._prefix + key).encode()), "value": _b64(_bytes(value))}, self._deadline()
        self._leased(lambda lease: self._post("/kv/put", {**put, "lease": lease}, deadline), deadline)

    def get(self, key: str) -> bytes:
        """``key``'s value. A missing key is waited for, within the call's bound (``DistStoreError`` after it):
        ``Rendezvous`` reads only keys it saw, so this is a key deleted meanwhile."""
        deadline = self._deadline()
        while True:
            found = self._range(key, deadline)
            if found is not None:
                return found[0]
            if time.monotonic() + 0.01 >= deadline:
                raise dist.DistStoreError(f"get: {key!r} is not in etcd (timeout after {self._request_s:.3g}s)")
            time.sleep(0.01)

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists: one transaction comparing their create revisions."""
        compare = [{"key": _b64((self._prefix + key).encode()), "target": "CREATE", "result": "GREATER",
                    "create_revision": 0} for key in keys]
        return bool(self._txn({"compare": compare, "success": [], "failure": []}, self._deadline()).get("succeeded"))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        timeout_s = self._request_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + timeout_s
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"wait: {keys!r} not in etcd (timeout after {timeout_s:.3g}s)")
            time.sleep(0.01)

    def delete_key(self, key: str) -> bool:
        answer = self._post("/kv/deleterange", {"key": _b64((self._prefix + key).encode())}, self._deadline())
        return int(answer.get("deleted", 0)) > 0

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """As ``TCPStore``'s: ``desired`` stored (and returned) if ``key`` holds ``expected`` (or is missing and
        ``expected`` is empty), else the value it holds (``expected`` when it is missing)."""
        expected, desired, deadline = _bytes(expected), _bytes(desired), self._deadline()
        encoded = _b64((self._prefix + key).encode())

        def swap(compare: dict) -> tuple[bool, tuple[bytes, int] | None]:
            answer = self._leased(lambda lease: self._txn({
                "compare": [{"key": encoded, **compare}],
                "success": [{"request_put": {"key": encoded, "value": _b64(desired), "lease": lease}}],
                "failure": [{"request_range": {"key": encoded}}]}, deadline), deadline)
            if answer.get("succeeded"):
                return True, None
            return False, _ranged(answer.get("responses", [{}])[0].get("response_range", {}))

        found: tuple[bytes, int] | None = None
        for _ in range(16):
            if not expected:  # a missing key counts as empty; etcd compares no value of a missing key
                done, found = swap({"target": "CREATE", "result": "EQUAL", "create_revision": 0})
                if done:
                    return desired
                if found is None:
                    continue  # deleted meanwhile
                if found[0]:
                    return found[0]
            done, found = swap({"target": "VALUE", "result": "EQUAL", "value": _b64(expected)})
            if done:
                return desired
            if found is not None:
                return found[0]
            if expected:
                return expected
        raise PeerLostError(f"compare_set: {key!r} in etcd keeps changing (16 tries)")

    def add(self, key: str, amount: int) -> int:
        """The counter under ``key`` (decimal, no lease: it outlives the member), moved by ``amount``: a
        transaction on the revision read, tried again when another member moved it first."""
        deadline = self._deadline()
        encoded = _b64((self._prefix + key).encode())
        while True:
            found = self._range(key, deadline)
            current = int(found[0] or b"0") if found is not None else 0
            if amount == 0:
                return current
            compare: dict[str, Any] = ({"target": "MOD", "result": "EQUAL", "mod_revision": found[1]}
                                       if found is not None else
                                       {"target": "CREATE", "result": "EQUAL", "create_revision": 0})
            answer = self._txn({"compare": [{"key": encoded, **compare}], "failure": [], "success": [
                {"request_put": {"key": encoded, "value": _b64(str(current + amount).encode())}}]}, deadline)
            if answer.get("succeeded"):
                return current + amount
            if time.monotonic() >= deadline:
                raise PeerLostError(f"add: the counter {key!r} in etcd kept changing for {self._request_s:.3g}s")

    def raise_to(self, key: str, floor: int) -> int:
        """The counter raised to at least ``floor`` (never lowered)."""
        behind = floor - self.add(key, 0)
        return self.add(key, behind) if behind > 0 else floor - behind

    def list_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` (without this store's own prefix) with its value: one linearizable range."""
        start = (self._prefix + prefix).encode()
        end = start[:-1] + bytes([start[-1] + 1])
        answer = self._post("/kv/range", {"key": _b64(start), "range_end": _b64(end)}, self._deadline())
        return {base64.b64decode(kv["key"]).decode()[len(self._prefix):]: base64.b64decode(kv.get("value", ""))
                for kv in answer.get("kvs") or []}

    def num_keys(self) -> int:
        prefix = self._prefix.encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        answer = self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(end), "count_only": True},
                            self._deadline())
        return int(answer.get("count", 0))
