"""Rank functions the CPU and the GPU test suites both run (``memory="cpu"`` or ``"cuda"``).

Each is launched with ``tensorwire.testing.suite.launch`` and raises ``AssertionError`` on a wrong byte.
"""

from __future__ import annotations

import torch

import tensorwire as tw

from .data import assert_equal, rank_values, sentinel
from .suite import INIT_TIMEOUT, WAIT, ring_peers

__all__ = ["repost"]


def repost(rounds: int, memory: str = "cpu") -> int:
    """Rank function: on a ring, each rank WRITEs to the next and READs from it through two prepared
    transfers posted ``rounds`` times, the sources changing every round; every round's bytes are checked.
    ``memory="cuda"``: the tensors live on ``comm.device``. Returns ``rounds``."""
    n = 4096
    comm = tw.init(timeout=INIT_TIMEOUT)
    device = comm.device if memory == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def values(rank: int, offset: int = 0) -> torch.Tensor:
        return rank_values(rank, n, torch.int64, device, offset=offset)

    def settle() -> None:  # kernels that filled a buffer are done before a peer reads it
        if device.type == "cuda":
            torch.cuda.synchronize()

    nxt, prv = ring_peers(comm)
    wsrc, wdst = values(comm.rank), sentinel(n, torch.int64, device)
    rsrc, rdst = values(comm.rank), sentinel(n, torch.int64, device)
    reg = comm.register([wsrc, wdst, rsrc, rdst])
    comm.publish("bufs", reg.descs)
    _, remote_wdst, remote_rsrc, _ = comm.lookup("bufs", nxt, timeout=WAIT)
    write = comm.prepare(tw.WRITE, wsrc, remote_wdst)
    read = comm.prepare(tw.READ, rdst, remote_rsrc)
    for r in range(rounds):
        offset = 1_000_000 * (r + 1)
        # WRITE re-post: new data in the same source tensor, the same prepared transfer.
        wsrc.copy_(values(comm.rank, offset))
        settle()
        write.post()
        write.wait(timeout=WAIT)
        assert write.status() is tw.Status.DONE
        comm.barrier(timeout=WAIT)
        assert_equal(wdst, values(prv, offset), f"round {r}: re-posted WRITE from {prv}")
        # READ re-post: the owner changes its data between rounds; the reader sees the new values.
        rsrc.copy_(values(comm.rank, offset))
        settle()
        comm.barrier(timeout=WAIT)
        read.post()
        read.wait(timeout=WAIT)
        assert read.status() is tw.Status.DONE
        assert_equal(rdst, values(nxt, offset), f"round {r}: re-posted READ from {nxt}")
        comm.barrier(timeout=WAIT)  # nobody overwrites a source before its reader is done
    write.close()
    read.close()
    comm.close()
    return rounds
