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
from .blocks import BlockPool, BlockPoolDesc, BlockTransfer
from .communicator import Communicator, init
from .descriptors import MemoryKind, TensorDesc
from .errors import (
    AuthenticationError,
    BackendUnavailableError,
    ClosedError,
    InvalidArgumentError,
    PeerLostError,
    RevokedError,
    TensorwireError,
    TransferError,
    WaitTimeoutError,
)
from .membership import Member
from .moe import all_to_all_v
from .registration import Registration
from .transfer import Transfer

READ = Op.READ
WRITE = Op.WRITE

__version__ = "0.1.0"

__all__ = [
    "READ", "WRITE", "Op", "Status", "init", "Communicator", "Registration", "Transfer", "TensorDesc",
    "BlockPool", "BlockPoolDesc", "BlockTransfer",
    "MemoryKind", "BackendInfo", "backends", "testing", "TensorwireError", "InvalidArgumentError",
    "ClosedError", "BackendUnavailableError", "TransferError", "WaitTimeoutError", "PeerLostError",
    "RevokedError",
    "AuthenticationError", "moe", "all_to_all_v", "Member",
]
