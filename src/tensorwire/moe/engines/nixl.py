"""The ``"nixl"`` MoE engine: one-sided WRITEs into peers' registered buffers, completed by notifications.

Host and GPU memory alike; the path that crosses machines. Driven by the CPU, so every call synchronises
with the host (once, to read the counts) and blocks until its rows have arrived.

Per call::

    1. counts   each rank WRITEs its count row into slot [round % 2][rank] of every peer's counts buffer
                (host memory) with notify (COUNTS, round % 2) (prepared once, re-posted); it waits for W - 1
                such notifications. Now every rank holds the whole count matrix, so every rank knows where
                each of its rows lands.
    2. rows     each rank WRITEs, per destination, one item per (local expert) block straight to its final
                place in the destination's receive buffer (no permutation on the receiver), with notify
                (ROWS, round); a receiver waits for one notification per rank that sends it rows.
    3. combine  the receiver WRITEs each block of expert outputs back into the source's return buffer at
                the block's send-order position, notify (RETURN, round of the dispatch); the source sums.

Buffers. Receive buffers are registered once per (purpose, device kind) and grown (re-registered and
re-published under a key naming their size) when a call needs more. Sizes are a pure function of the count
matrix every rank holds, so every rank knows every peer's current size without asking, and looks a
grown buffer up once. Send staging buffers are registered too (NIXL reads from registered memory).

Why nothing is overwritten while still in use: a rank posts the counts of round n+1 only after it has
finished round n, and every WRITE of round n+1 waits for all counts of round n+1; so rows of the next call
never land before every rank is done with the previous one. Count slots alternate between two rounds
(a rank that received nothing from a peer may finish a round before that peer has read its counts).
Return buffers alternate between two dispatches, which is why a dispatch must be combined before the
second dispatch after it (``check_fresh``). Notifications carry (kind, round): one that arrives early is
remembered, so back-to-back calls never mix.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...backends.base import Op, Status
from ...descriptors import TensorDesc
from ...errors import TransferError
from ...progress import wait_until
from ..engine import DispatchHandle, Received, SkeletonEngine
from ..layout import Placement, SendLayout
from ..rows import META_COLUMNS, next_power_of_two, pack_meta, row_bytes, unpack_meta, weighted_sum

if TYPE_CHECKING:
    from ...communicator import Communicator

__all__ = ["NixlEngine"]

_MAGIC = b"twmoe"
_MESSAGE = struct.Struct("<BQ")  # kind, round
_COUNTS, _ROWS, _RETURN = 1, 2, 3
_KIND_NAMES = {_COUNTS: "count row", _ROWS: "rows", _RETURN: "expert outputs"}
_MIN_BUFFER_BYTES = 4096
_META_BYTES = META_COLUMNS * 8


class _Buffer:
    """A registered byte buffer of this rank (``tensor [nbytes]`` uint8)."""

    def __init__(self, comm: Communicator, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.registration = comm.register(self.tensor)
        self.desc: TensorDesc = self.registration.descs[0]

    def rows(self, dtype: torch.dtype, count: int, row_shape: tuple[int, ...]) -> torch.Tensor:
        """The first ``count`` rows of ``row_shape`` and ``dtype``, as a view."""
        row_elements = 1
        for size in row_shape:
            row_elements *= size
        nbytes = count * row_elements * torch.empty((), dtype=dtype).element_size()
        return self.tensor[:nbytes].view(dtype).view(count, *row_shape)

    def close(self) -> None:
        self.registration.close()


@dataclass(frozen=True)
class _State:
    """What combine needs from a dispatch."""

    round: int
    where: Placement  # host tensors
    num_received: int


def _settle(device: torch.device) -> None:
    """NIXL reads and writes from the CPU's point in time: let the stream finish what fills the buffers."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class NixlEngine(SkeletonEngine):
    name = "nixl"

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm)
        comm._inbox.open_channel(_MAGIC)  # MoE notifications never mix with the user's
        self._rounds = 0  # count exchanges so far: the same on every rank
        self._counts: tuple[int, _Buffer, _Buffer] | None = None  # (slot width, slots, my row)
        self._receive: dict[str, _Buffer] = {}
        self._sizes: dict[str, list[int]] = {}  # every rank's receive buffer size, per family
        self._remote: dict[tuple[str, int], tuple[int, TensorDesc]] = {}
        self._staging: dict[str, _Buffer] = {}
        self._retired: list[_Buffer] = []  # outgrown buffers, kept registered (see _retire)
        self._counts_transfers: dict[tuple[int, int], list] = {}  # (slot parity, width) -> one WRITE per peer
        self._early: list[set[tuple[int, int]]] = [set() for _ in range(comm.world_size)]

    # --- the row moves --------------------------------------------------------------------------
    def move_rows(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor, where: Placement,
                  capacity: int | None) -> Received:
        me, device, hidden = self.rank, x.device, x.shape[1]
        row_bytes = hidden * x.element_size()
        rows_per_rank = where.rows_per_rank.tolist()
        allocated = [capacity if capacity is not None else n for n in rows_per_rank]
        family = f"dispatch/{device.type}"
        x_buffer = self._ensure_receive(f"{family}/x", [n * row_bytes for n in allocated], device)
        meta_buffer = self._ensure_receive(f"{family}/meta", [n * _META_BYTES for n in allocated], device)
        local_x = _rows_or_empty(x_buffer, x.dtype, allocated[me], (hidden,), device)
        local_meta = _rows_or_empty(meta_buffer, torch.int64, allocated[me], (META_COLUMNS,), device)

        num_sent = int(where.pairs_per_rank[me])
        tokens = layout.token_of_row[:num_sent]
        stage_x = self._stage("dispatch/x", num_sent * row_bytes, device).rows(x.dtype, num_sent, (hidden,))
        torch.index_select(x, 0, tokens, out=stage_x)
        stage_meta = self._stage("dispatch/meta", num_sent * _META_BYTES, device).rows(
            torch.int64, num_sent, (META_COLUMNS,))
        pack_meta(stage_meta, me, tokens, topk_weights.reshape(-1).index_select(0, layout.order[:num_sent]))
        _settle(device)

        sends = self._route(_blocks(where.send_counts, where.send_start, where.destination_start), [
            (stage_x, local_x, f"{family}/x", row_bytes), (stage_meta, local_meta, f"{family}/meta", _META_BYTES)])
        senders = [s for s, n in enumerate(where.recv_counts.sum(1).tolist()) if n and s != me]
        self._move(_ROWS, self._rounds, sends, senders, "dispatch")

        num_received = rows_per_rank[me]
        recv_x, meta = local_x.clone(), local_meta.clone()
        recv_x[num_received:] = 0  # capacity rows past the valid ones: zeros, as the torch engine gives
        meta[num_received:] = 0
        src_rank, src_idx, weights = unpack_meta(meta, topk_weights.dtype)
        return Received(recv_x=recv_x, tokens_per_expert=where.tokens_per_expert.to(device), recv_src_rank=src_rank,
                        recv_src_idx=src_idx, recv_weights=weights,
                        num_recv_rows=torch.tensor(num_received, dtype=torch.int64).to(device),
                        state=_State(self._rounds, where, num_received))

    def return_rows(self, expert_out: torch.Tensor, handle: DispatchHandle, num_tokens: int) -> torch.Tensor:
        state: _State = handle.state
        me, device, hidden = self.rank, expert_out.device, expert_out.shape[1]
        row_bytes = hidden * expert_out.element_size()
        where = state.where
        pairs = where.pairs_per_rank.tolist()  # rows each rank dispatched = rows it gets back
        family = f"combine{handle.dispatch_index % 2}/{device.type}"
        back = self._ensure_receive(family, [n * row_bytes for n in pairs], device)
        returned = _rows_or_empty(back, expert_out.dtype, pairs[me], (hidden,), device)
        num_received = state.num_received
        stage = self._stage("combine", num_received * row_bytes, device).rows(expert_out.dtype, num_received, (hidden,))
        stage.copy_(expert_out[:num_received])
        _settle(device)

        sends = self._route(_blocks(where.recv_counts, where.recv_start, where.return_start),
                            [(stage, returned, family, row_bytes)])
        senders = [r for r, n in enumerate(where.send_counts.sum(1).tolist()) if n and r != me and row_bytes]
        self._move(_RETURN, state.round, sends, senders, "combine")
        return weighted_sum(returned, handle.layout, handle.topk_weights)

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        me, device, world = self.rank, send.device, self.world_size
        row_shape = tuple(send.shape[1:])
        nbytes = row_bytes(send)
        counts = torch.tensor(send_counts, dtype=torch.int64)
        where = self.place(self.count_round(counts, 0, nbytes, None, world, "all_to_all_v"), None, "all_to_all_v")
        recv_counts = where.recv_counts.reshape(-1).tolist()
        num_received = sum(recv_counts)
        if nbytes == 0:
            return torch.empty(num_received, *row_shape, dtype=send.dtype, device=device), recv_counts
        family = f"a2av/{device.type}"
        buffer = self._ensure_receive(family, [n * nbytes for n in where.rows_per_rank.tolist()], device)
        local = _rows_or_empty(buffer, torch.uint8, num_received, (nbytes,), device)
        stage = self._stage("a2av", send.shape[0] * nbytes, device).rows(torch.uint8, send.shape[0], (nbytes,))
        stage.copy_(send.reshape(send.shape[0], nbytes // send.element_size()).view(torch.uint8))
        _settle(device)

        sends = self._route(_blocks(where.send_counts, where.send_start, where.destination_start),
                            [(stage, local, family, nbytes)])
        senders = [s for s, n in enumerate(recv_counts) if n and s != me]
        self._move(_ROWS, self._rounds, sends, senders, "all_to_all_v")
        recv = local.clone().view(send.dtype).view(num_received, *row_shape)
        return recv, recv_counts

    def close(self) -> None:
        """Close the count round's prepared WRITEs and deregister every buffer (local; idempotent)."""
        self._drop_counts_transfers()
        buffers = [*self._receive.values(), *self._staging.values(), *self._retired]
        if self._counts is not None:
            buffers += self._counts[1:]
        self._receive, self._staging, self._retired, self._counts = {}, {}, [], None
        for buffer in buffers:
            buffer.close()

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
            message = _MAGIC + _MESSAGE.pack(_COUNTS, parity)
            transfers = self._counts_transfers[(parity, width)] = [
                self.comm.prepare(Op.WRITE, own, self._peer_buffer("counts", peer).narrow(offset, width * 8),
                                  notify=message, transport="nixl") for peer in peers]
        try:
            for transfer in transfers:
                transfer.post()
            self._await(_COUNTS, parity, peers, transfers, fn)
        except BaseException:
            self._drop_counts_transfers()  # a failed round may leave them in flight: prepare afresh next time
            raise
        return table[parity, :, :width].clone()

    def _counts_space(self, width: int) -> tuple[int, _Buffer, _Buffer]:
        """The counts buffers, grown in lockstep (every rank asks for the same width in the same call)."""
        stride = max(64, next_power_of_two(width))
        if self._counts is None or self._counts[0] < stride:
            self._drop_counts_transfers()
            if self._counts is not None:
                self._retire(self._counts[1], self._counts[2])
            slots = _Buffer(self.comm, 2 * self.world_size * stride * 8, torch.device("cpu"))
            mine = _Buffer(self.comm, stride * 8, torch.device("cpu"))
            self._counts = (stride, slots, mine)
            self._sizes["counts"] = [slots.nbytes] * self.world_size
            self.comm.publish(f"moe/nixl/counts/{slots.nbytes}", slots.desc)
        return self._counts

    def _retire(self, *buffers: _Buffer) -> None:
        """Keep outgrown buffers registered until the communicator closes, so no address a peer has seen is
        freed and handed to the next buffer mid-job. Growth is geometric: at most as much again as the
        largest buffers."""
        self._retired.extend(buffers)

    def _drop_counts_transfers(self) -> None:
        for transfers in self._counts_transfers.values():
            for transfer in transfers:
                transfer.close()
        self._counts_transfers.clear()

    # --- buffers --------------------------------------------------------------------------------
    def _ensure_receive(self, family: str, need: list[int], device: torch.device) -> _Buffer | None:
        """This rank's receive buffer of ``family``, grown if ``need[self.rank]`` bytes do not fit; also
        grows this rank's record of every peer's size (the same rule runs on every rank)."""
        sizes = self._sizes.setdefault(family, [0] * self.world_size)
        for rank, nbytes in enumerate(need):
            if nbytes > sizes[rank]:
                sizes[rank] = max(_MIN_BUFFER_BYTES, next_power_of_two(nbytes))
        mine = self._receive.get(family)
        if sizes[self.rank] and (mine is None or mine.nbytes != sizes[self.rank]):
            if mine is not None:
                self._retire(mine)
            mine = self._receive[family] = _Buffer(self.comm, sizes[self.rank], device)
            self.comm.publish(f"moe/nixl/{family}/{mine.nbytes}", mine.desc)
        return mine

    def _route(self, blocks_by_peer, streams: list[tuple[torch.Tensor, torch.Tensor, str, int]]) -> dict[int, list]:
        """Copy this rank's own blocks in place; return, per peer, the ``(staged rows, remote range)`` items
        to WRITE. ``blocks_by_peer`` yields ``(peer, [(count, local start, remote start)])``; ``streams`` are
        ``(staged rows, this rank's destination rows, buffer family, bytes per row)``, moved block by block."""
        sends: dict[int, list] = {}
        for peer, blocks in blocks_by_peer:
            if peer == self.rank:
                for count, start, target in blocks:
                    for stage, local, _, _ in streams:
                        local[target:target + count].copy_(stage[start:start + count])
                continue
            remotes = [(stage, self._peer_buffer(family, peer), row_bytes) for stage, _, family, row_bytes in streams]
            sends[peer] = [(stage[start:start + count], remote.narrow(target * row_bytes, count * row_bytes))
                           for count, start, target in blocks for stage, remote, row_bytes in remotes]
        return sends

    def _peer_buffer(self, family: str, peer: int) -> TensorDesc:
        """The descriptor of ``peer``'s current ``family`` buffer (looked up once per size)."""
        size = self._sizes[family][peer]
        cached = self._remote.get((family, peer))
        if cached is None or cached[0] != size:
            desc = self.comm.lookup(f"moe/nixl/{family}/{size}", peer)[0]
            cached = self._remote[(family, peer)] = (size, desc)
        return cached[1]

    def _stage(self, name: str, nbytes: int, device: torch.device) -> _Buffer:
        """A registered local buffer of at least ``nbytes`` (rows are gathered into it for NIXL to read)."""
        buffer = self._staging.get(name)
        if buffer is None or buffer.nbytes < nbytes or buffer.tensor.device != device:
            if buffer is not None:
                self._retire(buffer)
            buffer = self._staging[name] = _Buffer(self.comm, max(_MIN_BUFFER_BYTES, next_power_of_two(nbytes)), device)
        return buffer

    # --- moving bytes ---------------------------------------------------------------------------
    def _move(self, kind: int, round_: int, sends: dict[int, list[tuple[torch.Tensor, TensorDesc]]],
              senders: list[int], fn: str) -> None:
        """Post one WRITE (with notify (kind, round)) per peer in ``sends``, then wait until every rank in
        ``senders`` has notified (kind, round) and our own WRITEs are done. Blocks (sleeping between polls),
        bounded by the communicator's timeout."""
        message = _MAGIC + _MESSAGE.pack(kind, round_)
        transfers = []
        try:
            for blocks in sends.values():
                items = [(local, remote) for local, remote in blocks if remote.nbytes]
                if not items:
                    continue
                transfer = self.comm.prepare(Op.WRITE, [local for local, _ in items], [remote for _, remote in items],
                                             notify=message, transport="nixl")
                transfers.append(transfer)
                transfer.post()
            self._await(kind, round_, senders, transfers, fn)
        finally:
            for transfer in transfers:
                transfer.close()

    def _await(self, kind: int, round_: int, senders: list[int], transfers: list, fn: str) -> None:
        """Wait for one (kind, round) notification from each of ``senders`` (others that arrive are kept for
        their own call) and for ``transfers`` to complete. A posted NIXL WRITE only progresses while its
        status is polled, so both are polled in one loop: waiting for the peers alone would deadlock."""
        wanted = (kind, round_)
        pending = []
        for sender in senders:
            if wanted in self._early[sender]:
                self._early[sender].remove(wanted)
            else:
                pending.append(sender)
        in_flight = list(transfers)

        def ready() -> bool:
            for transfer in list(in_flight):
                state = transfer.status()
                if state is Status.ERROR:
                    raise TransferError(f"{fn}: the WRITE of {_KIND_NAMES[kind]} to rank {transfer.peer} failed; "
                                        "the peer may have exited")
                if state is Status.DONE:
                    in_flight.remove(transfer)
            for sender in list(pending):
                while (message := self.comm._inbox.try_pop(sender, _MAGIC)) is not None:
                    got = self._parse(message, sender, fn)
                    if got == wanted:
                        pending.remove(sender)
                        break
                    if got in self._early[sender]:
                        raise TransferError(
                            f"{fn}: rank {sender} delivered {_KIND_NAMES[got[0]]} of round {got[1]} twice")
                    self._early[sender].add(got)
            return not pending and not in_flight

        def describe() -> str:
            if pending:
                return (f"{fn}: rank(s) {pending} did not deliver their {_KIND_NAMES[kind]} of round {round_}; "
                        "every rank must make the same MoE calls in the same order")
            return f"{fn}: WRITEs of {_KIND_NAMES[kind]} to rank(s) {[t.peer for t in in_flight]} did not complete"

        wait_until(ready, self.comm.timeout_s, describe, self.comm.config)

    @staticmethod
    def _parse(message: bytes, sender: int, fn: str) -> tuple[int, int]:
        if len(message) != len(_MAGIC) + _MESSAGE.size or not message.startswith(_MAGIC):
            raise TransferError(
                f"{fn}: rank {sender} sent a malformed tensorwire.moe notification ({message[:24]!r}); "
                "messages starting with b'twmoe' are reserved for tensorwire.moe"
            )
        kind, round_ = _MESSAGE.unpack_from(message, len(_MAGIC))
        return kind, round_


def _blocks(counts: torch.Tensor, starts: torch.Tensor, targets: torch.Tensor):
    """Per peer, the non-empty blocks ``(count, local start, remote start)`` of three ``[W, L]`` tables."""
    rows = zip(counts.tolist(), starts.tolist(), targets.tolist())
    for peer, (row_counts, row_starts, row_targets) in enumerate(rows):
        blocks = [(n, s, t) for n, s, t in zip(row_counts, row_starts, row_targets) if n]
        if blocks:
            yield peer, blocks


def _rows_or_empty(buffer: _Buffer | None, dtype: torch.dtype, count: int, row_shape: tuple[int, ...],
                   device: torch.device) -> torch.Tensor:
    if buffer is None:
        return torch.zeros(count, *row_shape, dtype=dtype, device=device)
    return buffer.rows(dtype, count, row_shape)
