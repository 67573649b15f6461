"""The ring READ/WRITE, re-post and notification behaviours on CUDA tensors (``device=comm.device``), with
2 and 4 processes sharing the machine's GPU(s), and a CPU<->GPU mixed transfer.

Selected with ``pytest -m gpu``; skipped (with the reason) where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import pytest
import torch

import tensorwire as tw
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.scenarios import repost
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch, ring_peers

pytestmark = pytest.mark.gpu

WORLDS = [pytest.param(2, id="world2"), pytest.param(4, id="world4")]


def _gpu_comm():
    comm = tw.init(timeout=INIT_TIMEOUT)
    assert comm.device.type == "cuda", f"tw.init chose {comm.device} on a CUDA machine"
    assert comm.device.index == comm.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(comm.device)  # tensorwire never does this for us
    return comm


def _gpu_ring(n: int):
    comm = _gpu_comm()
    dev = comm.device
    nxt, prv = ring_peers(comm)
    src = rank_values(comm.rank, n, device=dev)
    rdst, wdst = sentinel(n, device=dev), sentinel(n, device=dev)
    reg = comm.register([src, rdst, wdst])
    assert all(d.kind is tw.MemoryKind.CUDA and d.device == str(dev) for d in reg.descs), reg.descs
    comm.publish("bufs", reg.descs)
    remote_src, _, remote_wdst = comm.lookup("bufs", nxt, timeout=WAIT)
    torch.cuda.synchronize()  # the fills above are done before a peer touches the memory
    comm.barrier(timeout=WAIT)
    with comm.prepare(tw.READ, rdst, remote_src) as x:
        transport = x.transport
        x.post()
        x.wait(timeout=WAIT)
    assert_equal(rdst, rank_values(nxt, n, device=dev), f"GPU READ from rank {nxt}")
    comm.write(src, remote_wdst, timeout=WAIT)
    comm.barrier(timeout=WAIT)
    assert_equal(wdst, rank_values(prv, n, device=dev), f"GPU WRITE from rank {prv}")
    comm.barrier(timeout=WAIT)
    comm.close()
    return transport


def _gpu_notify(messages: int):
    slot = 1024
    comm = _gpu_comm()
    dev = comm.device
    nxt, prv = ring_peers(comm)
    src = torch.cat([rank_values(comm.rank, slot, torch.int64, dev, offset=100_000 * i) for i in range(messages)])
    dst = sentinel(slot * messages, torch.int64, dev)
    reg = comm.register([src, dst])
    comm.publish("inbox", reg.descs[1])
    remote = comm.lookup("inbox", nxt, timeout=WAIT)[0]
    torch.cuda.synchronize()
    comm.barrier(timeout=WAIT)
    for i in range(messages):
        comm.write(src[i * slot:(i + 1) * slot], remote.narrow(i * slot * 8, slot * 8),
                   notify=f"{comm.rank}->{nxt} #{i}".encode(), timeout=WAIT)
    for i in range(messages):
        got = comm.wait_notification(prv, timeout=WAIT)
        assert got == f"{prv}->{comm.rank} #{i}".encode(), f"message {i} from rank {prv}: got {got!r}"
        assert_equal(dst[i * slot:(i + 1) * slot], rank_values(prv, slot, torch.int64, dev, offset=100_000 * i),
                     f"GPU slot {i} after its notification")
    try:
        extra = comm.wait_notification(prv, timeout=0.3)
    except tw.WaitTimeoutError:
        pass
    else:
        raise AssertionError(f"an extra notification arrived: {extra!r}")
    comm.barrier(timeout=WAIT)
    comm.close()
    return messages


def _gpu_cpu_mixed():
    n = 1 << 16
    comm = _gpu_comm()
    dev = comm.device
    nxt, prv = ring_peers(comm)
    cpu_src, cpu_dst = rank_values(comm.rank, n), sentinel(n)
    gpu_src, gpu_dst = rank_values(comm.rank, n, device=dev), sentinel(n, device=dev)
    reg = comm.register([cpu_src, cpu_dst, gpu_src, gpu_dst])
    comm.publish("bufs", reg.descs)
    remote_cpu_src, remote_cpu_dst, remote_gpu_src, _ = comm.lookup("bufs", nxt, timeout=WAIT)
    torch.cuda.synchronize()
    comm.barrier(timeout=WAIT)
    # local CUDA <- remote CPU
    comm.read(gpu_dst, remote_cpu_src, timeout=WAIT)
    assert_equal(gpu_dst, rank_values(nxt, n, device=dev), "READ remote CPU into local GPU")
    # local CPU <- remote CUDA
    comm.read(cpu_dst, remote_gpu_src, timeout=WAIT)
    assert_equal(cpu_dst, rank_values(nxt, n), "READ remote GPU into local CPU")
    comm.barrier(timeout=WAIT)
    # local CUDA -> remote CPU
    cpu_dst.fill_(-1)
    comm.barrier(timeout=WAIT)
    comm.write(gpu_src, remote_cpu_dst, timeout=WAIT)
    comm.barrier(timeout=WAIT)
    assert_equal(cpu_dst, rank_values(prv, n), "WRITE from a GPU into this CPU buffer")
    # One transfer may not mix (CUDA, CPU) and (CPU, CPU) items.
    try:
        comm.prepare(tw.READ, [gpu_dst[:16], cpu_dst[:16]],
                     [remote_cpu_src.narrow(0, 64), remote_cpu_src.narrow(64, 64)])
    except tw.InvalidArgumentError as e:
        assert "mix memory kinds" in str(e), str(e)
    else:
        raise AssertionError("prepare accepted items of two (local, remote) memory-kind pairs")
    comm.barrier(timeout=WAIT)
    comm.close()
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_ring_read_write(world):
    """CUDA tensors: each rank READs its neighbour's GPU buffer and WRITEs into the next one's, exactly."""
    transports = launch(_gpu_ring, world, 1 << 20)
    print(f"\nGPU ring transports: {transports}")
    assert len(transports) == world and all(isinstance(t, str) and t != "none" for t in transports)


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_repost(world):
    """CUDA tensors: one prepared READ and one WRITE re-posted 10 times carry each round's new data."""
    assert launch(repost, world, 10, "cuda") == [10] * world


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_notifications_follow_data(world):
    """CUDA tensors: WRITE notifications arrive in order, each after its slot's data."""
    assert launch(_gpu_notify, world, 4) == [4] * world


def test_gpu_cpu_mixed():
    """Local CUDA <-> remote CPU READs and WRITEs arrive exactly; mixing kind pairs in one transfer is refused."""
    assert launch(_gpu_cpu_mixed, 2) == [True, True]
