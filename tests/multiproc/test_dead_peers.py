"""A process that outlives many peers: 100 jobs in one process, each with a peer killed (SIGKILL) after a tensor
READ, a block READ and a notification, each job's communicator closed while what failed is still referenced, hold
the same file descriptors and OS threads after the last ``close()`` as after the first (+5 at most), with no
``gc.collect()``. A failed post's error, kept by the user or by the transfer, used to hold frames that held the
NIXL agent (its threads and sockets) in a reference cycle until a gc pass.

The peers are forked from a small process that imported tensorwire and runs nothing else (one thread: a safe
fork), so that a job costs a fork instead of an interpreter start: 100 jobs fit in CI on 2 cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tensorwire.testing import free_port, launch
from tensorwire.testing.suite import scaled

JOBS = 100
GROWTH_LIMIT = 5  # fds, and OS threads: the bound
# The liveness bound is 1 s on an idle machine, at the machine's pace (``scaled``) when it runs (a busy machine
# answers a liveness handshake late: a live peer must not be taken for a dead one).
ENV = {"TENSORWIRE_JOB_TOKEN": "0123456789abcdef0123456789abcdef"}

# One peer per line of stdin (the port of its job): forked, it joins as rank 1, registers a tensor and a pool,
# publishes them, notifies rank 0 and waits to be killed; the fork's pid goes to stdout.
_PEERS = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import tensorwire as tw

    def peer(port):
        comm = tw.init(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=60)
        values = torch.arange(1 << 16, dtype=torch.int64)
        source = comm.register(values)
        comm.publish("source", source.descs[0])
        pool = comm.register_blocks(torch.arange(64 * 256, dtype=torch.int32).view(64, 256))
        comm.publish_blocks("pool", pool)
        comm.barrier(timeout=60)
        comm.write(values[:1], comm.lookup("inbox", 0, timeout=60)[0], notify=b"ready", timeout=60)
        time.sleep(600)  # until killed

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed peers are reaped by the kernel
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                peer(int(line))
            except BaseException:
                import traceback
                traceback.print_exc()  # in the test's output: why rank 0 then sees its peer gone
            finally:
                os._exit(1)
        print(pid, flush=True)
""")


def _job(peers: subprocess.Popen, kept: list) -> None:
    """One job as rank 0: READ a tensor and blocks from the peer, take its notification, kill it, let a post fail,
    close. The errors are kept (``kept``), as a caller logging failures later would."""
    import torch

    import tensorwire as tw

    port = free_port()
    peers.stdin.write(f"{port}\n")
    peers.stdin.flush()
    pid = int(peers.stdout.readline())
    comm = tw.init(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=60)
    try:
        inbox = comm.register(torch.zeros(1, dtype=torch.int64))
        comm.publish("inbox", inbox.descs[0])
        out = torch.zeros(1 << 16, dtype=torch.int64)
        comm.register(out)
        pool = comm.register_blocks(torch.zeros(64, 256, dtype=torch.int32))
        comm.barrier(timeout=60)
        comm.read(out, comm.lookup("source", 1, timeout=60)[0], timeout=60)
        blocks = comm.prepare_blocks(tw.READ, pool, comm.lookup_blocks("pool", 1, timeout=60))
        blocks.post([1, 2, 3], [4, 5, 6])
        blocks.wait(timeout=60)
        assert comm.wait_notification(1, timeout=60) == b"ready"
        os.kill(pid, signal.SIGKILL)
        try:
            blocks.post([7], [8])
            blocks.wait(timeout=60)
            comm.wait_notification(1, timeout=60)  # ended by the liveness bound if the post did not fail
        except tw.TensorwireError as e:
            kept.append(e)
    finally:
        comm.close()


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _jobs(count: int) -> list[tuple[int, int]]:
    """Run ``count`` jobs; the (fds, OS threads) after each one's close."""
    import gc

    gc.disable()  # no collection may hide a cycle: what close() leaves must go by reference counting
    os.environ.update({**ENV, "TENSORWIRE_LIVENESS_S": f"{scaled(1.0):.2f}"})
    peers = subprocess.Popen([sys.executable, "-c", _PEERS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    kept: list = []
    counts = []
    try:
        for _ in range(count):
            _job(peers, kept)
            counts.append(_counts())
    finally:
        peers.kill()
        peers.wait(timeout=60)
    assert kept, "no post to a killed peer failed: the jobs did not exercise dead peers"
    return counts


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts fds and threads through /proc")
def test_a_hundred_jobs_with_dead_peers_hold_no_more_fds_or_threads_than_one():
    counts = launch(_jobs, 1, JOBS, timeout=scaled(900))[0]
    (fds_first, threads_first), (fds_last, threads_last) = counts[0], counts[-1]
    print(f"\nafter the first close: {fds_first} fds, {threads_first} threads; after close {JOBS}: {fds_last} fds, "
          f"{threads_last} threads (most: {max(c[0] for c in counts)} fds, {max(c[1] for c in counts)} threads)")
    assert fds_last <= fds_first + GROWTH_LIMIT and threads_last <= threads_first + GROWTH_LIMIT, counts
