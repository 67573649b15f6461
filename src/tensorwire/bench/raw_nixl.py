"""The raw NIXL baseline of ``tensorwire bench p2p``: a bare NIXL agent per rank, driven as a raw NIXL user
would drive it (see ``tensorwire.bench.p2p``), so the comparison isolates what tensorwire adds."""

from __future__ import annotations

from typing import Any

import torch

from ..descriptors import MemoryKind, TensorDesc
from ..errors import TransferError

__all__ = ["RawNixl"]


class RawNixl:
    """A bare NIXL agent per rank, driven as a raw NIXL user would (see the module docstring)."""

    def __init__(self, rank: int, store: Any, raw_config: str, wakeup_ms: float) -> None:
        from ..backends.nixl_setup import _import_nixl, _make_agent

        api, bindings = _import_nixl()
        self.rank = rank
        self.name, self.peer_name = f"bench-raw-rank{rank}", f"bench-raw-rank{1 - rank}"
        self.store = store  # also carries the benchmark's own requests (see InboxChecker)
        if raw_config == "sleeping":
            self.agent = _make_agent(api, bindings, self.name, wakeup_ms, sync_mode="NONE")
        elif raw_config == "tensorwire":
            self.agent = _make_agent(api, bindings, self.name, wakeup_ms)
        else:
            self.agent = api.nixl_agent(self.name)
        self._registrations: list[Any] = []

    def register(self, tensor: torch.Tensor) -> None:
        self._registrations.append(self.agent.register_memory([tensor]))

    def exchange_metadata(self) -> None:
        """Publish this agent's metadata (after every registration) and load the peer's."""
        self.store.set(f"raw-md/{self.rank}", self.agent.get_agent_metadata())
        self.agent.add_remote_agent(self.store.get(f"raw-md/{1 - self.rank}"))

    def prepare(self, op: str, local: torch.Tensor, remote: TensorDesc) -> Any:
        mem_type = "DRAM" if remote.kind is MemoryKind.CPU else "VRAM"
        local_descs = self.agent.get_xfer_descs(local)
        remote_descs = self.agent.get_xfer_descs([(remote.addr, remote.nbytes, max(remote.device_index, 0))], mem_type)
        return self.agent.initialize_xfer(op, local_descs, remote_descs, self.peer_name)

    def post_and_wait(self, handle: Any) -> None:
        agent = self.agent
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(f"bench: raw NIXL transfer to {self.peer_name} ended in state {state!r}")

    def close(self) -> None:
        """Deregister and drop the agent. Idempotent."""
        if self.agent is None:
            return
        for registration in self._registrations:
            self.agent.deregister_memory(registration)
        self._registrations = []
        self.agent = None  # dropping the agent joins its progress thread
