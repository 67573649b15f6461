"""One engine rank's KV cache in a fleet: its communicator, its cache registered once as a published block pool, and
its place in the engine's tensor parallelism (which KV heads its blocks hold)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

import tensorwire as tw

from .handoff import member_name
from .heads import Sharding
from .shapes import BlockShape

__all__ = ["KVMember", "POOL_KEY"]

POOL_KEY = "kv-cache"  # under which each rank publishes its block pool


class KVMember:
    """One rank of a serving engine, as a fleet member holding a KV cache.

    ``views``: the cache as block views (``[num_blocks, ...]`` each, one device; block i of the pool = block i of every
    view, e.g. one view per layer); ``instance``: the engine's name in the fleet (rank ``tp_rank`` joins as
    ``member_name(instance, tp_rank, sharding.tp_size)``); ``sharding``: how the model's KV heads are spread over the
    engine's ranks (``heads.Sharding``); ``block_size``: tokens per block; ``order``: how a block of every view holds
    its rows (one head of one token): ``"HND"`` heads outermost (a head range is one byte range: cheapest across TP
    sizes) or ``"NHD"`` tokens outermost (``shapes.py``); ``layout``: the fingerprint that must match between producer
    and consumer (model, KV heads, dtype; not TP, block size or order). ``comm``: a communicator to use (not closed
    here); otherwise one is made with ``tw.init(directory=, name=, timeout=)``. Blocks while joining and registering;
    ``close()`` is idempotent."""

    def __init__(self, views: Sequence[torch.Tensor], *, instance: str, tp_rank: int, sharding: Sharding,
                 layout: str, block_size: int, order: str = "HND", directory: str | None = None,
                 timeout_s: float = 30.0, comm: tw.Communicator | None = None) -> None:
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < sharding.tp_size:
            raise tw.InvalidArgumentError(f"KVMember: tp_rank={tp_rank!r} for tensor parallelism "
                                          f"{sharding.tp_size}; give the rank in [0, {sharding.tp_size})")
        self.instance, self.tp_rank, self.sharding = instance, tp_rank, sharding
        start, stop = sharding.heads(tp_rank)
        self.layout, self.shape = layout, BlockShape(block_size, stop - start, order)
        self.name = member_name(instance, tp_rank, sharding.tp_size)
        self._owns_comm = comm is None
        if comm is None:
            if directory is None:
                raise tw.InvalidArgumentError("KVMember: no fleet to join; give directory='tcp://HOST:PORT' (a "
                                              "`tensorwire directory`) or set TENSORWIRE_DIRECTORY")
            comm = tw.init(directory=directory, name=self.name, timeout=timeout_s)
        self.comm = comm
        try:
            self.pool = comm.register_blocks(list(views))
            comm.publish_blocks(POOL_KEY, self.pool)
        except BaseException:
            self._close_comm()
            raise

    def unreachable(self) -> str | None:
        """Why no peer process could read this cache (no transport here can carry it), with the fix; None when
        one can (NIXL; CUDA IPC for GPU memory on one host; ``shm`` for host memory in a shared file)."""
        available = {name: info for name, info in tw.backends().items() if info.available}
        if "nixl" in available:
            return None
        views = self.pool.views
        if views[0].device.type == "cuda":
            if "cuda_ipc" in available:
                return None
            where = "GPU memory and CUDA IPC is unavailable here"
        elif "shm" in available and all(tw.in_shared_file(v) for v in views):
            return None
        else:
            where = "host memory outside a shared file mapping (only NIXL reaches it from another process)"
        why = tw.backends()["nixl"].reason
        return (f"no transport can carry this KV cache to a peer: NIXL is unavailable ({why}) and the cache is in "
                f"{where}; install NIXL where the engine runs (pip install nixl), or every load will fail")

    @property
    def heads(self) -> tuple[int, int]:
        """The KV heads this rank's blocks hold, ``[start, stop)`` of the model's."""
        return self.sharding.heads(self.tp_rank)

    def close(self) -> None:
        """Release the pool and leave the fleet (a communicator given to the constructor stays open)."""
        pool, self.pool = getattr(self, "pool", None), None
        if pool is not None:
            pool.close()
        self._close_comm()

    def _close_comm(self) -> None:
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None and self._owns_comm:
            comm.close()
