"""Who am I, who are my peers, and the key-value store we meet in.

Reads the launcher's environment (torchrun, OpenMPI, SLURM) and connects to torch.distributed's
``TCPStore`` (rank 0 hosts it). Every blocking call takes a timeout and raises ``WaitTimeoutError``;
losing the store's host raises ``PeerLostError``. Non-goal: process-group collectives.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from .errors import InvalidArgumentError, PeerLostError, WaitTimeoutError

__all__ = ["Environment", "resolve_environment", "Rendezvous"]

# (rank, world size, local rank, local world size) variable names per launcher, most specific first.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True)
class Environment:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str
    agent_store: bool = False  # torchrun's agent already hosts a TCPStore at MASTER_ADDR:MASTER_PORT


def _int(value: str, name: str) -> int:
    # SLURM writes e.g. "4(x2)" for tasks per node.
    head = value.split("(")[0].split(",")[0]
    try:
        return int(head)
    except ValueError:
        raise InvalidArgumentError(f"init: environment variable {name}={value!r} is not an integer") from None


def resolve_environment(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> Environment:
    """Keyword overrides first, then the first launcher whose variables are set, else a 1-rank world."""
    env = os.environ
    launcher, found = "none", None
    for name, r, w, lr, lw in _LAUNCHERS:
        if r in env and w in env:
            launcher, found = name, (r, w, lr, lw)
            break
    if found:
        r, w, lr, lw = found
        env_rank, env_world = _int(env[r], r), _int(env[w], w)
        env_local_rank = _int(env[lr], lr) if lr in env else env_rank
        env_local_world = _int(env[lw], lw) if lw in env else env_world
    else:
        env_rank, env_world, env_local_rank, env_local_world = 0, 1, 0, 1
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    local_rank = env_local_rank if rank == env_rank else rank
    local_world = env_local_world if world_size == env_world else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"init: world_size={world_size!r}; give an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"init: rank={rank!r} is outside [0, {world_size}); check RANK and WORLD_SIZE")
    addr = master_addr or env.get("MASTER_ADDR")
    port = master_port if master_port is not None else env.get("MASTER_PORT")
    if world_size > 1 and (not addr or port is None):
        raise InvalidArgumentError(
            f"init: rank {rank} of {world_size} needs a rendezvous address; set MASTER_ADDR and MASTER_PORT "
            "(torchrun does) or pass master_addr=..., master_port=..."
        )
    return Environment(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr or "127.0.0.1",
        master_port=_int(str(port), "MASTER_PORT") if port is not None else 0,
        launcher=launcher,
        # Like torch.distributed's env:// init: under torchrun every rank is a client of the agent's store.
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and master_port is None,
    )


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class Rendezvous:
    """A namespaced view of the TCPStore with bounded waits and the barrier built on it."""

    def __init__(self, env: Environment, timeout_s: float, store: dist.Store | None = None) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self._owns_store = store is None
        if store is None:
            try:
                store = dist.TCPStore(
                    env.master_addr,
                    env.master_port,
                    env.world_size,
                    is_master=env.rank == 0 and not env.agent_store,
                    timeout=_delta(timeout_s),
                    wait_for_workers=False,
                )
            except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError
                if "EADDRINUSE" in str(e):
                    raise InvalidArgumentError(
                        f"init: rank {env.rank} cannot host the store: port {env.master_port} on {env.master_addr} "
                        "is in use (EADDRINUSE); choose another MASTER_PORT"
                    ) from e
                raise PeerLostError(
                    f"init: rank {env.rank} could not reach the store at {env.master_addr}:{env.master_port} "
                    f"within {timeout_s:.0f}s ({e}); is rank 0 running and MASTER_ADDR/MASTER_PORT right?"
                ) from e
        self._raw = store
        self.store = dist.PrefixStore("tensorwire/", store)
        self._barrier_generation = 0

    # --- key/value ----------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self._call(lambda: self.store.set(key, value), f"writing {key!r}")

    def get(self, key: str, timeout_s: float | None = None, what: str | None = None) -> bytes:
        """Blocks until ``key`` exists (at most ``timeout_s``), then returns its value."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.wait([key], timeout_s, what or f"waiting for {key!r}")
        return self._call(lambda: self.store.get(key), f"reading {key!r}")

    def wait(self, keys: list[str], timeout_s: float, what: str) -> None:
        self._call(lambda: self.store.wait(keys, _delta(timeout_s)), what, timeout_s)

    def add(self, key: str, amount: int) -> int:
        return int(self._call(lambda: self.store.add(key, amount), f"adding to {key!r}"))

    def check(self, key: str) -> bool:
        return bool(self._call(lambda: self.store.check([key]), f"checking {key!r}"))

    # --- collectives on the store ---------------------------------------------------------------
    def barrier(self, timeout_s: float | None = None) -> None:
        """Returns when every rank has entered the same barrier; collective, blocking."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._barrier_generation += 1
        key = f"barrier/{self._barrier_generation}"
        if self.add(key, 1) == self.env.world_size:
            self.set(f"{key}/done", b"1")
        self.wait(
            [f"{key}/done"], timeout_s,
            f"barrier {self._barrier_generation}: rank {self.env.rank} waited for {self.env.world_size} ranks",
        )

    def depart(self, timeout_s: float) -> None:
        """Say this rank is done; the store's host waits (bounded) until every rank said so."""
        if self.env.world_size == 1:
            return
        arrived = self.add("departed", 1)
        if self.env.rank != 0 or not self._owns_store or self.env.agent_store:
            return
        deadline = time.monotonic() + timeout_s
        while arrived < self.env.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            arrived = self.add("departed", 0)

    def _call(self, fn, what: str, timeout_s: float | None = None):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - torch's store raises DistStoreError/DistNetworkError/RuntimeError
            text = str(e)
            if isinstance(e, getattr(dist, "DistNetworkError", ())) or "Connection" in text or "Broken pipe" in text:
                raise PeerLostError(
                    f"{what}: lost the store hosted by rank 0 at {self.env.master_addr}:{self.env.master_port} ({text.splitlines()[0]})"
                ) from e
            if "imeout" in text or "timed out" in text:
                seconds = self.timeout_s if timeout_s is None else timeout_s
                raise WaitTimeoutError(
                    f"{what}: not done after {seconds:.3g}s; a peer may be slow, stuck or dead. "
                    "Pass a larger timeout= or check the other ranks"
                ) from e
            raise


def hostname() -> str:
    return socket.gethostname()
