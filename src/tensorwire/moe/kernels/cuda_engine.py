"""The host op of the ``"cuda"`` MoE backend: spaces, device-side tables, launches (see ``nvlink``).

Spaces are CUDA tensors registered with the communicator (so the ``cuda_ipc`` transport exports them) and
mapped into this process for every peer (``Communicator.peer_pointer``). Creating one is collective
(each rank publishes its space under the same key and looks up every peer's) and synchronises with the
host, so the first call of each shape does; make it once before capturing a CUDA graph. After that:

* with ``capacity``: the routing tables (``routing``'s kernels), the count exchange, the row stores and
  the waits (stream memory operations on flag words, ``nvlink``'s docstring) are all stream-ordered
  device work: no host sync, and the sequence can be captured in a CUDA graph and replayed (a replay
  uses the buffer half its capture used). Errors (an expert id out of range, ranks disagreeing on
  shapes, a capacity overflow) are ORed into a device word that ``Dispatch.check()`` (or the next
  exact-shape call) reads and raises; so is a wait the watchdog had to release.
* without ``capacity``: one host sync reads the count matrix (and the error word) to size the outputs.

Every rank issues its calls on one stream (the current one), in the same order.

``recv_x`` is a view of the receive buffer (no copy out); combine stores the expert outputs into the same
rows (no copy when they were computed in place into ``recv_x``) and the sources pull their weighted sums
from there.

The steps are module functions over plain tensors (``space.tensor``, ``space.peer_bases``) and a ``wait``
callable, so a test can run them on Triton's interpreter with host tensors standing in for the mapped
spaces and a host loop standing in for the stream waits.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ... import cuda
from ...errors import BackendUnavailableError, InvalidArgumentError, WaitTimeoutError
from ..dispatch import Dispatch
from ..exchange import (
    ERROR_EXPERT_OUT_OF_RANGE,
    ERROR_MISMATCH,
    ERROR_OVERFLOW,
    HEADER,
    NO_CAPACITY,
    check_count_rows,
    check_fresh,
    next_power_of_two,
)
from ..layout import SendLayout, placement

if TYPE_CHECKING:
    from ...communicator import Communicator
    from .routing import BlockTables

__all__ = ["SCATTER_PROGRAMS", "CudaEngine", "DataSpace", "SignalSpace"]

# Programs of one scatter_rows launch: enough resident warps to keep a GPU's memory busy (8 per SM on a
# 132-SM H200), and the same on every rank, since each rank waits for this many signals from each source.
SCATTER_PROGRAMS = 1024
TIMED_OUT = 8  # the device error word's bit for a forced wait, beside exchange's ERROR_* bits
_ALIGN = 128


def _align(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


def word_dtype(row_bytes: int) -> torch.dtype:
    """The widest machine word dividing a row, so Triton can move rows 16 bytes at a time."""
    return torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8


# --- spaces ---------------------------------------------------------------------------------------
Wait = Callable[[torch.Tensor, int, int, int], None]  # (space tensor, first flag word, target, count)


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
            f"backend='cuda' sets up its buffers ({key}) on the first call of each shape, which cannot be "
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
            raise BackendUnavailableError(f"backend='cuda': {e}; or pass backend='nixl'") from e
    return tensor, registration, torch.tensor(addresses, dtype=torch.int64).to(device)


# --- steps (plain tensors in, kernels launched on the current stream; no host sync) ---------------
def exchange_counts(kernels: ModuleType, signals: SignalSpace, counts: torch.Tensor, errors: torch.Tensor | None,
                    row_bytes: int, capacity: int | None, num_experts: int, rank: int, world: int, wait: Wait) -> None:
    """Every rank's count row (``exchange``'s format: header, then ``counts [n]`` int64) into this rank's
    slots of the round (whose number the caller bumped): the slots then hold ``[W, HEADER + n]``.
    ``errors``: a 0-dim bool on the device, the out-of-range bit of the header (None: no errors)."""
    kernels.publish_counts[(world,)](
        signals.words, signals.peer_bases, counts, counts if errors is None else errors, row_bytes,
        NO_CAPACITY if capacity is None else capacity, num_experts, rank, world, counts.numel(), signals.stride,
        signals.flags_offset, signals.slots_offset, HEADER_WORDS=HEADER, HAS_ERROR=errors is not None, BLOCK=128,
    )
    wait(signals.tensor, signals.flags_offset, 1, world)


def current_rows(signals: SignalSpace, width: int) -> torch.Tensor:
    """A copy of the round's count rows ``[W, width]`` int64 (for the host: the slots are reused)."""
    return signals.slots.index_select(0, signals.round % 2)[0, :, :width].contiguous()


def store_rows(kernels: ModuleType, space: DataSpace, words: torch.Tensor, order: torch.Tensor | None,
               block_of_pair: torch.Tensor, weights: torch.Tensor | None, topk: int, where: BlockTables, half: int,
               rank: int, world: int) -> None:
    """Store this rank's rows into ROWS[half] of the ranks that hold their blocks. ``words [T, row_words]``;
    send-order row i is pair ``order[i]`` (the identity when ``order`` is None), which copies ``words[pair //
    topk]`` to block ``block_of_pair[pair]`` of ``where``'s ``[W, blocks per rank]`` tables (none when that is
    ``>= W * blocks per rank``); with ``weights`` (one per pair) each row's META is stored too. Every
    rank's DATA_FLAGS[rank] then counts ``SCATTER_PROGRAMS`` more."""
    size = words.element_size()
    row_words = space.row_bytes // size
    block = min(max(next_power_of_two(row_words), 128), 1024)
    pairs = block_of_pair.reshape(-1)
    kernels.scatter_rows[(SCATTER_PROGRAMS,)](
        words, pairs if order is None else order, pairs, pairs if weights is None else weights.reshape(-1),
        where.send_start, where.destination_start, space.peer_bases, pairs.numel(), where.send_start.numel(),
        where.send_start.shape[1], rank, world, space.capacity, half, row_words, space.row_stride_bytes // size,
        space.rows_offset_bytes // size, space.meta_offset, space.flags_offset, TOPK=topk, PROGRAMS=SCATTER_PROGRAMS,
        HAS_ORDER=order is not None, HAS_META=weights is not None, BLOCK=block, num_warps=4,
    )


def signal_ready(kernels: ModuleType, space: DataSpace, rank: int, world: int) -> None:
    kernels.signal_ready[(world,)](space.peer_bases, space.ready_offset, rank)


def pull_combine(kernels: ModuleType, result: torch.Tensor, layout: SendLayout, where: BlockTables,
                 topk_weights: torch.Tensor, space: DataSpace, half: int) -> None:
    """``result [T, H]``: the weighted sum of every pair's expert output, pulled from the peers' ROWS[half]
    (pairs placed by ``layout`` and ``where``, the dispatch's tables)."""
    num_tokens, hidden = result.shape
    if not (num_tokens and hidden):
        return
    size = result.element_size()
    block = min(max(next_power_of_two(hidden), 16), 1024)
    kernels.combine_pull[(num_tokens, -(-hidden // block))](
        result, layout.expert_of_pair.contiguous(), layout.position_of_pair.contiguous(), topk_weights.contiguous(),
        where.send_start, where.destination_start, space.peer_bases, layout.num_experts,
        layout.local_experts, space.capacity, half * space.capacity, hidden, space.row_stride_bytes // size,
        space.rows_offset_bytes // size, TOPK=layout.topk, BLOCK=block, num_warps=4,
    )


def received_meta(space: DataSpace, half: int, rows: int,
                  weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source rank, source token) ``[rows]`` int64 views of META[half], and the weights ``[rows]`` in
    ``weight_dtype`` (one conversion)."""
    meta = space.meta(half)[:, :rows]
    return meta[0], meta[1], meta[2].view(torch.float64).to(weight_dtype)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def raise_errors(bits: int, fn: str, timeout_s: float) -> None:
    if bits & TIMED_OUT:
        raise WaitTimeoutError(f"{fn}: a GPU wait of backend='cuda' was not released by the peers within "
                               f"{timeout_s:.3g}s and was forced open; a peer is stuck, dead or made different MoE "
                               "calls; results since are invalid and this communicator's cuda backend is unusable: "
                               "close it and init a new one")
    if bits & ERROR_EXPERT_OUT_OF_RANGE:
        raise InvalidArgumentError(f"{fn}: topk_idx on some rank held expert ids outside [-1, num_experts) (they were "
                                   "dropped); pass ids in [0, num_experts), or -1 for 'no expert'")
    if bits & ERROR_MISMATCH:
        raise InvalidArgumentError(f"{fn}: the ranks disagreed on num_experts, hidden size x dtype or capacity; pass "
                                   "the same on every rank")
    if bits & ERROR_OVERFLOW:
        raise InvalidArgumentError(f"{fn}: capacity was too small for the rows some rank received (rows past it were "
                                   "dropped, results are invalid); pass a larger capacity=")


class StreamWaits:
    """The ``wait`` of the steps on a GPU: the current stream waits until each of ``count`` flag words
    (32-bit, 8 bytes apart from ``first_word`` of the space) reaches ``target`` (stream memory operations:
    graph-capturable, no SM busy), then ``consume_flags`` subtracts ``target`` from each.

    Watchdog: an eager (not captured) wait is watched by the progress thread; if the stream has not passed
    it within the communicator's ``timeout_s``, the watchdog stores the targets itself (on a stream of its
    own) so that the GPU goes on, and sets ``timed_out``: from then on the engine refuses every call (the
    flags no longer match the peers'). The deadline counts from when the wait was enqueued. Closing the
    communicator opens every eager wait still pending the same way. A replayed graph is not watched.
    """

    def __init__(self, comm: Communicator, kernels: ModuleType) -> None:
        self._comm, self._kernels = comm, kernels
        self._release_stream = None
        # Eager waits whose watchdog has not seen them passed: {key: (event, addresses, target)}. Only the
        # progress thread queries the events (a query on the calling thread would count as a host sync).
        self._pending: dict[int, tuple[torch.cuda.Event, list[int], int]] = {}
        self.timed_out = False
        comm._stream_waiters.add(self)  # close() calls _release_stream_waits

    def __call__(self, space: torch.Tensor, first_word: int, target: int, count: int) -> None:
        stream = torch.cuda.current_stream()
        addresses = [space.data_ptr() + 8 * (first_word + i) for i in range(count)]
        for address in addresses:
            cuda.stream_wait_value(stream, address, target)
        self._kernels.consume_flags[(1,)](space.view(torch.int64), first_word, target, count,
                                          BLOCK=next_power_of_two(count))
        if not torch.cuda.is_current_stream_capturing():
            self._watch(stream, addresses, target)

    def _watch(self, stream, addresses: list[int], target: int) -> None:
        if self._release_stream is None:
            self._release_stream = torch.cuda.Stream(device=stream.device)  # never the stream that waits
        passed = torch.cuda.Event()
        passed.record(stream)
        waiting = (passed, addresses, target)
        key = id(waiting)
        self._pending[key] = waiting
        timeout_s = self._comm.timeout_s
        deadline = time.monotonic() + timeout_s

        def watchdog() -> bool:
            if passed.query():
                self._pending.pop(key, None)
                return True
            if time.monotonic() < deadline:
                return False
            self._pending.pop(key, None)
            self._force_open([waiting], f"a GPU wait was not released within {timeout_s:.3g}s (a peer is stuck or "
                                        "dead)")
            return True

        self._comm._engine.watch(watchdog, on_error=self._watchdog_failed)

    def _force_open(self, waits: list, why: str) -> None:
        """Store the awaited values from a stream of our own, so the waiting streams go on; the engine is
        unusable from then on."""
        self.timed_out = True  # before the stores: a host sync that returns sees it
        cu = cuda.driver()
        with torch.cuda.device(self._release_stream.device):  # the context current on this thread
            handle = cu.CUstream(self._release_stream.cuda_stream)
            for _, addresses, target in waits:
                for address in addresses:
                    cuda.check(cu.cuMemsetD32Async(address, target, 1, handle), "cuMemsetD32Async")
        warnings.warn(f"tensorwire: backend='cuda': {why}; forced it open, MoE calls on this communicator raise "
                      "from now on", RuntimeWarning, stacklevel=2)

    def _watchdog_failed(self, error: Exception) -> None:
        self.timed_out = True
        warnings.warn(f"tensorwire: backend='cuda': the watchdog could not open a GPU wait: {error}", RuntimeWarning,
                      stacklevel=2)

    def _release_stream_waits(self) -> bool:
        """Communicator close: open every eager wait the stream has not passed. True if there was one."""
        waits = [w for w in list(self._pending.values()) if not w[0].query()]
        self._pending.clear()
        if waits:
            self._force_open(waits, f"{len(waits)} GPU wait(s) were still pending when the communicator closed")
        return bool(waits)


# --- the engine -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _State:
    dispatch_index: int
    space: DataSpace
    half: int
    where: BlockTables


class CudaEngine:
    name = "cuda"

    def __init__(self, comm: Communicator) -> None:
        try:
            from . import nvlink, routing  # Triton, imported when the backend first runs
        except ImportError as e:
            missing = e.name or "a module"
            raise BackendUnavailableError(
                f"backend='cuda': importing its Triton kernels failed because {missing!r} could not be imported "
                f"({e}); install triton matching torch {torch.__version__}, or pass backend='nixl'"
            ) from e
        self.kernels, self.routing = nvlink, routing
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.device: torch.device | None = None
        self.error: torch.Tensor | None = None  # int64 [1]: error bits, sticky until reported
        self.dispatches = 0
        self._signals: dict[int, SignalSpace] = {}
        self._data: dict[str, DataSpace] = {}
        self._registrations: list = []  # spaces stay registered for the communicator's life
        self._wait = StreamWaits(comm, nvlink)

    def send_layout(self, topk_idx: torch.Tensor, num_experts: int, world_size: int) -> SendLayout:
        """Three Triton launches (``routing``) instead of ``layout.send_layout``'s torch ops and radix sort."""
        return self.routing.send_layout(topk_idx, num_experts, world_size)

    def dispatch(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor,
                 capacity: int | None) -> Dispatch:
        device = self._bind(x.device, "dispatch")
        me, world, kernels = self.rank, self.world_size, self.kernels
        hidden = x.shape[1]
        row_bytes = hidden * x.element_size()
        with torch.cuda.device(device):
            signals = self._exchange_counts(layout.expert_counts, layout.out_of_range, row_bytes, capacity,
                                            layout.num_experts)
            if capacity is None:
                host = self._sync(current_rows(signals, HEADER + layout.num_experts), "dispatch")  # the one host sync
                rows_per_rank = placement(host[:, HEADER:], me).rows_per_rank.tolist()
                space = self._exact_space("dispatch", max(rows_per_rank), row_bytes, device)
                out_rows = rows_per_rank[me]
            else:
                space = self._space("dispatch", capacity, row_bytes, device)
                out_rows = capacity
            where = self.routing.block_tables(signals.slots, signals.round, me, world, layout.local_experts,
                                              self.error, capacity)
            self.dispatches += 1
            half = space.next_half()
            store_rows(kernels, space, x.view(word_dtype(row_bytes)), layout.order, layout.expert_of_pair, topk_weights,
                       layout.topk, where, half, me, world)  # an expert is a block of the tables
            self._wait(space.tensor, space.flags_offset, SCATTER_PROGRAMS, world)
            recv_x = space.rows(x.dtype, hidden, half)[:out_rows]  # a view: no copy out of the receive buffer
            src_rank, src_idx, weights = received_meta(space, half, out_rows, topk_weights.dtype)
        return Dispatch(
            recv_x=recv_x, tokens_per_expert=where.tokens_per_expert, recv_src_rank=src_rank, recv_src_idx=src_idx,
            recv_weights=weights, num_recv_rows=torch.clamp(where.num_recv_rows, max=space.capacity),
            capacity=capacity, backend=self.name, comm=self.comm, num_tokens=layout.num_tokens, layout=layout,
            topk_weights=topk_weights, state=_State(self.dispatches, space, half, where), engine=self,
        )

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatch) -> torch.Tensor:
        state: _State = dispatched.state
        check_fresh(self.dispatches, state.dispatch_index)
        device = self._bind(expert_out.device, "combine")
        space, world = state.space, self.world_size
        hidden = expert_out.shape[1]
        with torch.cuda.device(device):
            rows = space.rows(expert_out.dtype, hidden, state.half)[:expert_out.shape[0]]
            if not _same_memory(rows, expert_out):  # experts computed in place into recv_x need no copy
                rows.copy_(expert_out)
            signal_ready(self.kernels, space, self.rank, world)
            self._wait(space.tensor, space.ready_offset, 1, world)
            result = torch.empty(dispatched.num_tokens, hidden, dtype=expert_out.dtype, device=device)
            pull_combine(self.kernels, result, dispatched.layout, state.where, dispatched.topk_weights, space,
                         state.half)
        return result

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        device = self._bind(send.device, "all_to_all_v")
        me, world = self.rank, self.world_size
        row_shape = tuple(send.shape[1:])
        row_elements = 1
        for size in row_shape:
            row_elements *= size
        row_bytes = row_elements * send.element_size()
        with torch.cuda.device(device):
            counts = torch.tensor(send_counts, dtype=torch.int64).to(device)
            signals = self._exchange_counts(counts, None, row_bytes, None, world)
            host = self._sync(current_rows(signals, HEADER + world), "all_to_all_v")
            where_host = placement(host[:, HEADER:], me)
            recv_counts = where_host.recv_counts.reshape(-1).tolist()
            num_received = sum(recv_counts)
            if row_bytes == 0:
                return torch.empty(num_received, *row_shape, dtype=send.dtype, device=device), recv_counts
            space = self._exact_space("a2av", max(where_host.rows_per_rank.tolist()), row_bytes, device)
            half = space.next_half()
            words = send.reshape(send.shape[0], row_elements).view(torch.uint8).view(word_dtype(row_bytes))
            destination_of_row = torch.repeat_interleave(torch.arange(world, device=device), counts,
                                                          output_size=send.shape[0])
            where = self.routing.block_tables(signals.slots, signals.round, me, world, 1, self.error, None)
            store_rows(self.kernels, space, words, None, destination_of_row, None, 1, where, half, me, world)
            self._wait(space.tensor, space.flags_offset, SCATTER_PROGRAMS, world)
            recv = space.rows(torch.uint8, row_bytes, half)[:num_received].clone()  # the caller owns the result
        return recv.view(send.dtype).view(num_received, *row_shape), recv_counts

    def check(self, fn: str) -> None:
        """Raise (and clear) the errors recorded on the device or by the watchdog. Synchronises with the host."""
        if self.error is not None:
            bits = int(self.error.item()) | self._watchdog_bits()
            if bits:
                self.error.zero_()
                raise_errors(bits, fn, self.comm.timeout_s)

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
            raise InvalidArgumentError(f"{fn}: backend='cuda' of this communicator runs on {self.device}, these "
                                       f"tensors are on {device}; keep one device per communicator")
        return device

    def _space(self, purpose: str, capacity: int, row_bytes: int, device: torch.device) -> DataSpace:
        key = f"{purpose}/{capacity}/{row_bytes}"
        space = self._data.get(key)
        if space is None:
            space = self._data[key] = self._new_space(key, capacity, row_bytes, device)
        return space

    def _exact_space(self, purpose: str, most_rows: int, row_bytes: int, device: torch.device) -> DataSpace:
        """For exact shapes: the largest space of this row size so far if it fits, else a bigger one (every
        rank sees the same counts, so every rank picks the same)."""
        key = f"exact/{purpose}/{row_bytes}"
        space = self._data.get(key)
        if space is None or space.capacity < most_rows:
            capacity = max(64, next_power_of_two(most_rows))
            space = self._data[key] = self._new_space(f"{key}/{capacity}", capacity, row_bytes, device)
        return space

    def _new_space(self, key: str, capacity: int, row_bytes: int, device: torch.device) -> DataSpace:
        tensor, registration, bases = map_space(self.comm, f"data/{key}",
                                                DataSpace.nbytes(self.world_size, capacity, row_bytes), device)
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
