"""The ``"cuda"`` engine's spaces: CUDA buffers every rank allocates alike and maps for every peer.

Spaces are CUDA tensors registered with the communicator (so the ``cuda_ipc`` transport exports them) and
mapped into this process for every peer (``Communicator.peer_pointer``). Creating one is collective (each
rank publishes its space under the same key and looks up every peer's) and synchronises with the host, so
the first call of each shape does; make it once before capturing a CUDA graph. ``kernels/nvlink.py``
draws both layouts and the memory-ordering contract.

The classes only compute offsets and views over a plain tensor, so a test can stand host tensors in for
the mapped spaces and run the kernels on Triton's interpreter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...errors import BackendUnavailableError, InvalidArgumentError

if TYPE_CHECKING:
    from ...communicator import Communicator

__all__ = ["DataSpace", "SignalSpace", "map_space", "word_dtype"]

_ALIGN = 128


def _align(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


def word_dtype(row_bytes: int) -> torch.dtype:
    """The widest machine word dividing a row, so Triton can move rows 16 bytes at a time."""
    return torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8


class SignalSpace:
    """Count exchange, int64 words: round (word 0), COUNT_FLAGS [W], COUNT_SLOTS [2, W, stride]."""

    def __init__(self, tensor: torch.Tensor, peer_bases: torch.Tensor, world: int, stride: int) -> None:
        self.tensor, self.peer_bases, self.stride = tensor, peer_bases, stride
        self.flags_offset = _ALIGN // 8
        self.slots_offset = self.flags_offset + _align(world * 8) // 8
        self.words = tensor.view(torch.int64)
        self.round = self.words[0:1]
        self.slots = self.words[self.slots_offset:self.slots_offset + 2 * world * stride].view(2, world, stride)

    @staticmethod
    def nbytes(world: int, stride: int) -> int:
        return (_ALIGN // 8 + _align(world * 8) // 8 + 2 * world * stride) * 8


class DataSpace:
    """Rows: DATA_FLAGS [W], READY_FLAGS [W], META [2, 3, C] (int64), ROWS [2, C, stride] (``nvlink``)."""

    def __init__(self, tensor: torch.Tensor, peer_bases: torch.Tensor, world: int, capacity: int,
                 row_bytes: int) -> None:
        self.tensor, self.peer_bases = tensor, peer_bases
        self.capacity, self.row_bytes = capacity, row_bytes
        self.row_stride_bytes, self.flags_offset, self.ready_offset, self.meta_offset, self.rows_offset_bytes = \
            self._offsets(world, capacity, row_bytes)
        self.words = tensor.view(torch.int64)
        self.dispatches = 0  # counted on the host, the same on every rank: dispatch n uses half n % 2

    def next_half(self) -> int:
        half = self.dispatches % 2
        self.dispatches += 1
        return half

    @staticmethod
    def _offsets(world: int, capacity: int, row_bytes: int) -> tuple[int, int, int, int, int]:
        row_stride = _align(max(row_bytes, 1), 64)  # 64 bytes: 16 words of 32 bits, Triton's vector hint
        flags = 0
        ready = flags + _align(world * 8) // 8
        meta = ready + _align(world * 8) // 8
        rows = _align((meta + 2 * capacity * 3) * 8)
        return row_stride, flags, ready, meta, rows

    @staticmethod
    def nbytes(world: int, capacity: int, row_bytes: int) -> int:
        row_stride, *_, rows = DataSpace._offsets(world, capacity, row_bytes)
        return rows + 2 * capacity * row_stride

    def rows(self, dtype: torch.dtype, row_elements: int, half: int) -> torch.Tensor:
        """``[C, row_elements]`` view of ROWS[half] in ``dtype`` (strided if a row is not a multiple of 64 bytes)."""
        size = torch.empty((), dtype=dtype).element_size()
        region = self.tensor[self.rows_offset_bytes:].view(dtype).view(2, self.capacity, self.row_stride_bytes // size)
        return region[half, :, :row_elements]

    def meta(self, half: int) -> torch.Tensor:
        """``[3, C]`` int64 view of META[half]: source rank, source token, weight bits (float64) per row."""
        return self.words[self.meta_offset:self.meta_offset + 2 * 3 * self.capacity].view(2, 3, self.capacity)[half]


def map_space(comm: Communicator, key: str, nbytes: int,
              device: torch.device) -> tuple[torch.Tensor, object, torch.Tensor]:
    """A zeroed CUDA buffer registered with ``comm``, published under ``moe/cuda/<key>``, and every rank's
    copy of it as an address in this process (``[W]`` int64 on ``device``). Collective; syncs the host."""
    if torch.cuda.is_current_stream_capturing():
        raise InvalidArgumentError(
            f"engine='cuda' sets up its buffers ({key}) on the first call of each shape, which cannot be "
            "captured; make one call with the same shapes and capacity before capturing the CUDA graph"
        )
    tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)  # zeroed flags before any peer can address them
    registration = comm.register(tensor)
    comm.publish(f"moe/cuda/{key}", registration.descs)
    addresses = []
    for peer in range(comm.world_size):
        if peer == comm.rank:
            addresses.append(tensor.data_ptr())
            continue
        desc = comm.lookup(f"moe/cuda/{key}", peer)[0]
        try:
            addresses.append(comm.peer_pointer(desc))
        except BackendUnavailableError as e:
            raise BackendUnavailableError(f"engine='cuda': {e}; or pass engine='nixl'") from e
    return tensor, registration, torch.tensor(addresses, dtype=torch.int64).to(device)
