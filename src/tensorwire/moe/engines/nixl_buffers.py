"""The ``"nixl"`` MoE engine's registered buffers: receive buffers every peer knows the size of, staging buffers
NIXL reads from, and the block pools over them.

Receive buffers are registered once per family (purpose, device kind) and grown (re-registered and
re-published under a key naming their size) when a call needs more. Sizes are a pure function of the count
matrix every rank holds, so every rank knows every peer's current size without asking, and looks a grown
buffer up once. Outgrown buffers stay registered until the engine closes (``retire``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...blocks import BlockPool
from ...descriptors import TensorDesc
from ..rows import next_power_of_two

if TYPE_CHECKING:
    from ...communicator import Communicator

__all__ = ["Buffer", "Stream", "NixlBuffers", "rows_or_empty"]

MIN_BUFFER_BYTES = 4096


class Buffer:
    """A registered byte buffer of this rank (``tensor [nbytes]`` uint8)."""

    def __init__(self, comm: Communicator, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.registration = comm.register(self.tensor)
        self.desc: TensorDesc = self.registration.descs[0]

    def rows(self, dtype: torch.dtype, count: int, row_shape: tuple[int, ...]) -> torch.Tensor:
        """The first ``count`` rows of ``row_shape`` and ``dtype``, as a view."""
        row_elements = 1
        for size in row_shape:
            row_elements *= size
        nbytes = count * row_elements * torch.empty((), dtype=dtype).element_size()
        return self.tensor[:nbytes].view(dtype).view(count, *row_shape)

    def close(self) -> None:
        self.registration.close()


@dataclass(frozen=True)
class Stream:
    """Rows of one kind that travel in one WRITE: read from a registered ``stage`` buffer, written into the peer's
    receive buffer of ``family``, ``row_bytes`` each."""

    stage: Buffer
    family: str
    row_bytes: int


def rows_or_empty(buffer: Buffer | None, dtype: torch.dtype, count: int, row_shape: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    """``count`` rows of ``buffer`` (a view), or zeros where there is no buffer (nothing to receive)."""
    if buffer is None:
        return torch.zeros(count, *row_shape, dtype=dtype, device=device)
    return buffer.rows(dtype, count, row_shape)


class NixlBuffers:
    """One engine's buffers. ``sizes[family]``: every rank's receive buffer size, the same on every rank."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self.sizes: dict[str, list[int]] = {}
        self._receive: dict[str, Buffer] = {}
        self._remote: dict[tuple[str, int], tuple[int, TensorDesc]] = {}
        self._staging: dict[str, Buffer] = {}
        self._retired: list[Buffer] = []  # outgrown buffers, kept registered (see retire)
        self._pools: dict[tuple, BlockPool] = {}  # block pools over staging buffers, see pool

    def receive(self, family: str, need: list[int], device: torch.device) -> Buffer | None:
        """This rank's receive buffer of ``family``, grown if ``need[rank]`` bytes do not fit; also grows this
        rank's record of every peer's size (the same rule runs on every rank). May register and publish."""
        comm = self._comm
        sizes = self.sizes.setdefault(family, [0] * comm.world_size)
        for rank, nbytes in enumerate(need):
            if nbytes > sizes[rank]:
                sizes[rank] = max(MIN_BUFFER_BYTES, next_power_of_two(nbytes))
        mine = self._receive.get(family)
        if sizes[comm.rank] and (mine is None or mine.nbytes != sizes[comm.rank]):
            if mine is not None:
                self.retire(mine)
            mine = self._receive[family] = Buffer(comm, sizes[comm.rank], device)
            comm.publish(f"moe/nixl/{family}/{mine.nbytes}", mine.desc)
        return mine

    def peer(self, family: str, peer: int) -> TensorDesc:
        """The descriptor of ``peer``'s current ``family`` buffer (looked up once per size; blocks then)."""
        size = self.sizes[family][peer]
        cached = self._remote.get((family, peer))
        if cached is None or cached[0] != size:
            desc = self._comm.lookup(f"moe/nixl/{family}/{size}", peer)[0]
            cached = self._remote[(family, peer)] = (size, desc)
        return cached[1]

    def stage(self, name: str, nbytes: int, device: torch.device) -> Buffer:
        """A registered local buffer of at least ``nbytes`` (rows are gathered into it for NIXL to read)."""
        buffer = self._staging.get(name)
        if buffer is None or buffer.nbytes < nbytes or buffer.tensor.device != device:
            if buffer is not None:
                self.retire(buffer)
            nbytes = max(MIN_BUFFER_BYTES, next_power_of_two(nbytes))
            buffer = self._staging[name] = Buffer(self._comm, nbytes, device)
        return buffer

    def retire(self, *buffers: Buffer) -> None:
        """Keep outgrown buffers registered until the engine closes, so no address a peer has seen is freed and
        handed to the next buffer mid-job. Growth is geometric: at most as much again as the largest buffers.
        Block pools over them (and their WRITEs) are closed: nothing is in flight between calls."""
        self._retired.extend(buffers)
        gone = {id(buffer) for buffer in buffers}
        for key in [key for key in self._pools if gone.intersection(key[0])]:
            self._pools.pop(key).close()

    def pool(self, streams: list[Stream]) -> BlockPool:
        """A block pool whose block ``i`` is row ``i`` of every stream's stage buffer (views inside their
        registrations: nothing is registered again), made once per (buffers, bytes per row)."""
        key = (tuple(id(stream.stage) for stream in streams), tuple(stream.row_bytes for stream in streams))
        pool = self._pools.get(key)
        if pool is None:
            rows = min(stream.stage.nbytes // stream.row_bytes for stream in streams)
            views = [stream.stage.tensor[:rows * stream.row_bytes].view(rows, stream.row_bytes) for stream in streams]
            pool = self._pools[key] = self._comm.register_blocks(views)
        return pool

    def close(self, *more: Buffer) -> None:
        """Close the pools and deregister every buffer (and ``more``). Local; idempotent."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        buffers = [*self._receive.values(), *self._staging.values(), *self._retired, *more]
        self._receive, self._staging, self._retired = {}, {}, []
        for buffer in buffers:
            buffer.close()
