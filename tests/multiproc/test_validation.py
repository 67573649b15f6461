"""Every invalid call raises the documented error type, with a message that names the problem, and
changes nothing.

One 2-rank job provokes all the errors (rank 0 calls, rank 1 owns the remote memory) and returns what each
call raised; the parametrized tests below check them one by one, so a failure names its case.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.backends import fake
from tensorwire.testing import free_port
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch

N = 256  # int64 elements in each buffer: 2048 bytes
NO_ERROR = "no error"


def _portable(e: BaseException):
    """The exception itself when it is a tensorwire error (they pickle), else a description."""
    if isinstance(e, tw.TensorwireError) and type(e).__module__.startswith("tensorwire"):
        return e
    return f"{type(e).__name__}: {e}"


def _provoke_errors():
    comm = tw.init(timeout=INIT_TIMEOUT)
    me, peer = comm.rank, 1 - comm.rank
    buf = rank_values(me, N, torch.int64)  # what the peer reads
    out = sentinel(N, torch.int64)
    gone = rank_values(me, N, torch.int64, offset=500)  # rank 1 deregisters it midway
    reg = comm.register([buf, out])
    reg_gone = comm.register(gone)
    comm.publish("bufs", reg.descs + reg_gone.descs)
    remote, remote_out, remote_gone = comm.lookup("bufs", peer, timeout=WAIT)
    seen: dict[str, object] = {}

    def attempt(case, fn):
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - the point is to record it
            seen[case] = _portable(e)
        else:
            seen[case] = NO_ERROR
            if isinstance(result, tw.Transfer):
                result.close()

    comm.barrier(timeout=WAIT)
    if me == 0:
        # Load rank 1's memory map (and prove the setup works) with a valid READ of the range to be closed.
        comm.read(out, remote_gone, timeout=WAIT)
        assert_equal(out, rank_values(1, N, torch.int64, offset=500), "setup READ")
        out.fill_(-1)
    comm.barrier(timeout=WAIT)
    if me == 1:
        reg_gone.close()  # rank 0 still holds remote_gone from lookup()
    comm.barrier(timeout=WAIT)

    if me == 0:
        # --- register ---
        attempt("register-empty-list", lambda: comm.register([]))
        attempt("register-not-a-tensor", lambda: comm.register("tensor"))
        attempt("register-list-with-non-tensor", lambda: comm.register([torch.zeros(4), 3]))
        attempt("register-non-contiguous", lambda: comm.register(torch.zeros(8, 8).t()))
        attempt("register-zero-length", lambda: comm.register(torch.zeros(0)))
        attempt("register-overlap-existing", lambda: comm.register(buf[10:20]))
        lonely = torch.zeros(1)
        attempt("register-overlap-existing-enclosing", lambda: comm.register([lonely, buf]))
        fresh = torch.zeros(200, dtype=torch.int64)
        attempt("register-overlap-within-call", lambda: comm.register([fresh[0:100], fresh[50:150]]))
        # ...and nothing of the failed calls stayed registered: the first range can be registered now.
        attempt("register-after-failed-register", lambda: comm.register(fresh[0:100]).close())
        attempt("register-after-failed-enclosing", lambda: comm.register(lonely).close())

        # --- prepare: local side ---
        unregistered = torch.zeros(N, dtype=torch.int64)
        attempt("prepare-unregistered-local", lambda: comm.prepare(tw.READ, unregistered, remote))
        half = torch.zeros(2 * N, dtype=torch.int64)
        reg_half = comm.register(half[:N])
        attempt("prepare-local-straddles-registration", lambda: comm.prepare(tw.READ, half[N // 2:N // 2 + N], remote))
        reg_half.close()
        attempt("prepare-local-of-closed-registration", lambda: comm.prepare(tw.READ, half[:N], remote))
        attempt("prepare-non-contiguous-local", lambda: comm.prepare(tw.READ, out.view(16, 16).t(), remote))
        attempt("prepare-local-not-a-tensor", lambda: comm.prepare(tw.READ, "out", remote))
        attempt("prepare-length-mismatch", lambda: comm.prepare(tw.READ, [out[:128], out[128:]], [remote]))
        attempt("prepare-size-mismatch", lambda: comm.prepare(tw.READ, out[:10], remote))
        attempt("prepare-bad-op", lambda: comm.prepare("READ", out, remote))
        attempt("prepare-notify-not-bytes", lambda: comm.prepare(tw.WRITE, out, remote, notify="hello"))

        # --- prepare: remote side ---
        attempt("prepare-remote-empty-list", lambda: comm.prepare(tw.READ, [out], []))
        attempt("prepare-remote-not-a-desc", lambda: comm.prepare(tw.READ, out, [b"desc"]))
        attempt("prepare-remote-several-ranks",
                lambda: comm.prepare(tw.READ, [out[:128], buf[:128]],
                                     [remote.narrow(0, 1024), reg.descs[0].narrow(0, 1024)]))
        attempt("prepare-bad-transport", lambda: comm.prepare(tw.READ, out, remote, transport="carrier-pigeon"))
        attempt("prepare-unreachable-transport", lambda: comm.prepare(tw.READ, out, remote, transport="local"))
        attempt("prepare-own-rank-range-outside",
                lambda: comm.prepare(tw.READ, out, dataclasses.replace(reg.descs[0], addr=reg.descs[0].addr + 8)))
        attempt("prepare-remote-rank-outside-world",
                lambda: comm.prepare(tw.READ, out, dataclasses.replace(remote, rank=5)))
        by_hand = tw.TensorDesc(1, remote.end + 4096, N * 8, tw.MemoryKind.CPU, -1, remote.epoch)
        attempt("prepare-remote-made-by-hand", lambda: comm.prepare(tw.READ, out, by_hand))
        attempt("prepare-remote-addr-replaced",
                lambda: comm.prepare(tw.READ, out, dataclasses.replace(remote, addr=remote.addr + 8)))
        bigger = torch.zeros(N + 1, dtype=torch.int64)
        reg_bigger = comm.register(bigger)
        attempt("prepare-remote-nbytes-replaced",
                lambda: comm.prepare(tw.READ, bigger, dataclasses.replace(remote, nbytes=remote.nbytes + 8)))
        reg_bigger.close()
        attempt("prepare-remote-wrong-memory-kind",
                lambda: comm.prepare(tw.READ, out,
                                     dataclasses.replace(remote, kind=tw.MemoryKind.CUDA, device_index=0)))
        attempt("narrow-past-the-end", lambda: remote.narrow(remote.nbytes - 8, 16))
        attempt("prepare-remote-of-closed-registration", lambda: comm.prepare(tw.READ, out, remote_gone))

        # --- transfer state ---
        x = comm.prepare(tw.READ, out, remote)
        attempt("status-before-post", x.status)
        attempt("wait-before-post", lambda: x.wait(timeout=1))
        attempt("wait-negative-timeout", lambda: (x.post(), x.wait(timeout=-1)))
        x.wait(timeout=WAIT)
        x.close()
        x.close()  # idempotent
        attempt("post-closed-transfer", x.post)
        attempt("wait-closed-transfer", lambda: x.wait(timeout=1))
        attempt("status-closed-transfer", x.status)

        # --- other arguments ---
        attempt("lookup-empty-key", lambda: comm.lookup("", 1, timeout=1))
        attempt("lookup-rank-outside-world", lambda: comm.lookup("bufs", 2, timeout=1))
        attempt("publish-key-not-str", lambda: comm.publish(7, remote))
        attempt("wait-notification-rank-outside-world", lambda: comm.wait_notification(9, timeout=0.1))
        attempt("wait-notification-negative-timeout", lambda: comm.wait_notification(1, timeout=-1))

        # --- nothing was lost: the same communicator still runs valid transfers ---
        out.fill_(-1)
        attempt("valid-read-after-errors", lambda: comm.read(out, remote, timeout=WAIT))
        seen["valid-read-data"] = out.tolist()  # plain data: launch cannot return tensors (see test_lifecycle)
        attempt("valid-write-after-errors", lambda: comm.write(buf, remote_out, notify=b"after errors", timeout=WAIT))
        # An empty notification message: either refused or delivered, never silently dropped.
        attempt("write-empty-notify", lambda: comm.write(buf, remote_out, notify=b"", timeout=WAIT))
        attempt("write-bytearray-notify", lambda: comm.write(buf, remote_out, notify=bytearray(b"ba"), timeout=WAIT))
        held = comm.prepare(tw.READ, out, remote)
    comm.barrier(timeout=WAIT)
    if me == 1:
        seen["notification-after-errors"] = comm.wait_notification(0, timeout=WAIT)
        seen["written-after-errors"] = out.tolist()
        try:
            seen["empty-notification"] = comm.wait_notification(0, timeout=1.0)
        except tw.WaitTimeoutError as e:
            seen["empty-notification"] = e
        if seen["empty-notification"] == b"ba":  # the empty one was dropped; this is the next one
            seen["bytearray-notification"], seen["empty-notification"] = b"ba", "dropped"
        else:
            try:
                seen["bytearray-notification"] = comm.wait_notification(0, timeout=WAIT)
            except tw.WaitTimeoutError as e:
                seen["bytearray-notification"] = e
    comm.barrier(timeout=WAIT)
    comm.close()
    comm.close()  # idempotent

    if me == 0:
        # --- a closed communicator refuses everything, and closed what it owned ---
        seen["registration-closed-by-comm-close"] = reg.closed
        seen["transfer-closed-by-comm-close"] = held.closed
        attempt("closed-comm-register", lambda: comm.register(torch.zeros(4)))
        attempt("closed-comm-prepare", lambda: comm.prepare(tw.READ, out, remote))
        attempt("closed-comm-read", lambda: comm.read(out, remote, timeout=1))
        attempt("closed-comm-write", lambda: comm.write(out, remote, timeout=1))
        attempt("closed-comm-publish", lambda: comm.publish("k", remote))
        attempt("closed-comm-lookup", lambda: comm.lookup("bufs", 1, timeout=1))
        attempt("closed-comm-barrier", lambda: comm.barrier(timeout=1))
        attempt("closed-comm-wait-notification", lambda: comm.wait_notification(1, timeout=0.1))
        attempt("closed-comm-transfer-post", held.post)
        attempt("closed-registration-close-again", reg.close)
    return seen


def _stopped(pid: int, timeout: float = 10.0) -> None:
    """Return once process ``pid`` is stopped (``T`` in /proc/<pid>/stat), after a SIGSTOP sent to it."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout}s of SIGSTOP")
        time.sleep(0.001)


def _post_in_flight_to_a_stopped_peer(directory: str):
    """Rank 0 WRITEs over NIXL (TCP) to rank 1 while rank 1 is stopped (SIGSTOP): at least 64 MiB and twice what
    the kernel's socket buffers can hold, so the WRITE cannot complete before rank 1 runs again (SIGCONT), whatever
    the machine's speed."""
    comm = tw.init(timeout=INIT_TIMEOUT)
    buffered = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            buffered += int(f.read().split()[2])  # the most a socket may buffer
    big = torch.full((max(64 << 20, 2 * buffered),), comm.rank + 1, dtype=torch.uint8)
    reg = comm.register(big)
    comm.publish("big", reg.descs)
    remote = comm.lookup("big", 1 - comm.rank, timeout=WAIT)
    if comm.rank == 1:
        with open(os.path.join(directory, "rank1.pid"), "w") as f:
            f.write(str(os.getpid()))
    comm.barrier(timeout=WAIT)
    observed = []
    if comm.rank == 0:
        with open(os.path.join(directory, "rank1.pid")) as f:
            peer_pid = int(f.read())
        with comm.prepare(tw.WRITE, big, remote) as x:
            for _ in range(3):
                os.kill(peer_pid, signal.SIGSTOP)
                try:
                    _stopped(peer_pid)
                    x.post()
                    status = x.status()
                    try:
                        x.post()
                    except tw.InvalidArgumentError as e:
                        observed.append((status, e))
                    else:
                        observed.append((status, NO_ERROR))
                    after = x.status()
                finally:
                    os.kill(peer_pid, signal.SIGCONT)
                observed.append((after, "status after the refused post"))
                x.wait(timeout=WAIT)
                assert x.status() is tw.Status.DONE
            x.post()  # after wait() the transfer may be posted again
            x.wait(timeout=WAIT)
    comm.barrier(timeout=30)
    if comm.rank == 1:
        assert_equal(big[:1 << 20], torch.ones(1 << 20, dtype=torch.uint8), "rank 0's WRITEs, first MiB")
        assert_equal(big[-(1 << 20):], torch.ones(1 << 20, dtype=torch.uint8), "rank 0's WRITEs, last MiB")
    comm.close()
    return observed


@pytest.fixture(scope="module")
def observed():
    """What every invalid call raised on rank 0 (and what rank 1 received), from one 2-rank job."""
    rank0, rank1 = launch(_provoke_errors, 2)
    return rank0, rank1


CASES = [
    # case, error type, substring of the message
    ("register-empty-list", tw.InvalidArgumentError, "the tensor list is empty"),
    ("register-not-a-tensor", tw.InvalidArgumentError, "expected a tensor or a list of tensors, got str"),
    ("register-list-with-non-tensor", tw.InvalidArgumentError, "item 1 is a int, not a torch.Tensor"),
    ("register-non-contiguous", tw.InvalidArgumentError, "not contiguous"),
    ("register-zero-length", tw.InvalidArgumentError, "has zero bytes"),
    ("register-overlap-existing", tw.InvalidArgumentError, "overlaps registered range"),
    ("register-overlap-existing-enclosing", tw.InvalidArgumentError, "tensor 1"),
    ("register-overlap-within-call", tw.InvalidArgumentError, "tensor 1"),
    ("prepare-unregistered-local", tw.InvalidArgumentError, "is not inside any registered tensor"),
    ("prepare-local-straddles-registration", tw.InvalidArgumentError, "is not inside any registered tensor"),
    ("prepare-local-of-closed-registration", tw.InvalidArgumentError, "is not inside any registered tensor"),
    ("prepare-non-contiguous-local", tw.InvalidArgumentError, "not contiguous"),
    ("prepare-local-not-a-tensor", tw.InvalidArgumentError, "expected a tensor or a list of tensors"),
    ("prepare-length-mismatch", tw.InvalidArgumentError, "2 local tensors but 1 remote descriptors"),
    ("prepare-size-mismatch", tw.InvalidArgumentError, "local tensor has 80 bytes, remote descriptor 2048"),
    ("prepare-bad-op", tw.InvalidArgumentError, "pass tw.READ or tw.WRITE"),
    ("prepare-notify-not-bytes", tw.InvalidArgumentError, "notify must be non-empty bytes"),
    ("prepare-remote-empty-list", tw.InvalidArgumentError, "non-empty list"),
    ("prepare-remote-not-a-desc", tw.InvalidArgumentError, "remote item 0 is a bytes"),
    ("prepare-remote-several-ranks", tw.InvalidArgumentError, "belong to ranks [0, 1]"),
    ("prepare-bad-transport", tw.InvalidArgumentError, "transport='carrier-pigeon'"),
    ("prepare-unreachable-transport", tw.InvalidArgumentError, "transport='local' cannot reach rank 1"),
    ("prepare-own-rank-range-outside", tw.InvalidArgumentError, "is outside what rank 0 has registered"),
    ("prepare-remote-rank-outside-world", tw.InvalidArgumentError, "rank 5 is outside [0, 2)"),
    ("prepare-remote-made-by-hand", tw.InvalidArgumentError, "is outside what rank 1 has registered"),
    ("prepare-remote-addr-replaced", tw.InvalidArgumentError, "is outside what rank 1 has registered"),
    ("prepare-remote-nbytes-replaced", tw.InvalidArgumentError, "is outside what rank 1 has registered"),
    ("prepare-remote-wrong-memory-kind", tw.InvalidArgumentError, "is outside what rank 1 has registered"),
    ("narrow-past-the-end", tw.InvalidArgumentError, "outside the 2048 bytes"),
    ("status-before-post", tw.InvalidArgumentError, "never posted"),
    ("wait-before-post", tw.InvalidArgumentError, "never posted"),
    ("wait-negative-timeout", tw.InvalidArgumentError, "timeout=-1"),
    ("post-closed-transfer", tw.ClosedError, "the transfer is closed"),
    ("wait-closed-transfer", tw.ClosedError, "the transfer is closed"),
    ("status-closed-transfer", tw.ClosedError, "the transfer is closed"),
    ("lookup-empty-key", tw.InvalidArgumentError, "key must be a non-empty str"),
    ("lookup-rank-outside-world", tw.InvalidArgumentError, "rank 2 is outside [0, 2)"),
    ("publish-key-not-str", tw.InvalidArgumentError, "key must be a non-empty str"),
    ("wait-notification-rank-outside-world", tw.InvalidArgumentError, "rank 9 is outside [0, 2)"),
    ("wait-notification-negative-timeout", tw.InvalidArgumentError, "timeout=-1"),
    ("closed-comm-register", tw.ClosedError, "register: the communicator is closed"),
    ("closed-comm-prepare", tw.ClosedError, "prepare: the communicator is closed"),
    ("closed-comm-read", tw.ClosedError, "the communicator is closed"),
    ("closed-comm-write", tw.ClosedError, "the communicator is closed"),
    ("closed-comm-publish", tw.ClosedError, "publish: the communicator is closed"),
    ("closed-comm-lookup", tw.ClosedError, "lookup: the communicator is closed"),
    ("closed-comm-barrier", tw.ClosedError, "barrier: the communicator is closed"),
    ("closed-comm-wait-notification", tw.ClosedError, "wait_notification: the communicator is closed"),
    ("closed-comm-transfer-post", tw.ClosedError, "is closed"),
]


@pytest.mark.parametrize("case,error,text", CASES, ids=[c.values[0] if hasattr(c, "values") else c[0] for c in CASES])
def test_invalid_call_raises(observed, case, error, text):
    """The invalid call raises the documented error type with a message naming the problem."""
    got = observed[0][case]
    assert isinstance(got, error), f"{case}: expected {error.__name__}, got {got!r}"
    assert text in str(got), f"{case}: message {str(got)!r} does not mention {text!r}"


def test_failed_register_leaves_nothing_registered(observed):
    """After a register call fails on its second tensor, the first tensor's range is not left registered."""
    assert observed[0]["register-after-failed-register"] == NO_ERROR
    assert observed[0]["register-after-failed-enclosing"] == NO_ERROR


def test_communicator_works_after_errors(observed):
    """After ~40 rejected calls the communicator still READs and WRITEs (with notify) correctly."""
    rank0, rank1 = observed
    assert rank0["valid-read-after-errors"] == NO_ERROR
    assert_equal(torch.tensor(rank0["valid-read-data"]), rank_values(1, N, torch.int64), "READ after errors")
    assert rank0["valid-write-after-errors"] == NO_ERROR
    assert rank1["notification-after-errors"] == b"after errors"
    assert_equal(torch.tensor(rank1["written-after-errors"]), rank_values(0, N, torch.int64), "WRITE after errors")


def test_close_communicator_closes_what_it_owns(observed):
    """comm.close() closes its registrations and transfers; closing twice is harmless."""
    rank0, _ = observed
    assert rank0["registration-closed-by-comm-close"] is True
    assert rank0["transfer-closed-by-comm-close"] is True
    assert rank0["closed-registration-close-again"] == NO_ERROR


def test_bytearray_notify_is_delivered(observed):
    """notify= may be a bytearray; the peer receives the same bytes."""
    rank0, rank1 = observed
    assert rank0["write-bytearray-notify"] == NO_ERROR
    assert rank1["bytearray-notification"] == b"ba"


def test_empty_notify_is_refused_or_delivered(observed):
    """A WRITE with notify=b'' either raises InvalidArgumentError or delivers an empty message; never drops it."""
    rank0, rank1 = observed
    refused = isinstance(rank0["write-empty-notify"], tw.InvalidArgumentError)
    delivered = rank1["empty-notification"] == b""
    assert refused or delivered, f"rank 0: {rank0['write-empty-notify']!r}; rank 1 got: {rank1['empty-notification']!r}"


def test_remote_desc_of_closed_registration_is_rejected(observed):
    """prepare with a descriptor of a range its owner deregistered raises InvalidArgumentError."""
    got = observed[0]["prepare-remote-of-closed-registration"]
    assert isinstance(got, tw.InvalidArgumentError), f"got {got!r}"
    assert "outside what rank 1 has registered" in str(got)


def _refused_while_in_flight(status, err) -> None:
    assert status is tw.Status.IN_PROGRESS, f"the first post was not in flight: {status}"
    assert isinstance(err, tw.InvalidArgumentError), f"re-post while in flight gave {err!r}"
    assert "still in flight" in str(err) and "call wait()" in str(err), str(err)


def test_post_while_in_flight_is_rejected():
    """post() of a transfer still in flight raises InvalidArgumentError ('still in flight') and changes nothing;
    after wait() it may be posted again. The fake transport's hold() keeps every copy in flight until it is
    left, so each re-post meets a transfer in flight, on any machine."""
    with tw.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu",
                 timeout=WAIT) as comm:
        source, destination = rank_values(0, N, torch.int64), sentinel(N, torch.int64)
        with comm.register([source, destination]) as reg, \
                comm.prepare(tw.WRITE, source, reg.descs[1], transport="fake") as x:
            for round_ in range(3):
                before = destination.clone()
                source.copy_(rank_values(0, N, torch.int64, offset=100 * round_))
                with fake.hold():
                    x.post()
                    status = x.status()
                    with pytest.raises(tw.InvalidArgumentError) as refused:
                        x.post()
                    _refused_while_in_flight(status, refused.value)
                    assert x.status() is tw.Status.IN_PROGRESS, "the refused post changed the transfer's state"
                    assert_equal(destination, before, f"round {round_}: bytes landed while held")
                x.wait(timeout=WAIT)
                assert x.status() is tw.Status.DONE
                assert_equal(destination, source, f"round {round_}: the WRITE after wait")
            x.post()  # after wait() the transfer may be posted again
            x.wait(timeout=WAIT)


def test_post_while_in_flight_over_nixl_is_rejected(tmp_path):
    """The same over NIXL between two processes: rank 0's re-post of a WRITE to a stopped rank 1 (it cannot
    complete) is refused, and the transfer stays in flight until rank 1 runs again."""
    rank0, _ = launch(_post_in_flight_to_a_stopped_peer, 2, str(tmp_path), env={"UCX_TLS": "tcp"})
    assert len(rank0) == 6, rank0
    for (status, err), (after, _) in zip(rank0[0::2], rank0[1::2]):
        _refused_while_in_flight(status, err)
        assert after is tw.Status.IN_PROGRESS, f"the refused post changed the transfer's state: {after}"
