"""End-to-end READ/WRITE between processes on host memory, over real NIXL (UCX underneath).

Every test runs on world sizes 2 and 4. Ranks form a ring: rank r reads from / writes to ``next = r + 1``
and is written by ``prev = r - 1`` (mod world). Data encodes its sender (``rank * 1000 + index``) and
receive buffers start as SENTINEL, so data from the wrong rank, the wrong offset, or no data at all fails.
Every rank meets a barrier before closing so that no peer disappears while another still addresses it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.testing.data import SENTINEL, assert_equal, rank_values, sentinel
from tensorwire.testing.scenarios import repost
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch, ring_peers

WORLDS = [pytest.param(2, id="world2"), pytest.param(4, id="world4")]


# --- rank functions (module level: they are pickled by reference into the spawned ranks) ----------
def _ring_setup(n: int):
    """A communicator, its ring neighbours, a registered source (this rank's values) and sentinel target."""
    comm = tw.init(timeout=INIT_TIMEOUT)
    nxt, prv = ring_peers(comm)
    src, dst = rank_values(comm.rank, n), sentinel(n)
    return comm, nxt, prv, src, dst, comm.register([src, dst])


def _ring_read(n: int):
    comm, nxt, _, src, dst, reg = _ring_setup(n)
    comm.publish("src", reg.descs[0])
    remote = comm.lookup("src", nxt, timeout=WAIT)
    assert len(remote) == 1 and remote[0].rank == nxt and remote[0].nbytes == src.nbytes
    comm.read(dst, remote, timeout=WAIT)
    assert_equal(dst, rank_values(nxt, n), f"rank {comm.rank} READ from rank {nxt}")
    assert_equal(src, rank_values(comm.rank, n), f"rank {comm.rank}: a READ must not change the source")
    comm.barrier(timeout=WAIT)
    reg.close()
    comm.close()
    return comm.rank


def _ring_write(n: int):
    comm, nxt, prv, src, dst, reg = _ring_setup(n)
    comm.publish("dst", reg.descs[1])
    remote = comm.lookup("dst", nxt, timeout=WAIT)
    comm.barrier(timeout=WAIT)
    with comm.prepare(tw.WRITE, src, remote) as x:
        assert (x.op, x.peer, x.nbytes, x.transport) == (tw.WRITE, nxt, src.nbytes, "nixl"), repr(x)
        x.post()
        x.wait(timeout=WAIT)
        assert x.status() is tw.Status.DONE
    comm.barrier(timeout=WAIT)  # every WRITE is done before anyone looks at its buffer
    assert_equal(dst, rank_values(prv, n), f"rank {comm.rank} written by rank {prv}")
    comm.barrier(timeout=WAIT)
    comm.close()
    return comm.rank


def _several_tensors():
    comm = tw.init(timeout=INIT_TIMEOUT)
    nxt, prv = ring_peers(comm)
    layout = [(torch.float32, 10), (torch.int64, 1000), (torch.bfloat16, 4097)]
    srcs = [rank_values(comm.rank, n, dt, offset=100 * i) for i, (dt, n) in enumerate(layout)]
    dsts = [sentinel(n, dt) for dt, n in layout]
    wdsts = [sentinel(n, dt) for dt, n in layout]
    reg = comm.register(srcs + dsts + wdsts)
    k = len(layout)
    comm.publish("src", reg.descs[:k])
    comm.publish("wdst", reg.descs[2 * k:])
    remote_src = comm.lookup("src", nxt, timeout=WAIT)
    remote_wdst = comm.lookup("wdst", nxt, timeout=WAIT)
    assert len(remote_src) == k
    # READ: three tensors in one transfer, one post.
    with comm.prepare(tw.READ, dsts, remote_src) as x:
        assert x.nbytes == sum(t.nbytes for t in srcs)
        x.post()
        x.wait(timeout=WAIT)
    for i, ((dt, n), d) in enumerate(zip(layout, dsts)):
        assert_equal(d, rank_values(nxt, n, dt, offset=100 * i), f"READ item {i} ({dt}, {n}) from rank {nxt}")
    # WRITE: the same three tensors pushed in one transfer.
    comm.write(srcs, remote_wdst, timeout=WAIT)
    comm.barrier(timeout=WAIT)
    for i, ((dt, n), d) in enumerate(zip(layout, wdsts)):
        assert_equal(d, rank_values(prv, n, dt, offset=100 * i), f"WRITE item {i} ({dt}, {n}) from rank {prv}")
    comm.barrier(timeout=WAIT)
    comm.close()
    return comm.rank


def _views():
    n, es = 1000, 8  # int64 elements
    comm = tw.init(timeout=INIT_TIMEOUT)
    nxt, prv = ring_peers(comm)
    src = rank_values(comm.rank, n, torch.int64)
    dst = sentinel(n, torch.int64)
    reg = comm.register([src, dst])
    comm.publish("both", reg.descs)
    remote_src, remote_dst = comm.lookup("both", nxt, timeout=WAIT)
    # READ remote elements [100, 200) into local elements [300, 400).
    comm.read(dst[300:400], remote_src.narrow(100 * es, 100 * es), timeout=WAIT)
    assert_equal(dst[300:400], rank_values(nxt, n, torch.int64)[100:200], "READ remote view into local view")
    comm.barrier(timeout=WAIT)  # everyone finished its READ check before the WRITEs below land
    # WRITE local elements [0, 50) to remote elements [600, 650).
    comm.write(src[0:50], remote_dst.narrow(600 * es, 50 * es), timeout=WAIT)
    comm.barrier(timeout=WAIT)
    expected = sentinel(n, torch.int64)
    expected[300:400] = rank_values(nxt, n, torch.int64)[100:200]
    expected[600:650] = rank_values(prv, n, torch.int64)[0:50]
    assert_equal(dst, expected, f"rank {comm.rank}: only the addressed views changed")
    comm.barrier(timeout=WAIT)
    comm.close()
    return comm.rank


_DTYPES = [torch.float32, torch.bfloat16, torch.int64]
_SIZES = [1, 3, 1000, 65537, 1 << 20]  # up to 4 MiB (float32) / 8 MiB (int64)


def _dtypes_and_sizes():
    comm = tw.init(timeout=INIT_TIMEOUT)
    nxt, prv = ring_peers(comm)
    cases = [(dt, n) for dt in _DTYPES for n in _SIZES]
    srcs = [rank_values(comm.rank, n, dt) for dt, n in cases]
    rdst = [sentinel(n, dt) for dt, n in cases]
    wdst = [sentinel(n, dt) for dt, n in cases]
    reg = comm.register(srcs + rdst + wdst)
    k = len(cases)
    comm.publish("src", reg.descs[:k])
    comm.publish("wdst", reg.descs[2 * k:])
    remote_src = comm.lookup("src", nxt, timeout=WAIT)
    remote_wdst = comm.lookup("wdst", nxt, timeout=WAIT)
    for i, (dt, n) in enumerate(cases):
        comm.read(rdst[i], remote_src[i], timeout=WAIT)
        assert_equal(rdst[i], rank_values(nxt, n, dt), f"READ {dt} x {n} from rank {nxt}")
        comm.write(srcs[i], remote_wdst[i], timeout=WAIT)
    comm.barrier(timeout=WAIT)
    for i, (dt, n) in enumerate(cases):
        assert_equal(wdst[i], rank_values(prv, n, dt), f"WRITE {dt} x {n} from rank {prv}")
    comm.barrier(timeout=WAIT)
    comm.close()
    return comm.rank


def _notify_ring(messages: int):
    slot = 64  # int64 elements per message slot
    comm = tw.init(timeout=INIT_TIMEOUT)
    nxt, prv = ring_peers(comm)
    src = torch.cat([rank_values(comm.rank, slot, torch.int64, offset=100_000 * i) for i in range(messages)])
    dst = sentinel(slot * messages, torch.int64)
    again_src = rank_values(comm.rank, slot, torch.int64, offset=-50_000)
    again_dst = sentinel(slot, torch.int64)
    reg = comm.register([src, dst, again_src, again_dst])
    comm.publish("inbox", [reg.descs[1], reg.descs[3]])
    remote_dst, remote_again = comm.lookup("inbox", nxt, timeout=WAIT)
    comm.barrier(timeout=WAIT)
    # Send every message without waiting for the receiver: slot i, then its notification.
    for i in range(messages):
        part = slice(i * slot, (i + 1) * slot)
        comm.write(src[part], remote_dst.narrow(i * slot * 8, slot * 8), notify=f"{comm.rank}->{nxt} #{i}".encode(),
                   timeout=WAIT)
    # One prepared WRITE with notify, posted three times, notifies three times.
    with comm.prepare(tw.WRITE, again_src, remote_again, notify=f"again from {comm.rank}".encode()) as x:
        for _ in range(3):
            x.post()
            x.wait(timeout=WAIT)
    # Receive: no barrier; the notification alone says the slot's data is there.
    for i in range(messages):
        got = comm.wait_notification(prv, timeout=WAIT)
        assert got == f"{prv}->{comm.rank} #{i}".encode(), f"message {i} from rank {prv}: got {got!r}"
        part = slice(i * slot, (i + 1) * slot)
        assert_equal(dst[part], rank_values(prv, slot, torch.int64, offset=100_000 * i),
                     f"slot {i} after its notification from rank {prv}")
    for k in range(3):
        got = comm.wait_notification(prv, timeout=WAIT)
        assert got == f"again from {prv}".encode(), f"re-post notification {k}: got {got!r}"
    assert_equal(again_dst, rank_values(prv, slot, torch.int64, offset=-50_000), "re-posted WRITE with notify")
    # Nothing more is queued: waiting again times out, in about the time asked.
    t0 = time.perf_counter()
    try:
        extra = comm.wait_notification(prv, timeout=0.3)
    except tw.WaitTimeoutError as e:
        elapsed = time.perf_counter() - t0
        assert f"rank {prv}" in str(e), str(e)
    else:
        raise AssertionError(f"an extra notification arrived from rank {prv}: {extra!r}")
    assert 0.25 <= elapsed < 3.0, f"wait_notification(timeout=0.3) took {elapsed:.2f}s"
    comm.barrier(timeout=WAIT)
    comm.close()
    return elapsed


def _notify_two_senders(messages: int):
    slot = 16
    comm = tw.init(timeout=INIT_TIMEOUT)
    senders = (1, 2)
    buf = sentinel(slot * comm.world_size * messages, torch.int64)
    src = torch.cat([rank_values(comm.rank, slot, torch.int64, offset=100_000 * i) for i in range(messages)])
    reg = comm.register([buf, src])
    comm.publish("inbox", reg.descs[0])
    if comm.rank in senders:
        remote = comm.lookup("inbox", 0, timeout=WAIT)[0]
        for i in range(messages):
            place = (comm.rank * messages + i) * slot * 8
            comm.write(src[i * slot:(i + 1) * slot], remote.narrow(place, slot * 8),
                       notify=f"from {comm.rank} #{i}".encode(), timeout=WAIT)
    comm.barrier(timeout=WAIT)  # both senders' notifications are in flight or queued
    if comm.rank == 0:
        # Drain rank 2 first although rank 1's messages may have arrived earlier: queues are per sender.
        for sender in (2, 1):
            for i in range(messages):
                got = comm.wait_notification(sender, timeout=WAIT)
                assert got == f"from {sender} #{i}".encode(), f"queue of rank {sender}, message {i}: got {got!r}"
                place = (sender * messages + i) * slot
                assert_equal(buf[place:place + slot], rank_values(sender, slot, torch.int64, offset=100_000 * i),
                             f"data of message {i} from rank {sender}")
        for silent in (1, 2, 3):
            try:
                got = comm.wait_notification(silent, timeout=0.2)
            except tw.WaitTimeoutError:
                continue
            raise AssertionError(f"unexpected notification from rank {silent}: {got!r}")
    comm.barrier(timeout=WAIT)
    comm.close()
    return comm.rank


def _notifications_keep_posting_order():
    """Rank 0 queues two messages to rank 1 whose copies complete out of order (a later, smaller copy first):
    the outbox of transports without a message channel still delivers them in posting order."""
    comm = tw.init(timeout=INIT_TIMEOUT)
    buf = sentinel(16, torch.int64)
    reg = comm.register(buf)
    comm.publish("inbox", reg.descs)
    if comm.rank == 0:
        comm.write(buf, comm.lookup("inbox", 1, timeout=WAIT)[0], notify=b"hello", timeout=WAIT)  # connects
        first_copy_done = threading.Event()
        comm._runtime.outbox.send_after(1, b"first", first_copy_done.is_set)
        comm._runtime.outbox.send_after(1, b"second", lambda: True)  # already complete, yet queued behind "first"
        time.sleep(0.2)
        first_copy_done.set()
        comm.barrier(timeout=WAIT)
        got = None
    else:
        comm.barrier(timeout=WAIT)
        got = [comm.wait_notification(0, timeout=WAIT) for _ in range(3)]
    comm.barrier(timeout=WAIT)
    comm.close()
    return got


def _a_failed_notification_does_not_strand_the_next():
    """A queued message whose completion check fails is dropped with a warning; the one behind it still
    goes out (here to this rank itself, which needs no connection)."""
    import warnings

    comm = tw.init(timeout=INIT_TIMEOUT)
    checks = []

    def broken() -> bool:
        checks.append(1)
        if len(checks) == 1:
            return False  # still copying: the message waits in the outbox
        raise RuntimeError("the copy's event failed")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm._runtime.outbox.send_after(0, b"lost", broken)
        comm._runtime.outbox.send_after(0, b"next", lambda: True)
        got = comm.wait_notification(0, timeout=WAIT)
    comm.close()
    return got, any("could not be sent" in str(w.message) for w in caught)


def _zero_bytes():
    n = 256
    comm = tw.init(timeout=INIT_TIMEOUT)
    nxt, _ = ring_peers(comm)
    src = rank_values(comm.rank, n)
    dst = sentinel(n)
    reg = comm.register([src, dst])
    comm.publish("src", reg.descs[0])
    remote = comm.lookup("src", nxt, timeout=WAIT)[0]
    # A zero-byte item between two real ones is skipped; the others move.
    with comm.prepare(tw.READ, [dst[:100], dst[100:100], dst[100:]],
                      [remote.narrow(0, 400), remote.narrow(400, 0), remote.narrow(400, (n - 100) * 4)]) as x:
        assert x.nbytes == n * 4, x.nbytes
        x.post()
        x.wait(timeout=WAIT)
    assert_equal(dst, rank_values(nxt, n), "READ with a zero-byte item in the middle")
    # Only zero-byte items: nothing to move, complete at once, re-postable.
    with comm.prepare(tw.WRITE, [src[5:5], dst[7:7]], [remote.narrow(0, 0), remote.narrow(n * 4, 0)]) as x:
        assert (x.nbytes, x.transport) == (0, "none"), repr(x)
        for _ in range(3):
            x.post()
            assert x.status() is tw.Status.DONE
            x.wait(timeout=0)
    comm.read(dst[3:3], remote.narrow(12, 0), timeout=0)
    comm.barrier(timeout=WAIT)
    comm.close()
    return comm.rank


# --- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
def test_ring_read(world):
    """Each rank READs its neighbour's registered buffer (1 MiB) and gets the neighbour's values."""
    assert launch(_ring_read, world, 1 << 18) == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_ring_write(world):
    """Each rank WRITEs into its neighbour's buffer; after a barrier every buffer holds its writer's values."""
    assert launch(_ring_write, world, 1 << 18) == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.slow
def test_several_tensors_in_one_transfer(world):
    """One prepared READ (and one WRITE) moves three tensors of different dtypes and sizes."""
    assert launch(_several_tensors, world) == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.slow
def test_views_inside_registered_tensors(world):
    """A local slice of a registered tensor and a remote desc.narrow() address exactly those bytes."""
    assert launch(_views, world) == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.slow
def test_dtypes_and_sizes(world):
    """float32/bfloat16/int64 tensors of 1 element to 1 Mi elements arrive exactly, READ and WRITE."""
    assert launch(_dtypes_and_sizes, world) == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.slow
def test_repost_prepared_transfer(world):
    """One prepared READ and one prepared WRITE re-posted 25 times carry each round's new data."""
    assert launch(repost, world, 25) == [25] * world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.slow
def test_notifications_follow_data_in_order(world):
    """WRITE notifications arrive in order per sender, after their data; then wait_notification times out."""
    elapsed = launch(_notify_ring, world, 5)
    assert len(elapsed) == world and all(0.25 <= e < 3.0 for e in elapsed), elapsed


def test_notifications_from_two_senders_are_queued_separately():
    """World 4: ranks 1 and 2 both notify rank 0, whose per-sender queues keep them apart and in order."""
    assert launch(_notify_two_senders, 4, 4) == [0, 1, 2, 3]


def test_notifications_keep_posting_order_when_copies_complete_out_of_order():
    """A copy that completes before an earlier one does not overtake the earlier one's notification."""
    assert launch(_notifications_keep_posting_order, 2) == [None, [b"hello", b"first", b"second"]]


def test_a_failed_notification_does_not_strand_the_next():
    assert launch(_a_failed_notification_does_not_strand_the_next, 1) == [(b"next", True)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.slow
def test_zero_byte_items(world):
    """Zero-byte items are skipped inside a transfer; a transfer of only zero-byte items completes at once."""
    assert launch(_zero_bytes, world) == list(range(world))


def test_sentinel_differs_from_data():
    """Guard for the suite itself: SENTINEL never equals a rank-encoded value, in any dtype used here."""
    for dt in _DTYPES:
        for rank in range(4):
            assert not bool((rank_values(rank, 1 << 20, dt) == SENTINEL).any())
