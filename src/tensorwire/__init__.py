"""tensorwire: one-sided tensor transfers between processes and GPUs, PyTorch-native.

    import tensorwire as tw
    with tw.init() as comm:                      # torchrun / mpirun / SLURM environment
        reg = comm.register(buf)                 # contiguous CPU or CUDA tensor
        comm.publish("buf", reg.descs)
        peer = comm.lookup("buf", (comm.rank + 1) % comm.world_size)
        comm.read(out, peer)                     # out: a registered tensor (or a view inside one)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Eager, and free of torch: the transports' names, the operations, the errors. ``backends`` must be bound here
# before anything imports the ``tensorwire.backends`` package, which would otherwise take its name.
from .backends import BackendInfo, backends
from .backends.base import Op, Status
from .errors import (
    AuthenticationError,
    BackendUnavailableError,
    ClosedError,
    InvalidArgumentError,
    PeerLostError,
    RevokedError,
    TensorwireError,
    TensorwireWarning,
    TransferError,
    WaitTimeoutError,
)

READ = Op.READ
WRITE = Op.WRITE

# Every public name is imported on first use (PEP 562): ``import tensorwire`` costs no torch, so the ``tensorwire``
# command's --help and a process that only reads a constant stay fast. What each name is, and from where:
_PUBLIC: dict[str, tuple[str, str | None]] = {
    "testing": (".testing", None), "moe": (".moe", None),
    "BlockTransfer": (".block_transfer", "BlockTransfer"),
    "BlockPool": (".blocks", "BlockPool"), "BlockPoolDesc": (".blocks", "BlockPoolDesc"),
    "Communicator": (".communicator", "Communicator"),
    "MemoryKind": (".descriptors", "MemoryKind"), "TensorDesc": (".descriptors", "TensorDesc"),
    "fleet_from_environment": (".joining", "fleet_from_environment"), "init": (".joining", "init"),
    "Member": (".meeting.membership", "Member"), "all_to_all_v": (".moe", "all_to_all_v"),
    "Registration": (".registration", "Registration"),
    "open_for_job": (".sealing", "open_for_job"), "seal_for_job": (".sealing", "seal_for_job"),
    "shared_empty": (".shared_memory", "shared_empty"), "Transfer": (".transfer", "Transfer"),
    "in_shared_file": (".backends.shared_files", "in_shared_file"),
}

if TYPE_CHECKING:  # what a checker, and the layering test, see: the same names, imported eagerly
    from . import moe, testing
    from .backends.shared_files import in_shared_file
    from .block_transfer import BlockTransfer
    from .blocks import BlockPool, BlockPoolDesc
    from .communicator import Communicator
    from .descriptors import MemoryKind, TensorDesc
    from .joining import fleet_from_environment, init
    from .meeting.membership import Member
    from .moe import all_to_all_v
    from .registration import Registration
    from .sealing import open_for_job, seal_for_job
    from .shared_memory import shared_empty
    from .transfer import Transfer


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported now and kept."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'tensorwire' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value: Any = importlib.import_module(module, __name__)
    value = value if attribute is None else getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _package_version() -> str:
    """The installed distribution's version (pyproject.toml is the one place it is written)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorwire")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


__version__ = _package_version()

__all__ = [
    "READ", "WRITE", "Op", "Status", "init", "Communicator", "Registration", "Transfer", "TensorDesc",
    "BlockPool", "BlockPoolDesc", "BlockTransfer",
    "MemoryKind", "BackendInfo", "backends", "testing", "TensorwireError", "TensorwireWarning", "InvalidArgumentError",
    "ClosedError", "BackendUnavailableError", "TransferError", "WaitTimeoutError", "PeerLostError",
    "RevokedError",
    "AuthenticationError", "moe", "all_to_all_v", "Member", "shared_empty", "in_shared_file", "seal_for_job",
    "open_for_job",
    "fleet_from_environment",
]
