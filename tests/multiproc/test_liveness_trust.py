"""Liveness and lifetimes under pressure, with real processes: running out of descriptors here is a local error
and never a verdict on a live peer, a stranger's flood of unfinished liveness handshakes costs a bounded number
of descriptors, a second process claiming a live rank whose claim was deleted from the store is refused, a store
host that stops (SIGSTOP) is reported as not answering, and closing gives every descriptor and thread back
without the garbage collector.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

import tensorwire as tw
from tensorwire.testing import free_port
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch

HERE = os.path.dirname(os.path.abspath(__file__))
LIVENESS_S = 2.0
ENV = {"TENSORWIRE_LIVENESS_S": str(LIVENESS_S)}
N = 4096


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _threads() -> int:
    """This process's threads, native ones (UCX's, torch's) included."""
    return len(os.listdir("/proc/self/task"))


def _line(proc: subprocess.Popen, prefix: str) -> str:
    """The first line ``proc`` prints that starts with ``prefix`` (libraries below may print their own)."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"the process exited ({proc.wait()}) without printing {prefix!r}")


def _python(code: str, env: dict[str, str], **kwargs) -> subprocess.Popen:
    """A fresh interpreter running ``code`` with this directory importable."""
    prelude = f"import sys; sys.path.insert(0, {HERE!r})\n"
    return subprocess.Popen([sys.executable, "-c", prelude + code], env=env, text=True, **kwargs)


# --- running out of descriptors is local ---------------------------------------------------------------------
def _exhaust_descriptors() -> list[int]:
    """Lower the soft descriptor limit to the highest open descriptor and fill every hole below it: the next
    socket or file fails with EMFILE. Returns the fillers (close them, then restore the limit)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(_open_fds()) + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    fillers = []
    while True:
        try:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return fillers


def _out_of_descriptors_while_contacting_a_live_peer():
    comm = tw.init(timeout=INIT_TIMEOUT)
    buf, out = rank_values(comm.rank, N), sentinel(N)
    reg = comm.register([buf, out])
    comm.publish("buf", reg.descs[0])
    comm.barrier(timeout=WAIT)
    result = None
    if comm.rank == 1:
        remote = comm.lookup("buf", 2, timeout=WAIT)  # a store value: rank 2's liveness socket is not opened yet
        limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        fillers = _exhaust_descriptors()
        try:
            comm.read(out, remote, timeout=WAIT)  # the first contact with rank 2 needs a socket
        except tw.TensorwireError as e:
            error = e
        else:
            error = None
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        assert error is not None, "a READ without a descriptor to spare succeeded"
        result = (type(error).__name__, str(error))
        comm.read(out, remote, timeout=WAIT)  # descriptors are back: rank 2 was alive all along
        assert_equal(out, rank_values(2, N), "READ from rank 2 once descriptors are back")
    comm.barrier(timeout=WAIT)
    comm.close()
    return result


@pytest.mark.slow
def test_running_out_of_descriptors_is_a_local_error_and_not_a_verdict_on_a_live_peer():
    """Rank 1 has no descriptor to spare when it first contacts rank 2 (alive): the READ fails with a typed error
    that says the trouble is local (the limit and ``ulimit -n``), not PeerLostError, and once descriptors are
    back a READ from rank 2 succeeds (the old code took rank 2 for gone, for good)."""
    name, message = launch(_out_of_descriptors_while_contacting_a_live_peer, 3, env=ENV)[1]
    print(f"\n{name}: {message}")
    assert name == "TransferError", f"{name}: {message}"
    assert "ulimit -n" in message and "EMFILE" in message, message


# --- a flood of unfinished handshakes ------------------------------------------------------------------------
_FLOOD = 600  # connections a stranger holds open to the victim's liveness port


def _flood(host: str, port: int, count: int) -> None:
    """Run in a process without the token: open ``count`` connections to a liveness listener, send nothing,
    hold them until stdin closes."""
    import socket

    held = [socket.create_connection((host, port)) for _ in range(count)]
    print("holding", len(held), flush=True)
    sys.stdin.read()


def _flooded_listener():
    comm = tw.init(timeout=INIT_TIMEOUT)
    peer = 1 - comm.rank
    buf, out = rank_values(comm.rank, N), sentinel(N)
    reg = comm.register([buf, out])
    comm.publish("buf", reg.descs[0])
    remote = comm.lookup("buf", peer, timeout=WAIT)
    comm.read(out, remote, timeout=WAIT)
    comm.barrier(timeout=WAIT)
    result = None
    if comm.rank == 0:
        before = len(_open_fds())
        host, port = comm._rendezvous.liveness.address
        env = {k: v for k, v in os.environ.items() if k != "TENSORWIRE_JOB_TOKEN"}
        stranger = _python(f"import test_liveness_trust as t; t._flood({host!r}, {port}, {_FLOOD})", env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        _line(stranger, "holding")
        most = before
        deadline = time.monotonic() + 3 * LIVENESS_S
        while time.monotonic() < deadline:  # waits poll the listener: they accept and handshake
            try:
                comm.lookup("never-published", peer, timeout=0.05)
            except tw.WaitTimeoutError:
                pass
            most = max(most, len(_open_fds()))
        out.fill_(-1)
        comm.read(out, remote, timeout=WAIT)  # the peer's own connection is untouched
        assert_equal(out, rank_values(peer, N), "READ during the flood")
        stranger.stdin.close()
        stranger.wait(timeout=30)
        result = before, most
    comm.barrier(timeout=WAIT + 3 * LIVENESS_S + 30)  # rank 0 floods for 3 liveness periods and starts a process
    comm.close()
    return result


@pytest.mark.slow
def test_a_flood_of_unfinished_liveness_handshakes_costs_a_bounded_number_of_descriptors():
    """A process without the token opens 600 connections to rank 0's liveness port and sends nothing: rank 0
    holds at most its cap of pending handshakes (64) plus a few, not one descriptor per connection."""
    before, most = launch(_flooded_listener, 2, env=ENV)[0]
    print(f"\nrank 0: {before} descriptors before the flood, at most {most} during it")
    assert most - before <= 64 + 16, f"{most - before} more descriptors for {_FLOOD} unfinished handshakes"


# --- a deleted claim ----------------------------------------------------------------------------------------
def _deleted_claim():
    comm = tw.init(timeout=INIT_TIMEOUT)
    port = int(os.environ["MASTER_PORT"])
    buf, out = rank_values(comm.rank, N), sentinel(N)
    reg = comm.register([buf, out])
    comm.publish("buf", reg.descs[0])
    remote = comm.lookup("buf", 1 - comm.rank, timeout=WAIT)
    result = None
    if comm.rank == 1:
        import datetime

        import torch.distributed as dist

        outsider = dist.PrefixStore("tensorwire/", dist.TCPStore("127.0.0.1", port, None, False,
                                                                 datetime.timedelta(seconds=10)))
        assert outsider.delete_key("rank/1"), "rank 1's claim was not in the store"
        code = ("import tensorwire as tw\n"
                "try:\n"
                f"    tw.init(rank=1, world_size=2, master_addr='127.0.0.1', master_port={port}, timeout=10)\n"
                "except tw.TensorwireError as e:\n"
                "    print(type(e).__name__, e)\n"
                "else:\n"
                "    print('joined')\n")
        second = _python(code, dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        while second.poll() is None:  # this rank keeps calling into tensorwire meanwhile, as a live rank does
            try:
                comm.lookup("never-published", 0, timeout=0.05)
            except tw.WaitTimeoutError:
                pass
        result = second.stdout.read().strip()
    comm.barrier(timeout=WAIT)
    comm.read(out, remote, timeout=WAIT)  # the first rank 1 is still the one
    assert_equal(out, rank_values(1 - comm.rank, N), "READ after the second claim")
    comm.barrier(timeout=WAIT)
    comm.close()
    return result


@pytest.mark.slow
def test_a_second_process_claiming_a_live_rank_whose_claim_was_deleted_is_refused():
    """A process outside the job deletes ``rank/1`` from the store; a second process of the job then claims rank 1
    while the first still runs: it is refused with a typed error naming both processes."""
    refused = launch(_deleted_claim, 2, env=ENV)[1]
    print(f"\n{refused}")
    assert refused.startswith("InvalidArgumentError init: rank 1 of 2 is already taken"), refused
    assert refused.count(" pid ") >= 2, f"the message does not name both processes: {refused}"


# --- a stopped store host -----------------------------------------------------------------------------------
def _store_host(port: int) -> None:
    comm = tw.init(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=INIT_TIMEOUT)
    print("ready", flush=True)
    sys.stdin.read()
    comm.close()


def _store_client(port: int) -> None:
    comm = tw.init(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=INIT_TIMEOUT)
    print("ready", flush=True)
    sys.stdin.readline()  # the store's host is stopped now
    try:
        comm.barrier(timeout=60)
    except tw.TensorwireError as e:
        print(json.dumps([type(e).__name__, str(e)]), flush=True)
    else:
        print(json.dumps(["returned", ""]), flush=True)
    os._exit(0)  # a close would wait for the stopped host


@pytest.mark.slow
def test_a_stopped_store_host_is_reported_as_not_answering():
    """The store's host is stopped with SIGSTOP (alive, but silent): a barrier on the other rank ends with
    PeerLostError saying the store did not answer within the bound and that its host may be stopped."""
    port = free_port()
    env = {**os.environ, **ENV, "TENSORWIRE_JOB_TOKEN": os.urandom(16).hex()}
    host = _python(f"import test_liveness_trust as t; t._store_host({port})", env,
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    client = _python(f"import test_liveness_trust as t; t._store_client({port})", env,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        _line(host, "ready")
        _line(client, "ready")
        os.kill(host.pid, signal.SIGSTOP)
        client.stdin.write("go\n")
        client.stdin.flush()
        name, message = json.loads(_line(client, "["))
    finally:
        for proc in (client, host):
            proc.kill()
            proc.wait(timeout=30)
    print(f"\n{name}: {message}")
    assert name == "PeerLostError", f"{name}: {message}"
    assert f"did not answer within {LIVENESS_S:g}s (stopped, overloaded or unreachable)" in message, message


# --- closing gives everything back --------------------------------------------------------------------------
def _doomed_peer(port: int) -> None:
    comm = tw.init(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=INIT_TIMEOUT)
    buf = rank_values(1, N)
    reg = comm.register(buf)
    comm.publish("buf", reg.descs[0])
    comm.barrier(timeout=WAIT)
    time.sleep(600)  # killed by rank 0


def _jobs_with_a_killed_peer(jobs: int):
    """In this one process: ``jobs`` communicators in turn, each with a peer that is killed while connected; the
    descriptors and threads held before each init, after each close (no ``gc.collect``)."""
    import gc

    gc.disable()  # nothing may depend on the collector
    counts = []
    for _ in range(jobs):
        before = (len(_open_fds()), _threads())
        port = free_port()
        peer = _python(f"import test_liveness_trust as t; t._doomed_peer({port})", dict(os.environ))
        comm = tw.init(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=INIT_TIMEOUT)
        out = sentinel(N)
        reg = comm.register(out)
        remote = comm.lookup("buf", 1, timeout=WAIT)
        comm.barrier(timeout=WAIT)
        comm.read(out, remote, timeout=WAIT)
        assert_equal(out, rank_values(1, N), "READ before the kill")
        peer.kill()
        peer.wait(timeout=30)
        try:
            comm.read(out, remote, timeout=WAIT)
        except tw.PeerLostError:
            pass
        else:
            raise AssertionError("a READ from a killed peer succeeded")
        reg.close()
        comm.close()
        del comm, reg, out, remote
        counts.append((before, (len(_open_fds()), _threads())))
    return counts


@pytest.mark.slow
def test_closing_after_a_peer_died_gives_back_every_descriptor_and_thread_without_the_collector():
    """Four communicators in one process, one after the other, each with a peer killed while connected, each
    closed: with the garbage collector off, the process holds no more descriptors or threads after the last
    close than after the first one (the first init loads libraries that stay), and no more than before it."""
    counts = launch(_jobs_with_a_killed_peer, 1, 4, env=ENV, timeout=240)[0]
    for i, (before, after) in enumerate(counts):
        print(f"\njob {i}: descriptors {before[0]} -> {after[0]}, threads {before[1]} -> {after[1]}")
    first_close, last_close = counts[0][1], counts[-1][1]
    assert last_close[0] <= first_close[0], f"descriptors grew from {first_close[0]} to {last_close[0]}"
    assert last_close[1] <= first_close[1], f"threads grew from {first_close[1]} to {last_close[1]}"
    assert last_close[1] <= counts[0][0][1], f"{last_close[1]} threads after close, {counts[0][0][1]} before init"
