"""Two "hosts" (network namespaces joined by a veth pair, each rank with its own hostname): transfers take
``nixl`` and move the right bytes; then the link is cut and both ranks get typed errors and leave in bounded time.

Root only (creating namespaces needs it): skipped elsewhere with the reason."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.testing import netns
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import launch, raises_after

LIVENESS_S = 2.0
BOUND_S = LIVENESS_S + 10.0  # generous: a bounded exit, not a benchmark


def _wait_for_file(path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.01)




def _rank_on_its_host(hosts: netns.TwoHosts, signals: str):
    rank = int(os.environ["RANK"])
    hosts.enter(rank)
    peer = 1 - rank
    comm = tw.init(timeout=60.0)
    n = 1 << 16
    src, dst = rank_values(rank, n, torch.int64), sentinel(n, torch.int64)
    pool_views = torch.full((8, 256), -1, dtype=torch.int64)
    pool_views.copy_(torch.arange(8 * 256).view(8, 256) + rank * 100_000)
    reg = comm.register([src, dst])
    pool = comm.register_blocks(pool_views)
    comm.publish("src", reg.descs[0])
    comm.publish("dst", reg.descs[1])
    comm.publish_blocks("pool", pool)
    remote_src, remote_dst = comm.lookup("src", peer, timeout=30), comm.lookup("dst", peer, timeout=30)
    remote_pool = comm.lookup_blocks("pool", peer, timeout=30)
    with comm.prepare(tw.READ, dst, remote_src) as x:  # READ
        assert x.transport == "nixl", x.transport
        assert comm._peers.host_of(peer) != comm._peers.host, "the two namespaces look like one host"
        x.post()
        x.wait(timeout=30)
    assert_equal(dst, rank_values(peer, n, torch.int64), "READ across the veth pair")
    comm.barrier(timeout=30)
    if rank == 0:  # WRITE with a notification
        comm.write(src, remote_dst, notify=b"written", timeout=30)
    else:
        assert comm.wait_notification(0, timeout=30) == b"written"
        assert_equal(dst, rank_values(0, n, torch.int64), "WRITE across the veth pair")
    comm.barrier(timeout=30)
    local_ids, remote_ids = np.array([0, 3, 5]), np.array([7, 1, 2])  # a block list
    with comm.prepare_blocks(tw.READ, pool, remote_pool) as bx:
        assert bx.transport == "nixl", bx.transport
        bx.post(local_ids, remote_ids)
        bx.wait(timeout=30)
    for local, remote in zip(local_ids, remote_ids):
        expected = torch.arange(256) + int(remote) * 256 + peer * 100_000
        assert_equal(pool_views[local], expected, f"block {remote} of rank {peer} into block {local}")
    comm.barrier(timeout=30)
    big = torch.zeros(1 << 24, dtype=torch.uint8)  # 16 MiB, to have a READ in flight when the link is gone
    big_reg = comm.register(big)
    comm.publish("big", big_reg.descs[0])
    remote_big = comm.lookup("big", peer, timeout=30)
    pending = comm.prepare(tw.READ, big, remote_big)
    comm.barrier(timeout=30)

    open(os.path.join(signals, f"ready{rank}"), "w").close()
    _wait_for_file(os.path.join(signals, "cut"))
    results = {}
    if rank == 0:
        pending.post()
        results["transfer_wait"] = raises_after(lambda: pending.wait(timeout=60),
                                                  (tw.PeerLostError, tw.TransferError))
        results["wait_notification"] = raises_after(lambda: comm.wait_notification(1, timeout=60), tw.PeerLostError)
    else:
        results["wait_notification"] = raises_after(lambda: comm.wait_notification(0, timeout=60), tw.PeerLostError)
        results["barrier"] = raises_after(lambda: comm.barrier(timeout=60), tw.PeerLostError)
        results["lookup"] = raises_after(lambda: comm.lookup("never", 0, timeout=60), tw.PeerLostError)
    t0 = time.monotonic()
    comm.close()
    results["close"] = ("ok", time.monotonic() - t0)
    assert comm.closed
    return results


@pytest.fixture
def two_hosts():
    reason = netns.skip_reason()
    if reason is not None:
        pytest.skip(f"two hosts: {reason}")
    with netns.TwoHosts() as hosts:
        yield hosts


@pytest.mark.slow
def test_two_hosts_move_bytes_over_nixl_and_a_cut_link_ends_both_ranks(two_hosts, tmp_path):
    signals = str(tmp_path)
    cutter_error = []

    def cut_when_ready():
        try:
            for rank in (0, 1):
                _wait_for_file(os.path.join(signals, f"ready{rank}"), 120)
            two_hosts.cut()
            open(os.path.join(signals, "cut"), "w").close()
        except Exception as e:  # noqa: BLE001 - reported below
            cutter_error.append(e)

    cutter = threading.Thread(target=cut_when_ready, daemon=True)
    cutter.start()
    results = launch(_rank_on_its_host, 2, two_hosts, signals, timeout=100,
                     env={"TENSORWIRE_LIVENESS_S": str(LIVENESS_S)})
    cutter.join(timeout=5)
    assert not cutter_error, cutter_error
    for rank, timings in enumerate(results):
        print(f"\nrank {rank} after the cut: "
              + ", ".join(f"{k} {name} in {s:.2f}s" for k, (name, s) in timings.items()))
        for call, (_, seconds) in timings.items():
            assert seconds < BOUND_S, f"rank {rank}: {call} took {seconds:.1f}s after the cut (bound {BOUND_S}s)"
