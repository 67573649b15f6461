"""Lifetimes: registering again after close, bounded waits on absent peers, a peer that dies, closing in
any order, context managers, and the ``tw.testing.launch`` helper itself."""

from __future__ import annotations

import os
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, close_patiently, launch, pace, scaled


# --- rank functions --------------------------------------------------------------------------------
def _register_cycles(cycles: int):
    n = 1024
    comm = tw.init(timeout=INIT_TIMEOUT)
    peer = 1 - comm.rank
    same_src = torch.empty(n, dtype=torch.int64)  # re-registered at the same address on even cycles
    fresh_srcs = []  # a new address on odd cycles (kept alive so addresses differ)
    dst = sentinel(n, torch.int64)  # re-registered every cycle
    for c in range(cycles):
        offset = 10_000 * (c + 1)
        if c % 2 == 0:
            src = same_src
        else:
            fresh_srcs.append(torch.empty(n, dtype=torch.int64))
            src = fresh_srcs[-1]
        src.copy_(rank_values(comm.rank, n, torch.int64, offset=offset))
        dst.fill_(-1)
        reg = comm.register([src, dst])
        comm.publish(f"src/{c}", reg.descs[0])
        remote = comm.lookup(f"src/{c}", peer, timeout=WAIT)
        comm.read(dst, remote, timeout=WAIT)
        assert_equal(dst, rank_values(peer, n, torch.int64, offset=offset), f"cycle {c}: READ after re-registering")
        comm.barrier(timeout=WAIT)  # the peer is done reading src before it is deregistered
        reg.close()
        assert reg.closed
        try:
            comm.prepare(tw.READ, dst, remote).close()
        except tw.InvalidArgumentError as e:
            assert "not inside any registered tensor" in str(e), str(e)
        else:
            raise AssertionError(f"cycle {c}: prepare accepted a local tensor whose registration was closed")
        comm.barrier(timeout=WAIT)
    comm.close()
    return cycles


def _times_out(call, what: str) -> tuple[float, str]:
    """``call()`` must raise WaitTimeoutError: how long it took, and the message."""
    t0 = time.perf_counter()
    try:
        call()
    except tw.WaitTimeoutError as e:
        return time.perf_counter() - t0, str(e)
    raise AssertionError(f"{what} returned")


def _lookup_unpublished():
    comm = tw.init(timeout=INIT_TIMEOUT)
    result = None
    if comm.rank == 0:
        result = _times_out(lambda: comm.lookup("nobody-publishes-this", 1, timeout=0.5),
                            "lookup of an unpublished key")
    comm.barrier(timeout=WAIT)
    comm.close()
    return result


def _barrier_absent_rank():
    comm = tw.init(timeout=INIT_TIMEOUT)
    result = None
    if comm.rank == 0:
        result = _times_out(lambda: comm.barrier(timeout=1.0), "barrier although rank 1 never entered it")
    else:
        time.sleep(2.0)  # rank 1 never enters the barrier
    comm.close()
    return result


def _peer_killed():
    rank = int(os.environ["RANK"])
    # Rank 0 gets a short timeout: its close() waits at most that long for the dead rank to depart.
    comm = tw.init(timeout=3.0 if rank == 0 else INIT_TIMEOUT)
    peer = 1 - rank
    buf = rank_values(rank, 1 << 16, torch.int64)
    reg = comm.register(buf)
    comm.publish("buf", reg.descs)
    remote = comm.lookup("buf", peer, timeout=WAIT)
    if rank == 0:
        comm.write(buf, remote, timeout=WAIT)  # connected and working before the peer dies
    comm.barrier(timeout=WAIT)
    if rank == 1:
        os._exit(0)  # dies without closing anything
    expected = (tw.PeerLostError, tw.TransferError, tw.WaitTimeoutError)
    x = comm.prepare(tw.WRITE, buf, remote)
    t0 = time.perf_counter()
    error = None
    while error is None and time.perf_counter() - t0 < scaled(10.0):
        try:
            x.post()
            x.wait(timeout=2.0)
        except expected as e:
            error = e
        else:
            time.sleep(0.01)
    detected_s = time.perf_counter() - t0
    assert error is not None, f"rank 0 kept WRITE-ing to a dead rank for {scaled(10.0):.0f} s without any error"
    x.close()  # closing a failed transfer must not raise
    t1 = time.perf_counter()
    try:
        comm.write(buf, remote, timeout=2.0)
    except expected:
        pass
    else:
        raise AssertionError("a new WRITE to the dead rank succeeded")
    again_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    comm.close()
    close_s = time.perf_counter() - t2
    # The liveness bound (5 s) with a margin, at this machine's pace: a busy machine runs the dead rank's detection
    # and rank 0's close late, never wrongly.
    assert detected_s < scaled(10.0) and again_s < scaled(5.0) and close_s < scaled(6.0), (
        detected_s, again_s, close_s, pace())
    return type(error).__name__, detected_s, again_s, close_s


def _close_order(first: int):
    comm = tw.init(timeout=INIT_TIMEOUT)
    peer = 1 - comm.rank
    buf = rank_values(comm.rank, 1024)
    out = sentinel(1024)
    reg = comm.register([buf, out])
    comm.publish("buf", reg.descs[0])
    remote = comm.lookup("buf", peer, timeout=WAIT)
    comm.read(out, remote, timeout=WAIT)
    assert_equal(out, rank_values(peer, 1024), "READ before closing")
    comm.barrier(timeout=WAIT)
    if comm.rank != first:
        time.sleep(1.0)
        # The store must still be up although `first` has closed: rank 0 keeps it until every rank departed.
        assert comm.lookup("buf", peer, timeout=WAIT) == remote
    t0 = time.perf_counter()
    comm.close()
    return time.perf_counter() - t0


def _context_managers():
    rank = int(os.environ["RANK"])
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        assert (comm.rank, comm.world_size, comm.local_rank) == (rank, 2, rank)
        assert comm.device == torch.device("cpu")
        peer = 1 - rank
        src, dst = rank_values(rank, 100), sentinel(100)
        with comm.register([src, dst]) as reg:
            assert not reg.closed
            d = reg.descs[0]
            assert (d.rank, d.addr, d.nbytes, d.kind, d.device) == (rank, src.data_ptr(), 400, tw.MemoryKind.CPU, "cpu")
            comm.publish("src", d)
            remote = comm.lookup("src", peer, timeout=WAIT)
            with comm.prepare(tw.READ, dst, remote) as x:
                x.post()
                x.wait(timeout=WAIT)
            assert x.closed
            assert_equal(dst, rank_values(peer, 100), "READ inside context managers")
            comm.barrier(timeout=WAIT)
        assert reg.closed
        comm.barrier(timeout=WAIT)
    assert comm.closed
    return True


def _square(k: int):
    return int(os.environ["RANK"]) ** 2 + k


def _fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank 1")
    time.sleep(60)


def _exit_on_rank_1():
    if os.environ["RANK"] == "1":
        os._exit(0)
    return "done"


def _return_tensor():
    return torch.arange(3)


# --- tests ----------------------------------------------------------------------------------------
def test_register_close_register_round_trip():
    """Register -> transfer -> close, four times (same address, new address, ...): each new registration works,
    the closed one is refused locally, and the peer follows the new registration epochs."""
    assert launch(_register_cycles, 2, 4) == [4, 4]


def test_lookup_of_unpublished_key_times_out():
    """lookup of a key nobody publishes raises WaitTimeoutError after about its timeout, naming the key."""
    result = launch(_lookup_unpublished, 2)[0]
    elapsed, message = result
    assert 0.4 <= elapsed < scaled(5.0), (elapsed, pace())  # never before its 0.5 s timeout (less a poll)
    assert "nobody-publishes-this" in message, message


@pytest.mark.slow
def test_barrier_times_out_when_a_rank_does_not_come():
    """barrier raises WaitTimeoutError after about its timeout when a rank never enters it."""
    elapsed, message = launch(_barrier_absent_rank, 2)[0]
    assert 0.9 <= elapsed < scaled(5.0), (elapsed, pace())  # never before its 1 s timeout (less a poll)
    assert "barrier" in message, message


def test_peer_killed_mid_job():
    """Rank 1 dies (os._exit) after a barrier; rank 0's WRITEs to it fail with PeerLostError/TransferError/
    WaitTimeoutError within bounded time, a new WRITE fails too, and rank 0's close() returns in bounded time."""
    results = launch(_peer_killed, 2, timeout=15)
    assert results[1] is None
    kind, detected_s, again_s, close_s = results[0]
    print(f"peer loss seen as {kind} after {detected_s:.2f}s; next WRITE failed in {again_s:.2f}s; "
          f"close {close_s:.2f}s")
    assert kind in {"PeerLostError", "TransferError", "WaitTimeoutError"}


@pytest.mark.parametrize("first", [0, 1], ids=["rank0-closes-first", "rank0-closes-last"])
@pytest.mark.slow
def test_close_order(first):
    """Ranks may close in either order: both finish, and rank 0 keeps the store up until rank 1 has closed."""
    close_s = launch(_close_order, 2, first)
    if first == 0:
        assert close_s[0] >= 0.8, f"rank 0 closed first but did not wait for rank 1 to depart: {close_s}"
    else:
        assert close_s[0] < 3.0, f"rank 0 closed last but still waited: {close_s}"
    assert all(s < INIT_TIMEOUT for s in close_s), close_s


def test_context_managers():
    """tw.init, register and prepare work as context managers and close what they opened."""
    assert launch(_context_managers, 2) == [True, True]


@pytest.mark.slow
def test_launch_returns_results_in_rank_order():
    """launch passes *args to every rank and returns the per-rank results in rank order."""
    assert launch(_square, 3, 10, timeout=scaled(60)) == [10, 11, 14]


def test_launch_first_failing_rank_fails_all():
    """A rank that raises makes launch raise RankFailedError with its traceback at once, not after the others."""
    t0 = time.perf_counter()
    with pytest.raises(tw.testing.RankFailedError) as info:
        launch(_fail_on_rank_1, 2, timeout=scaled(50))
    assert time.perf_counter() - t0 < scaled(30), "launch waited for the healthy rank instead of failing at once"
    assert "rank 1 of 2 failed" in str(info.value)
    assert "ValueError: boom from rank 1" in str(info.value)


def test_launch_os_exit_rank_yields_none():
    """A rank that exits with os._exit(0) without returning yields None in launch's results."""
    assert launch(_exit_on_rank_1, 2, timeout=6) == ["done", None]


def test_launch_can_return_a_tensor():
    """A rank function may return a CPU tensor; launch hands it back to the caller."""
    (got,) = launch(_return_tensor, 1, timeout=60)
    assert torch.equal(got, torch.arange(3))


def _reregister_at_an_overlapping_address():
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        n = 1 << 16
        big = sentinel(2 * n)  # rank 1 re-registers the same memory, larger, after closing the first range
        src = rank_values(comm.rank, 2 * n)
        source = comm.register(src)
        try:
            if comm.rank == 1:
                first = comm.register(big[:n])
                comm.publish("first", first.descs)
            comm.barrier(timeout=WAIT)
            if comm.rank == 0:
                comm.write(src[:n], comm.lookup("first", 1, timeout=WAIT), timeout=WAIT)
            comm.barrier(timeout=WAIT)
            if comm.rank == 1:
                first.close()
                second = comm.register(big)
                comm.publish("second", second.descs)
            comm.barrier(timeout=WAIT)
            outcome = None
            if comm.rank == 0:
                try:
                    comm.write(src, comm.lookup("second", 1, timeout=WAIT), timeout=WAIT)
                    outcome = "ok"
                except tw.TransferError as e:
                    outcome = str(e)
            comm.barrier(timeout=WAIT)
            if comm.rank == 1:  # rank 0 closes its source meanwhile: each waits for the other's answer
                close_patiently(second)
        finally:
            close_patiently(source)
    return outcome


def test_reregistering_an_overlapping_range_is_writable():
    """A peer that closes a registration and registers a larger one at the same address can be written."""
    assert launch(_reregister_at_an_overlapping_address, 2)[0] == "ok"


def _stale_descriptor_of_reregistered_memory():
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        target = sentinel(4096)
        src = rank_values(comm.rank, 4096)
        message = None
        source = comm.register(src)
        try:
            if comm.rank == 1:
                first = comm.register(target)
                comm.publish("first", first.descs)
            comm.barrier(timeout=WAIT)
            old = comm.lookup("first", 1, timeout=WAIT)
            comm.barrier(timeout=WAIT)
            if comm.rank == 1:
                first.close()
                second = comm.register(target)  # the same addresses, a new registration
                comm.publish("second", second.descs)
            comm.barrier(timeout=WAIT)
            if comm.rank == 0:
                try:
                    comm.write(src, old, timeout=WAIT)
                except tw.InvalidArgumentError as e:
                    message = str(e)
                comm.write(src, comm.lookup("second", 1, timeout=WAIT), timeout=WAIT)  # the fresh one works
            comm.barrier(timeout=WAIT)
            if comm.rank == 1:
                assert_equal(target, rank_values(0, 4096), "WRITE through the fresh descriptor")
                second.close()
            comm.barrier(timeout=WAIT)
        finally:  # both ranks close at once, each waiting for the other's answer: a busy box may answer late
            close_patiently(source)
    return message


def test_descriptor_of_a_closed_registration_is_refused_even_at_a_reused_address():
    """Memory registered again at the same addresses does not revive the old descriptors."""
    message = launch(_stale_descriptor_of_reregistered_memory, 2)[0]
    assert message is not None and "comes from a registration of rank 1 that was closed" in message, message


def _closing_a_registration_closes_its_transfers():
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        src, dst = rank_values(comm.rank, 1024), sentinel(1024)
        with comm.register(dst) as target:
            comm.publish("dst", target.descs)
            remote = comm.lookup("dst", 1 - comm.rank, timeout=WAIT)
            source = comm.register(src)
            x = comm.prepare(tw.WRITE, src, remote)
            source.close()
            assert x.closed, "a transfer over deregistered local memory stayed open"
            with pytest.raises(tw.ClosedError, match="the transfer is closed"):
                x.post()
            comm.barrier(timeout=WAIT)
    return True


def test_closing_a_registration_closes_the_transfers_prepared_on_it():
    """No post can read or write local memory the backend no longer holds (it may be freed already)."""
    assert launch(_closing_a_registration_closes_its_transfers, 2) == [True, True]
