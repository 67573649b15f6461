"""Which MoE engine moves the rows: the names, what each needs, the default, one engine per communicator.

| engine    | memory    | how                                                              | host sync          |
|-----------|-----------|------------------------------------------------------------------|--------------------|
| ``torch`` | cpu, cuda | torch.distributed all-to-all (Gloo on host, NCCL on GPU)         | one per call       |
| ``nixl``  | cpu, cuda | one-sided WRITEs into peers' registered buffers + notifications  | one per call       |
| ``cuda``  | cuda      | Triton kernels storing into peers' memory through CUDA IPC       | none with capacity |

``engine=None`` picks, for host tensors, ``nixl`` (UCX shared memory beats Gloo's TCP; ``tensorwire
bench`` measures both), and for CUDA tensors ``cuda`` when every rank is on this host and Triton and the
CUDA IPC transport are present, else ``nixl`` (the path that crosses machines).

Engines are created on first use, kept in the communicator's ``moe.engines`` extension slot
(``comm.runtime.extension``), and closed by ``Communicator.close`` (``comm.runtime.close_with``: they release their
buffers, GPU waits and process groups there), never used after it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from ..errors import BackendUnavailableError, InvalidArgumentError
from .engine import Engine

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["ENGINES", "default_engine", "engine"]

ENGINES = ("torch", "nixl", "cuda")
# Engines live on their communicator (an extension slot), not in a module-level WeakKeyDictionary: an engine
# holds registrations, which hold the communicator, so a weak-keyed cache would keep it alive forever.
_ENGINES_SLOT = "moe.engines"


def _cuda_reason(comm: Communicator, device: torch.device) -> str | None:
    """None when the ``cuda`` engine can run here, else why not."""
    if device.type != "cuda":
        return f"it moves CUDA tensors only, these are on {device}"
    if comm.runtime.transports.with_capability("peer_pointers") is None:
        return ("the communicator has no transport that maps peers' GPU memory (CUDA IPC: cuda-python missing? "
                "run 'tensorwire doctor')")
    if comm.local_world_size != comm.world_size:
        return (f"it reaches ranks of this host only, and only {comm.local_world_size} of the "
                f"{comm.world_size} ranks are local")
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton, or tensorwire[cuda])"
    return None


def default_engine(comm: Communicator, device: torch.device) -> str:
    """The fastest engine available for tensors on ``device`` (see the module docstring)."""
    if device.type == "cuda" and _cuda_reason(comm, device) is None:
        return "cuda"
    return "nixl"


def engine(comm: Communicator, requested: str | None, device: torch.device, fn: str) -> Engine:
    """The engine named ``requested`` (None: the default) for ``comm``, created once per communicator."""
    if requested is not None and requested not in ENGINES:
        raise InvalidArgumentError(
            f"{fn}: engine={requested!r} is not one of {', '.join(map(repr, ENGINES))}; pass one of them, "
            "or None for the fastest available"
        )
    name = requested or default_engine(comm, device)
    if name == "cuda":
        reason = _cuda_reason(comm, device)
        if reason is not None:
            raise BackendUnavailableError(
                f"{fn}: engine='cuda' is unavailable: {reason}; "
                "pass engine='nixl' or 'torch'"
            )
    if name == "torch":
        from . import collectives

        available, reason = collectives.availability(device)
        if not available:
            raise BackendUnavailableError(f"{fn}: engine='torch' is unavailable: {reason}; pass engine='nixl'")
    engines = comm.runtime.extension(_ENGINES_SLOT, dict)
    if name not in engines:
        engines[name] = _create(comm, name)
        comm.runtime.close_with(engines[name])
    return engines[name]


def _create(comm: Communicator, name: str) -> Engine:
    """The engine's module is imported on first use: each pulls in what only it needs (Triton, NIXL)."""
    if name == "torch":
        from .engines.torch import TorchEngine

        return TorchEngine(comm)
    if name == "nixl":
        from .engines.nixl import NixlEngine

        return NixlEngine(comm)
    from .engines.cuda import CudaEngine

    return CudaEngine(comm)
