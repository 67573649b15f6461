"""One producer rank as a consumer lane sees it: finding it in the fleet (bounded; one that left is remembered),
its published pool, the messages to it, and the READs of a head range of its blocks into ours, as the two engines'
block shapes pair them (``shapes.BlockPlan``)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

import tensorwire as tw

from .handoff import Load, member_name
from .heads import HeadRead, Sharding
from .member import POOL_KEY, KVMember
from .shapes import BlockPlan, BlockShape, Part

__all__ = ["Source", "LoadFailed"]

log = logging.getLogger(__name__)

_PRESENCE_S = 0.2  # how long a departed producer's name is looked up before its job fails
# A lost producer still listed under its rank is taken as gone this long: the directory forgets a dead member
# within TENSORWIRE_LIVENESS_S, so one listed after this is alive (its loss was a false alarm) and is contacted again.
_DEPARTED_S = 15.0
_MAX_RANGES = 65535  # views of a derived pool (the block kernel's grid, a pool descriptor's count)


class LoadFailed(Exception):
    """A job's failure with its ``reason`` (``LoadResult.reason``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Source:
    """Producer rank ``producer_rank`` of instance ``instance`` (TP ``producer_tp``), as consumer ``member`` reaches
    it (``channel``: the consumer's channel to producers; ``bounds``: its ``timeout_s``, ``contact_s``;
    ``transport``: the READs' one, None: the fastest). A lane thread's only."""

    def __init__(self, member: KVMember, channel: Any, bounds: tuple[float, float], instance: str, producer_rank: int,
                 producer_tp: int, transport: str | None = None) -> None:
        self._forced = transport
        self.own, self.channel = member, channel
        self.timeout_s, self.contact_s = bounds
        self.producer_rank, self.producer_tp = producer_rank, producer_tp
        self.member = member_name(instance, producer_rank, producer_tp)
        self.rank = -1  # its fleet rank at the last contact
        self.desc: tw.BlockPoolDesc | None = None
        self.order: str | None = None  # its blocks' order of rows, as its last grant said (None: no grant yet)
        self.transport = ""
        self._plans: dict[tuple, tuple[BlockPlan, list[Part]]] = {}  # (read, block size, order) -> plan, parts
        self._transfers: dict[tuple, tuple[tw.BlockTransfer, tw.BlockPool | None]] = {}
        self._warned = False  # logged once that its blocks take several descriptors each
        self._departed_rank: int | None = None  # the rank it had when it left (-1: never found)
        self._departed_at = 0.0
        self._fresh = True  # no READ from it completed yet (its connection is being set up)
        self._last: list[tuple] = []  # the last posts: (plan, part, local ids, remote ids)

    # --- finding it ---------------------------------------------------------------------------------------------
    def contact(self, layout: str) -> None:
        """Find its rank and pool (once; bounded by ``contact_s``; by a short look within ``_DEPARTED_S`` of its
        loss or of a contact that missed, so that loads naming it fail fast meanwhile, and by ``contact_s`` again
        after that: on a loaded box one missed contact must not make a live producer unreachable for good)."""
        if self.desc is not None:
            return
        recent = self._departed_rank is not None and time.monotonic() - self._departed_at < _DEPARTED_S
        bound = _PRESENCE_S if recent else self.contact_s
        try:
            rank = self.own.comm.rank_of(self.member, timeout=bound)
        except tw.WaitTimeoutError:
            if not recent:  # a window starts at a miss; misses inside it do not stretch it
                self._departed_rank = -1 if self._departed_rank is None else self._departed_rank
                self._departed_at = time.monotonic()
            raise LoadFailed("unreachable", f"no member {self.member!r} in the fleet within {bound:g}s; is the "
                             "producer running, under that name, in this directory?") from None
        if rank == self._departed_rank and time.monotonic() - self._departed_at < _DEPARTED_S:
            raise LoadFailed("departed", f"producer {self.member!r} (rank {rank}) left; its handoffs are recomputed "
                             "until it is started again")
        self.rank = rank  # if it is lost during the contact, this rank is the one that left
        self.desc = self._lookup(rank)
        self._fresh = True
        self._departed_rank = None

    def _lookup(self, rank: int) -> tw.BlockPoolDesc:
        """Its pool. On a 2-core box running several engines the first answer can miss ``contact_s``; a producer
        still listed under its name is asked again until ``timeout_s``: only this lane waits."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.own.comm.lookup_blocks(POOL_KEY, rank, timeout=self.contact_s)
            except (tw.WaitTimeoutError, tw.PeerLostError) as e:
                if time.monotonic() >= deadline or not self.listed():
                    raise
                log.info("KV consumer: first contact with %r (rank %d) failed, again: %s", self.member, rank, e)
                time.sleep(0.5)  # a dead producer refuses at once: do not spin until the directory forgets it

    def listed(self) -> bool:
        """Whether the directory still lists its rank under its name."""
        try:
            return self.own.comm.rank_of(self.member, timeout=_PRESENCE_S) == self.rank
        except tw.WaitTimeoutError:
            return False

    def check_alive(self) -> None:
        """``LoadFailed("lost")`` if the fleet no longer lists it."""
        if not self.listed():
            raise LoadFailed("lost", f"producer {self.member!r} (rank {self.rank}) left the fleet")

    def send(self, message: bytes) -> None:
        self.channel.send(self.rank, message)

    # --- reading ------------------------------------------------------------------------------------------------
    def post(self, read: HeadRead, loads: list[Load]) -> int:
        """Post the READs of ``read``'s heads of ``loads``' blocks into ours: one per part of the block plan
        (``shapes.BlockPlan``: one part when both engines' blocks hold the same tokens); returns the bytes."""
        block_size = loads[0].handoff.block_size
        if any(ld.handoff.block_size != block_size for ld in loads):
            raise LoadFailed("layout", f"{self.member!r}'s handoffs name different block sizes "
                             f"{sorted({ld.handoff.block_size for ld in loads})}; one engine has one block size")
        plan, parts = self._plan(read, block_size)
        moved = 0
        for part in parts:
            pairs = [plan.pairs(part.index, np.asarray(ld.local_block_ids, dtype=np.int64),
                                np.asarray(ld.handoff.block_ids, dtype=np.int64), ld.handoff.num_tokens)
                     for ld in loads]
            local, remote = (np.concatenate([p[i] for p in pairs]) for i in (0, 1))
            if not len(local):
                continue  # a part past every prompt's last block (larger consumer blocks, short prompts)
            transfer = self._transfer(plan, part)
            transfer.post(local, remote)
            self._last.append((plan, part, local, remote))
            moved += len(local) * transfer.bytes_per_block
        return moved

    def wait(self) -> None:
        """Wait for the posts since the last wait. The first READ to a producer sets up its transport's connection; on a
        loaded box that can miss its bound while the producer is fine: once more on fresh transfers, if it is still
        listed (a READ only rewrites our own blocks of these requests, and the producer frees them only after our DONE,
        which follows the last wait: repeating it is harmless)."""
        posted, self._last = self._last, []
        try:
            for plan, part, _, _ in posted:
                self._transfer(plan, part).wait(timeout=self.timeout_s)
        except tw.TensorwireError as e:
            if not self._fresh or not self.listed():
                raise
            log.info("KV consumer: the first READ from %r failed, once more: %s", self.member, e)
            self.drop()
            for plan, part, local, remote in posted:
                self._transfer(plan, part).post(local, remote)
            for plan, part, _, _ in posted:
                self._transfer(plan, part).wait(timeout=self.timeout_s)
        self._fresh = False

    def _plan(self, read: HeadRead, block_size: int) -> tuple[BlockPlan, list[Part]]:
        """Our blocks and its, as ``read`` pairs them (its shape: the handoff's block size, its grant's order), and
        the plan's parts; made once per (read, block size, order)."""
        key = (read, block_size, self.order)
        if key not in self._plans:
            own = self.own.sharding
            start, stop = Sharding(self.producer_tp, own.total_heads, own.replicated).heads(self.producer_rank)
            try:
                plan = BlockPlan(self.own.shape, BlockShape(block_size, stop - start, self.order), read)
            except tw.InvalidArgumentError as e:
                raise LoadFailed("layout", f"{self.member!r}: {e}") from None
            self._plans[key] = (plan, plan.parts())
        return self._plans[key]

    def _transfer(self, plan: BlockPlan, part: Part) -> tw.BlockTransfer:
        key = (plan.read, plan.remote, part.index)
        if key not in self._transfers:
            local, remote = self._selected(plan, part)
            transfer = self.own.comm.prepare_blocks(tw.READ, local or self.own.pool, remote, transport=self._forced)
            self._transfers[key] = (transfer, local)
            self.transport = transfer.transport
        return self._transfers[key][0]

    def _selected(self, plan: BlockPlan, part: Part) -> tuple[tw.BlockPool | None, tw.BlockPoolDesc]:
        """Our pool and its pool reduced to ``part``'s rows of every block of every view (None, desc: whole
        blocks)."""
        pool = self.own.pool
        if plan.whole:
            return None, self.desc
        local_row = _per_row(pool.block_bytes, plan.local.rows)
        remote_row = _per_row(self.desc.block_bytes, plan.remote.rows)
        if local_row is None or local_row != remote_row:
            raise LoadFailed("layout", f"bytes per row (one head of one token) per view differ: this consumer "
                             f"{local_row}, {self.member!r} {remote_row} (blocks of {pool.block_bytes} and "
                             f"{self.desc.block_bytes} bytes, {plan.local} and {plan.remote}); both must serve the "
                             "same model and KV dtype, and give KVMember their own block_size")
        regions = len(local_row) * len(part.ranges)
        if regions > _MAX_RANGES:
            raise LoadFailed("layout", f"reading {self.member!r}'s {plan.remote.order} blocks into our "
                             f"{plan.local.order} ones takes {len(part.ranges)} ranges per block and view, {regions} "
                             f"in all (at most {_MAX_RANGES}); run both engines with the HND layout")
        if len(part.ranges) > 1 and not self._warned:
            self._warned = True
            log.info("KV consumer: %r's %s blocks of %d tokens into our %s blocks of %d: %d descriptors per block and "
                     "view (HND on both sides needs one)", self.member, plan.remote.order, plan.remote.block_size,
                     plan.local.order, plan.local.block_size, len(part.ranges))
        local = pool.select([(v, row * lr, row * n) for v, row in enumerate(local_row) for lr, _, n in part.ranges])
        remote = self.desc.select([(v, row * rr, row * n) for v, row in enumerate(remote_row)
                                   for _, rr, n in part.ranges])
        return local, remote
    def failed(self, reason: str) -> None:
        """After a job failed: a lost producer the directory no longer lists under its rank is remembered as
        departed (a live one taken for lost under load, still listed, is contacted again at the next load); its
        transfers are contacted afresh."""
        if reason == "lost" and not self.listed():
            self._departed_rank, self._departed_at = self.rank, time.monotonic()
        self.drop()
        self._last = []
        self.desc = None

    def drop(self) -> None:
        for transfer, local in self._transfers.values():
            try:
                transfer.close()
                if local is not None:
                    local.close()
            except Exception as e:  # noqa: BLE001 - a transfer to a dead producer may fail to close; go on
                log.debug("KV consumer: closing the transfer to %r: %s", self.member, e)
        self._transfers.clear()


def _per_row(block_bytes: tuple[int, ...], rows: int) -> list[int] | None:
    if any(b % rows for b in block_bytes):
        return None
    return [b // rows for b in block_bytes]
