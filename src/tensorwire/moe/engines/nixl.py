"""The ``"nixl"`` MoE engine: one-sided WRITEs into peers' registered buffers, completed by notifications.

Host and GPU memory alike; the path that crosses machines. Driven by the CPU, so every call blocks until its
rows have arrived, and on a GPU waits for the stream where NIXL is to read what the stream wrote: dispatch to
read the counts and once its rows are staged, combine once its outputs are staged.

Per call::

    1. counts   each rank WRITEs its count row into slot [round % 2][rank] of every peer's counts buffer
                (host memory) with notify (COUNTS, round % 2) (prepared once, re-posted); it waits for W - 1
                such notifications. Now every rank holds the whole count matrix, so every rank knows where
                each of its rows lands.
    2. rows     each rank WRITEs to each destination ONE contiguous range: the rows it sends there (adjacent
                in its send order), the rows and their metadata in one request, into the destination's
                arrival buffer at this rank's slot (sources lie end to end in rank order: the slot is the
                number of rows lower ranks send there, from the count matrix), with notify (ROWS, round). A
                rank gathers its rows for itself straight into its own slot while its WRITEs are on their
                way. A receiver waits for one notification per rank that sends it rows, then copies the
                arrived rows (source major) into receive order (local expert major) in the tensors it returns.
    3. combine  the receiver gathers the expert outputs back into arrival order and WRITEs each source its
                range, which is contiguous in the source's send order too, to where that range starts in
                the source's return buffer, notify (RETURN, round of the dispatch); the source sums. (Its own
                range it gathers straight into its return buffer.)

Transfers. Rows are the blocks of block transfers (``comm.prepare_blocks``): a pool over this rank's
staging buffers, a pool descriptor of the peer's buffer built from its published descriptor, one WRITE per
peer prepared once per (peer, buffers, bytes per row) and posted every call with that call's row ids. So a
call builds no descriptor list in Python and makes no store round trip (``prepare`` loads the peer's memory
map from the store every time).

Buffers (``nixl_buffers.py``): receive buffers grown in lockstep on every rank (sizes follow from the count
matrix), staging buffers NIXL reads from; notifications and the wait for them: ``nixl_arrivals.py``.

Why nothing is overwritten while still in use: a rank posts the counts of round n+1 only after it has
finished round n, and every WRITE of round n+1 waits for all counts of round n+1; so rows of the next call
never land before every rank is done with the previous one. Count slots alternate between two rounds
(a rank that received nothing from a peer may finish a round before that peer has read its counts).
Return buffers alternate between two dispatches, which is why a dispatch must be combined before the
second dispatch after it (``check_fresh``). Inside a round each source writes only its own slot of an
arrival buffer, and the receiver has read the buffer (into the tensors it returns; on a GPU the next call
waits for that copy on the current stream before it posts its counts: dispatch's count row is read from the
device, all_to_all_v synchronises the stream first; calls on one device use one stream) before it posts its
next counts. A
staging buffer is refilled, and a prepared WRITE posted again, only by a later call: every call waits until
its own WRITEs are complete. Notifications carry (kind, round): one that arrives early is remembered, so
back-to-back calls never mix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...backends.base import Op
from ...block_transfer import BlockTransfer
from ...blocks import BlockPoolDesc
from ..count_rows import HEADER
from ..engine import DispatchHandle, Received, SkeletonEngine
from ..layout import Placement, SendLayout, exclusive_cumsum, segment_positions
from ..rows import META_COLUMNS, in_receive_order, next_power_of_two, pack_meta, row_bytes, unpack_meta, weighted_sum
from .nixl_arrivals import COUNTS, RETURN, ROWS, Arrivals, message
from .nixl_buffers import Buffer, NixlBuffers, Stream, rows_or_empty

if TYPE_CHECKING:
    from ...communicator import Communicator

__all__ = ["NixlEngine"]

_META_BYTES = META_COLUMNS * 8


@dataclass(frozen=True)
class _Placement(Placement):
    """``Placement`` plus ``arrival_slot``: per destination, the row at which this rank's rows start in the
    destination's arrival buffer (the rows lower ranks send there come first)."""

    arrival_slot: tuple[int, ...]


@dataclass(frozen=True)
class _State:
    """What combine needs from a dispatch."""

    round: int
    where: _Placement  # host tensors
    num_received: int
    receive_position: torch.Tensor  # [num_received] int64 on x's device: each arrived row's receive-order row


def _settle(device: torch.device) -> None:
    """NIXL reads and writes from the CPU's point in time: let the stream finish what fills the buffers."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class NixlEngine(SkeletonEngine):
    name = "nixl"

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm)
        self._arrivals = Arrivals(comm)
        self._buffers = NixlBuffers(comm)
        self._rounds = 0  # count exchanges so far: the same on every rank
        self._counts: tuple[int, Buffer, Buffer] | None = None  # (slot width, slots, my row)
        self._counts_transfers: dict[tuple[int, int], list] = {}  # (slot parity, width) -> one WRITE per peer
        self._writes: dict[tuple[str, int], tuple[tuple, BlockTransfer]] = {}  # (purpose, peer) -> (key, WRITE)

    def place(self, counts: torch.Tensor, capacity: int | None, fn: str) -> _Placement:
        """The skeleton's placement plus this rank's slot in every destination's arrival buffer."""
        where = super().place(counts, capacity, fn)
        world = self.world_size
        rows_between = counts[:, HEADER:].reshape(world, world, -1).sum(2)  # [source, destination]
        slots = exclusive_cumsum(rows_between, dim=0)[self.rank].tolist()
        return _Placement(**{f.name: getattr(where, f.name) for f in fields(Placement)}, arrival_slot=tuple(slots))

    # --- the row moves --------------------------------------------------------------------------
    def move_rows(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor, where: _Placement,
                  capacity: int | None) -> Received:
        me, device, hidden = self.rank, x.device, x.shape[1]
        row_bytes = hidden * x.element_size()
        rows_per_rank = where.rows_per_rank.tolist()
        num_received = rows_per_rank[me]
        family = f"dispatch/{device.type}"
        x_buffer = self._buffers.receive(f"{family}/x", [n * row_bytes for n in rows_per_rank], device)
        meta_buffer = self._buffers.receive(f"{family}/meta", [n * _META_BYTES for n in rows_per_rank], device)
        arrived_x = rows_or_empty(x_buffer, x.dtype, num_received, (hidden,), device)
        arrived_meta = rows_or_empty(meta_buffer, torch.int64, num_received, (META_COLUMNS,), device)

        num_sent = int(where.pairs_per_rank[me])
        sent = where.send_counts.sum(1).tolist()  # rows to each destination
        first = where.send_start[:, 0].tolist()  # where they start in the send order
        from_source = where.recv_counts.sum(1).tolist()
        arrival_start = _starts(from_source)
        tokens = layout.token_of_row[:num_sent]
        weights = topk_weights.reshape(-1).index_select(0, layout.order[:num_sent])
        stage_x = self._buffers.stage("dispatch/x", num_sent * row_bytes, device)
        staged_x = stage_x.rows(x.dtype, num_sent, (hidden,))
        stage_meta = self._buffers.stage("dispatch/meta", num_sent * _META_BYTES, device)
        staged_meta = stage_meta.rows(torch.int64, num_sent, (META_COLUMNS,))
        own = slice(first[me], first[me] + sent[me])
        for part in _around(own, num_sent):  # the peers' rows; this rank's own skip the staging buffer
            torch.index_select(x, 0, tokens[part], out=staged_x[part])
            pack_meta(staged_meta[part], me, tokens[part], weights[part])
        _settle(device)

        def own_rows() -> None:  # gathered while the WRITEs are on their way
            arrive = slice(arrival_start[me], arrival_start[me] + sent[me])
            torch.index_select(x, 0, tokens[own], out=arrived_x[arrive])
            pack_meta(arrived_meta[arrive], me, tokens[own], weights[own])

        streams = [Stream(stage_x, f"{family}/x", row_bytes), Stream(stage_meta, f"{family}/meta", _META_BYTES)]
        streams = [stream for stream in streams if stream.row_bytes]  # rows of H = 0 elements: metadata only
        ranges = {peer: (first[peer], where.arrival_slot[peer], n) for peer, n in enumerate(sent) if n and peer != me}
        senders = [s for s, n in enumerate(from_source) if n and s != me]
        self._move(ROWS, self._rounds, "dispatch", streams, ranges, own_rows, senders, "dispatch")

        # Both directions of the permutation, so that dispatch and combine each gather (a scatter with
        # index_copy_ takes ~3x as long on the host).
        position = segment_positions(where.recv_start.reshape(-1), where.recv_counts.reshape(-1), num_received)
        arrival_row = torch.empty_like(position)
        arrival_row[position] = torch.arange(num_received)
        position, arrival_row, tokens_per_expert, num_recv_rows = _upload([
            position, arrival_row, where.tokens_per_expert, torch.tensor(num_received, dtype=torch.int64)], device)
        out_rows = num_received if capacity is None else capacity
        recv_x = in_receive_order(arrived_x, arrival_row, out_rows)
        meta = in_receive_order(arrived_meta, arrival_row, out_rows)
        src_rank, src_idx, weights = unpack_meta(meta, topk_weights.dtype)
        return Received(recv_x=recv_x, tokens_per_expert=tokens_per_expert, recv_src_rank=src_rank,
                        recv_src_idx=src_idx, recv_weights=weights, num_recv_rows=num_recv_rows,
                        state=_State(self._rounds, where, num_received, position))

    def return_rows(self, expert_out: torch.Tensor, handle: DispatchHandle, num_tokens: int) -> torch.Tensor:
        state: _State = handle.state
        me, device, hidden = self.rank, expert_out.device, expert_out.shape[1]
        row_bytes = hidden * expert_out.element_size()
        where = state.where
        pairs = where.pairs_per_rank.tolist()  # rows each rank dispatched = rows it gets back
        family = f"combine{handle.dispatch_index % 2}/{device.type}"
        back = self._buffers.receive(family, [n * row_bytes for n in pairs], device)
        returned = rows_or_empty(back, expert_out.dtype, pairs[me], (hidden,), device)
        num_received = state.num_received
        from_source = where.recv_counts.sum(1).tolist()
        arrival_start = _starts(from_source)
        target = where.return_start[:, 0].tolist()  # where each source's range starts in its send order
        stage = self._buffers.stage("combine", num_received * row_bytes, device)
        staged = stage.rows(expert_out.dtype, num_received, (hidden,))
        position = state.receive_position  # gathering with it puts receive order back into arrival order
        outputs = expert_out.detach()  # bytes leave through NIXL: no gradient flows here either way
        own = slice(arrival_start[me], arrival_start[me] + from_source[me])
        for part in _around(own, num_received):  # the peers' rows; this rank's own skip the staging buffer
            torch.index_select(outputs, 0, position[part], out=staged[part])
        _settle(device)

        def own_rows() -> None:  # gathered while the WRITEs are on their way
            back_to = slice(target[me], target[me] + from_source[me])
            torch.index_select(outputs, 0, position[own], out=returned[back_to])

        ranges = {source: (arrival_start[source], target[source], n) for source, n in enumerate(from_source)
                  if n and source != me and row_bytes}
        senders = [r for r, n in enumerate(where.send_counts.sum(1).tolist()) if n and r != me and row_bytes]
        self._move(RETURN, state.round, family, [Stream(stage, family, row_bytes)], ranges, own_rows, senders,
                   "combine")
        return weighted_sum(returned, handle.layout, handle.topk_weights)

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        me, device, world = self.rank, send.device, self.world_size
        row_shape = tuple(send.shape[1:])
        nbytes = row_bytes(send)
        counts = torch.tensor(send_counts, dtype=torch.int64)
        # Its count row is made on the host, so reading it waits for no stream: let the stream finish the copies
        # out of the arrival buffers (the last call's) before the peers, told our counts, write the next rows.
        _settle(device)
        where = self.place(self.count_round(counts, 0, nbytes, None, world, "all_to_all_v"), None, "all_to_all_v")
        recv_counts = where.recv_counts.reshape(-1).tolist()
        num_received = sum(recv_counts)
        if nbytes == 0:
            return torch.empty(num_received, *row_shape, dtype=send.dtype, device=device), recv_counts
        family = f"a2av/{device.type}"
        buffer = self._buffers.receive(family, [n * nbytes for n in where.rows_per_rank.tolist()], device)
        # One expert per rank: the arrival order (source major) is the receive order.
        arrived = rows_or_empty(buffer, torch.uint8, num_received, (nbytes,), device)
        sent = where.send_counts.reshape(-1).tolist()
        first, slot = _starts(sent), where.arrival_slot
        rows = send.reshape(send.shape[0], nbytes // send.element_size()).view(torch.uint8)
        stage = self._buffers.stage("a2av", send.shape[0] * nbytes, device)
        staged = stage.rows(torch.uint8, send.shape[0], (nbytes,))
        own = slice(first[me], first[me] + sent[me])
        for part in _around(own, send.shape[0]):
            staged[part].copy_(rows[part])
        _settle(device)

        def own_rows() -> None:
            arrived[slot[me]:slot[me] + sent[me]].copy_(rows[own])

        ranges = {peer: (first[peer], slot[peer], n) for peer, n in enumerate(sent) if n and peer != me}
        senders = [s for s, n in enumerate(recv_counts) if n and s != me]
        self._move(ROWS, self._rounds, "a2av", [Stream(stage, family, nbytes)], ranges, own_rows, senders,
                   "all_to_all_v")
        recv = arrived.clone().view(send.dtype).view(num_received, *row_shape)
        return recv, recv_counts

    def close(self) -> None:
        """Close the prepared WRITEs and block pools and deregister every buffer (local; idempotent)."""
        self._drop_counts_transfers()
        self._drop_writes()
        counts, self._counts = self._counts, None
        self._buffers.close(*(counts[1:] if counts is not None else ()))

    # --- the count exchange ---------------------------------------------------------------------
    def exchange_counts(self, row: torch.Tensor, fn: str) -> torch.Tensor:
        """Every rank's count row ``[W, width]`` int64 on the host (``count_rows``). The ``.cpu()`` of
        ``row`` is the call's one host sync."""
        world, me = self.world_size, self.rank
        row = row.cpu()
        width = row.numel()
        self._rounds += 1
        parity = self._rounds % 2
        stride, slots, mine = self._counts_space(width)
        table = slots.tensor.view(torch.int64).view(2, world, stride)
        own = mine.tensor.view(torch.int64)[:width]
        own.copy_(row)
        table[parity, me, :width].copy_(row)
        peers = [peer for peer in range(world) if peer != me]
        transfers = self._counts_transfers.get((parity, width))
        if transfers is None:
            # Prepared once per (slot parity, width) and re-posted every other round. Their notification
            # names the parity, not the round: a peer is never two rounds ahead (it needs our counts of
            # the round in between), so the parity tells the rounds apart.
            offset = (parity * world + me) * stride * 8
            notify = message(COUNTS, parity)
            transfers = self._counts_transfers[(parity, width)] = [
                self.comm.prepare(Op.WRITE, own, self._buffers.peer("counts", peer).narrow(offset, width * 8),
                                  notify=notify, transport="nixl") for peer in peers]
        try:
            for transfer in transfers:
                transfer.post()
            self._arrivals.wait(COUNTS, parity, peers, transfers, fn)
        except BaseException:
            self._drop_counts_transfers()  # a failed round may leave them in flight: prepare afresh next time
            raise
        return table[parity, :, :width].clone()

    def _counts_space(self, width: int) -> tuple[int, Buffer, Buffer]:
        """The counts buffers, grown in lockstep (every rank asks for the same width in the same call)."""
        stride = max(64, next_power_of_two(width))
        if self._counts is None or self._counts[0] < stride:
            self._drop_counts_transfers()
            if self._counts is not None:
                self._buffers.retire(self._counts[1], self._counts[2])
            slots = Buffer(self.comm, 2 * self.world_size * stride * 8, torch.device("cpu"))
            mine = Buffer(self.comm, stride * 8, torch.device("cpu"))
            self._counts = (stride, slots, mine)
            self._buffers.sizes["counts"] = [slots.nbytes] * self.world_size
            self.comm.publish(f"moe/nixl/counts/{slots.nbytes}", slots.desc)
        return self._counts

    def _drop_counts_transfers(self) -> None:
        for transfers in self._counts_transfers.values():
            for transfer in transfers:
                transfer.close()
        self._counts_transfers.clear()

    # --- moving bytes ---------------------------------------------------------------------------
    def _move(self, kind: int, round_: int, purpose: str, streams: list[Stream],
              ranges: dict[int, tuple[int, int, int]], local_work: Callable[[], None], senders: list[int],
              fn: str) -> None:
        """Post one WRITE (with notify (kind, round)) per peer in ``ranges``: ``(first, target, count)`` moves
        rows ``[first, first + count)`` of every stream's stage buffer to rows ``[target, target + count)`` of
        the peer's buffer of the stream's family. Then run ``local_work`` (this rank's own rows: the peers get
        theirs first), and wait until every rank in ``senders`` has notified (kind, round) and our own WRITEs
        are done. Blocks (sleeping between polls), bounded by the communicator's timeout. The WRITEs stay
        prepared for the next call (``purpose`` names them)."""
        notify = message(kind, round_)
        posted = []
        try:
            for peer, (first, target, count) in ranges.items():
                write = self._write_to(purpose, peer, streams)
                write.post(np.arange(first, first + count), np.arange(target, target + count), notify=notify)
                posted.append(write)
            local_work()
            self._arrivals.wait(kind, round_, senders, posted, fn)
        except BaseException:
            self._drop_writes()  # a failed call may leave them in flight: prepare afresh next time
            raise

    def _write_to(self, purpose: str, peer: int, streams: list[Stream]) -> BlockTransfer:
        """The prepared row WRITE from this rank's staging buffers to ``peer``'s buffers of the streams'
        families, for ``purpose``; prepared again (one store round trip) only when a buffer on either side
        was replaced or the bytes per row changed."""
        pool = self._buffers.pool(streams)
        descs = [self._buffers.peer(stream.family, peer) for stream in streams]
        key = (id(pool), tuple((d.addr, d.nbytes, d.epoch, s.row_bytes) for d, s in zip(descs, streams)))
        cached = self._writes.get((purpose, peer))
        if cached is not None and cached[0] == key and not cached[1].closed:
            return cached[1]
        if cached is not None:
            cached[1].close()
        rows = min(d.nbytes // s.row_bytes for d, s in zip(descs, streams))
        remote = BlockPoolDesc(peer, descs[0].kind, descs[0].device_index, rows,
                               tuple((d.addr, s.row_bytes, s.row_bytes, d.epoch) for d, s in zip(descs, streams)))
        write = self.comm.prepare_blocks(Op.WRITE, pool, remote, transport="nixl")
        self._writes[(purpose, peer)] = (key, write)
        return write

    def _drop_writes(self) -> None:
        for _, write in self._writes.values():
            write.close()
        self._writes.clear()


def _starts(counts: list[int]) -> list[int]:
    """Where each of ``counts`` consecutive ranges starts when they are laid end to end."""
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


def _upload(host: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``host`` int64 tensors (any shapes) on ``device``. To a GPU in one copy from pinned memory that does not
    wait for the stream (a plain ``.to(device)`` from pageable memory waits for it, once per tensor); the
    pinned block is the caching host allocator's, which keeps it until the copy has run. Views of one device
    tensor, not overlapping."""
    if device.type != "cuda":
        return [tensor.to(device) for tensor in host]
    packed = torch.cat([tensor.reshape(-1) for tensor in host]).pin_memory().to(device, non_blocking=True)
    parts, start = [], 0
    for tensor in host:
        parts.append(packed[start:start + tensor.numel()].view(tensor.shape))
        start += tensor.numel()
    return parts


def _around(middle: slice, total: int) -> tuple[slice, slice]:
    """The rows of ``[0, total)`` before and after ``middle``."""
    return slice(0, middle.start), slice(middle.stop, total)
