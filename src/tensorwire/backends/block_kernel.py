"""The Triton kernel that moves KV-cache blocks by id: one launch per request, any number of blocks.

Importing this module imports Triton; ``block_copy`` imports it only when a GPU block request is prepared.

Data flow. A pool is R regions (one per view the user registered); block ``b`` of region ``r`` is the byte
range ``[base[r] + b * stride[r], + block_bytes[r])``. A request moves, for every pair ``i`` of ids and every
region ``r``, block ``src_ids[i]`` of the source pool to block ``dst_ids[i]`` of the destination pool. The
grid is ``(pairs, regions, chunks)``: program ``(i, r, c)`` copies chunk ``c`` (``CHUNK`` words) of that
block in one pass, loading from the source and storing to the destination directly (either may be a
peer's memory mapped through CUDA IPC: NVLink, or the same GPU).

Addresses. Regions live in unrelated allocations, so they are passed as word offsets from one anchor
pointer (the region table itself) rather than as R pointer arguments: one compiled kernel serves any R.
``ALIGN`` (words) is what the host proved for every base, stride and size; it lets the compiler issue
128-bit accesses.

Safety. An id outside ``[0, blocks)`` on either side moves nothing (ids on the device are not checked by
the host, which would need a sync): no byte lands outside the destination pool.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["copy_blocks"]


@triton.jit
def copy_blocks(
    anchor,  # *int32 (or *uint8): the region table; every address below is a word offset from it
    table,  # *int64 [5, R]: dst base, src base (word offsets from anchor), dst stride, src stride, block words
    dst_ids,  # *int32|*int64 [pairs]
    src_ids,  # *int32|*int64 [pairs]
    num_regions,
    dst_blocks,
    src_blocks,
    CHUNK: tl.constexpr,  # words per program
    TILE: tl.constexpr,  # words per loop step
    ALIGN: tl.constexpr,  # words every base, stride and block size is a multiple of
):
    pair = tl.program_id(0)
    region = tl.program_id(1)
    chunk = tl.program_id(2)
    dst_id = tl.load(dst_ids + pair).to(tl.int64)
    src_id = tl.load(src_ids + pair).to(tl.int64)
    valid = (dst_id >= 0) & (dst_id < dst_blocks) & (src_id >= 0) & (src_id < src_blocks)
    block_words = tl.load(table + 4 * num_regions + region)
    start = chunk.to(tl.int64) * CHUNK
    dst = tl.load(table + region) + dst_id * tl.load(table + 2 * num_regions + region) + start
    src = tl.load(table + num_regions + region) + src_id * tl.load(table + 3 * num_regions + region) + start
    dst = tl.multiple_of(dst, ALIGN)
    src = tl.multiple_of(src, ALIGN)
    for step in tl.static_range(0, CHUNK, TILE):
        offsets = step + tl.arange(0, TILE)
        mask = valid & (start + offsets < block_words)
        words = tl.load(anchor + src + offsets, mask=mask)
        tl.store(anchor + dst + offsets, words, mask=mask)
