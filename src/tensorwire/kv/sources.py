"""One producer rank as a consumer lane sees it: finding it in the fleet (bounded; one that left is remembered),
its published pool, the messages to it, and the READs of a head range of its blocks into ours."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

import tensorwire as tw

from .handoff import member_name
from .heads import HeadRead, Sharding
from .member import POOL_KEY, KVMember

__all__ = ["Source", "LoadFailed"]

log = logging.getLogger(__name__)

_PRESENCE_S = 0.2  # how long a departed producer's name is looked up before its job fails
# A lost producer still listed under its rank is taken as gone this long: the directory forgets a dead member
# within TENSORWIRE_LIVENESS_S, so one listed after this is alive (its loss was a false alarm) and is contacted again.
_DEPARTED_S = 15.0


class LoadFailed(Exception):
    """A job's failure with its ``reason`` (``LoadResult.reason``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Source:
    """Producer rank ``producer_rank`` of instance ``instance`` (TP ``producer_tp``), as consumer ``member`` reaches
    it (``channel``: the consumer's channel to producers; ``bounds``: its ``timeout_s``, ``contact_s``). A lane
    thread's only."""

    def __init__(self, member: KVMember, channel: Any, bounds: tuple[float, float], instance: str, producer_rank: int,
                 producer_tp: int) -> None:
        self.own, self.channel = member, channel
        self.timeout_s, self.contact_s = bounds
        self.producer_rank, self.producer_tp = producer_rank, producer_tp
        self.member = member_name(instance, producer_rank, producer_tp)
        self.rank = -1  # its fleet rank at the last contact
        self.desc: tw.BlockPoolDesc | None = None
        self.heads_outermost = False  # as its last grant said
        self.transport = ""
        self._transfers: dict[tuple[int, int, int], tuple[tw.BlockTransfer, tw.BlockPool | None]] = {}
        self._departed_rank: int | None = None  # the rank it had when it left (-1: never found)
        self._departed_at = 0.0
        self._fresh = True  # no READ from it completed yet (its connection is being set up)
        self._last: tuple = ()

    # --- finding it ---------------------------------------------------------------------------------------------
    def contact(self, layout: str) -> None:
        """Find its rank and pool (once; bounded by ``contact_s``, at once for one that left)."""
        if self.desc is not None:
            return
        bound = self.contact_s if self._departed_rank is None else _PRESENCE_S
        try:
            rank = self.own.comm.rank_of(self.member, timeout=bound)
        except tw.WaitTimeoutError:
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
    def post(self, read: HeadRead, local: np.ndarray, remote: np.ndarray) -> tuple[Source, int]:
        """Post the READ of ``read``'s heads of blocks ``remote`` into ours ``local``; returns (self, bytes)."""
        transfer = self._transfer(read)
        transfer.post(local, remote)
        self._last = (read, local, remote)
        return self, len(local) * transfer.bytes_per_block

    def wait(self, moved: int) -> int:
        """Wait for the last post. The first READ to a producer sets up its transport's connection; on a loaded box
        that can miss its bound while the producer is fine: once more on a fresh transfer, if it is still listed
        (a READ only rewrites our own blocks of these requests, and the producer frees them only after our DONE,
        which follows the last wait: repeating it is harmless)."""
        read, local, remote = self._last
        try:
            self._transfer(read).wait(timeout=self.timeout_s)
        except tw.TensorwireError as e:
            if not self._fresh or not self.listed():
                raise
            log.info("KV consumer: the first READ from %r failed, once more: %s", self.member, e)
            self.drop()
            self._transfer(read).post(local, remote)
            self._transfer(read).wait(timeout=self.timeout_s)
        self._fresh = False
        return moved

    @staticmethod
    def _key(read: HeadRead) -> tuple[int, int, int]:
        return read.local_offset, read.remote_offset, read.num_heads

    def _transfer(self, read: HeadRead) -> tw.BlockTransfer:
        key = self._key(read)
        if key not in self._transfers:
            comm, pool = self.own.comm, self.own.pool
            local, remote = self._narrowed(read, pool)
            transfer = comm.prepare_blocks(tw.READ, local or pool, remote)
            self._transfers[key] = (transfer, local)
            self.transport = transfer.transport
        return self._transfers[key][0]

    def _narrowed(self, read: HeadRead, pool: tw.BlockPool) -> tuple[tw.BlockPool | None, tw.BlockPoolDesc]:
        """Our pool and its pool reduced to ``read``'s heads of every block (None, desc: whole blocks)."""
        member = self.own
        local_heads = member.heads[1] - member.heads[0]
        own = member.sharding
        start, stop = Sharding(self.producer_tp, own.total_heads, own.replicated).heads(self.producer_rank)
        remote_heads = stop - start
        if member.sharding.replicated or read.num_heads == local_heads == remote_heads:
            return None, self.desc
        if not (member.heads_outermost and self.heads_outermost):
            raise LoadFailed("layout", f"reading heads {read.first_head}..{read.first_head + read.num_heads - 1} of "
                             f"{self.member!r} needs both caches with heads outermost inside a block (this consumer: "
                             f"{member.heads_outermost}, the producer: {self.heads_outermost}); use a head-outermost "
                             "(HND) KV layout on both, or the same tensor parallelism")
        local_bph = _per_head(pool.block_bytes, local_heads)
        remote_bph = _per_head(self.desc.block_bytes, remote_heads)
        if local_bph is None or local_bph != remote_bph:
            raise LoadFailed("layout", f"bytes per head per view differ: this consumer {local_bph}, {self.member!r} "
                             f"{remote_bph}; both must serve the same model, KV dtype and block size")
        sizes = [b * read.num_heads for b in local_bph]
        local = pool.narrow([b * read.local_offset for b in local_bph], sizes)
        return local, self.desc.narrow([b * read.remote_offset for b in remote_bph], sizes)

    def failed(self, reason: str) -> None:
        """After a job failed: a lost producer is remembered as departed; its transfers are contacted afresh."""
        if reason == "lost":
            self._departed_rank, self._departed_at = self.rank, time.monotonic()
        self.drop()
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


def _per_head(block_bytes: tuple[int, ...], heads: int) -> list[int] | None:
    if any(b % heads for b in block_bytes):
        return None
    return [b // heads for b in block_bytes]
