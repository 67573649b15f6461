"""BlockPlan: which rows of which blocks a head range of a request moves, for every order and block-size pair."""

import itertools

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.kv import BlockPlan, BlockShape, HeadMap, HeadRead, Sharding


def _cache(shape: BlockShape, num_blocks: int, first_head: int, token_of) -> np.ndarray:
    """[num_blocks, rows] of codes: each row holds (global token, global head, K/V) as token * 1000 + head * 2 + kv
    (kv 0 unless the order holds both halves)."""
    blocks = np.zeros((num_blocks, shape.rows), dtype=np.int64)
    tokens, heads, halves = np.meshgrid(np.arange(shape.block_size), np.arange(shape.heads),
                                        np.arange(shape.halves), indexing="ij")
    rows = shape.row(tokens, heads, halves)
    for block in range(num_blocks):
        token = token_of(block, tokens)
        blocks[block, rows.ravel()] = (token * 1000 + (heads + first_head) * 2 + halves).ravel()
    return blocks


@pytest.mark.parametrize("tp", [(2, 1), (1, 2), (2, 4), (4, 2), (8, 2), (2, 8)])
@pytest.mark.parametrize("sizes", [(16, 16), (16, 32), (32, 16), (16, 64), (64, 16)])
@pytest.mark.parametrize("orders", [*itertools.product(("HND", "NHD", "HKND"), repeat=2)])
@pytest.mark.parametrize("prefix_blocks", [0, 1])
def test_every_row_lands_where_its_token_and_head_belong(tp, sizes, orders, prefix_blocks):
    producer_tp, consumer_tp = tp
    producer_size, consumer_size = sizes
    total_heads, num_tokens = 4, 150
    head_map = HeadMap(Sharding(producer_tp, total_heads), Sharding(consumer_tp, total_heads))
    producer_blocks = -(-num_tokens // producer_size)
    consumer_blocks = -(-num_tokens // consumer_size)
    # Producer blocks stored at scattered ids; consumer blocks too.
    remote_ids = np.arange(producer_blocks)[::-1] * 2 + 1
    local_ids = (np.arange(consumer_blocks) * 3 + 2)[prefix_blocks:]
    if "HKND" in orders and (orders[0] != orders[1] or producer_size != consumer_size):
        with pytest.raises(tw.InvalidArgumentError, match="HKND"):  # the CPU cache pairs only with itself, one size
            BlockPlan(BlockShape(consumer_size, 1, orders[1]), BlockShape(producer_size, 1, orders[0]),
                      HeadRead(0, 0, 1, 0, 0))
        return
    for consumer_rank in range(consumer_tp):
        start, stop = Sharding(consumer_tp, total_heads).heads(consumer_rank)
        local_shape = BlockShape(consumer_size, stop - start, orders[1])
        destination = np.full((3 * consumer_blocks + 3, local_shape.rows), -1, dtype=np.int64)
        for read in head_map.reads(consumer_rank):
            p_start, p_stop = Sharding(producer_tp, total_heads).heads(read.producer_rank)
            remote_shape = BlockShape(producer_size, p_stop - p_start, orders[0])
            position_of = {int(b): i for i, b in enumerate(remote_ids)}
            source = np.full((2 * producer_blocks + 2, remote_shape.rows), -7, dtype=np.int64)
            source[remote_ids] = _cache(remote_shape, producer_blocks, p_start,
                                        lambda b, t: b * producer_size + t)
            plan = BlockPlan(local_shape, remote_shape, read)
            for part in plan.parts():
                local, remote = plan.pairs(part.index, local_ids, remote_ids, num_tokens)
                assert len(set(local.tolist())) == len(local)
                for lb, rb in zip(local, remote):
                    assert position_of[int(rb)] < producer_blocks
                    for local_row, remote_row, rows in part.ranges:
                        assert (destination[lb, local_row:local_row + rows] == -1).all(), "a row written twice"
                        destination[lb, local_row:local_row + rows] = source[rb, remote_row:remote_row + rows]
        expected = _cache(local_shape, consumer_blocks, start, lambda b, t: b * consumer_size + t)
        for position in range(prefix_blocks, consumer_blocks):
            got, want = destination[local_ids[position - prefix_blocks]], expected[position]
            real = (want // 1000) < num_tokens  # the last block's tail past the prompt holds no KV
            assert (got[real] == want[real]).all(), (consumer_rank, position)
            assert (got[~real] != -7).all()  # never bytes from outside the producer's blocks


def test_ranges_merge_as_far_as_both_orders_allow():
    split = HeadRead(producer_rank=0, first_head=2, num_heads=2, remote_offset=2, local_offset=0)
    hnd = BlockPlan(BlockShape(16, 2), BlockShape(16, 4), split)
    assert [p.ranges for p in hnd.parts()] == [((0, 32, 32),)]
    nhd = BlockPlan(BlockShape(16, 2, "NHD"), BlockShape(16, 4, "NHD"), split)
    assert nhd.parts()[0].ranges == tuple((2 * t, 4 * t + 2, 2) for t in range(16))
    mixed = BlockPlan(BlockShape(16, 2, "NHD"), BlockShape(16, 4, "HND"), split)
    assert len(mixed.parts()[0].ranges) == 32
    whole = HeadRead(0, 0, 4, 0, 0)
    assert BlockPlan(BlockShape(16, 4, "NHD"), BlockShape(16, 4, "NHD"), whole).whole
    assert BlockPlan(BlockShape(16, 4), BlockShape(16, 4), whole).whole
    assert not BlockPlan(BlockShape(32, 4), BlockShape(16, 4), whole).whole
    larger = BlockPlan(BlockShape(32, 4, "NHD"), BlockShape(16, 4, "NHD"), whole)
    assert [p.ranges for p in larger.parts()] == [((0, 0, 64),), ((64, 0, 64),)]


def test_pairs_follow_tokens_across_block_sizes():
    whole = HeadRead(0, 0, 1, 0, 0)
    bigger = BlockPlan(BlockShape(32, 1), BlockShape(16, 1), whole)
    assert [x.tolist() for x in bigger.pairs(0, [7, 8], [10, 11, 12, 13], 50)] == [[7, 8], [10, 12]]
    assert [x.tolist() for x in bigger.pairs(1, [7, 8], [10, 11, 12], 40)] == [[7], [11]]  # 8's second half: past
    smaller = BlockPlan(BlockShape(16, 1), BlockShape(64, 1), whole)
    assert [x.tolist() for x in smaller.pairs(0, [0, 1, 2, 3, 4], [20, 21], 70)] == [[0, 4], [20, 21]]
    assert [x.tolist() for x in smaller.pairs(3, [0, 1, 2, 3, 4], [20, 21], 70)] == [[3], [20]]
    assert [x.tolist() for x in smaller.pairs(3, [3, 4], [20, 21], 70)] == [[3], [20]]  # a prefix hit of 3 blocks
    with pytest.raises(tw.InvalidArgumentError, match="exactly 2 producer blocks"):
        smaller.pairs(0, [0], [20, 21, 22], 70)


@pytest.mark.parametrize("bad", [dict(block_size=0, heads=1), dict(block_size=16, heads=True),
                                 dict(block_size=16, heads=1, order="hnd"), dict(block_size=1 << 20, heads=1)])
def test_shapes_from_peers_are_checked(bad):
    with pytest.raises(tw.InvalidArgumentError, match="BlockShape"):
        BlockShape(**bad)


def test_the_cpu_cache_pairs_only_with_itself():
    with pytest.raises(tw.InvalidArgumentError, match="HKND"):
        BlockPlan(BlockShape(16, 1, "HKND"), BlockShape(16, 1, "HND"), HeadRead(0, 0, 1, 0, 0))
    with pytest.raises(tw.InvalidArgumentError, match="same --block-size"):  # rows packed per block by its kernels
        BlockPlan(BlockShape(32, 2, "HKND"), BlockShape(16, 2, "HKND"), HeadRead(0, 0, 2, 0, 0))
    split = BlockPlan(BlockShape(16, 1, "HKND"), BlockShape(16, 2, "HKND"), HeadRead(0, 1, 1, 1, 0))
    assert split.parts()[0].ranges == ((0, 32, 32),)  # head 1's K and V rows: one range


def test_block_sizes_that_do_not_divide_or_lie_far_apart_are_refused():
    with pytest.raises(tw.InvalidArgumentError, match="neither divides the other"):
        BlockPlan(BlockShape(16, 1), BlockShape(24, 1), HeadRead(0, 0, 1, 0, 0))
    with pytest.raises(tw.InvalidArgumentError, match="too far apart"):  # 4096 parts, each a prepared READ
        BlockPlan(BlockShape(16, 1), BlockShape(1 << 16, 1), HeadRead(0, 0, 1, 0, 0))
    assert BlockPlan(BlockShape(16, 1), BlockShape(1024, 1), HeadRead(0, 0, 1, 0, 0)).ratio == 64
