"""Triton kernels of the ``"cuda"`` MoE backend: rows stored straight into peers' GPU memory.

Importing this module imports Triton; ``cuda_engine`` imports it only when the backend first runs.

Memory. Every rank allocates the same *spaces* (same sizes, same offsets), registers them with the
communicator and maps every peer's copy through CUDA IPC, so a kernel holds ``peer_bases[r]``, the address
of rank r's space *in this process*. A kernel stores into a peer's space directly (NVLink, or the same GPU).

Signal space (count exchange; one per count-row width)::

    word 0                      round     count exchanges so far (this rank only; bumped before each)
    COUNT_FLAGS [W]             word s:   the round of the last count row rank s stored here
    COUNT_SLOTS [2, W, stride]  [round % 2, s]: rank s's count row of that round

Data space (rows; one per (purpose, capacity C, row bytes))::

    word 0                      round     dispatches into this space so far (this rank only)
    DATA_FLAGS  [W, P]          [s, p]:   the round of the last dispatch whose rows program p of rank s
                                          has finished storing here
    READY_FLAGS [2, W]          [round % 2, r]: the round whose expert outputs rank r has in place
    META        [2, C, 3]       int64 (source rank, token, weight bits) per received row
    ROWS        [2, C, row]     the rows (row padded to 16 bytes)

Data flow of one dispatch (P programs per peer, each row once)::

    rank s                                   rank r
    allgather_counts: row -> r.COUNT_SLOTS[round%2][s], release-store r.COUNT_FLAGS[s] = round
                      spin (acquire) until s.COUNT_FLAGS[r] >= round, copy the slot out
    (torch ops on the device: placement tables from the count matrix)
    dispatch_rows:    x[token] -> r.ROWS[round%2][its final row], meta -> r.META[...]
                      release-store r.DATA_FLAGS[s][p] = round        wait_flags: spin until every
                                                                      DATA_FLAGS[s][p] >= round
    combine:          (r copies its expert outputs into its own ROWS[round%2] and release-stores
                      s.READY_FLAGS[round%2][r] = round for every s)
    wait_flags: spin until READY_FLAGS[round%2][r] >= round for every r
    combine_pull:     y[t] = sum_k w[t,k] * r.ROWS[round%2][row(t,k)], loads straight from the peers

Memory-ordering contract.
  * A producer stores its data with plain stores, then ``tl.debug_barrier()`` (every thread of the
    program has stored), then ONE ``atomic_xchg(flag, round, sem="release", scope="sys")``: a release at
    system scope, cumulative over the program's stores; for READY the stores were made by earlier kernels
    of the same stream, which complete before the releasing kernel starts.
  * A consumer spins with ``atomic_add(flag, 0, sem="acquire", scope="sys")`` until ``flag >= round``;
    everything it (or a later kernel of its stream) reads afterwards sees the producer's stores.
  * Flags only grow (they hold rounds), so nothing is ever reset and a CUDA graph replays unchanged: the
    round lives in device memory and is bumped by a device op.
  * Reuse: rows of round n+1 are stored only after every rank has sent its round n+1 count row, i.e.
    finished round n; count slots and row regions alternate between two rounds (``round % 2``), which is
    why a dispatch must be combined before the second dispatch after it.
  * Every spin gives up after ``max_spins`` polls, ORs ``TIMED_OUT`` into the error word and returns:
    a dead peer never hangs the GPU; ``Dispatch.check()`` reports it.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["allgather_counts", "combine_pull", "dispatch_rows", "signal_ready", "wait_flags"]


@triton.jit
def _wait_at_least(flag_ptr, target, error_ptr, max_spins, TIMED_OUT: tl.constexpr):
    """Spin (acquire, system scope) until ``*flag_ptr >= target``, or flag a timeout."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < target) & (spins < max_spins):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    if seen < target:
        tl.atomic_or(error_ptr, TIMED_OUT)


@triton.jit
def allgather_counts(space_ptr, peer_bases_ptr, row_ptr, out_ptr, error_ptr, rank, world, width, stride,
                     flags_offset, slots_offset, max_spins, TIMED_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (W,). Program p stores this rank's count row into rank p's slot, signals it, then waits for
    rank p's row here and copies it to ``out[p]``. ``space_ptr``: this rank's signal space (int64 words;
    word 0 is the round, already bumped); offsets are in words."""
    peer = tl.program_id(0)
    round_ = tl.load(space_ptr)
    parity = round_ % 2
    remote = tl.load(peer_bases_ptr + peer).to(tl.pointer_type(tl.int64))
    lanes = tl.arange(0, BLOCK)
    slot = remote + slots_offset + (parity * world + rank) * stride
    for start in range(0, width, BLOCK):
        mask = start + lanes < width
        tl.store(slot + start + lanes, tl.load(row_ptr + start + lanes, mask=mask), mask=mask)
    tl.debug_barrier()
    tl.atomic_xchg(remote + flags_offset + rank, round_, sem="release", scope="sys")

    _wait_at_least(space_ptr + flags_offset + peer, round_, error_ptr, max_spins, TIMED_OUT)
    tl.debug_barrier()
    mine = space_ptr + slots_offset + (parity * world + peer) * stride
    for start in range(0, width, BLOCK):
        mask = start + lanes < width
        values = tl.load(mine + start + lanes, mask=mask, volatile=True)
        tl.store(out_ptr + peer * width + start + lanes, values, mask=mask)


@triton.jit
def dispatch_rows(words_ptr, token_ptr, weight_bits_ptr, send_counts_ptr, send_start_ptr, destination_start_ptr,
                  peer_bases_ptr, round_ptr, rank, local_experts, capacity, row_words, row_stride_words,
                  rows_offset_words, meta_offset, flags_offset,
                  PROGRAMS_PER_PEER: tl.constexpr, HAS_META: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (W * P,). Program (peer, lane) stores rows lane, lane + P, ... of each (peer, local expert)
    block of this rank's send order into the peer's ROWS region at their final position (rows that would
    land past ``capacity`` are dropped; the host side flags the overflow), with their META, then
    release-stores its DATA_FLAGS word at the peer.

    ``words_ptr``: the rows as machine words ``[T, row_words]`` (int32/int16/uint8: 16-byte accesses where
    alignment allows). ``token_ptr`` [T*K]: the source row of each send-order row. Tables ``[W, L]`` int64.
    ``round_ptr``: this data space's round (already bumped). Offsets: ``rows_offset_words`` in words,
    ``meta_offset``/``flags_offset`` in int64 words, all from the space's base."""
    program = tl.program_id(0)
    peer = program // PROGRAMS_PER_PEER
    lane = program % PROGRAMS_PER_PEER
    round_ = tl.load(round_ptr)
    parity = round_ % 2
    base = tl.load(peer_bases_ptr + peer)
    rows_region = base.to(tl.pointer_type(words_ptr.dtype.element_ty)) + rows_offset_words
    rows_region = tl.multiple_of(rows_region, 16)
    longs = base.to(tl.pointer_type(tl.int64))
    lanes = tl.arange(0, BLOCK)
    meta_lanes = tl.arange(0, 4)
    for expert in range(local_experts):
        count = tl.load(send_counts_ptr + peer * local_experts + expert)
        first = tl.load(send_start_ptr + peer * local_experts + expert)
        target = tl.load(destination_start_ptr + peer * local_experts + expert)
        for j in range(lane, count, PROGRAMS_PER_PEER):
            row = target + j
            if row < capacity:
                token = tl.load(token_ptr + first + j)
                source = words_ptr + token * row_words
                destination = rows_region + (parity * capacity + row) * row_stride_words
                for start in range(0, row_words, BLOCK):
                    mask = start + lanes < row_words
                    tl.store(destination + start + lanes, tl.load(source + start + lanes, mask=mask), mask=mask)
                if HAS_META:
                    weight_bits = tl.load(weight_bits_ptr + first + j)
                    meta = tl.where(meta_lanes == 0, rank, tl.where(meta_lanes == 1, token, weight_bits))
                    meta_row = longs + meta_offset + (parity * capacity + row) * 3
                    tl.store(meta_row + meta_lanes, meta.to(tl.int64), mask=meta_lanes < 3)
    tl.debug_barrier()
    tl.atomic_xchg(longs + flags_offset + rank * PROGRAMS_PER_PEER + lane, round_, sem="release", scope="sys")


@triton.jit
def wait_flags(space_ptr, flags_offset, per_source, parity_stride, target_ptr, error_ptr, max_spins,
               TIMED_OUT: tl.constexpr):
    """Grid (W,). Program s waits until the ``per_source`` words at ``flags_offset + (target % 2) *
    parity_stride + s * per_source`` of this rank's space all reach ``*target_ptr``."""
    source = tl.program_id(0)
    target = tl.load(target_ptr)
    first = space_ptr + flags_offset + (target % 2) * parity_stride + source * per_source
    for j in range(per_source):
        _wait_at_least(first + j, target, error_ptr, max_spins, TIMED_OUT)


@triton.jit
def signal_ready(peer_bases_ptr, target_ptr, ready_offset, rank, world):
    """Grid (W,). Program p release-stores ``p.READY_FLAGS[round % 2][rank] = round``: this rank's expert
    outputs (stored into its own ROWS by the previous kernels of this stream) may be pulled."""
    peer = tl.program_id(0)
    round_ = tl.load(target_ptr)
    remote = tl.load(peer_bases_ptr + peer).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(remote + ready_offset + (round_ % 2) * world + rank, round_, sem="release", scope="sys")


@triton.jit
def combine_pull(y_ptr, pair_rank_ptr, pair_row_ptr, pair_weight_ptr, pair_usable_ptr, peer_bases_ptr, round_ptr,
                 capacity, hidden, row_stride, rows_offset, topk, BLOCK: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK)). ``y[t, cols] = sum over k (in order) of weight[t, k] * row(t, k)[cols]``,
    float32 accumulation, where row(t, k) is ``ROWS[round % 2][pair_row[t, k]]`` in rank
    ``pair_rank[t, k]``'s space, loaded straight from that peer; pairs with ``pair_usable == 0`` add 0.
    ``row_stride``/``rows_offset`` in elements of y's dtype."""
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < hidden
    round_ = tl.load(round_ptr)
    parity = round_ % 2
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(topk):
        pair = token * topk + k
        usable = tl.load(pair_usable_ptr + pair) != 0
        peer = tl.load(pair_rank_ptr + pair)
        row = tl.load(pair_row_ptr + pair)
        weight = tl.load(pair_weight_ptr + pair)
        base = tl.load(peer_bases_ptr + peer).to(tl.pointer_type(y_ptr.dtype.element_ty))
        base = tl.multiple_of(base + rows_offset, 16)
        values = tl.load(base + (parity * capacity + row) * row_stride + columns, mask=in_row & usable, other=0.0)
        total += values.to(tl.float32) * weight
    tl.store(y_ptr + token * hidden + columns, total.to(y_ptr.dtype.element_ty), mask=in_row)
