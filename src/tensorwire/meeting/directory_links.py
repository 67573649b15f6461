"""A fleet member's link to its directory, one kind per directory behind one small interface (``DirectoryLink``):
what ``fleet.Fleet`` asks of the embedded directory (``tcp://``: ``directory_store.py``'s authenticated connection
to ``directory.py``) and of etcd (``etcd://``: ``etcd_store.py``) alike, so the fleet's code has no branch per kind.

The interface: ``where`` (as ``init``'s ``directory=`` names it), ``store`` (a store lent to the rendezvous for
good, etcd's; None where the rendezvous opens its own connection with ``connect``), ``sockets`` (the connection a
watchdog may cut), ``keep_alive`` (one round trip; False when this member's lease had expired and its keys went),
``reconnect`` (after a loss: a new store, or None where the same one goes on; and whether the lease was lost), and
``release`` (at ``close``: let this member's keys go at once where the directory does not do it by itself).
Every call blocks for its round trips, bounded by the caller's store calls (``rendezvous.Rendezvous._call``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

from ..environment import Environment
from .directory_store import DirectoryStore
from .etcd_access import EtcdAccess
from .etcd_store import EtcdStore, fleet_prefix

__all__ = ["DirectoryLink", "EmbeddedLink", "EtcdLink", "link_for"]


class DirectoryLink(Protocol):
    where: str
    store: dist.Store | None

    def connect(self, timeout_s: float) -> dist.Store: ...
    def sockets(self, store: dist.Store) -> list[socket.socket]: ...
    def keep_alive(self) -> bool: ...
    def reconnect(self, run: Callable, timeout_s: float) -> tuple[dist.Store | None, bool]: ...
    def release(self) -> None: ...


class EmbeddedLink:
    """The embedded directory: a connection of this member's own, which is its lease (its keys live while it
    does and speaks); a lost one is replaced by a new connection."""

    store = None

    def __init__(self, env: Environment, token: bytes | None, liveness_s: float) -> None:
        self._host, self._port, self._token, self._liveness_s = env.master_addr, env.master_port, token, liveness_s
        self.where = f"tcp://{env.master_addr}:{env.master_port}"

    def connect(self, timeout_s: float) -> DirectoryStore:
        """An authenticated connection (``AuthenticationError`` for another token), tried for ``timeout_s`` while
        the directory does not take connections."""
        return DirectoryStore(self._host, self._port, token=self._token, lease_s=2 * self._liveness_s,
                              connect_s=timeout_s, request_s=self._liveness_s)

    def sockets(self, store: dist.Store) -> list[socket.socket]:
        return [store.socket] if isinstance(store, DirectoryStore) else []

    def keep_alive(self) -> bool:
        return True  # the heartbeat's round trip on the connection is what keeps the lease

    def reconnect(self, run: Callable, timeout_s: float) -> tuple[DirectoryStore, bool]:
        return self.connect(timeout_s), False

    def release(self) -> None:
        """Nothing to do: the directory lets the keys go when the connection closes."""


class EtcdLink:
    """An etcd cluster: one store for the member's life, its keys under one lease that ``keep_alive`` refreshes
    (lost when the member could not reach a quorum for its TTL: then written again under a new one)."""

    def __init__(self, env: Environment, token: bytes | None, liveness_s: float, access: EtcdAccess | None) -> None:
        # The lease outlives two missed heartbeats; a call gives up before the rendezvous's bound (liveness_s).
        self.store = EtcdStore(env.etcd, lease_ttl_s=2 * liveness_s, request_s=0.8 * liveness_s, access=access,
                               fleet=fleet_prefix(token))
        self.where = "etcd://" + ",".join(self.store.endpoints)

    def connect(self, timeout_s: float) -> EtcdStore:
        return self.store

    def sockets(self, store: dist.Store) -> list[socket.socket]:
        return []  # HTTP requests of its own, each bounded

    def keep_alive(self) -> bool:
        return bool(self.store.keep_alive())

    def reconnect(self, run: Callable, timeout_s: float) -> tuple[None, bool]:
        """No connection to make: back once a quorum answers (``run`` bounds the call)."""
        return None, not run(self.store.keep_alive, timeout_s)

    def release(self) -> None:
        """Revoke the lease: this member's keys leave etcd at once."""
        self.store.revoke()


def link_for(env: Environment, token: bytes | None, liveness_s: float,
             etcd_access: EtcdAccess | None = None) -> DirectoryLink:
    """The link to the directory ``env`` names (``env.etcd``: etcd's endpoints, else the embedded directory)."""
    return EtcdLink(env, token, liveness_s, etcd_access) if env.etcd else EmbeddedLink(env, token, liveness_s)
