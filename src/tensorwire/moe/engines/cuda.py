"""The ``"cuda"`` MoE engine: Triton kernels store rows straight into peers' GPU memory (CUDA IPC).

Its spaces (``cuda_spaces``) are mapped into every peer; its steps (``cuda_steps``) launch ``kernels/nvlink``
on the current stream; its waits (``cuda_waits``) are stream memory operations. The dispatch runs the
shared skeleton (``engine``) with every step on the device:

* with ``capacity``: the count round, the placement (``cuda_routing``'s block tables), the capacity check
  and the row stores are stream-ordered device work: no host sync, and the sequence can be captured in a
  CUDA graph and replayed (a replay uses the buffer half its capture used). Errors (an expert id out of
  range, ranks disagreeing on shapes, a capacity overflow) are ORed into a device word that
  ``Dispatch.check()`` (or the next exact-shape call) reads and raises; so is a wait the watchdog had to
  release.
* without ``capacity``: one host sync reads the count matrix (and the error word) to size the outputs.

Every rank issues its calls on one stream (the current one), in the same order. The first call of each
shape sets up a space (collective, syncs the host): make it before capturing a graph.

``recv_x`` is a view of the receive buffer (no copy out); combine stores the expert outputs into the same
rows (no copy when they were computed in place into ``recv_x``) and the sources pull their weighted sums
from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...errors import BackendUnavailableError, InvalidArgumentError
from ..count_rows import HEADER, check_count_rows
from ..engine import Dispatch, DispatchHandle, Received, SkeletonEngine
from ..layout import Placement, SendLayout, placement
from ..rows import check_fresh, next_power_of_two, row_bytes
from . import cuda_routing
from .cuda_routing import BlockTables
from .cuda_spaces import DataSpace, SignalSpace, map_space, word_dtype
from .cuda_steps import (
    SCATTER_PROGRAMS,
    TIMED_OUT,
    current_rows,
    exchange_counts,
    pull_combine,
    raise_errors,
    received_meta,
    signal_ready,
    store_rows,
)
from .cuda_waits import StreamWaits

if TYPE_CHECKING:
    from ...communicator import Communicator

__all__ = ["CudaEngine"]


@dataclass(frozen=True)
class _Counts:
    """Step 1's result: the signal space holding the round's count rows, what the round was about, and on
    the exact path the rows each rank receives (read on the host)."""

    signals: SignalSpace
    row_bytes: int
    blocks_per_rank: int
    host: Placement | None


@dataclass(frozen=True)
class _Placed:
    """Steps 2 and 3's result: the block tables on the device, the space the rows go to, the rows of out."""

    where: BlockTables
    space: DataSpace
    out_rows: int


@dataclass(frozen=True)
class _State:
    space: DataSpace
    half: int
    where: BlockTables


class CudaEngine(SkeletonEngine):
    name = "cuda"

    def __init__(self, comm: Communicator) -> None:
        try:
            from ..kernels import nvlink, routing  # Triton, imported when the engine is first created
        except ImportError as e:
            missing = e.name or "a module"
            raise BackendUnavailableError(
                f"engine='cuda': importing its Triton kernels failed because {missing!r} could not be imported "
                f"({e}); install triton matching torch {torch.__version__}, or pass engine='nixl'"
            ) from e
        super().__init__(comm)
        self.kernels, self.routing = nvlink, routing
        self.device: torch.device | None = None
        self.error: torch.Tensor | None = None  # int64 [1]: error bits, sticky until reported
        self._signals: dict[int, SignalSpace] = {}
        self._data: dict[str, DataSpace] = {}
        self._registrations: list = []  # spaces stay registered until the engine closes
        self._wait = StreamWaits(comm, nvlink)

    def send_layout(self, topk_idx: torch.Tensor, num_experts: int, world_size: int) -> SendLayout:
        """Three Triton launches (``cuda_routing``) instead of ``layout.send_layout``'s torch ops and radix sort."""
        return cuda_routing.send_layout(self.routing, topk_idx, num_experts, world_size)

    def dispatch(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor,
                 capacity: int | None) -> Dispatch:
        with torch.cuda.device(self._bind(x.device, "dispatch")):
            return super().dispatch(x, layout, topk_weights, capacity)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatch) -> torch.Tensor:
        handle = dispatched._handle
        check_fresh(self.dispatches, handle.dispatch_index)  # before _bind, as the host engines refuse it
        with torch.cuda.device(self._bind(expert_out.device, "combine")):
            return self.return_rows(expert_out, handle, dispatched.num_tokens)

    # --- the skeleton's steps, on the device ------------------------------------------------------
    def count_round(self, counts: torch.Tensor, errors: torch.Tensor | None, row_bytes: int, capacity: int | None,
                    num_experts: int, fn: str) -> _Counts:
        """Every rank's count row into the slots of a new round; on the exact path read on the host (the
        call's one host sync) and checked there."""
        signals = self._exchange_counts(counts, errors, row_bytes, capacity, num_experts)
        blocks_per_rank = num_experts // self.world_size
        if capacity is not None:
            return _Counts(signals, row_bytes, blocks_per_rank, None)
        host = self._sync(current_rows(signals, HEADER + counts.numel()), fn)
        return _Counts(signals, row_bytes, blocks_per_rank, placement(host[:, HEADER:], self.rank))

    def place(self, counts: _Counts, capacity: int | None, fn: str) -> _Placed:
        """The block tables on the device (with ``capacity`` their kernel also checks it, and the headers,
        into the device error word) and the space the rows go to."""
        if capacity is None:
            rows_per_rank = counts.host.rows_per_rank.tolist()
            space = self._exact_space("dispatch", max(rows_per_rank), counts.row_bytes)
            out_rows = rows_per_rank[self.rank]
        else:
            space, out_rows = self._space("dispatch", capacity, counts.row_bytes), capacity
        signals = counts.signals
        where = cuda_routing.block_tables(self.routing, signals.slots, signals.round, self.rank, self.world_size,
                                          counts.blocks_per_rank, self.error, capacity)
        return _Placed(where, space, out_rows)

    def move_rows(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor, where: _Placed,
                  capacity: int | None) -> Received:
        space, tables, world = where.space, where.where, self.world_size
        half = space.next_half()
        store_rows(self.kernels, space, x.view(word_dtype(space.row_bytes)), layout.order, layout.expert_of_pair,
                   topk_weights, layout.topk, tables, half, self.rank, world)  # an expert is a block of the tables
        self._wait(space.tensor, space.flags_offset, SCATTER_PROGRAMS, world)
        recv_x = space.rows(x.dtype, x.shape[1], half)[:where.out_rows]  # a view: no copy out of the buffer
        src_rank, src_idx, weights = received_meta(space, half, where.out_rows, topk_weights.dtype)
        return Received(recv_x=recv_x, tokens_per_expert=tables.tokens_per_expert, recv_src_rank=src_rank,
                        recv_src_idx=src_idx, recv_weights=weights,
                        num_recv_rows=torch.clamp(tables.num_recv_rows, max=space.capacity),
                        state=_State(space, half, tables))

    def return_rows(self, expert_out: torch.Tensor, handle: DispatchHandle, num_tokens: int) -> torch.Tensor:
        state: _State = handle.state
        space, hidden = state.space, expert_out.shape[1]
        rows = space.rows(expert_out.dtype, hidden, state.half)[:expert_out.shape[0]]
        if not _same_memory(rows, expert_out):  # experts computed in place into recv_x need no copy
            rows.copy_(expert_out)
        signal_ready(self.kernels, space, self.rank, self.world_size)
        self._wait(space.tensor, space.ready_offset, 1, self.world_size)
        result = torch.empty(num_tokens, hidden, dtype=expert_out.dtype, device=expert_out.device)
        pull_combine(self.kernels, result, handle.layout, state.where, handle.topk_weights, space, state.half)
        return result

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        device = self._bind(send.device, "all_to_all_v")
        me, world, nbytes = self.rank, self.world_size, row_bytes(send)
        with torch.cuda.device(device):
            counts = torch.tensor(send_counts, dtype=torch.int64).to(device)
            round_ = self.count_round(counts, None, nbytes, None, world, "all_to_all_v")
            recv_counts = round_.host.recv_counts.reshape(-1).tolist()
            num_received = sum(recv_counts)
            if nbytes == 0:
                return torch.empty(num_received, *send.shape[1:], dtype=send.dtype, device=device), recv_counts
            space = self._exact_space("a2av", max(round_.host.rows_per_rank.tolist()), nbytes)
            half = space.next_half()
            row_elements = nbytes // send.element_size()
            words = send.reshape(send.shape[0], row_elements).view(torch.uint8).view(word_dtype(nbytes))
            destination_of_row = torch.repeat_interleave(torch.arange(world, device=device), counts,
                                                          output_size=send.shape[0])
            tables = cuda_routing.block_tables(self.routing, round_.signals.slots, round_.signals.round, me, world, 1,
                                               self.error, None)
            store_rows(self.kernels, space, words, None, destination_of_row, None, 1, tables, half, me, world)
            self._wait(space.tensor, space.flags_offset, SCATTER_PROGRAMS, world)
            recv = space.rows(torch.uint8, nbytes, half)[:num_received].clone()  # the caller owns the result
        return recv.view(send.dtype).view(num_received, *send.shape[1:]), recv_counts

    def check(self, fn: str) -> None:
        """Raise (and clear) the errors recorded on the device or by the watchdog. Synchronises with the host."""
        if self.error is not None:
            bits = int(self.error.item()) | self._watchdog_bits()
            if bits:
                self.error.zero_()
                raise_errors(bits, fn, self.comm.timeout_s)

    def close(self) -> None:
        """Open the GPU waits still pending (peers may never release them) and deregister the spaces. Local,
        idempotent; ``Communicator.close`` calls it."""
        self._wait.release()
        registrations, self._registrations = self._registrations, []
        self._signals, self._data = {}, {}
        for registration in registrations:
            registration.close()

    # --- internals ------------------------------------------------------------------------------
    def _exchange_counts(self, counts: torch.Tensor, errors: torch.Tensor | None, row_bytes: int,
                         capacity: int | None, num_experts: int) -> SignalSpace:
        """Every rank's count row into the slots of a new round of the signal space for this width."""
        stride = max(64, next_power_of_two(HEADER + counts.numel()))
        signals = self._signals.get(stride)
        if signals is None:
            tensor, registration, bases = map_space(self.comm, f"signal/{stride}",
                                                    SignalSpace.nbytes(self.world_size, stride), counts.device)
            self._registrations.append(registration)
            signals = self._signals[stride] = SignalSpace(tensor, bases, self.world_size, stride)
        signals.round.add_(1)
        exchange_counts(self.kernels, signals, counts, errors, row_bytes, capacity, num_experts, self.rank,
                        self.world_size, self._wait)
        return signals

    def _bind(self, device: torch.device, fn: str) -> torch.device:
        if self._wait.timed_out:
            raise_errors(TIMED_OUT, fn, self.comm.timeout_s)
        if self.device is None:
            self.device = device
            self.error = torch.zeros(1, dtype=torch.int64, device=device)
        elif device != self.device:
            raise InvalidArgumentError(f"{fn}: engine='cuda' of this communicator runs on {self.device}, these "
                                       f"tensors are on {device}; keep one device per communicator")
        return device

    def _space(self, purpose: str, capacity: int, row_bytes: int) -> DataSpace:
        key = f"{purpose}/{capacity}/{row_bytes}"
        space = self._data.get(key)
        if space is None:
            space = self._data[key] = self._new_space(key, capacity, row_bytes)
        return space

    def _exact_space(self, purpose: str, most_rows: int, row_bytes: int) -> DataSpace:
        """For exact shapes: the largest space of this row size so far if it fits, else a bigger one (every
        rank sees the same counts, so every rank picks the same)."""
        key = f"exact/{purpose}/{row_bytes}"
        space = self._data.get(key)
        if space is None or space.capacity < most_rows:
            capacity = max(64, next_power_of_two(most_rows))
            space = self._data[key] = self._new_space(f"{key}/{capacity}", capacity, row_bytes)
        return space

    def _new_space(self, key: str, capacity: int, row_bytes: int) -> DataSpace:
        tensor, registration, bases = map_space(self.comm, f"data/{key}",
                                                DataSpace.nbytes(self.world_size, capacity, row_bytes), self.device)
        self._registrations.append(registration)
        return DataSpace(tensor, bases, self.world_size, capacity, row_bytes)

    def _watchdog_bits(self) -> int:
        """TIMED_OUT once the watchdog forced a wait open: sticky, the flags no longer match the peers'."""
        return TIMED_OUT if self._wait.timed_out else 0

    def _sync(self, rows: torch.Tensor, fn: str) -> torch.Tensor:
        """Count rows and error word on the host (the exact path's one sync); raises what they show."""
        host = torch.cat([rows.reshape(-1), self.error]).cpu()
        bits = int(host[-1]) | self._watchdog_bits()
        if bits:
            self.error.zero_()
            raise_errors(bits, fn, self.comm.timeout_s)
        rows = host[:-1].view(rows.shape)
        check_count_rows(rows, fn)
        return rows


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
