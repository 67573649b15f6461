"""Resources: repeated prepare/post/wait/close and register/close keep memory flat; an idle communicator
costs (almost) no CPU, and a blocked waiter sleeps rather than spins."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, cores_used_while, launch, rss_bytes

MiB = 1 << 20
RSS_GROWTH_LIMIT = 20 * MiB
IDLE_CORES_LIMIT = 0.05
WAITER_CORES_LIMIT = 0.15


def _churn(transfer_cycles: int, register_cycles: int):
    comm = tw.init(timeout=INIT_TIMEOUT)
    peer = 1 - comm.rank
    n = 4096
    src = rank_values(comm.rank, n, torch.int64)
    dst = sentinel(n, torch.int64)
    reg = comm.register([src, dst])
    comm.publish("bufs", reg.descs)
    remote_src, remote_dst = comm.lookup("bufs", peer, timeout=WAIT)
    comm.barrier(timeout=WAIT)
    numbers = {}
    if comm.rank == 0:
        pieces = 64  # several items per transfer, so that a per-item leak shows up sooner
        step = n // pieces

        def transfer_cycle(i):
            op = tw.READ if i % 2 == 0 else tw.WRITE
            local = [(dst if op is tw.READ else src)[k * step:(k + 1) * step] for k in range(pieces)]
            whole = remote_src if op is tw.READ else remote_dst
            remote = [whole.narrow(k * step * 8, step * 8) for k in range(pieces)]
            x = comm.prepare(op, local, remote)
            x.post()
            x.wait(timeout=WAIT)
            x.close()

        def register_cycle(i):
            t = torch.zeros(16384 + (i % 7) * 64, dtype=torch.float32)  # 64 KiB, touched: a leak of it shows
            r = comm.register(t)
            r.close()

        for i in range(1000):  # warm up allocator pools, UCX request pools, peer caches
            transfer_cycle(i)
        for i in range(100):
            register_cycle(i)
        gc.collect()
        numbers["rss_start"] = rss_bytes()
        for name, cycle, count in (("transfer", transfer_cycle, transfer_cycles),
                                   ("register", register_cycle, register_cycles)):
            t0 = time.perf_counter()
            for i in range(count):
                cycle(i)
            numbers[f"{name}_s"] = time.perf_counter() - t0
            gc.collect()
            numbers[f"rss_after_{name}s"] = rss_bytes()
        # Still correct after all that.
        comm.read(dst, remote_src, timeout=WAIT)
        assert_equal(dst, rank_values(peer, n, torch.int64), "READ after the churn")
    comm.barrier(timeout=120)
    comm.close()
    return numbers


def _idle_cpu():
    comm = tw.init(timeout=INIT_TIMEOUT)
    peer = 1 - comm.rank
    buf = rank_values(comm.rank, 1 << 18)
    out = sentinel(1 << 18)
    reg = comm.register([buf, out])
    comm.publish("buf", reg.descs[0])
    remote = comm.lookup("buf", peer, timeout=WAIT)
    comm.read(out, remote, timeout=WAIT)  # the peer is loaded and connected
    assert_equal(out, rank_values(peer, 1 << 18), "READ before idling")
    comm.barrier(timeout=WAIT)
    idle = cores_used_while(lambda: time.sleep(2.0))
    comm.barrier(timeout=WAIT)

    def wait_for_nothing():
        try:
            comm.wait_notification(peer, timeout=1.0)
        except tw.WaitTimeoutError:
            return
        raise AssertionError("a notification arrived although nobody sent one")

    waiting = cores_used_while(wait_for_nothing)
    comm.barrier(timeout=WAIT)
    comm.close()
    return idle, waiting


@pytest.mark.slow
def test_churn_keeps_rss_flat():
    """10,000 prepare/post/wait/close cycles and 1,000 register/close cycles grow RSS by less than 20 MiB."""
    numbers = launch(_churn, 2, 10_000, 1_000, timeout=300)[0]
    start, after_t, after_r = numbers["rss_start"], numbers["rss_after_transfers"], numbers["rss_after_registers"]
    print(
        f"\nRSS start {start / MiB:.1f} MiB; after 10,000 transfer cycles {after_t / MiB:.1f} MiB "
        f"(+{(after_t - start) / MiB:.2f}, {numbers['transfer_s'] * 100:.1f} us/cycle); "
        f"after 1,000 register cycles {after_r / MiB:.1f} MiB (+{(after_r - after_t) / MiB:.2f}, "
        f"{numbers['register_s'] * 1000:.1f} us/cycle)"
    )
    assert after_t - start < RSS_GROWTH_LIMIT, f"transfer cycles grew RSS by {(after_t - start) / MiB:.1f} MiB"
    assert after_r - after_t < RSS_GROWTH_LIMIT, f"register cycles grew RSS by {(after_r - after_t) / MiB:.1f} MiB"


@pytest.mark.slow
def test_idle_communicator_costs_no_cpu():
    """A communicator with a registered buffer and a connected peer uses < 0.05 core while idle for 2 s, and a
    blocked wait_notification sleeps (< 0.15 core) instead of spinning."""
    results = launch(_idle_cpu, 2)
    for rank, (idle, waiting) in enumerate(results):
        print(f"\nrank {rank}: idle {idle:.4f} core, blocked in wait_notification {waiting:.4f} core")
    for rank, (idle, waiting) in enumerate(results):
        assert idle < IDLE_CORES_LIMIT, f"rank {rank} used {idle:.3f} core while idle (limit {IDLE_CORES_LIMIT})"
        assert waiting < WAITER_CORES_LIMIT, f"rank {rank} used {waiting:.3f} core blocked in wait_notification"
