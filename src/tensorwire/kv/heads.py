"""The KV head map: from which producer ranks each consumer rank reads its KV heads, whatever the two TP sizes.

A prefill engine (the producer) runs tensor parallelism P, a decode engine (the consumer) TP D, and the model has
H KV heads. A rank of TP size T holds an interval of global head indices:

- T <= H: H % T == 0 and rank r holds [r·H/T, (r+1)·H/T).
- T > H (GQA replication): T % H == 0 and rank r holds the single head r·H // T, so T/H neighbouring ranks are
  replicas of one another.
- MLA (``replicated=True``): the cache has no head split; every rank holds all of [0, H), H normally 1.

Everything here is computed on these intervals, never on a TP ratio: formulas on the ratio of the TP sizes break
once a TP size exceeds H (the GQA-replication bug that vLLM #45330 and SGLang #31295 shipped).

Consumer rank d reads every head of its interval exactly once, from one producer rank that holds it; consecutive
heads from one producer rank form one ``HeadRead``. With heads outermost inside a block (HND), a ``HeadRead`` is one
contiguous run per block: ``num_heads`` heads starting ``remote_offset`` heads into the producer rank's block and
landing ``local_offset`` heads into the consumer rank's, so one descriptor per block per source. Where several
producer ranks hold a head (GQA replication, MLA), the consumer ranks needing that head, taken in rank order
(i = 0, 1, ...), read replica i mod (number of replicas). A producer rank no consumer reads from must still learn
that the request's blocks can go: consumer rank p mod D releases it (tells it "done" without reading).

P=2, D=4, H=8. Producer 0 holds [0, 4), producer 1 holds [4, 8); consumer d holds [2d, 2d + 2)::

    reads(0) == [HeadRead(producer_rank=0, first_head=0, num_heads=2, remote_offset=0, local_offset=0)]
    reads(1) == [HeadRead(producer_rank=0, first_head=2, num_heads=2, remote_offset=2, local_offset=0)]
    reads(2) == [HeadRead(producer_rank=1, first_head=4, num_heads=2, remote_offset=0, local_offset=0)]
    reads(3) == [HeadRead(producer_rank=1, first_head=6, num_heads=2, remote_offset=2, local_offset=0)]
    readers_of(0) == [0, 1]; readers_of(1) == [2, 3]; no releases

P=8, D=2, H=4 (the producer replicates heads). Producer p holds head p // 2, so ranks 2h and 2h + 1 are the two
replicas of head h; consumer 0 holds [0, 2), consumer 1 holds [2, 4). Each head is needed by one consumer rank
only (i = 0), which reads the first replica; the other replicas are released::

    reads(0) == [HeadRead(0, first_head=0, num_heads=1, remote_offset=0, local_offset=0),
                 HeadRead(2, first_head=1, num_heads=1, remote_offset=0, local_offset=1)]
    reads(1) == [HeadRead(4, 2, 1, 0, 0), HeadRead(6, 3, 1, 0, 1)]
    releases(0) == []; releases(1) == [1, 3, 5, 7]

The same TP sizes with MLA (``replicated=True``, H=1): consumer d reads the whole cache from producer d mod 8, so
consumer 0 reads producer 0 and releases 2, 4 and 6; consumer 1 reads producer 1 and releases 3, 5 and 7.

Scope: arithmetic on ranks and head indices, computed once per ``HeadMap``; no tensors, no I/O, nothing blocks.
Non-goals: bytes and block layouts (the caller scales offsets by its bytes per head), different block sizes, and
TP sizes of which neither divides the other (refused, as vLLM refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tensorwire import InvalidArgumentError

__all__ = ["HeadMap", "HeadRead", "Sharding"]


def _check_count(where: str, name: str, value: object) -> None:
    """Refuse anything but an int >= 1; a bool is refused too, since ``True`` as a TP size is a slip, not a 1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(
            f"{where}: {name} must be an int, got {value!r} ({type(value).__name__}); pass a positive int")
    if value < 1:
        raise InvalidArgumentError(f"{where}: {name} must be >= 1, got {value}; pass a positive int")


def _check_rank(where: str, name: str, rank: object, size: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise InvalidArgumentError(
            f"{where}: {name} must be an int, got {rank!r} ({type(rank).__name__}); pass an int in [0, {size})")
    if not 0 <= rank < size:
        raise InvalidArgumentError(
            f"{where}: {name} {rank} is out of range for a TP size of {size}; pass an int in [0, {size})")


def _divisors(number: int) -> str:
    return ", ".join(str(d) for d in range(1, number + 1) if number % d == 0)


@dataclass(frozen=True)
class Sharding:
    """How one engine's KV heads are spread over its tensor-parallel ranks.

    ``tp_size`` ranks share ``total_heads`` KV heads: each rank holds ``total_heads / tp_size`` of them, or one
    head (replicated on ``tp_size / total_heads`` ranks) when ``tp_size > total_heads``. ``replicated=True`` is an
    MLA cache: no head split, every rank holds the whole cache. Construction raises ``InvalidArgumentError`` for
    sizes that do not split evenly.
    """

    tp_size: int
    total_heads: int
    replicated: bool = False  # MLA: every rank holds the whole cache

    def __post_init__(self) -> None:
        _check_count("Sharding", "tp_size", self.tp_size)
        _check_count("Sharding", "total_heads", self.total_heads)
        if not isinstance(self.replicated, bool):
            raise InvalidArgumentError(f"Sharding: replicated must be a bool, got {self.replicated!r} "
                                       f"({type(self.replicated).__name__}); pass True for an MLA cache, else False")
        size, heads = self.tp_size, self.total_heads
        if self.replicated:
            return  # every rank holds everything: any TP size works
        if size <= heads and heads % size:
            raise InvalidArgumentError(
                f"Sharding: {heads} KV heads do not split evenly over tp_size {size} ({heads} % {size} = "
                f"{heads % size}); use a tp_size that divides {heads} ({_divisors(heads)}) or a multiple of {heads}")
        if size > heads and size % heads:
            raise InvalidArgumentError(
                f"Sharding: tp_size {size} exceeds the {heads} KV heads but is not a multiple of them, so the heads "
                f"cannot be replicated evenly (GQA replication); use a multiple of {heads} or one of "
                f"{_divisors(heads)}")

    def heads(self, tp_rank: int) -> tuple[int, int]:
        """The global KV heads ``[start, stop)`` that rank ``tp_rank`` holds (``(0, total_heads)`` when replicated)."""
        _check_rank("Sharding.heads", "tp_rank", tp_rank, self.tp_size)
        if self.replicated:
            return 0, self.total_heads
        if self.tp_size <= self.total_heads:
            per_rank = self.total_heads // self.tp_size
            return tp_rank * per_rank, (tp_rank + 1) * per_rank
        head = tp_rank * self.total_heads // self.tp_size
        return head, head + 1


def _holders(sharding: Sharding, head: int) -> range:
    """The ranks of ``sharding`` holding global ``head``, in rank order: replicas of one another when several."""
    if sharding.replicated:
        return range(sharding.tp_size)
    if sharding.tp_size <= sharding.total_heads:
        rank = head // (sharding.total_heads // sharding.tp_size)
        return range(rank, rank + 1)
    copies = sharding.tp_size // sharding.total_heads
    return range(head * copies, (head + 1) * copies)


@dataclass(frozen=True)
class HeadRead:
    """One contiguous run of heads a consumer rank reads from one producer rank, the same for every block.

    Offsets count heads, not bytes: the run starts ``remote_offset`` heads into the producer rank's share of a
    block and lands ``local_offset`` heads into the consumer rank's (both 0 for MLA).
    """

    producer_rank: int
    first_head: int  # global index of the first head read
    num_heads: int
    remote_offset: int  # heads from the start of the producer rank's interval (0 for MLA)
    local_offset: int  # heads from the start of the consumer rank's interval (0 for MLA)


@dataclass(frozen=True)
class HeadMap:
    """Which producer ranks each consumer rank reads from, and which it only releases.

    Built once per (producer engine, consumer engine) pair; every query afterwards is a lookup. Construction
    raises ``InvalidArgumentError`` when the two engines cannot exchange KV: different numbers of KV heads, MLA on
    one side only, or TP sizes of which neither divides the other.
    """

    producer: Sharding
    consumer: Sharding
    # Per consumer rank its reads; per producer rank the consumer ranks reading from it.
    _reads: tuple[tuple[HeadRead, ...], ...] = field(init=False, repr=False, compare=False)
    _readers: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for side, sharding in (("producer", self.producer), ("consumer", self.consumer)):
            if not isinstance(sharding, Sharding):
                raise InvalidArgumentError(f"HeadMap: {side} must be a Sharding, got {type(sharding).__name__}; "
                                           "pass Sharding(tp_size=..., total_heads=...)")
        self._check_compatible()
        reads = tuple(self._plan(rank) for rank in range(self.consumer.tp_size))
        readers = tuple(tuple(rank for rank, runs in enumerate(reads) if any(r.producer_rank == p for r in runs))
                        for p in range(self.producer.tp_size))
        object.__setattr__(self, "_reads", reads)  # frozen: the plan is fixed at construction
        object.__setattr__(self, "_readers", readers)

    def _check_compatible(self) -> None:
        producer, consumer = self.producer, self.consumer
        if producer.total_heads != consumer.total_heads:
            raise InvalidArgumentError(
                f"HeadMap: the producer ({producer}) has {producer.total_heads} KV heads, the consumer ({consumer}) "
                f"{consumer.total_heads}; both engines must serve the same model: give both Shardings its number "
                "of KV heads")
        if producer.replicated != consumer.replicated:
            raise InvalidArgumentError(
                f"HeadMap: producer replicated={producer.replicated} ({producer}) but consumer "
                f"replicated={consumer.replicated} ({consumer}); an MLA cache cannot be exchanged with a head-split "
                "one: both engines must run the same model, with the same replicated=")
        # Intervals could serve these sizes, but vLLM refuses them: refusing here as well fails such a pair at
        # setup on both sides rather than at the first request on one.
        if producer.tp_size % consumer.tp_size and consumer.tp_size % producer.tp_size:
            raise InvalidArgumentError(
                f"HeadMap: producer tp_size {producer.tp_size} and consumer tp_size {consumer.tp_size} do not divide "
                "one another (vLLM refuses these too); run TP sizes where one is a multiple of the other")

    def _plan(self, consumer_rank: int) -> tuple[HeadRead, ...]:
        start, stop = self.consumer.heads(consumer_rank)
        runs: list[HeadRead] = []
        for head in range(start, stop):
            # The consumer ranks needing this head take its producer replicas in turn, spreading the reads.
            turn = _holders(self.consumer, head).index(consumer_rank)
            replicas = _holders(self.producer, head)
            source = replicas[turn % len(replicas)]
            # Heads are visited in order, so a run from the same source always ends at head - 1: extend it.
            if runs and runs[-1].producer_rank == source:
                runs[-1] = replace(runs[-1], num_heads=runs[-1].num_heads + 1)
            else:
                remote_offset = head - self.producer.heads(source)[0]
                runs.append(HeadRead(source, head, 1, remote_offset, head - start))
        return tuple(runs)

    def reads(self, consumer_rank: int) -> list[HeadRead]:
        """The runs consumer rank ``consumer_rank`` reads, sorted by ``first_head``; together they cover its
        interval, each head once."""
        _check_rank("HeadMap.reads", "consumer_rank", consumer_rank, self.consumer.tp_size)
        return list(self._reads[consumer_rank])

    def releases(self, consumer_rank: int) -> list[int]:
        """The producer ranks that consumer rank ``consumer_rank`` tells "done" without reading from them: those
        no consumer reads from (replicas left idle), each released by exactly one consumer rank, ``p mod D``."""
        _check_rank("HeadMap.releases", "consumer_rank", consumer_rank, self.consumer.tp_size)
        size = self.consumer.tp_size
        return [rank for rank, readers in enumerate(self._readers) if not readers and rank % size == consumer_rank]

    def messages_to(self, producer_rank: int) -> int:
        """How many consumer ranks send producer rank ``producer_rank`` a read or a release, i.e. how many
        "done" messages it waits for before freeing a request's blocks (at least 1)."""
        _check_rank("HeadMap.messages_to", "producer_rank", producer_rank, self.producer.tp_size)
        return len(self._readers[producer_rank]) or 1  # no reader: exactly one consumer rank releases it

    def readers_of(self, producer_rank: int) -> list[int]:
        """The consumer ranks that read from producer rank ``producer_rank``, in rank order (empty if released)."""
        _check_rank("HeadMap.readers_of", "producer_rank", producer_rank, self.producer.tp_size)
        return list(self._readers[producer_rank])
