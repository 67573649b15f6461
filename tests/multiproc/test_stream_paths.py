"""The code that serves GPU streams for CPU-driven transports, run on any machine: the ``fake`` transport (a
host loopback completed by a later poll, ``backends/fake.py``) under host stand-in streams (``HostStream``).

What these prove is the protocol between a stream and the progress and deadline threads (done_seq, the
doorbell and its done flag, graph replays, the per-sender notification counters, the timeouts that release a
stream); tests/gpu/test_streams_gpu.py runs the same protocol on real CUDA streams with NIXL and CUDA IPC.
A consumer here is a host function launched on the stream after the wait: it must see the transfer's bytes.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import tensorwire as tw
from tensorwire import cuda
from tensorwire.backends import fake
from tensorwire.backends.fake import HostStream
from tensorwire.testing import free_port

N = 1 << 12  # int32 elements per buffer
NOT_YET_S = 0.2  # how long a consumer that must wait is watched not running


@pytest.fixture
def comm(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", "stream-paths-test-token")
    with tw.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu",
                 timeout=10) as comm:
        yield comm


@pytest.fixture
def stream():
    with HostStream() as stream:
        yield stream


def _buffers(comm):
    """(source, destination, registration): the source holds 0..N-1, the destination zeros."""
    source = torch.arange(N, dtype=torch.int32)
    destination = torch.zeros(N, dtype=torch.int32)
    return source, destination, comm.register([source, destination])


def _prepare(comm, op, source, destination, registration, **kwargs):
    """A transfer that moves ``source`` into ``destination`` with ``op`` (READ: local is the destination)."""
    if op is tw.READ:
        return comm.prepare(tw.READ, destination, registration.descs[0], transport="fake", **kwargs)
    return comm.prepare(tw.WRITE, source, registration.descs[1], transport="fake", **kwargs)


def _snapshot_on(stream, tensor):
    """Launch a consumer on ``stream`` that copies ``tensor``; returns the list it appends to."""
    seen = []
    stream.launch(lambda: seen.append(tensor.clone()))
    return seen


@pytest.mark.parametrize("op", [tw.READ, tw.WRITE], ids=["READ", "WRITE"])
def test_a_cpu_post_waited_on_a_stream_holds_the_consumer_until_done(comm, stream, op):
    source, destination, reg = _buffers(comm)
    with reg, _prepare(comm, op, source, destination, reg) as x:
        assert x.transport == "fake"
        for round_ in range(3):
            source.fill_(round_ + 1)
            with fake.hold():
                x.post()
                x.wait(stream=stream)  # returns at once
                seen = _snapshot_on(stream, destination)
                time.sleep(NOT_YET_S)
                assert not seen, "the consumer ran while the transfer was still in flight"
            stream.synchronize(5)
            assert bool((seen[0] == round_ + 1).all()), f"round {round_}: the consumer saw {seen[0][:4]}"
            x.wait(timeout=5)


@pytest.mark.parametrize("op", [tw.READ, tw.WRITE], ids=["READ", "WRITE"])
def test_a_stream_post_moves_the_bytes_the_stream_produced(comm, stream, op):
    """post(stream=) rings the doorbell when the stream gets there: the bytes a producer wrote after the call
    returned, but before the stream reached it, are the ones that move."""
    source, destination, reg = _buffers(comm)
    producer_done = cuda.HostWords(1)
    with reg, _prepare(comm, op, source, destination, reg) as x:
        stream.wait_value(producer_done.addr(0), 1)  # the producer "kernel" has not finished
        x.post(stream=stream)
        x.wait(stream=stream)
        seen = _snapshot_on(stream, destination)
        source.fill_(7)
        producer_done.values[0] = 1
        stream.synchronize(5)
        assert bool((seen[0] == 7).all()), f"the transfer moved {seen[0][:4]}, not what the producer wrote"


@pytest.mark.parametrize("op", [tw.READ, tw.WRITE], ids=["READ", "WRITE"])
def test_a_captured_post_and_wait_move_new_bytes_at_every_replay(comm, stream, op):
    source, destination, reg = _buffers(comm)
    with reg, _prepare(comm, op, source, destination, reg) as x:
        seen = []
        with stream.capture() as graph:
            x.post(stream=stream)
            x.wait(stream=stream)
            stream.launch(lambda: seen.append(int(destination[0]) if bool((destination == destination[0]).all())
                                              else None))
        assert not seen  # captured, not run
        for replay in range(20):
            source.fill_(replay + 100)
            graph.replay()
            stream.synchronize(5)
        assert seen == [replay + 100 for replay in range(20)]


def test_a_stream_wait_is_released_at_its_timeout_and_the_handle_says_so(comm, stream):
    source, destination, reg = _buffers(comm)
    with reg, _prepare(comm, tw.READ, source, destination, reg) as x:
        with fake.hold(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x.post()
            x.wait(stream=stream, timeout=0.3)
            seen = _snapshot_on(stream, destination)
            stream.synchronize(5)  # released by the deadline thread although the copy is still held
        assert seen, "the consumer never ran"
        assert any("stream was released" in str(w.message) for w in caught), [str(w.message) for w in caught]
        with pytest.raises(tw.WaitTimeoutError, match="stream was released"):
            x.wait(timeout=5)
        x.wait(timeout=5)  # the error was reported once; the READ itself completed once released
        x.post()
        x.wait(timeout=5)
        assert torch.equal(destination, source)


def test_a_stream_post_that_times_out_fails_the_handle_and_releases_every_ring(comm, stream):
    source, destination, reg = _buffers(comm)
    with reg, _prepare(comm, tw.WRITE, source, destination, reg) as x:
        with fake.hold(), warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            with stream.capture() as graph:
                x.post(stream=stream)
                x.wait(stream=stream, timeout=0.3)
            graph.replay()
            stream.synchronize(5)  # the held ring was released by its deadline
        with pytest.raises(tw.WaitTimeoutError, match="failed now"):
            x.post(stream=stream)
        graph.replay()  # a replayed graph keeps ringing: released at once, nothing moves
        stream.synchronize(5)


def test_a_failed_transfer_releases_the_stream_and_raises_at_the_next_call(comm, stream):
    source, destination, reg = _buffers(comm)
    with reg, _prepare(comm, tw.READ, source, destination, reg) as x:
        with fake.fail():
            x.post()
            x.wait(stream=stream)
            stream.synchronize(5)
        with pytest.raises(tw.TransferError):
            x.wait(timeout=5)


def test_a_notification_waited_on_a_stream_releases_the_consumer_with_that_rounds_data(comm, stream):
    source, destination, reg = _buffers(comm)
    with reg, _prepare(comm, tw.WRITE, source, destination, reg, notify=b"go") as x:
        for round_ in range(5):
            source.fill_(round_ + 3)
            comm.wait_notification(0, stream=stream)
            seen = _snapshot_on(stream, destination)
            time.sleep(NOT_YET_S / 4)
            assert not seen, "the consumer ran before the notification"
            x.post()
            x.wait(timeout=5)
            stream.synchronize(5)
            assert bool((seen[0] == round_ + 3).all()), f"round {round_}: the consumer saw {seen[0][:4]}"


def test_a_notification_that_never_comes_releases_the_stream_at_its_timeout(comm, stream):
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        comm.wait_notification(0, stream=stream, timeout=0.3)
        seen = _snapshot_on(stream, torch.zeros(1))
        stream.synchronize(5)
    assert seen
    with pytest.raises(tw.WaitTimeoutError, match="nothing from rank 0"):
        comm.wait_notification(0, timeout=1)


def test_block_ids_posted_on_a_stream_move_at_every_replay(comm, stream):
    blocks, block_elems = 64, 256
    pool_a = torch.arange(blocks * block_elems, dtype=torch.int32).view(blocks, block_elems)
    pool_b = torch.zeros_like(pool_a)
    with comm.register_blocks(pool_a) as a, comm.register_blocks(pool_b) as b:
        with comm.prepare_blocks(tw.READ, b, a.desc, transport="fake") as x:
            local_ids, remote_ids = [3, 4, 5, 60], [10, 11, 12, 0]
            with stream.capture() as graph:
                x.post(local_ids, remote_ids, stream=stream)
                x.wait(stream=stream)
            for replay in range(3):
                pool_a.add_(1)
                graph.replay()
                stream.synchronize(5)
                assert torch.equal(pool_b[local_ids], pool_a[remote_ids]), f"replay {replay}"
            untouched = sorted(set(range(blocks)) - set(local_ids))
            assert not pool_b[untouched].any()


def test_close_releases_the_streams_still_waiting(stream, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", "stream-paths-test-token")
    comm = tw.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", timeout=1)
    source, destination, reg = _buffers(comm)
    x = _prepare(comm, tw.READ, source, destination, reg)
    with fake.hold(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x.post()
        x.wait(stream=stream, timeout=60)  # far beyond the communicator's own timeout
        comm.wait_notification(0, stream=stream, timeout=60)
        comm.close()
        stream.synchronize(5)
    assert comm.closed and x.closed
    assert any("close() released 2 stream wait(s)" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_a_ring_that_comes_after_close_still_moves_the_bytes(comm, stream):
    """close() while the stream has not reached its post(stream=) yet: the ring is served when it comes."""
    source, destination, reg = _buffers(comm)
    producer_done = cuda.HostWords(1)
    with reg:
        x = _prepare(comm, tw.READ, source, destination, reg)
        stream.wait_value(producer_done.addr(0), 1)
        x.post(stream=stream)
        x.wait(stream=stream)
        seen = _snapshot_on(stream, destination)
        x.close()
        source.fill_(9)
        producer_done.values[0] = 1
        stream.synchronize(5)
        assert bool((seen[0] == 9).all()), f"the ring after close moved {seen[0][:4]}"


def test_a_revoked_transfer_releases_the_stream_of_its_ring_in_flight(comm, stream):
    """The peer deregisters the memory while a stream post is in flight: the stream goes on once the copy has
    finished (not at the timeout, not never), and the handle raises RevokedError."""
    source, destination, reg = _buffers(comm)
    with reg, _prepare(comm, tw.WRITE, source, destination, reg) as x:
        with fake.hold():
            x.post(stream=stream)
            x.wait(stream=stream, timeout=60)
            time.sleep(NOT_YET_S)  # the ring is picked up and in flight
            x.revoke(tw.RevokedError("revoked"))
        stream.synchronize(5)
        with pytest.raises(tw.RevokedError):
            x.post(stream=stream)
