"""tensorwire: one-sided tensor transfers between processes and GPUs, PyTorch-native.

    import tensorwire as tw
    with tw.init() as comm:                      # torchrun / mpirun / SLURM environment
        reg = comm.register(buf)                 # contiguous CPU or CUDA tensor
        comm.publish("buf", reg.descs)
        peer = comm.lookup("buf", (comm.rank + 1) % comm.world_size)
        comm.read(out, peer)                     # out: a registered tensor (or a view inside one)
"""

from __future__ import annotations

from . import testing
from .backends import BackendInfo, backends
from .backends.base import Op, Status
from .backends.shm import in_shared_file
from .block_transfer import BlockTransfer
from .blocks import BlockPool, BlockPoolDesc
from .communicator import Communicator
from .descriptors import MemoryKind, TensorDesc
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
from .joining import fleet_from_environment, init
from .meeting.membership import Member
from .moe import all_to_all_v
from .registration import Registration
from .sealing import open_for_job, seal_for_job
from .shared_memory import shared_empty
from .transfer import Transfer

READ = Op.READ
WRITE = Op.WRITE

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
