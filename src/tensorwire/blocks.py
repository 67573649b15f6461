"""KV-cache block transfers: pools of equally sized blocks, and one request that moves thousands of them by id.

A ``BlockPool`` is a set of *views* (tensors whose dim 0 is the block index: vLLM's per-layer
``[num_blocks, 2, block, heads, dim]``, the K/V halves ``cache[0]``/``cache[1]`` of ``[2, num_blocks, ...]``,
or one all-layers-per-block tensor); block ``i`` of the pool is ``view[i]`` of every view. Its
``BlockPoolDesc`` is a small versioned value that travels through the store like a ``TensorDesc``. A
``BlockTransfer`` is prepared once per (operation, local pool, remote pool) and posted with any ids:

    pool = comm.register_blocks([k_cache, v_cache])          # [num_blocks, ...] each, one device
    comm.publish_blocks("kv", pool)
    remote = comm.lookup_blocks("kv", prefill_rank)
    with comm.prepare_blocks(tw.READ, pool, remote) as x:   # x.transport: cuda_ipc / nixl / shm / local
        x.post(local_ids, remote_ids)                        # ids: int tensors, numpy arrays or lists
        x.wait()

A ``BlockTransfer`` (``tensorwire.block_transfer``, where the ids are checked) is one request per post, never a
call per block: ``cuda_ipc`` and ``local`` (GPU) launch one Triton gather/scatter kernel over the peer's IPC-mapped
pool (stream-ordered, graph-capturable with ids in device tensors); ``nixl`` makes one ``make_prepped_xfer`` over
descriptor lists prepared once per transfer; ``shm`` and ``local`` (host) copy with one ``memmove`` per run of
consecutive blocks. This module holds the pools, their descriptors and the checks of a pair of pools.

A transfer between parts of blocks (the heads one tensor-parallel rank holds of a peer's wider block, the tokens of
a smaller block inside a larger one) pairs derived pools: ``pool.select(ranges)`` and ``desc.select(ranges)`` make
each ``(view, offset, size)`` range of every block a view of its own (``narrow(offsets, sizes)``: one range per
view). Which ranges a KV layout needs is ``tensorwire.kv``'s arithmetic; here they are bytes.

A block is one dense byte range whatever the order of its dims: vLLM's ``HND`` cache is a stride-permuted view of a
logical ``[num_blocks, block_size, heads, head_dim]`` shape, each block still one range of memory.

Non-goals: ids that differ between the views of one post (post each part with its own ids).
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .arguments import check_op, check_rank, check_transport
from .backends.base import Op, Segment
from .backends.block_copy import BlockLayout, BlockRegion
from .descriptors import MemoryKind, TensorDesc, field_problem, location_problem
from .errors import ClosedError, InvalidArgumentError
from .lifetime import Closeable
from .registration import Registration, as_tensor_list
from .runtime import Runtime

__all__ = ["BlockPool", "BlockPoolDesc", "check_pool", "pool_layout", "spans_to_register"]

_MAGIC = b"TWB"
_FORMAT_VERSION = 1
_HEADER = struct.Struct("<3sBiBxhQI")  # magic, version, rank, memory kind, device index, num_blocks, regions
_REGION = struct.Struct("<QQQI4x")  # addr, stride, block bytes, registration epoch
_MAX_REGIONS = 65535


@dataclass(frozen=True)
class BlockPoolDesc:
    """A pool of ``rank``: ``num_blocks`` blocks in each region ``(addr, stride, block_bytes, epoch)``.

    Wire format (little endian), ``pack``: header ``b"TWB" | version u8 | rank i32 | kind u8 | pad u8 |
    device index i16 | num_blocks u64 | region count u32``, then per region ``addr u64 | stride u64 |
    block bytes u64 | epoch u32 | pad u32``.

    Untrusted input (built by hand, or read from the store): construction refuses what no pool can be
    (``InvalidArgumentError``): a stride below the block size (negative, zero, overlapping blocks), a field
    outside its wire width, a last block ending past 2**64. So each view's span (block 0 to the end of the last
    block) holds every block, and ``prepare_blocks`` checking the spans against the owner's memory map bounds
    every byte any post can touch; ids are checked against ``num_blocks`` at each post."""

    rank: int
    kind: MemoryKind
    device_index: int
    num_blocks: int
    regions: tuple[tuple[int, int, int, int], ...]

    def __post_init__(self) -> None:
        problem = _pool_problem(self)
        if problem is not None:
            raise InvalidArgumentError(f"BlockPoolDesc: {problem}; no registered pool looks like this: use the "
                                       "descriptor lookup_blocks() or pool.desc returns")

    @property
    def block_bytes(self) -> tuple[int, ...]:
        return tuple(r[2] for r in self.regions)

    def layout(self) -> BlockLayout:
        return BlockLayout(tuple(BlockRegion(a, s, b) for a, s, b, _ in self.regions), self.num_blocks, self.kind,
                           self.device_index)

    def narrow(self, offsets: int | Sequence[int], sizes: int | Sequence[int]) -> BlockPoolDesc:
        """The same pool reduced to bytes ``[offsets[v], offsets[v] + sizes[v])`` of every block of view ``v`` (one
        int: the same for every view). A peer's ``prepare_blocks`` still checks the whole span against the
        owner's map. Raises ``InvalidArgumentError`` for a range outside a block."""
        ranges = narrowed_ranges(self.block_bytes, offsets, sizes, "BlockPoolDesc.narrow")
        return self.select([(v, o, n) for v, (o, n) in enumerate(ranges)])

    def select(self, ranges: Sequence[tuple[int, int, int]]) -> BlockPoolDesc:
        """A pool whose view ``i`` is bytes ``[offset, offset + size)`` of every block of this pool's view ``view``,
        for ``ranges[i] = (view, offset, size)`` (any order, views repeated). The peer's ``prepare_blocks`` checks
        every span against the owner's map as for the whole pool. Raises ``InvalidArgumentError`` for a view out
        of range, a range outside a block, or more than 65535 ranges."""
        checked = selected_ranges(self.block_bytes, ranges, "BlockPoolDesc.select")
        return BlockPoolDesc(self.rank, self.kind, self.device_index, self.num_blocks,
                             tuple((self.regions[v][0] + o, self.regions[v][1], n, self.regions[v][3])
                                   for v, o, n in checked))

    def spans(self) -> list[TensorDesc]:
        """Each region's bytes as a descriptor of the registration it lies in (checked against the owner's map)."""
        return [TensorDesc(self.rank, s.addr, s.nbytes, self.kind, self.device_index, region[3])
                for s, region in zip(self.layout().spans(), self.regions)]

    def pack(self) -> bytes:
        header = _HEADER.pack(_MAGIC, _FORMAT_VERSION, self.rank, int(self.kind), self.device_index, self.num_blocks,
                              len(self.regions))
        return header + b"".join(_REGION.pack(*r) for r in self.regions)

    @staticmethod
    def unpack(data: bytes) -> BlockPoolDesc:
        """Inverse of ``pack``; corrupt or foreign bytes raise ``InvalidArgumentError``."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"BlockPoolDesc.unpack: got {type(data).__name__}; pass the bytes pack() made")
        data = bytes(data)
        if len(data) < _HEADER.size:
            raise InvalidArgumentError(f"BlockPoolDesc.unpack: {len(data)} bytes is shorter than the {_HEADER.size}-"
                                       "byte header; the data is truncated or was not made by BlockPoolDesc.pack")
        magic, version, rank, kind, device_index, num_blocks, count = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != _FORMAT_VERSION:
            raise InvalidArgumentError(
                f"BlockPoolDesc.unpack: header {magic!r} version {version}, expected {_MAGIC!r} version "
                f"{_FORMAT_VERSION}; use the same tensorwire version on every rank")
        if len(data) != _HEADER.size + count * _REGION.size:
            raise InvalidArgumentError(f"BlockPoolDesc.unpack: {len(data)} bytes for {count} views; the data is "
                                       "truncated or corrupt")
        regions = tuple(_REGION.unpack_from(data, _HEADER.size + i * _REGION.size) for i in range(count))
        try:
            return BlockPoolDesc(rank, MemoryKind(kind) if kind in (0, 1) else kind, device_index, num_blocks, regions)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"BlockPoolDesc.unpack: rank {rank}, kind {kind}, {count} views of "
                                       f"{num_blocks} blocks: not a valid pool ({e}); the data is corrupt") from None


_U64 = 1 << 64


def _pool_problem(desc: BlockPoolDesc) -> str | None:
    """What makes ``desc`` no pool at all, or None (see ``BlockPoolDesc``)."""
    problem = (location_problem(desc.rank, desc.kind, desc.device_index, 0)
               or field_problem("num_blocks", desc.num_blocks, _U64, low=1))
    if problem is not None:
        return problem
    if not isinstance(desc.regions, tuple) or not 0 < len(desc.regions) <= _MAX_REGIONS:
        count = len(desc.regions) if isinstance(desc.regions, tuple) else f"a {type(desc.regions).__name__} of"
        return f"regions is {count} views; give a tuple of 1 to {_MAX_REGIONS} (addr, stride, block bytes, epoch)"
    for i, region in enumerate(desc.regions):
        if not isinstance(region, tuple) or len(region) != 4:
            return f"view {i} is {region!r}, not an (addr, stride, block bytes, epoch) tuple"
        addr, stride, block_bytes, epoch = region
        problem = (field_problem(f"view {i}'s addr", addr, _U64) or field_problem(f"view {i}'s stride", stride, _U64)
                   or field_problem(f"view {i}'s block bytes", block_bytes, _U64, low=1)
                   or field_problem(f"view {i}'s epoch", epoch, 1 << 32))
        if problem is None and desc.num_blocks > 1 and stride < block_bytes:
            problem = (f"view {i} has stride {stride} for blocks of {block_bytes} bytes (blocks must not overlap: "
                       "stride >= block bytes)")
        if problem is None and addr + stride * (desc.num_blocks - 1) + block_bytes > _U64:
            problem = (f"view {i}'s {desc.num_blocks} blocks of {block_bytes} bytes {stride} bytes apart from "
                       f"0x{addr:x} end past 2**64")
        if problem is not None:
            return problem
    return None


class BlockPool(Closeable):
    """Registered block memory of this rank (``comm.register_blocks``). Context manager; ``close()`` is
    idempotent and closes the block transfers prepared on the pool (and the registration it made, if any).

    Attributes: ``views`` (the tensors given), ``num_blocks``, ``block_bytes`` (per view), ``device``,
    ``desc`` (the ``BlockPoolDesc`` peers address).

    Closing revokes what peers prepared to the pool, whoever owns the memory: a pool that registered its views
    deregisters them; a pool of views inside the user's registrations, which live on, publishes its spans under
    an epoch of its own when its descriptor is first made (``expose``), and withdraws them at close
    (``withdraw``: the peers' transfers to that epoch are revoked like those to deregistered memory)."""

    def __init__(self, runtime: Runtime, views: list[torch.Tensor], layout: BlockLayout,
                 holders: list[Registration], owned: Registration | None,
                 expose: Callable[[list[Segment]], int] | None = None,
                 withdraw: Callable[[int], None] | None = None) -> None:
        self._runtime = runtime  # whose pool it is (a rank's), and its threads for the pool's transfers
        self.rank = runtime.rank
        self.views = views
        self.layout = layout
        self.num_blocks = layout.num_blocks
        self.block_bytes = tuple(r.block_bytes for r in layout.regions)
        self.device = views[0].device
        self._holders = holders  # the registration holding each view's bytes
        self._owned = owned
        self._expose, self._withdraw = expose, withdraw  # None when the pool registered its views itself
        self._own_epoch: int | None = None  # the epoch ``expose`` published the spans under
        self._desc: BlockPoolDesc | None = None
        # The BlockTransfers prepared on it, weakly: a transfer refers to its pool, and a strong set back would make
        # a cycle that keeps a dropped transfer (and the NIXL agent its request holds) alive until a gc pass.
        self.transfers: weakref.WeakSet = weakref.WeakSet()
        self._parts: weakref.WeakSet = weakref.WeakSet()  # narrowed pools over these views: closed with this one
        self.closed = False

    @property
    def desc(self) -> BlockPoolDesc:
        """The ``BlockPoolDesc`` peers address. The first one of a pool over the user's registrations publishes
        the pool's spans under an epoch of their own (one store round trip), which ``close()`` revokes."""
        if self._desc is None:
            self.check_open("desc")
            spans = self.layout.spans()
            if self._expose is None:
                epochs = [_desc_holding(h, s).epoch for h, s in zip(self._holders, spans)]
            else:
                self._own_epoch = self._expose(spans)
                epochs = [self._own_epoch] * len(spans)
            layout = self.layout
            self._desc = BlockPoolDesc(self.rank, layout.kind, layout.device_index, layout.num_blocks,
                                       tuple((r.addr, r.stride, r.block_bytes, e) for r, e in zip(layout.regions,
                                                                                                   epochs)))
        return self._desc

    def close(self) -> None:
        """Close the pool's block transfers, deregister what ``register_blocks`` registered, or withdraw the
        pool's own epoch from the user's registrations. Local, not collective: a peer's later post of a transfer
        to the pool raises ``RevokedError`` (once it handled the revocation), and its ``prepare_blocks`` or
        ``read_blocks`` with this pool's descriptor fails."""
        if self.closed:
            return
        self.closed = True
        for part in list(self._parts):
            part.close()
        for transfer in list(self.transfers):
            transfer.close()
        if self._owned is not None:
            self._owned.close()
        if self._own_epoch is not None:
            self._withdraw(self._own_epoch)
        self.views = []

    def narrow(self, offsets: int | Sequence[int], sizes: int | Sequence[int]) -> BlockPool:
        """A pool of bytes ``[offsets[v], offsets[v] + sizes[v])`` of every block of view ``v`` (one int: the same for
        every view), sharing this pool's registration: for ``prepare_blocks`` with a ``BlockPoolDesc.narrow`` of a
        peer's pool (a consumer rank reading its heads of a producer's block). Closed with this pool; closing it
        releases only its transfers. Raises ``InvalidArgumentError`` for a range outside a block."""
        self.check_open("narrow")
        ranges = narrowed_ranges(self.block_bytes, offsets, sizes, "BlockPool.narrow")
        return self.select([(v, o, n) for v, (o, n) in enumerate(ranges)])

    def select(self, ranges: Sequence[tuple[int, int, int]]) -> BlockPool:
        """A pool whose view ``i`` is bytes ``[offset, offset + size)`` of every block of this pool's view ``view``,
        for ``ranges[i] = (view, offset, size)``, sharing this pool's registration: for ``prepare_blocks`` with a
        ``BlockPoolDesc.select`` of a peer's pool (the rows of a token-major block that hold some heads, the part
        of a larger block that one smaller block fills). Closed with this pool; closing it releases only its
        transfers. Raises ``InvalidArgumentError`` as ``BlockPoolDesc.select``."""
        self.check_open("select")
        checked = selected_ranges(self.block_bytes, ranges, "BlockPool.select")
        regions = self.layout.regions
        layout = BlockLayout(tuple(BlockRegion(regions[v].addr + o, regions[v].stride, n) for v, o, n in checked),
                             self.num_blocks, self.layout.kind, self.layout.device_index)
        holders = [self._holders[v] for v, _, _ in checked]
        part = BlockPool(self._runtime, self.views, layout, holders, None, self._expose, self._withdraw)
        self._parts.add(part)
        return part

    @property
    def holders(self) -> frozenset[Registration]:
        """The registrations holding the views' bytes (a transfer prepared on the pool closes with them)."""
        return frozenset(self._holders)

    def check_open(self, fn: str) -> None:
        """``ClosedError`` when the pool, or a registration holding its views, is closed."""
        if self.closed:
            raise ClosedError(f"{fn}: the block pool is closed; register the blocks again with comm.register_blocks")
        if any(h.closed for h in self._holders):
            raise ClosedError(f"{fn}: the registration holding this pool's views was closed; register them again")

    def check_pair(self, op: Op, remote: BlockPoolDesc, transport: str | None, world_size: int) -> None:
        """``prepare_blocks``'s checks of the peer's pool against this one: a pool with the same views (bytes per
        block) of a valid rank, not this rank's other memory kind."""
        check_op(op, "prepare_blocks")
        if not isinstance(remote, BlockPoolDesc):
            raise InvalidArgumentError(f"prepare_blocks: remote is a {type(remote).__name__}; pass the BlockPoolDesc "
                                       "from lookup_blocks() (or pool.desc)")
        if self.block_bytes != remote.block_bytes:
            raise InvalidArgumentError(
                f"prepare_blocks: local pool has {len(self.block_bytes)} views of {self.block_bytes} bytes per block, "
                f"rank {remote.rank}'s {len(remote.block_bytes)} of {remote.block_bytes}; both pools need the same "
                "views in the same order, with equal bytes per block")
        check_rank(remote.rank, world_size, "prepare_blocks")
        if remote.rank == self.rank and self.layout.kind is not remote.kind:
            raise InvalidArgumentError("prepare_blocks: host and GPU pools of one rank; copy between them with torch "
                                       "(index_select / index_copy_)")
        check_transport(transport, "prepare_blocks")

    def _leak_message(self) -> str:
        return "a BlockPool was garbage-collected without close(); call pool.close() or use 'with comm.register_blocks'"

    def __repr__(self) -> str:
        return (f"BlockPool({len(self.block_bytes)} views x {self.num_blocks} blocks of {self.block_bytes} bytes on "
                f"{self.device}{', closed' if self.closed else ''})")


def check_pool(pool: BlockPool, runtime: Runtime, fn: str) -> None:
    """``pool`` is an open ``BlockPool`` of the communicator of ``runtime`` (``InvalidArgumentError`` otherwise)."""
    if not isinstance(pool, BlockPool) or pool._runtime is not runtime:
        raise InvalidArgumentError(f"{fn}: pass a BlockPool from this communicator's register_blocks(), got {pool!r}")
    pool.check_open(fn)


def narrowed_ranges(block_bytes: tuple[int, ...], offsets: int | Sequence[int], sizes: int | Sequence[int],
                    fn: str) -> list[tuple[int, int]]:
    """``(offset, size)`` per view, checked to lie inside that view's blocks."""
    count = len(block_bytes)
    offsets = [offsets] * count if isinstance(offsets, int) and not isinstance(offsets, bool) else list(offsets)
    sizes = [sizes] * count if isinstance(sizes, int) and not isinstance(sizes, bool) else list(sizes)
    if len(offsets) != count or len(sizes) != count:
        raise InvalidArgumentError(f"{fn}: {len(offsets)} offsets and {len(sizes)} sizes for {count} views; give one "
                                   "int, or one per view")
    for view, (offset, size, length) in enumerate(zip(offsets, sizes, block_bytes)):
        if (isinstance(offset, bool) or isinstance(size, bool) or not isinstance(offset, int)
                or not isinstance(size, int) or offset < 0 or size < 1 or offset + size > length):
            raise InvalidArgumentError(f"{fn}: view {view}: bytes [{offset!r}, +{size!r}) of a {length}-byte block; "
                                       "give 0 <= offset and 1 <= size with offset + size <= the block's bytes")
    return list(zip(offsets, sizes))


def selected_ranges(block_bytes: tuple[int, ...], ranges: Sequence[tuple[int, int, int]],
                    fn: str) -> list[tuple[int, int, int]]:
    """``ranges`` as a list of ``(view, offset, size)``, each checked to lie inside one of that view's blocks."""
    if isinstance(ranges, (str, bytes)) or not isinstance(ranges, Sequence) or not 0 < len(ranges) <= _MAX_REGIONS:
        raise InvalidArgumentError(f"{fn}: got {ranges!r:.80}; give a list of 1 to {_MAX_REGIONS} (view, offset, "
                                   "size) ranges")
    checked = []
    for i, item in enumerate(ranges):
        if not isinstance(item, (tuple, list)) or len(item) != 3 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in item):
            raise InvalidArgumentError(f"{fn}: range {i} is {item!r}; give (view, offset, size) ints")
        view, offset, size = item
        if not 0 <= view < len(block_bytes):
            raise InvalidArgumentError(f"{fn}: range {i} names view {view} of a pool of {len(block_bytes)} views")
        if offset < 0 or size < 1 or offset + size > block_bytes[view]:
            raise InvalidArgumentError(f"{fn}: range {i}: bytes [{offset}, +{size}) of view {view}'s "
                                       f"{block_bytes[view]}-byte block; give 0 <= offset and 1 <= size with offset "
                                       "+ size <= the block's bytes")
        checked.append((view, offset, size))
    return checked


def _desc_holding(registration: Registration, span: Segment) -> TensorDesc:
    return next(d for d, s in zip(registration.descs, registration.segments)
                if s.addr <= span.addr and span.addr + span.nbytes <= s.addr + s.nbytes)


def pool_layout(views: torch.Tensor | Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], BlockLayout]:
    """Check ``views`` (each ``[num_blocks, ...]``, block ``i`` = ``view[i]`` one contiguous byte range, one
    device for all) and describe them as a ``BlockLayout``."""
    views = as_tensor_list(views, "register_blocks")
    first = views[0]
    regions = []
    for i, view in enumerate(views):
        if view.device != first.device or view.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"register_blocks: view {i} is on {view.device}, view 0 on {first.device}; "
                                       "one pool holds one CPU or CUDA device's memory: make one pool per device")
        if view.dim() < 1 or view.shape[0] != first.shape[0] or view.shape[0] < 1:
            raise InvalidArgumentError(
                f"register_blocks: view {i} has shape {tuple(view.shape)}, view 0 {tuple(first.shape)}; every view "
                "is [num_blocks, ...] with the same num_blocks >= 1 (dim 0 is the block index)")
        block = view[0]
        block_bytes = block.numel() * view.element_size()
        stride = view.stride(0) * view.element_size()
        if not _dense(block) or block_bytes == 0:
            raise InvalidArgumentError(
                f"register_blocks: a block of view {i} (shape {tuple(block.shape)}, strides {block.stride()}) is not "
                "one non-empty dense byte range; give views whose dims after the first cover their bytes once, in "
                "any order (e.g. .contiguous(), or a permutation of a contiguous tensor's dims)")
        if view.shape[0] > 1 and stride < block_bytes:
            raise InvalidArgumentError(f"register_blocks: view {i} has blocks {stride} bytes apart but {block_bytes} "
                                       "bytes long: they overlap; dim 0 must step over whole blocks")
        regions.append(BlockRegion(view.data_ptr(), stride, block_bytes))
    kind = MemoryKind.CPU if first.device.type == "cpu" else MemoryKind.CUDA
    device_index = -1 if kind is MemoryKind.CPU else first.device.index
    return views, BlockLayout(tuple(regions), first.shape[0], kind, device_index)


def _dense(block: torch.Tensor) -> bool:
    """Whether ``block``'s elements fill ``numel`` consecutive elements from its first one, in any dim order (a
    stride-permuted contiguous tensor is dense: its bytes are one range, in another order)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(block.shape, block.stride()) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def spans_to_register(views: list[torch.Tensor], layout: BlockLayout) -> list[torch.Tensor]:
    """Flat ``uint8`` tensors covering the views' spans, overlapping spans merged (interleaved views such as
    ``cache[:, 0]`` and ``cache[:, 1]`` share their span), to register once each."""
    order = sorted(range(len(views)), key=lambda i: layout.regions[i].addr)
    merged: list[list] = []  # [start, end, view index]
    for i in order:
        span = layout.span(layout.regions[i])
        if merged and span.addr < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span.addr + span.nbytes)
        else:
            merged.append([span.addr, span.addr + span.nbytes, i])
    flats = []
    for start, end, i in merged:
        storage = views[i].untyped_storage()
        if end > storage.data_ptr() + storage.nbytes():
            raise InvalidArgumentError("register_blocks: views overlap across different tensors' storage; give views "
                                       "of one tensor, or of tensors that do not overlap")
        flat = torch.empty(0, dtype=torch.uint8, device=views[i].device)
        flats.append(flat.set_(storage, start - storage.data_ptr(), (end - start,), (1,)))
    return flats


