"""Every transport tensorwire has, in the order it prefers them, with what each can reach as data.

The communicator's transports are built from this table (``Transports``, from one ``BackendContext``), it
picks a transport per transfer from it (``reachable``), ``prepare(transport=)`` checks names against it,
``tw.backends()`` and ``tensorwire doctor`` report it, and the benchmarks read which transports are
stream-ordered from it. Adding a transport is one backend module (a class implementing ``base.Backend`` with its
``capabilities`` and ``create``, and a module-level ``info()``) plus one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..descriptors import MemoryKind
from .base import BackendInfo, Capabilities, Segment

__all__ = ["Transport", "TRANSPORTS", "NAMES", "TEST_TRANSPORTS", "FORCEABLE", "transport", "reachable",
           "capability_refusal", "infos", "stream_ordered_names"]


@dataclass(frozen=True)
class Transport:
    """One transport: its name and where its backend class lives."""

    name: str
    module: str  # under tensorwire.backends
    class_name: str

    def _module(self) -> Any:
        return importlib.import_module(f"{__package__}.{self.module}")

    def backend_class(self) -> Any:
        """The ``base.Backend`` class (its module is imported now: each pulls in only what it needs)."""
        return getattr(self._module(), self.class_name)

    @property
    def capabilities(self) -> Capabilities:
        return self.backend_class().capabilities

    def info(self) -> BackendInfo:
        """Whether it works here, and why not (the module's ``info()``)."""
        return self._module().info()


# Preference order: the first that reaches a peer carries the transfer.
TRANSPORTS: tuple[Transport, ...] = (
    Transport("local", "local", "LocalBackend"),  # this very process: a copy (NIXL would take TCP emulation)
    Transport("cuda_ipc", "cuda_ipc", "CudaIpcBackend"),  # GPU memory of a same-host peer, copy engines
    Transport("shm", "shm", "ShmBackend"),  # host memory a same-host peer keeps in a shared file: memcpy
    Transport("nixl", "nixl", "NixlBackend"),  # everything else, across hosts too (UCX)
    Transport("socket", "socket_messages", "SocketMessages"),  # messages only, on one host: where nixl is not installed
)
NAMES: tuple[str, ...] = tuple(t.name for t in TRANSPORTS)
# Transports for tests: never chosen by default, reported by neither ``tw.backends()`` nor the doctor;
# ``prepare(transport=)`` picks them.
TEST_TRANSPORTS: tuple[Transport, ...] = (
    Transport("fake", "fake", "FakeBackend"),  # host loopback completed by a later poll (stream paths in CI)
)
FORCEABLE: tuple[str, ...] = NAMES + tuple(t.name for t in TEST_TRANSPORTS)


def transport(name: str) -> Transport:
    return (TRANSPORTS + TEST_TRANSPORTS)[FORCEABLE.index(name)]


def stream_ordered_names() -> tuple[str, ...]:
    """Transports whose completion is ordered on a CUDA stream without the CPU."""
    return tuple(t.name for t in TRANSPORTS if t.capabilities.stream_ordered)


def reachable(backends: dict[str, Any], to_self: bool, same_host: bool, local_kind: MemoryKind,
              remote_kind: MemoryKind, peer: int, remotes: list[Segment]) -> list[str]:
    """The transports of ``backends`` (name -> instance) that can move ``local_kind`` <-> ``remote_kind``
    memory to ``peer`` (``remotes``: its segments), in preference order. A backend whose reach depends on the
    peer's memory (what it exported) answers ``reaches(peer, remotes)``."""
    names = []
    for entry in TRANSPORTS + TEST_TRANSPORTS:
        backend = backends.get(entry.name)
        if backend is None or capability_refusal(backend.capabilities, to_self, same_host, local_kind, remote_kind):
            continue
        if backend.reaches(peer, remotes):
            names.append(entry.name)
    return names


def capability_refusal(caps: Capabilities, to_self: bool, same_host: bool, local_kind: MemoryKind,
                       remote_kind: MemoryKind) -> str | None:
    """Why a transport with ``caps`` cannot carry such a transfer whatever the peer registered, or None."""
    if to_self and caps.same_process is False:
        return "it does not reach this very process (the local transport does)"
    if not to_self and caps.remote is False:
        return "it reaches this very process only"
    if caps.same_host_only and not same_host:
        return "it reaches ranks of this host only"
    if local_kind not in caps.memory_kinds or remote_kind not in caps.memory_kinds:
        return f"it moves {' and '.join(sorted(k.name for k in caps.memory_kinds))} memory only"
    if caps.same_kind_only and local_kind is not remote_kind:
        return "it moves memory between two ranges of the same kind only"
    return None


def infos() -> dict[str, BackendInfo]:
    """Every transport, whether it works here, and why not; creates no peers."""
    return {t.name: t.info() for t in TRANSPORTS}
