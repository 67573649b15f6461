"""The host side of the ``"cuda"`` engine's routing tables: buffers and launches of ``kernels/routing.py``.

``layout.send_layout`` and ``layout.placement`` compute the same tables with torch ops: about forty small
kernels and a radix sort per dispatch, which cost more than the rows' own copy at a few thousand tokens.
Here they take four launches, with the same results (the tests compare both). ``kernels/routing.py``
describes the counting sort and the block tables.

The kernels module is passed in (``kernels``: ``tensorwire.moe.kernels.routing``), so importing this module
does not import Triton. Every function is stream-ordered device work: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..count_rows import HEADER
from ..layout import SendLayout
from ..rows import next_power_of_two

__all__ = ["PAIR_BLOCK", "BlockTables", "block_tables", "send_layout"]

PAIR_BLOCK = 1024  # pairs per program of the counting sort: one in-register sort of this many keys


def send_layout(kernels: ModuleType, topk_idx: torch.Tensor, num_experts: int, world_size: int) -> SendLayout:
    """``layout.send_layout`` for ``topk_idx [T, K]`` int64 on a GPU, in three launches."""
    num_tokens, topk = topk_idx.shape
    num_pairs = num_tokens * topk
    device = topk_idx.device
    idx = topk_idx.contiguous()
    bins = next_power_of_two(num_experts + 3)  # experts, "none", "out of range", the padding lanes' bin
    blocks = max(1, -(-num_pairs // PAIR_BLOCK))
    key = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)
    hist = torch.empty(blocks, bins, dtype=torch.int32, device=device)
    within = torch.empty_like(hist)
    base = torch.empty(blocks, bins, dtype=torch.int64, device=device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    out_of_range = torch.empty((), dtype=torch.bool, device=device)
    order = torch.empty(num_pairs, dtype=torch.int64, device=device)
    position = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)
    kernels.count_pairs[(blocks,)](idx_ptr=idx, key_ptr=key, hist_ptr=hist, within_ptr=within, num_pairs=num_pairs,
                                   num_experts=num_experts, BINS=bins, BLOCK=PAIR_BLOCK)
    kernels.offset_blocks[(1,)](hist_ptr=hist, base_ptr=base, counts_ptr=counts, out_of_range_ptr=out_of_range,
                                num_blocks=blocks, num_experts=num_experts, BINS=bins)
    kernels.place_pairs[(blocks,)](idx_ptr=idx, base_ptr=base, within_ptr=within, order_ptr=order,
                                   position_ptr=position, num_pairs=num_pairs, num_experts=num_experts, BINS=bins,
                                   BLOCK=PAIR_BLOCK)
    return SendLayout(num_tokens=num_tokens, topk=topk, num_experts=num_experts, world_size=world_size, order=order,
                      position_of_pair=position, expert_of_pair=key, expert_counts=counts, out_of_range=out_of_range)


@dataclass(frozen=True)
class BlockTables:
    """What the row kernels and ``Dispatch`` need of ``layout.Placement`` (same meanings), int64 on the device:
    ``send_start``/``destination_start [W, L]``, ``tokens_per_expert [L]``, ``num_recv_rows`` (0-dim),
    ``rows_per_rank [W]``."""

    send_start: torch.Tensor
    destination_start: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_recv_rows: torch.Tensor
    rows_per_rank: torch.Tensor


def block_tables(kernels: ModuleType, slots: torch.Tensor, round_word: torch.Tensor, rank: int, world: int,
                 blocks_per_rank: int, error: torch.Tensor, capacity: int | None) -> BlockTables:
    """The tables from this round's count rows in ``slots [2, W, stride]`` int64 (the signal space's), one
    launch. ``capacity`` given: the error bits go into ``error [1]`` int64 on the device."""
    device = slots.device
    send_start = torch.empty(world, blocks_per_rank, dtype=torch.int64, device=device)
    destination_start = torch.empty_like(send_start)
    tokens_per_expert = torch.empty(blocks_per_rank, dtype=torch.int64, device=device)
    num_recv_rows = torch.empty((), dtype=torch.int64, device=device)
    rows_per_rank = torch.empty(world, dtype=torch.int64, device=device)
    kernels.place_blocks[(1,)](
        slots_ptr=slots, round_ptr=round_word, send_start_ptr=send_start, destination_start_ptr=destination_start,
        tokens_per_expert_ptr=tokens_per_expert, num_recv_rows_ptr=num_recv_rows, rows_per_rank_ptr=rows_per_rank,
        error_ptr=error, rank=rank, world=world, blocks_per_rank=blocks_per_rank, stride=slots.shape[2],
        capacity=-1 if capacity is None else capacity, HEADER_WORDS=HEADER, W_P=max(2, next_power_of_two(world)),
        L_P=max(2, next_power_of_two(blocks_per_rank)), CHECK=capacity is not None,
    )
    return BlockTables(send_start, destination_start, tokens_per_expert, num_recv_rows, rows_per_rank)
