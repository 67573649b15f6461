"""A fleet's directory in etcd: a ``torch.distributed.Store`` over an etcd cluster (``etcd3gw``, etcd's v3 JSON
gateway over HTTP).

What a fleet member's ``Rendezvous`` (``directory_client.py``) calls of its store, as etcd requests: ``set`` (a
put), ``get`` / ``check`` (linearizable ranges: a value read was committed by a quorum), ``compare_set`` and ``add``
(transactions that compare the value, or the revision read, so of two members racing for a key one wins),
``delete_key``. Keys live under ``tensorwire/``; values arrive sealed by ``Rendezvous`` (with a job token etcd
holds ciphertext bound to its key, as the embedded directory does).

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

Not thread-safe by design beyond one lock: ``Rendezvous`` makes every call from its one call thread. Non-goals:
TLS and etcd's own authentication (values are sealed with the job token), watches (members poll, as on the
embedded directory).
"""

from __future__ import annotations

import base64
import datetime
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from .errors import BackendUnavailableError, PeerLostError

__all__ = ["EtcdStore"]

PREFIX = "tensorwire/"


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

    ``lease_ttl_s``: the TTL of this member's lease (rounded up to whole seconds; keep it alive with
    ``keep_alive`` at least every half TTL). ``request_s``: the bound of every call. Every call blocks for its
    round trips (about a millisecond each on a local network), at most ``request_s``."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, lease_ttl_s: float, request_s: float) -> None:
        super().__init__()
        etcd3gw = _client_module()
        self._errors = etcd3gw.exceptions
        # api_path given: the client does not ask the version first (etcd >= 3.4 serves /v3/).
        self._clients = [etcd3gw.Etcd3Client(host, port, api_path="/v3/") for host, port in endpoints]
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
                        result = client.post(client.get_url(path), json=payload)
                    except (self._errors.ConnectionFailedError, self._errors.ConnectionTimeoutError) as e:
                        waited[endpoint] = waited.get(endpoint, 0.0) + time.monotonic() - began
                        failures[endpoint] = self._why(e, waited[endpoint])
                        continue
                    self._preferred = index
                    return result
                time.sleep(min(0.02, max(deadline - time.monotonic(), 0.0)))
        finally:
            self._lock.release()

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
        return (f"no etcd endpoint answered within {self._request_s:.3g}s: etcd has no quorum (its live nodes hold "
                f"every request) or its nodes are down or unreachable ({said})")

    def _deadline(self) -> float:
        return time.monotonic() + self._request_s

    def _txn(self, payload: dict, deadline: float) -> dict:
        return self._post("/kv/txn", payload, deadline)

    def _range(self, key: str, deadline: float) -> tuple[bytes, int] | None:
        return _ranged(self._post("/kv/range", {"key": _b64((PREFIX + key).encode())}, deadline))

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
                if "lease not found" not in (getattr(e, "detail_text", None) or ""):
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
        put, deadline = {"key": _b64((PREFIX + key).encode()), "value": _b64(_bytes(value))}, self._deadline()
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
        compare = [{"key": _b64((PREFIX + key).encode()), "target": "CREATE", "result": "GREATER",
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
        answer = self._post("/kv/deleterange", {"key": _b64((PREFIX + key).encode())}, self._deadline())
        return int(answer.get("deleted", 0)) > 0

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """As ``TCPStore``'s: ``desired`` stored (and returned) if ``key`` holds ``expected`` (or is missing and
        ``expected`` is empty), else the value it holds (``expected`` when it is missing)."""
        expected, desired, deadline = _bytes(expected), _bytes(desired), self._deadline()
        encoded = _b64((PREFIX + key).encode())

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
        encoded = _b64((PREFIX + key).encode())
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

    def num_keys(self) -> int:
        prefix = PREFIX.encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        answer = self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(end), "count_only": True},
                            self._deadline())
        return int(answer.get("count", 0))
