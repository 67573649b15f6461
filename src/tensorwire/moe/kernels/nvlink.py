"""Triton kernels of the ``"cuda"`` MoE engine: rows stored straight into peers' GPU memory.

Importing this module imports Triton; ``engines/cuda.py`` imports it only when the engine is first created,
and ``engines/cuda_steps.py`` launches the kernels (keyword arguments, these names).

Memory. Every rank allocates the same *spaces* (same sizes, same offsets), registers them with the
communicator and maps every peer's copy through CUDA IPC, so a kernel holds ``peer_bases[r]``, the address
of rank r's space *in this process*. A kernel stores into a peer's space directly (NVLink, or the same GPU).

Signal space (count exchange; one per count-row width)::

    word 0                      round     count exchanges so far (this rank only; bumped before each)
    COUNT_FLAGS [W]             word s:   count rows rank s stored here and this rank has not consumed
    COUNT_SLOTS [2, W, stride]  [round % 2, s]: rank s's count row of that round

Data space (rows; one per (purpose, capacity C, row bytes)); two halves, so that two dispatches may be in
flight before their combines. Dispatch n of a space (counted on the host, the same on every rank) uses half
``n % 2``; a dispatch captured in a CUDA graph keeps its half on every replay::

    DATA_FLAGS  [W]             word s:   programs of rank s that finished storing rows here, not consumed
    READY_FLAGS [W]             word r:   combines whose expert outputs rank r has in place, not consumed
    META        [2, 3, C]       int64 columns per received row: source rank, token, weight (float64 bits)
    ROWS        [2, C, row]     the rows (row padded to 64 bytes); ``recv_x`` is a view of ROWS[half]

Flags are 32-bit words (the low half of an int64 slot). Data flow of one dispatch (P programs)::

    rank s                                   rank r
    publish_counts:   row -> r.COUNT_SLOTS[round%2][s], release-add r.COUNT_FLAGS[s] += 1
    (stream waits until every COUNT_FLAGS[s] >= 1 here, consume_flags subtracts 1 from each, copies
     routing.place_blocks reads COUNT_SLOTS[round%2]: the block tables from the count matrix)
    scatter_rows:     x[token] -> r.ROWS[half][its final row], meta -> r.META[half][:, that row]
                      each program release-adds r.DATA_FLAGS[s] += 1   stream waits until every
                      for every r                                     DATA_FLAGS[s] >= P, subtracts P
    combine:          (r's expert outputs are in its own ROWS[half] (computed in place into recv_x, or
                      copied there), then r release-adds s.READY_FLAGS[r] += 1 for every s)
    stream waits until every READY_FLAGS[r] >= 1, subtracts 1
    combine_pull:     y[t] = sum_k w[t,k] * r.ROWS[half][row(t,k)], loads straight from the peers

Memory-ordering contract.
  * A producer stores its data with plain stores, then ``tl.debug_barrier()`` (every thread of the
    program has stored), then ONE atomic on the flag with ``sem="release", scope="sys"``: cumulative over
    the program's stores; for READY the stores were made by earlier kernels of the same stream, which
    complete before the releasing kernel starts.
  * A consumer's stream waits for the flag with a stream memory operation (``cuStreamWaitValue32``, done
    by the GPU's front end: no SM spins, and on a GPU shared by several processes the waiting context
    yields its time slice instead of holding it), then ``consume_flags`` atomically subtracts what it
    waited for; kernels after the wait see the producer's stores.
  * Flags count signals, and a consumer takes away exactly its own: a peer that runs ahead and signals
    the next call before this rank consumed the current one (two combines in a row, two count exchanges
    with no rows between them) leaves its signal standing for the next wait instead of being erased.
    The waited values never change (1, or P), so a CUDA graph replays unchanged; the count exchange's
    round lives in device memory, the row half is fixed at launch.
  * Reuse: a peer stores the rows of the next dispatch into a half only after every rank has sent its
    count row for that dispatch, i.e. has run (on its stream) everything it did with the half before:
    its use of ``recv_x`` and its combine's pulls. Two halves let a second dispatch run before the first
    is combined; a dispatch must be combined before the second dispatch after it.
  * A stream wait has no timeout of its own: the engine's watchdog (``engines/cuda_waits.py``) reports a wait that
    is not released within the communicator's timeout and then releases it, so a dead peer neither hangs
    the GPU nor goes unreported.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine_pull", "consume_flags", "publish_counts", "scatter_rows", "signal_ready"]

# Arguments whose value changes from call to call (the buffer half, the number of rows) are not
# specialised: Triton would otherwise compile a new variant when one of them becomes 1 (or stops being a
# multiple of 16), in the middle of a step whose stream already waits for a peer; loading a module then
# waits for that stream, and a dead peer's wait could no longer be opened by the watchdog.


@triton.jit
def publish_counts(space_ptr, peer_bases_ptr, counts_ptr, error_ptr, row_bytes, capacity, num_experts, rank, world,
                   width, stride, flags_offset, slots_offset, HEADER_WORDS: tl.constexpr, HAS_ERROR: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Grid (W,). Program p stores this rank's count row ``[errors, row_bytes, capacity, num_experts,
    *counts[:width]]`` (``count_rows``' format; ``errors`` = ``error_ptr[0]``, a bool, as bit 1) into rank p's
    slot of this round and release-adds 1 to p's COUNT_FLAGS[rank]. ``space_ptr``: this rank's signal space
    (int64 words; word 0 is the round, already bumped); offsets in int64 words."""
    peer = tl.program_id(0)
    parity = tl.load(space_ptr) % 2
    remote = tl.load(peer_bases_ptr + peer).to(tl.pointer_type(tl.int64))
    slot = remote + slots_offset + (parity * world + rank) * stride
    head = tl.arange(0, HEADER_WORDS)
    if HAS_ERROR:
        errors = tl.load(error_ptr).to(tl.int64)
    else:
        errors = 0
    header = tl.where(head == 0, errors, tl.where(head == 1, row_bytes, tl.where(head == 2, capacity, num_experts)))
    tl.store(slot + head, header.to(tl.int64))
    lanes = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        mask = start + lanes < width
        tl.store(slot + HEADER_WORDS + start + lanes, tl.load(counts_ptr + start + lanes, mask=mask), mask=mask)
    tl.debug_barrier()
    flag = (remote + flags_offset + rank).to(tl.pointer_type(tl.int32))
    tl.atomic_add(flag, 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["num_rows", "half"])
def scatter_rows(words_ptr, order_ptr, block_ptr, weight_ptr, send_start_ptr, destination_start_ptr, peer_bases_ptr,
                 num_rows, blocks, blocks_per_rank, rank, world, capacity, half, row_words, row_stride_words,
                 rows_offset_words, meta_offset, flags_offset,
                 TOPK: tl.constexpr, PROGRAMS: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_META: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Grid (PROGRAMS,). Program p stores send-order rows p, p + PROGRAMS, ... (of ``num_rows``). Row i is
    pair ``q = order[i]`` (``q = i`` without ``HAS_ORDER``): token ``q // TOPK``, block ``b = block[q]``
    (destination rank ``b // blocks_per_rank``, its local expert ``b % blocks_per_rank``; ``b >= blocks``:
    no expert, skipped), routing weight ``weight[q]``. It copies ``words[token]`` into that rank's
    ROWS[half] at row ``destination_start[b] + i - send_start[b]``, with its META columns (source rank,
    token, the weight's float64 bits). Rows past ``capacity`` are skipped (the block tables flag that
    overflow). Then the program release-adds 1 to every rank's DATA_FLAGS[rank]: a receiver waits for
    PROGRAMS signals from each source.

    ``words_ptr``: the rows as machine words ``[T, row_words]`` (int32/int16/uint8: 16-byte accesses where
    alignment allows). Tables ``[blocks]`` int64. Offsets: ``rows_offset_words`` in words,
    ``meta_offset``/``flags_offset`` in int64 words, all from a space's base. Many programs, each one row
    at a time, keep enough loads in flight to run at memory speed."""
    program = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    for i in range(program, num_rows, PROGRAMS):
        if HAS_ORDER:
            pair = tl.load(order_ptr + i)
        else:
            pair = i.to(tl.int64)
        block = tl.load(block_ptr + pair)
        if block < blocks:
            row = tl.load(destination_start_ptr + block) + i - tl.load(send_start_ptr + block)
            if row < capacity:
                base = tl.load(peer_bases_ptr + block // blocks_per_rank)
                region = base.to(tl.pointer_type(words_ptr.dtype.element_ty)) + rows_offset_words
                region = tl.multiple_of(region, 16)
                token = pair // TOPK
                source = words_ptr + token * row_words
                destination = region + (half * capacity + row) * row_stride_words
                for start in range(0, row_words, BLOCK):
                    mask = start + lanes < row_words
                    tl.store(destination + start + lanes, tl.load(source + start + lanes, mask=mask), mask=mask)
                if HAS_META:
                    weight_bits = tl.load(weight_ptr + pair).to(tl.float64).to(tl.int64, bitcast=True)
                    meta = base.to(tl.pointer_type(tl.int64)) + meta_offset + half * 3 * capacity + row
                    tl.store(meta, tl.full([], rank, tl.int64))
                    tl.store(meta + capacity, token)
                    tl.store(meta + 2 * capacity, weight_bits)
    tl.debug_barrier()
    for peer in range(world):
        flags = tl.load(peer_bases_ptr + peer).to(tl.pointer_type(tl.int64)) + flags_offset
        tl.atomic_add((flags + rank).to(tl.pointer_type(tl.int32)), 1, sem="release", scope="sys")


@triton.jit
def signal_ready(peer_bases_ptr, ready_offset, rank):
    """Grid (W,). Program p release-adds 1 to ``p.READY_FLAGS[rank]``: this rank's expert outputs (stored
    into its own ROWS by the previous kernels of this stream) may be pulled."""
    peer = tl.program_id(0)
    remote = tl.load(peer_bases_ptr + peer).to(tl.pointer_type(tl.int64))
    tl.atomic_add((remote + ready_offset + rank).to(tl.pointer_type(tl.int32)), 1, sem="release", scope="sys")


@triton.jit
def consume_flags(space_ptr, first_word, target, count, BLOCK: tl.constexpr):
    """Grid (1,). Subtract ``target`` from the ``count`` flags (32-bit, in the low halves of int64 words)
    from ``first_word`` of this rank's space, once the stream's waits saw each reach ``target``."""
    lanes = tl.arange(0, BLOCK)
    flags = space_ptr.to(tl.pointer_type(tl.int32)) + 2 * (first_word + lanes)
    tl.atomic_add(flags, tl.full([BLOCK], 0, tl.int32) - target, mask=lanes < count, sem="relaxed", scope="sys")


@triton.jit(do_not_specialize=["first_row"])
def combine_pull(y_ptr, expert_ptr, position_ptr, weight_ptr, send_start_ptr, destination_start_ptr, peer_bases_ptr,
                 num_experts, experts_per_rank, capacity, first_row, hidden, row_stride, rows_offset,
                 TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK)). ``y[t, cols] = sum over k (in order) of weight[t, k] * row(t, k)[cols]``,
    float32 accumulation. Pair (t, k) went to expert ``e = expert[t, k]`` (``>= num_experts``: none, adds 0)
    at send-order position ``position[t, k]``; its row is row ``first_row + destination_start[e] + position
    - send_start[e]`` of rank ``e // experts_per_rank``'s ROWS, loaded straight from that peer (rows past
    ``capacity`` were dropped and add 0). ``row_stride``/``rows_offset`` in elements of y's dtype. The K
    loads are unrolled, so all of them are in flight together."""
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        pair = token * TOPK + k
        expert = tl.load(expert_ptr + pair)
        valid = expert < num_experts
        expert = tl.where(valid, expert, 0)
        row = tl.load(destination_start_ptr + expert) + tl.load(position_ptr + pair) - tl.load(send_start_ptr + expert)
        usable = valid & (row < capacity)
        lanes_usable = (tl.zeros([BLOCK], dtype=tl.int32) + usable.to(tl.int32)) != 0  # per lane: a mask
        weight = tl.where(usable, tl.load(weight_ptr + pair).to(tl.float32), 0.0)  # an unused slot may hold NaN
        base = tl.load(peer_bases_ptr + expert // experts_per_rank).to(tl.pointer_type(y_ptr.dtype.element_ty))
        base = tl.multiple_of(base + rows_offset, 16)
        values = tl.load(base + (first_row + row) * row_stride + columns, mask=in_row & lanes_usable, other=0.0)
        total += values.to(tl.float32) * weight
    tl.store(y_ptr + token * hidden + columns, total.to(y_ptr.dtype.element_ty), mask=in_row)
