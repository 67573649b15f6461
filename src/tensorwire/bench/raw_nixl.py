"""The raw NIXL baseline of ``tensorwire bench p2p`` and ``bench kv``: a bare NIXL agent per rank, driven as a raw
NIXL user would drive it (see ``tensorwire.bench.p2p``), so the comparison isolates what tensorwire adds.

The agents swap their metadata through a store the benchmark owns and lends to ``tw.init`` (``init_with_store``),
as a raw NIXL user needs a side channel of their own; tensorwire's store stays private to it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..descriptors import MemoryKind, TensorDesc
from ..errors import TransferError

__all__ = ["RawNixl", "init_with_store", "release_store"]


def init_with_store(timeout_s: float) -> tuple[Any, Any]:
    """``(comm, bench_store)`` for a rank started by ``launch``: a ``TCPStore`` of the benchmark's own, lent to
    ``tw.init``, and that store under the prefix ``bench/`` for the benchmark's keys. Blocks until rank 0's store
    answers (at most ``timeout_s``). End with ``release_store`` after ``comm.close()``."""
    import datetime as dt

    import torch.distributed as dist

    import tensorwire as tw

    from ..environment import resolve_environment

    env = resolve_environment()
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0,
                          timeout=dt.timedelta(seconds=timeout_s), wait_for_workers=False)
    comm = tw.init(timeout=timeout_s, store=store)
    return comm, dist.PrefixStore("bench/", store)


def release_store(rank: int, bench_store: Any) -> None:
    """After ``comm.close()`` on both ranks of two: rank 0 hosts the store, so it waits for rank 1's last use of
    it (close() announces departure through it). Blocks up to the store's timeout."""
    if rank == 1:
        bench_store.set("closed", b"1")
    else:
        bench_store.wait(["closed"])


class RawNixl:
    """A bare NIXL agent of one rank of two, driven as a raw NIXL user would (see the module docstring).

    ``raw_config``: ``"sleeping"`` (NIXL's defaults but a progress thread that sleeps ``wakeup_ms`` between
    events), ``"tensorwire"`` (exactly tensorwire's agent configuration) or ``"nixl-default"``."""

    def __init__(self, rank: int, store: Any, raw_config: str, wakeup_ms: float, prefix: str = "bench-raw") -> None:
        from ..backends.nixl_setup import import_nixl, make_agent

        api, bindings = import_nixl()
        self.rank = rank
        self.name, self.peer_name = f"{prefix}-rank{rank}", f"{prefix}-rank{1 - rank}"
        self.store = store  # also carries the benchmark's own requests (see p2p_inbox.InboxChecker)
        if raw_config == "sleeping":
            self.agent = make_agent(api, bindings, self.name, wakeup_ms, sync_mode="NONE")
        elif raw_config == "tensorwire":
            self.agent = make_agent(api, bindings, self.name, wakeup_ms)
        else:
            self.agent = api.nixl_agent(self.name)
        self._registrations: list[Any] = []

    def register(self, tensor: torch.Tensor) -> None:
        self._registrations.append(self.agent.register_memory([tensor]))

    def deregister_all(self) -> None:
        """Deregister every tensor ``register`` registered (before they are freed)."""
        for registration in self._registrations:
            self.agent.deregister_memory(registration)
        self._registrations = []

    def exchange_metadata(self, tag: str = "") -> None:
        """Publish this agent's metadata (after every registration) under ``tag`` and load the peer's. Blocks
        until the peer published it (the store's timeout)."""
        self.store.set(f"raw-md/{tag}/{self.rank}", self.agent.get_agent_metadata())
        self.agent.add_remote_agent(self.store.get(f"raw-md/{tag}/{1 - self.rank}"))

    def forget_peer(self) -> None:
        """Unload the peer's metadata (before the peer's registrations change)."""
        self.agent.remove_remote_agent(self.peer_name)

    def prepare(self, op: str, local: torch.Tensor, remote: TensorDesc) -> Any:
        mem_type = "DRAM" if remote.kind is MemoryKind.CPU else "VRAM"
        local_descs = self.agent.get_xfer_descs(local)
        remote_descs = self.agent.get_xfer_descs([(remote.addr, remote.nbytes, max(remote.device_index, 0))], mem_type)
        return self.agent.initialize_xfer(op, local_descs, remote_descs, self.peer_name)

    def post_and_wait(self, handle: Any) -> None:
        """Post ``handle`` and poll it to the end in a tight loop, as a raw NIXL user would (spins one core). The
        loop is written out here, not shared with ``wait``: this is the baseline of the 4 KiB latency goal."""
        agent = self.agent
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(f"bench: raw NIXL transfer to {self.peer_name} ended in state {state!r}")

    def post(self, handle: Any) -> str:
        """Post ``handle`` (NIXL's ``transfer``); its state: ``"PROC"`` while in flight."""
        return self.agent.transfer(handle)

    def wait(self, handle: Any, state: str) -> None:
        """Poll a posted ``handle`` (last seen in ``state``) to the end in a tight loop."""
        agent = self.agent
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(f"bench: raw NIXL transfer to {self.peer_name} ended in state {state!r}")

    def close(self) -> None:
        """Deregister and drop the agent. Idempotent."""
        if self.agent is None:
            return
        self.deregister_all()
        self.agent = None  # dropping the agent joins its progress thread
