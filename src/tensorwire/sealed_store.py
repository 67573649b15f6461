"""A ``torch.distributed.Store`` over the ``Rendezvous``, for process groups built on a communicator's store.

torch's process groups meet through the store they are given: Gloo writes each rank's socket addresses there
(``<context>/<rank>``), NCCL the root's unique id (which carries its address). On the job's store as it is, those
values are stored as they are, so a process that reaches the store port could read them and forge them (point a
rank at its own socket). ``SealedStore`` hands every value to ``Rendezvous.set`` and takes it back through
``Rendezvous.get``, under a key prefix of its own: the values are sealed with the job token however the
``Rendezvous`` seals (bound to their key), a value that does not verify raises ``AuthenticationError`` inside
the group's creation and is not used, and every call is bounded like the ``Rendezvous``'s own (its waits also end
with ``PeerLostError`` once one of ``ranks`` is gone). Without a job token the ``Rendezvous`` stores values as
they are, and so does this store.

What torch 2.13 calls: Gloo ``set``, ``wait`` and ``get`` (seen on this store); NCCL, by its sources, ``set``
and ``get`` (the unique id) and ``check`` (its heartbeat monitor looks for dump signals). ``multi_get`` /
``multi_set`` are served one key at a time, sealed alike. ``add`` is the store's counter, passed through
unauthenticated (a counter cannot carry a MAC): neither group decides anything on one, and nothing here does.
Calls that compare or splice stored bytes (``compare_set``, ``append``), that delete or enumerate keys, or the
queue calls are refused: a sealed value cannot be compared or extended byte for byte, and no group built here
needs them.

Non-goal: a general-purpose store; the job's own values keep their own keys (this store's prefix keeps the
groups' keys apart from them).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, NoReturn

import torch.distributed as dist

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .bootstrap import Rendezvous

__all__ = ["SealedStore"]


def _bytes(value: bytes | str | list[int]) -> bytes:
    # torch hands values from C++ as bytes, from Python as str or bytes, from some bindings as a list of ints.
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore(dist.Store):
    """``rendezvous``'s sealed key-value calls under ``prefix``, as a ``dist.Store`` a process group takes.

    ``ranks``: the ranks whose values this store's waits wait for (a wait ends with ``PeerLostError`` once one
    of them is gone). ``timeout_s`` bounds ``get`` and a ``wait`` without a timeout. Blocking calls sleep while
    they wait (polling the store); none blocks past its timeout plus the liveness bound."""

    def __init__(self, rendezvous: Rendezvous, prefix: str, ranks: tuple[int, ...], timeout_s: float) -> None:
        super().__init__()
        self._rendezvous = rendezvous
        self._prefix = prefix
        self._ranks = ranks
        self._timeout_s = timeout_s
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    def _key(self, key: str) -> str:
        return self._prefix + key

    # --- what process groups call ---------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._rendezvous.set(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._rendezvous.get(self._key(key), self._timeout_s, f"process group: waiting for {key!r}",
                                    self._ranks)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        timeout_s = self._timeout_s if timeout is None else timeout.total_seconds()
        self._rendezvous.wait([self._key(key) for key in keys], timeout_s,
                              f"process group: waiting for {', '.join(map(repr, keys))}", self._ranks)

    def check(self, keys: list[str]) -> bool:
        return all(self._rendezvous.check(self._key(key)) for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        """The store's counter, unauthenticated (anyone reaching the store can move it): decide nothing on it."""
        return self._rendezvous.add(self._key(key), amount)

    def has_extended_api(self) -> bool:
        return False  # the groups use set/wait/get, not multi_get/append, on this store

    # --- what cannot be sealed, and nothing built here calls ----------------------------------------
    def _refuse(self, call: str) -> NoReturn:
        raise InvalidArgumentError(
            f"SealedStore.{call}: not supported on the store under tensorwire's process groups: its values are sealed "
            "with the job token, so they cannot be compared, extended, listed or deleted byte for byte; use "
            "set/get/wait/check")

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        self._refuse("compare_set")

    def append(self, key: str, value: bytes | str) -> None:
        self._refuse("append")

    def delete_key(self, key: str) -> bool:
        self._refuse("delete_key")

    def num_keys(self) -> int:
        self._refuse("num_keys")

    def list_keys(self) -> list[str]:
        self._refuse("list_keys")

    def queue_push(self, key: str, value: bytes | str) -> None:
        self._refuse("queue_push")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        self._refuse("queue_pop")

    def queue_len(self, key: str) -> int:
        self._refuse("queue_len")
