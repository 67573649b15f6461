"""The KV head map (tensorwire.kv.heads): coverage, offsets, release counts and load spreading for head-split and
MLA caches at every TP pairing a prefill/decode pair runs, and the refusals of the pairings that cannot work."""

from __future__ import annotations

import pytest

from tensorwire.errors import InvalidArgumentError
from tensorwire.kv.heads import HeadMap, HeadRead, Sharding

# (producer TP, consumer TP, KV heads): equal, either side larger, either side replicating heads (TP > heads).
HEAD_SPLIT = [(1, 2, 8), (2, 4, 8), (4, 2, 8), (8, 16, 8), (2, 8, 4), (4, 8, 2), (8, 2, 4), (1, 1, 8), (16, 8, 8),
              (2, 2, 1)]
# (producer TP, consumer TP) of an MLA cache (one replicated "head").
MLA = [(1, 2), (2, 1), (2, 4), (4, 2), (8, 2), (3, 3)]

CASES = [pytest.param(p, d, h, False, id=f"P{p}-D{d}-H{h}") for p, d, h in HEAD_SPLIT] + [
    pytest.param(p, d, 1, True, id=f"mla-P{p}-D{d}") for p, d in MLA]


def _map(producer_tp: int, consumer_tp: int, heads: int, replicated: bool) -> HeadMap:
    return HeadMap(Sharding(producer_tp, heads, replicated), Sharding(consumer_tp, heads, replicated))


@pytest.mark.parametrize("producer_tp, consumer_tp, heads, replicated", CASES)
def test_reads_cover_each_head_of_the_consumer_interval_once(producer_tp, consumer_tp, heads, replicated):
    head_map = _map(producer_tp, consumer_tp, heads, replicated)
    for rank in range(consumer_tp):
        start, stop = head_map.consumer.heads(rank)
        read = [head for r in head_map.reads(rank) for head in range(r.first_head, r.first_head + r.num_heads)]
        assert sorted(read) == list(range(start, stop)), f"consumer {rank}: {head_map.reads(rank)}"
        assert [r.first_head for r in head_map.reads(rank)] == sorted(r.first_head for r in head_map.reads(rank))


@pytest.mark.parametrize("producer_tp, consumer_tp, heads, replicated", CASES)
def test_reads_lie_in_the_producer_interval_at_consistent_offsets(producer_tp, consumer_tp, heads, replicated):
    head_map = _map(producer_tp, consumer_tp, heads, replicated)
    for rank in range(consumer_tp):
        local_start, local_stop = head_map.consumer.heads(rank)
        reads = head_map.reads(rank)
        for read in reads:
            remote_start, remote_stop = head_map.producer.heads(read.producer_rank)
            assert read.num_heads >= 1
            assert remote_start <= read.first_head and read.first_head + read.num_heads <= remote_stop, read
            assert local_start <= read.first_head and read.first_head + read.num_heads <= local_stop, read
            assert read.remote_offset == read.first_head - remote_start
            assert read.local_offset == read.first_head - local_start
            if replicated:
                assert (read.remote_offset, read.local_offset) == (0, 0)
        # One descriptor per block per source: neighbouring runs never come from the same producer rank.
        assert all(a.producer_rank != b.producer_rank for a, b in zip(reads, reads[1:])), reads


@pytest.mark.parametrize("producer_tp, consumer_tp, heads, replicated", CASES)
def test_every_producer_rank_hears_from_the_consumers_it_counts(producer_tp, consumer_tp, heads, replicated):
    head_map = _map(producer_tp, consumer_tp, heads, replicated)
    reached = {rank: [r.producer_rank for r in head_map.reads(rank)] + head_map.releases(rank)
               for rank in range(consumer_tp)}
    for producer in range(producer_tp):
        senders = [rank for rank, producers in reached.items() if producer in producers]
        assert head_map.messages_to(producer) == len(senders) >= 1, (producer, reached)
        readers = [rank for rank in range(consumer_tp)
                   if producer in [r.producer_rank for r in head_map.reads(rank)]]
        assert head_map.readers_of(producer) == readers
        if not readers:
            assert senders == [producer % consumer_tp]
    for rank in range(consumer_tp):
        read_from = {r.producer_rank for r in head_map.reads(rank)}
        assert not read_from & set(head_map.releases(rank)), f"consumer {rank} reads and releases one producer"


def test_two_producers_to_four_consumers_as_the_module_docstring_draws_it():
    head_map = _map(2, 4, 8, False)
    assert [head_map.reads(rank) for rank in range(4)] == [
        [HeadRead(0, 0, 2, 0, 0)], [HeadRead(0, 2, 2, 2, 0)], [HeadRead(1, 4, 2, 0, 0)], [HeadRead(1, 6, 2, 2, 0)]]
    assert [head_map.readers_of(p) for p in range(2)] == [[0, 1], [2, 3]]
    assert all(head_map.releases(rank) == [] for rank in range(4))


def test_four_producers_to_two_consumers_split_each_consumer_interval():
    head_map = _map(4, 2, 8, False)
    assert head_map.reads(1) == [HeadRead(2, 4, 2, 0, 0), HeadRead(3, 6, 2, 0, 2)]


def test_mla_spreads_the_consumers_over_the_producers():
    head_map = _map(2, 4, 1, True)
    assert [head_map.readers_of(p) for p in range(2)] == [[0, 2], [1, 3]]
    assert [head_map.messages_to(p) for p in range(2)] == [2, 2]
    many_producers = _map(8, 2, 1, True)
    assert many_producers.reads(1) == [HeadRead(1, 0, 1, 0, 0)]
    assert [many_producers.releases(rank) for rank in range(2)] == [[2, 4, 6], [3, 5, 7]]


def test_replicated_producer_heads_are_read_from_the_replica_of_the_consumer_turn():
    # P=8, H=4: head h lives on producer ranks 2h and 2h + 1. With D=2 each head is needed by one consumer rank
    # only (turn 0), which reads the first replica; the second replicas are released by consumer p mod 2 = 1.
    head_map = _map(8, 2, 4, False)
    for head in range(4):
        consumer = head // 2
        [read] = [r for r in head_map.reads(consumer) if r.first_head == head]
        assert read.producer_rank == 2 * head, (head, read)
    assert head_map.reads(0) == [HeadRead(0, 0, 1, 0, 0), HeadRead(2, 1, 1, 0, 1)]
    assert [head_map.releases(rank) for rank in range(2)] == [[], [1, 3, 5, 7]]


def test_replicated_producer_heads_alternate_between_replicas_when_several_consumers_need_them():
    # P=4, D=8, H=2: head 0 on producers 0 and 1, needed by consumers 0-3 in turn 0-3: replicas 0, 1, 0, 1.
    head_map = _map(4, 8, 2, False)
    assert [head_map.reads(rank)[0].producer_rank for rank in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [head_map.messages_to(p) for p in range(4)] == [2, 2, 2, 2]


def test_sharding_intervals():
    assert [Sharding(4, 8).heads(r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [Sharding(8, 2).heads(r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert Sharding(3, 1, replicated=True).heads(2) == (0, 1)


REFUSED_SHARDINGS = [
    pytest.param(lambda: Sharding(3, 8), ["tp_size 3", "8 KV heads"], id="H8-P3"),
    pytest.param(lambda: Sharding(16, 3), ["tp_size 16", "3 KV heads"], id="P16-H3"),
    pytest.param(lambda: Sharding(True, 8), ["tp_size", "True", "bool"], id="bool-tp"),
    pytest.param(lambda: Sharding(2, True), ["total_heads", "True", "bool"], id="bool-heads"),
    pytest.param(lambda: Sharding(2, 8, replicated=1), ["replicated", "1", "int"], id="int-replicated"),
    pytest.param(lambda: Sharding(-2, 8), ["tp_size", "-2"], id="negative-tp"),
    pytest.param(lambda: Sharding(2, -8), ["total_heads", "-8"], id="negative-heads"),
    pytest.param(lambda: Sharding(0, 8), ["tp_size", "0"], id="zero-tp"),
]


@pytest.mark.parametrize("build, named", REFUSED_SHARDINGS)
def test_sharding_refuses_sizes_that_do_not_split(build, named):
    with pytest.raises(InvalidArgumentError) as error:
        build()
    assert all(value in str(error.value) for value in named), str(error.value)


REFUSED_PAIRS = [
    pytest.param(Sharding(2, 6), Sharding(3, 6), ["tp_size 2", "tp_size 3", "vLLM"], id="P2-D3"),
    pytest.param(Sharding(4, 12), Sharding(6, 12), ["tp_size 4", "tp_size 6", "vLLM"], id="P4-D6"),
    pytest.param(Sharding(2, 8), Sharding(2, 4), ["8 KV heads", "4"], id="different-heads"),
    pytest.param(Sharding(2, 1, True), Sharding(2, 1), ["replicated=True", "replicated=False"], id="mla-vs-split"),
    pytest.param(Sharding(2, 8), (2, 8), ["consumer", "tuple"], id="not-a-sharding"),
]


@pytest.mark.parametrize("producer, consumer, named", REFUSED_PAIRS)
def test_head_map_refuses_engines_that_cannot_exchange_kv(producer, consumer, named):
    with pytest.raises(InvalidArgumentError) as error:
        HeadMap(producer, consumer)
    assert all(value in str(error.value) for value in named), str(error.value)


RANK_QUERIES = [
    pytest.param(lambda m: m.reads(4), ["HeadMap.reads", "consumer_rank 4", "[0, 4)"], id="reads"),
    pytest.param(lambda m: m.releases(-1), ["HeadMap.releases", "consumer_rank -1"], id="releases"),
    pytest.param(lambda m: m.messages_to(2), ["HeadMap.messages_to", "producer_rank 2", "[0, 2)"], id="messages"),
    pytest.param(lambda m: m.readers_of(True), ["HeadMap.readers_of", "True", "bool"], id="readers-bool"),
    pytest.param(lambda m: m.producer.heads(2), ["Sharding.heads", "tp_rank 2"], id="heads"),
]


@pytest.mark.parametrize("query, named", RANK_QUERIES)
def test_ranks_out_of_range_are_refused(query, named):
    with pytest.raises(InvalidArgumentError) as error:
        query(_map(2, 4, 8, False))
    assert all(value in str(error.value) for value in named), str(error.value)
    assert issubclass(InvalidArgumentError, ValueError)
