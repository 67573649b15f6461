"""The ``"cuda"`` engine's steps: plain tensors in, ``kernels.nvlink`` launched on the current stream.

Each step takes the kernels module, the spaces (``cuda_spaces``) and a ``wait`` callable (``cuda_waits``
on a GPU), so a test can run them on Triton's interpreter with host tensors standing in for the mapped
spaces and a host loop standing in for the stream waits. No step syncs with the host; every one is
CUDA-graph capturable. Kernels are launched with keyword arguments, named as in ``kernels/nvlink.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from ...errors import InvalidArgumentError, WaitTimeoutError
from ..count_rows import ERROR_EXPERT_OUT_OF_RANGE, ERROR_MISMATCH, ERROR_OVERFLOW, HEADER, NO_CAPACITY
from ..layout import SendLayout
from ..rows import next_power_of_two
from .cuda_routing import BlockTables
from .cuda_spaces import DataSpace, SignalSpace

__all__ = ["SCATTER_PROGRAMS", "TIMED_OUT", "Wait", "current_rows", "exchange_counts", "pull_combine",
           "raise_errors", "received_meta", "signal_ready", "store_rows"]

# Programs of one scatter_rows launch: enough resident warps to keep a GPU's memory busy (8 per SM on a
# 132-SM H200), and the same on every rank, since each rank waits for this many signals from each source.
SCATTER_PROGRAMS = 1024
TIMED_OUT = 8  # the device error word's bit for a forced wait, beside count_rows' ERROR_* bits
Wait = Callable[[torch.Tensor, int, int, int], None]  # (space tensor, first flag word, target, count)


def exchange_counts(kernels: ModuleType, signals: SignalSpace, counts: torch.Tensor, errors: torch.Tensor | None,
                    row_bytes: int, capacity: int | None, num_experts: int, rank: int, world: int, wait: Wait) -> None:
    """Every rank's count row (``count_rows``' format: header, then ``counts [n]`` int64) into this rank's
    slots of the round (whose number the caller bumped): the slots then hold ``[W, HEADER + n]``.
    ``errors``: a 0-dim bool on the device, the out-of-range bit of the header (None: no errors)."""
    kernels.publish_counts[(world,)](
        space_ptr=signals.words, peer_bases_ptr=signals.peer_bases, counts_ptr=counts,
        error_ptr=counts if errors is None else errors, row_bytes=row_bytes,
        capacity=NO_CAPACITY if capacity is None else capacity, num_experts=num_experts, rank=rank, world=world,
        width=counts.numel(), stride=signals.stride, flags_offset=signals.flags_offset,
        slots_offset=signals.slots_offset, HEADER_WORDS=HEADER, HAS_ERROR=errors is not None, BLOCK=128,
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
        words_ptr=words, order_ptr=pairs if order is None else order, block_ptr=pairs,
        weight_ptr=pairs if weights is None else weights.reshape(-1), send_start_ptr=where.send_start,
        destination_start_ptr=where.destination_start, peer_bases_ptr=space.peer_bases, num_rows=pairs.numel(),
        blocks=where.send_start.numel(), blocks_per_rank=where.send_start.shape[1], rank=rank, world=world,
        capacity=space.capacity, half=half, row_words=row_words, row_stride_words=space.row_stride_bytes // size,
        rows_offset_words=space.rows_offset_bytes // size, meta_offset=space.meta_offset,
        flags_offset=space.flags_offset, TOPK=topk, PROGRAMS=SCATTER_PROGRAMS, HAS_ORDER=order is not None,
        HAS_META=weights is not None, BLOCK=block, num_warps=4,
    )


def signal_ready(kernels: ModuleType, space: DataSpace, rank: int, world: int) -> None:
    """Tell every rank that this rank's expert outputs are in its own ROWS (READY_FLAGS[rank] += 1 there)."""
    kernels.signal_ready[(world,)](peer_bases_ptr=space.peer_bases, ready_offset=space.ready_offset, rank=rank)


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
        y_ptr=result, expert_ptr=layout.expert_of_pair.contiguous(), position_ptr=layout.position_of_pair.contiguous(),
        weight_ptr=topk_weights.contiguous(), send_start_ptr=where.send_start,
        destination_start_ptr=where.destination_start, peer_bases_ptr=space.peer_bases,
        num_experts=layout.num_experts, experts_per_rank=layout.local_experts, capacity=space.capacity,
        first_row=half * space.capacity, hidden=hidden, row_stride=space.row_stride_bytes // size,
        rows_offset=space.rows_offset_bytes // size, TOPK=layout.topk, BLOCK=block, num_warps=4,
    )


def received_meta(space: DataSpace, half: int, rows: int,
                  weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source rank, source token) ``[rows]`` int64 views of META[half], and the weights ``[rows]`` in
    ``weight_dtype`` (one conversion)."""
    meta = space.meta(half)[:, :rows]
    return meta[0], meta[1], meta[2].view(torch.float64).to(weight_dtype)


def raise_errors(bits: int, fn: str, timeout_s: float) -> None:
    """Raise what the device error word's ``bits`` say (``count_rows``' ERROR_* and ``TIMED_OUT``)."""
    if bits & TIMED_OUT:
        raise WaitTimeoutError(f"{fn}: a GPU wait of engine='cuda' was not released by the peers within "
                               f"{timeout_s:.3g}s and was forced open; a peer is stuck, dead or made different MoE "
                               "calls; results since are invalid and this communicator's cuda engine is unusable: "
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
