"""Triton kernels for the ``"cuda"`` engine's routing tables: the send order and the block tables.

Their buffers and launches (keyword arguments, these names) are in ``engines/cuda_routing.py``; importing
this module imports Triton. The tables are ``layout``'s (the tests compare both), in four launches:

Send order (``send_layout``): a stable counting sort of the ``P = T * K`` pairs by expert id, in blocks of
``PAIR_BLOCK`` pairs (``cuda_routing``). Every pair has a *bin*: its expert, ``E`` for "no expert" (-1),
``E + 1`` for an id out of range (sorted with the invalid pairs, and counted, so the error bit needs no extra
pass).

1. ``count_pairs`` (one program per block): the block's histogram over the bins, and its exclusive
   prefix ``within[b, bin]``: how many pairs of the block sort before the bin's first.
2. ``offset_blocks`` (one program): ``base[b, bin]``, where the block's first pair of that bin lands in
   the whole send order (bins before it in every block, then the same bin in earlier blocks), the
   per-expert counts, and the out-of-range flag.
3. ``place_pairs`` (one program per block): sorts the block's ``(bin, lane)`` keys (a stable order) and
   places the j-th of them at ``base[b, bin] + j - within[b, bin]``, writing both directions of the
   permutation (``order`` and ``position_of_pair``).

Block tables (``block_tables``): one program reads every rank's count row straight from the signal space
(the round's slots, no gather copy), and writes the sender's and receiver's tables that the row kernels
read, the receive-side counts, and, with a capacity, the error bits (``count_rows.ERROR_*``) that the
host-synchronised path would raise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..count_rows import ERROR_EXPERT_OUT_OF_RANGE, ERROR_MISMATCH, ERROR_OVERFLOW

__all__ = ["count_pairs", "offset_blocks", "place_blocks", "place_pairs"]

# The error bits as compile-time constants (a kernel may only read globals that are constexpr).
_OUT_OF_RANGE, _MISMATCH, _OVERFLOW = (tl.constexpr(bit) for bit in (ERROR_EXPERT_OUT_OF_RANGE, ERROR_MISMATCH,
                                                                     ERROR_OVERFLOW))


# --- the send order ---------------------------------------------------------------------------------
@triton.jit
def _bins(idx_ptr, block, num_pairs, num_experts, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """The block's pair indices and bins: expert id, ``E`` for -1, ``E + 1`` out of range, ``BINS - 1``
    for lanes past the last pair (sorted after everything, never stored)."""
    pairs = block * BLOCK + tl.arange(0, BLOCK)
    inside = pairs < num_pairs
    idx = tl.load(idx_ptr + pairs, mask=inside, other=-1)
    expert = tl.where((idx >= 0) & (idx < num_experts), idx, tl.where(idx == -1, num_experts, num_experts + 1))
    return pairs, tl.where(inside, expert, BINS - 1).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])  # see nvlink: no new variant mid-step when T changes
def count_pairs(idx_ptr, key_ptr, hist_ptr, within_ptr, num_pairs, num_experts,
                BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (blocks,). ``key[p]`` = the pair's expert, ``E`` when it has none; ``hist[b, :]`` the block's
    bin counts (int32) and ``within[b, :]`` their exclusive prefix."""
    block = tl.program_id(0)
    pairs, bins = _bins(idx_ptr, block, num_pairs, num_experts, BINS, BLOCK)
    tl.store(key_ptr + pairs, tl.minimum(bins, num_experts).to(tl.int64), mask=pairs < num_pairs)
    hist = tl.histogram(bins, BINS)
    columns = block * BINS + tl.arange(0, BINS)
    tl.store(hist_ptr + columns, hist)
    tl.store(within_ptr + columns, tl.cumsum(hist, 0) - hist)


@triton.jit(do_not_specialize=["num_blocks"])
def offset_blocks(hist_ptr, base_ptr, counts_ptr, out_of_range_ptr, num_blocks, num_experts, BINS: tl.constexpr):
    """Grid (1,). ``base[b, bin]`` (int64): the send-order position of block b's first pair of that bin;
    ``counts[e]`` pairs per expert; ``out_of_range`` whether any id was outside [-1, E)."""
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], dtype=tl.int64)
    for block in range(num_blocks):
        total += tl.load(hist_ptr + block * BINS + bins).to(tl.int64)
    running = tl.cumsum(total, 0) - total  # where each bin starts in the whole order
    for block in range(num_blocks):
        tl.store(base_ptr + block * BINS + bins, running)
        running += tl.load(hist_ptr + block * BINS + bins).to(tl.int64)
    tl.store(counts_ptr + bins, total, mask=bins < num_experts)
    tl.store(out_of_range_ptr, tl.sum(tl.where(bins == num_experts + 1, total, 0), 0) > 0)


@triton.jit(do_not_specialize=["num_pairs"])
def place_pairs(idx_ptr, base_ptr, within_ptr, order_ptr, position_ptr, num_pairs, num_experts,
                BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (blocks,). The block's pairs in (bin, pair) order; the j-th lands at ``base[b, bin] + j -
    within[b, bin]``: ``order[position] = pair`` and ``position_of_pair[pair] = position``."""
    block = tl.program_id(0)
    _, bins = _bins(idx_ptr, block, num_pairs, num_experts, BINS, BLOCK)
    lanes = tl.arange(0, BLOCK)
    ranked = tl.sort(bins * BLOCK + lanes)  # unique keys: a stable order inside each bin
    sorted_bins = ranked // BLOCK
    pair = (block * BLOCK + ranked % BLOCK).to(tl.int64)
    columns = block * BINS + sorted_bins
    position = tl.load(base_ptr + columns) + lanes - tl.load(within_ptr + columns)
    inside = pair < num_pairs
    tl.store(order_ptr + position, pair, mask=inside)
    tl.store(position_ptr + pair, position, mask=inside)


# --- the block tables -------------------------------------------------------------------------------
@triton.jit
def place_blocks(slots_ptr, round_ptr, send_start_ptr, destination_start_ptr, tokens_per_expert_ptr,
                 num_recv_rows_ptr, rows_per_rank_ptr, error_ptr, rank, world, blocks_per_rank, stride, capacity,
                 HEADER_WORDS: tl.constexpr, W_P: tl.constexpr, L_P: tl.constexpr, CHECK: tl.constexpr):
    """Grid (1,). Count rows ``[W, HEADER + W * L]`` int64 are rank s's row of this round at ``slots[round %
    2, s]`` (``stride`` words apart). Block ``(d, l)`` = local expert l of rank d. With ``CHECK`` (a
    capacity was given) ORs into ``error[0]``: an out-of-range id on any rank, headers that differ from
    this rank's (num_experts, row bytes, capacity), a rank receiving more than ``capacity`` rows."""
    parity = tl.load(round_ptr) % 2
    rows = slots_ptr + parity * world * stride
    d = tl.arange(0, W_P)[:, None]
    lane = tl.arange(0, L_P)[None, :]
    inside = (d < world) & (lane < blocks_per_rank)
    block = d * blocks_per_rank + lane
    header = tl.arange(0, HEADER_WORDS)
    mine_header = tl.load(rows + rank * stride + header)
    total = tl.zeros([W_P, L_P], dtype=tl.int64)
    before = tl.zeros([W_P, L_P], dtype=tl.int64)  # from the ranks before this one
    mine = tl.zeros([W_P, L_P], dtype=tl.int64)
    errors = tl.zeros([HEADER_WORDS], dtype=tl.int64)
    for source in range(world):
        counts = tl.load(rows + source * stride + HEADER_WORDS + block, mask=inside, other=0)
        total += counts
        before += tl.where(source < rank, counts, 0)
        mine += tl.where(source == rank, counts, 0)
        theirs = tl.load(rows + source * stride + header)
        errors |= tl.where(header == 0, theirs & _OUT_OF_RANGE, tl.where(theirs != mine_header, _MISMATCH, 0))
    rows_per_rank = tl.sum(total, 1)  # [W_P]
    mine_per_rank = tl.sum(mine, 1)
    send_start = (tl.cumsum(mine_per_rank, 0) - mine_per_rank)[:, None] + tl.cumsum(mine, 1) - mine
    destination_start = tl.cumsum(total, 1) - total + before
    tl.store(send_start_ptr + block, send_start, mask=inside)
    tl.store(destination_start_ptr + block, destination_start, mask=inside)
    tokens = tl.sum(tl.where(d == rank, total, 0), 0)  # [L_P]
    tl.store(tokens_per_expert_ptr + tl.arange(0, L_P), tokens, mask=tl.arange(0, L_P) < blocks_per_rank)
    tl.store(num_recv_rows_ptr, tl.sum(tokens, 0))
    tl.store(rows_per_rank_ptr + tl.arange(0, W_P), rows_per_rank, mask=tl.arange(0, W_P) < world)
    if CHECK:
        overflow = tl.where(tl.max(rows_per_rank, 0) > capacity, _OVERFLOW, 0)
        bits = tl.max(errors & _OUT_OF_RANGE, 0) | tl.max(errors & _MISMATCH, 0) | overflow
        tl.store(error_ptr, tl.load(error_ptr) | bits)
