"""A launcher's world: ranks ``0..world_size-1`` known at start (torchrun, mpirun, SLURM, or ``init``'s keywords),
meeting in torch's ``TCPStore`` that rank 0 hosts (or torchrun's agent, or a store lent to ``init``).

What a world has that a fleet has not: a fixed size, a store hosted by one of its ranks (rank 0 stays until every
rank departed, and is watched by every other rank from ``init`` on: a lost store is noticed in any wait), and a
barrier. Everything else (sealed values, bounded calls, rank claims, liveness) is ``Rendezvous``'s.
"""

from __future__ import annotations

import socket
import time

import torch.distributed as dist

from ..errors import InvalidArgumentError, PeerLostError
from .rendezvous import Rendezvous, delta, warn_once
from .store_sockets import listen_socket, store_client_sockets

__all__ = ["World"]


class World(Rendezvous):
    """One rank of a launcher's world (``env.fleet`` is False)."""

    def __init__(self, *args, **kwargs) -> None:
        self._barrier_generation = 0
        super().__init__(*args, **kwargs)

    # --- the meeting interface -------------------------------------------------------------------------------
    @property
    def has_peers(self) -> bool:
        return self.env.world_size > 1

    @property
    def notification_senders(self) -> int:
        return self.env.world_size

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def hosts_store(self) -> bool:
        """This rank hosts the store (rank 0 of a launcher's world, unless torchrun's agent or init's store=)."""
        return self.env.rank == 0 and self._owns_store and not self.env.agent_store

    def _joined(self) -> None:
        if self.env.rank != 0:  # the store's host: watched from the start (a lost store in any wait)
            self.get("alive/0", self.timeout_s, "init: waiting for rank 0's liveness address")
            self.liveness.watch(0)

    def members(self) -> dict:
        raise self._not_a_fleet("members")

    def rank_of(self, name: str, timeout_s: float) -> int:
        raise self._not_a_fleet("rank_of")

    @staticmethod
    def _not_a_fleet(fn: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{fn}: this communicator is a rank of a launcher's world (ranks 0..world_size-1), not a fleet "
            "member; join a fleet with tw.init(directory='tcp://HOST:PORT', name=...)")

    def barrier(self, timeout_s: float | None = None) -> None:
        """Returns when every rank has entered the same barrier; collective, blocking.

        Each rank writes a sealed arrival record, ``barrier/<g>/<rank>``; rank 0 waits for all of them, verifies
        each and writes ``barrier/<g>/done``, which the others wait for and verify. A shared ``add`` counter
        would be cheaper for rank 0 but cannot carry a MAC: anyone reaching the store could count in for a rank
        that has not arrived. A record that fails verification raises ``AuthenticationError``. A rank that is
        gone raises ``PeerLostError`` on rank 0, which says so in ``done`` (``lost <rank>``), so every rank
        raises it within the liveness bound."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._barrier_generation += 1
        generation, env = self._barrier_generation, self.env
        base = f"barrier/{generation}"
        what = f"barrier {generation}: rank {env.rank} waited for {env.world_size} ranks"
        self.set(f"{base}/{env.rank}", b"1")
        if env.rank == 0:
            arrivals = [f"{base}/{r}" for r in range(env.world_size)]
            try:
                self.wait(arrivals, timeout_s, what, ranks=range(1, env.world_size))
            except PeerLostError as e:
                try:
                    self.set(f"{base}/done", f"lost {e}".encode())
                except PeerLostError:
                    pass
                raise
            values = self._call(lambda: self.store.multi_get(arrivals), f"reading {base}")
            for key, value in zip(arrivals, values):
                self._open(key, value)
            self.set(f"{base}/done", b"1")
        done = self.get(f"{base}/done", timeout_s, what, ranks=(0,))
        if done.startswith(b"lost "):
            raise PeerLostError(f"{what}: rank 0 found a rank gone: {done[5:].decode(errors='replace')}")

    def depart(self, timeout_s: float) -> None:
        """Say this rank is done (``departed/<rank>``, sealed) and give up its rank; the store's host waits
        (bounded by ``timeout_s``) until every rank said so with a record that verifies, or is gone (its
        liveness connection broke: a rank that died does not hold the store's host for the whole timeout)."""
        self._release_rank()
        if self.env.world_size == 1:
            return
        self.set(f"departed/{self.env.rank}", b"1")
        if self.env.rank != 0 or not self._owns_store or self.env.agent_store:
            return
        deadline = time.monotonic() + timeout_s
        pending = list(range(1, self.env.world_size))
        start = time.monotonic()
        while pending and time.monotonic() < deadline:
            still = []
            for rank in pending:
                key = f"departed/{rank}"
                if self.check(key) and self._verifies(
                        key, self._call(lambda k=key: self.store.get(k), f"reading {key!r}")):
                    continue  # a record that does not verify is not a departure: keep the store up for that rank
                if self.liveness.lost(rank) is not None and not self.check(key):
                    continue  # gone without departing
                still.append(rank)
            pending = still
            if pending:
                time.sleep(min(0.02, max(0.0002, (time.monotonic() - start) / 32)))

    def _store_name(self) -> str:
        if self._owns_store:
            return f"the store hosted by rank 0 at {self.env.master_addr}:{self.env.master_port}"
        return "the store passed to init (store=)"

    # --- the store ---------------------------------------------------------------------------------------------
    def _namespaced(self, store: dist.Store) -> dist.Store:
        """The store under tensorwire's key prefix."""
        return dist.PrefixStore("tensorwire/", store)

    def _sockets_of(self, store: dist.Store, before: set[int]) -> list[socket.socket]:
        """Our connection(s) to our own ``store``, which the watchdog shuts down to end a call past its bound."""
        return store_client_sockets(before, store.port)

    def _connect(self) -> dist.Store:
        """torch's ``TCPStore``: rank 0 hosts it on ``MASTER_ADDR``'s interface (unless torchrun's agent does)."""
        env, timeout_s = self.env, self.timeout_s
        hosts = env.rank == 0 and not env.agent_store
        listener, why_not = listen_socket(env.master_addr, env.master_port) if hosts else (None, "")
        if why_not:
            warn_once("listen-all", (
                f"tensorwire: the store listens on every interface of rank 0's host, not only MASTER_ADDR's: "
                f"{why_not}; set MASTER_ADDR to rank 0's IP address on the network the ranks share"), stacklevel=5)
        try:
            store = dist.TCPStore(
                env.master_addr,
                listener.getsockname()[1] if listener is not None else env.master_port,
                env.world_size,
                is_master=hosts,
                timeout=delta(timeout_s),
                wait_for_workers=False,
                **({"master_listen_fd": listener.fileno()} if listener is not None else {}),
            )
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError
            if listener is not None:
                try:
                    listener.close()
                except OSError:
                    pass
            if "EADDRINUSE" in str(e):
                raise InvalidArgumentError(
                    f"init: rank {env.rank} cannot host the store: port {env.master_port} on {env.master_addr} "
                    "is in use (EADDRINUSE); choose another MASTER_PORT"
                ) from e
            raise PeerLostError(
                f"init: rank {env.rank} could not reach the store at {env.master_addr}:{env.master_port} "
                f"within {timeout_s:.0f}s ({e}); is rank 0 running and MASTER_ADDR/MASTER_PORT right?"
            ) from e
        if listener is not None:
            listener.detach()  # the store owns the socket now and closes it when it goes
        return store
