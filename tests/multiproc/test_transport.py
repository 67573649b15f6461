"""Transport selection and the progress engine, on host memory (runs in CI)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.backends.fake import HostStream
from tensorwire.config import Config
from tensorwire.progress import ProgressEngine
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch


def _self_transfer_takes_the_local_copy():
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        src = rank_values(comm.rank, 4096)
        dst = sentinel(4096)
        with comm.register([src, dst]) as reg:
            with comm.prepare(tw.WRITE, src, reg.descs[1], notify=b"to-myself") as x:
                assert x.transport == "local", x.transport
                x.post()
                x.wait(timeout=WAIT)
            assert_equal(dst, src, "self WRITE")
            assert comm.wait_notification(comm.rank, timeout=WAIT) == b"to-myself"
            dst.fill_(-1)
            with comm.prepare(tw.READ, dst[:100], reg.descs[0].narrow(400, 400)) as x:
                x.post()
                x.wait(timeout=WAIT)
            assert_equal(dst[:100], src[100:200], "self READ of a narrowed descriptor")
            with pytest.raises(tw.InvalidArgumentError, match="cannot reach rank"):
                comm.prepare(tw.WRITE, src, reg.descs[1], transport="nixl")
            with pytest.raises(tw.InvalidArgumentError, match="transport="):
                comm.prepare(tw.WRITE, src, reg.descs[1], transport="carrier-pigeon")
            with pytest.raises(tw.InvalidArgumentError, match="peer_pointer: needs a TensorDesc of CUDA memory"):
                comm.peer_pointer(reg.descs[0])
        comm.barrier(timeout=WAIT)
    return True


def test_transfer_to_own_rank_is_a_local_copy_with_notification():
    """A rank addressing its own memory gets the in-process copy (NIXL would take TCP emulation)."""
    assert launch(_self_transfer_takes_the_local_copy, 2) == [True, True]


def _host_transfers_take_nixl(forced: str | None):
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        peer = (comm.rank + 1) % comm.world_size
        src, dst = rank_values(comm.rank, 1024), sentinel(1024)
        with comm.register([src, dst]) as reg:
            comm.publish("dst", reg.descs[1:])
            remote = comm.lookup("dst", peer, timeout=WAIT)
            with comm.prepare(tw.WRITE, src, remote, transport=forced) as x:
                transport = x.transport
                x.post()
                x.wait(timeout=WAIT)
            comm.barrier(timeout=WAIT)
            assert_equal(dst, rank_values((comm.rank - 1) % comm.world_size, 1024), "ring WRITE")
            with pytest.raises(tw.InvalidArgumentError, match="cuda_ipc"):
                comm.prepare(tw.WRITE, src, remote, transport="cuda_ipc")
            comm.barrier(timeout=WAIT)
    return transport


@pytest.mark.parametrize("forced", [None, "nixl"])
def test_host_memory_between_processes_takes_nixl(forced):
    """Host memory of another process goes over NIXL; CUDA IPC is refused for it with the reason."""
    assert launch(_host_transfers_take_nixl, 2, forced) == ["nixl", "nixl"]


def _shared_host_memory_takes_shm(directory: str):
    """Each rank's inbox and outbox live in a file mapped MAP_SHARED; the ring's WRITEs and READs take shm,
    re-posted with new data, with a notification after the data; a private buffer still takes NIXL."""
    import os

    with tw.init(timeout=INIT_TIMEOUT) as comm:
        peer, previous = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
        path = os.path.join(directory, f"tensorwire-shm-test-{comm.rank}")
        shared = torch.from_file(path, shared=True, size=2 * 1024, dtype=torch.float32)
        inbox, outbox = shared[:1024], shared[1024:]
        private = sentinel(1024)
        transports = set()
        try:
            inbox.fill_(-1)
            with comm.register([shared, private]) as reg:
                comm.publish("shared", reg.descs[:1])
                remote = comm.lookup("shared", peer, timeout=WAIT)[0]
                with comm.prepare(tw.WRITE, private, remote.narrow(0, 4096), notify=b"written") as write, \
                        comm.prepare(tw.READ, private, remote.narrow(4096, 4096)) as read:
                    transports |= {write.transport, read.transport}
                    for round_ in range(3):
                        private.copy_(rank_values(comm.rank, 1024, offset=round_))
                        outbox.copy_(rank_values(comm.rank, 1024, offset=100 + round_))
                        comm.barrier(timeout=WAIT)
                        write.post()
                        write.wait(timeout=WAIT)
                        assert comm.wait_notification(previous, timeout=WAIT) == b"written"
                        assert_equal(inbox, rank_values(previous, 1024, offset=round_), f"round {round_}: WRITE")
                        comm.barrier(timeout=WAIT)
                        read.post()
                        read.wait(timeout=WAIT)
                        assert_equal(private, rank_values(peer, 1024, offset=100 + round_), f"round {round_}: READ")
                        comm.barrier(timeout=WAIT)
                comm.publish("private", reg.descs[1:])
                with comm.prepare(tw.WRITE, outbox, comm.lookup("private", peer, timeout=WAIT)[0]) as x:
                    transports.add(f"private:{x.transport}")
                comm.barrier(timeout=WAIT)
        finally:
            os.unlink(path)
    return sorted(transports)


def test_host_memory_in_a_shared_file_takes_shm(tmp_path):
    """Host memory that a peer maps from a shared file is copied through a mapping of the same file (UCX's
    process-to-process copy is slower); private memory keeps NIXL."""
    assert launch(_shared_host_memory_takes_shm, 2, str(tmp_path)) == [["private:nixl", "shm"]] * 2


def test_progress_engine_runs_watches_until_done_and_sleeps_when_idle():
    """Watches are polled from the engine's thread until they return True; no thread runs before work."""
    engine = ProgressEngine(Config(timeout_s=5, progress_wakeup_ms=10, spin_us=0, max_sleep_us=1000))
    assert engine._thread is None, "the progress thread must start lazily"
    polls, done = [], threading.Event()

    def watch() -> bool:
        polls.append(threading.current_thread().name)
        if len(polls) >= 3:
            done.set()
            return True
        return False

    engine.watch(watch)
    assert done.wait(5), "the engine never polled the watch to completion"
    time.sleep(0.05)
    assert len(polls) == 3, f"a finished watch was polled again ({len(polls)} polls)"
    assert set(polls) == {"tensorwire-progress"}
    engine.close()
    assert not engine._thread.is_alive()


def test_progress_engine_hands_a_failure_to_its_owner_only():
    """An exception inside a watch ends that watch and reaches its owner; other watches keep running and
    registering new ones never raises someone else's error."""
    engine = ProgressEngine(Config(timeout_s=5, progress_wakeup_ms=10, spin_us=0, max_sleep_us=1000))
    seen, later = [], threading.Event()

    def broken() -> bool:
        raise RuntimeError("boom")

    engine.watch(broken, on_error=seen.append)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [str(e) for e in seen] == ["boom"]
    assert not engine.still_watched([broken])
    engine.watch(lambda: later.set() or True)  # must not raise "boom"
    assert later.wait(5), "a watch registered after a failure never ran"
    engine.close()


def _crossed_writes_with_notify():
    """Both ranks post a 16 MiB WRITE with notify, then wait for the peer's notification without ever
    polling their own transfer: the notification must still be sent (the progress thread drives it)."""
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        n = 16 << 20
        src = torch.full((n,), comm.rank + 1, dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        peer = 1 - comm.rank
        with comm.register([src, dst]) as reg:
            comm.publish("dst", reg.descs[1:])
            with comm.prepare(tw.WRITE, src, comm.lookup("dst", peer, timeout=WAIT), notify=b"done") as x:
                comm.barrier(timeout=WAIT)
                x.post()
                assert comm.wait_notification(peer, timeout=WAIT) == b"done"
                assert bool((dst == peer + 1).all()), "the notification arrived before the data"
                x.wait(timeout=WAIT)
            comm.barrier(timeout=WAIT)
    return True


def test_notification_of_an_unpolled_write_is_still_sent():
    """Over TCP (transfers stay in flight after post), a sender busy waiting for its own notification
    still gets its WRITE's notification delivered to the peer."""
    assert launch(_crossed_writes_with_notify, 2, env={"UCX_TLS": "tcp"}) == [True, True]


class _LegacyDefaultStream:
    cuda_stream = 0


class _CuStreamLegacy:  # CUDA's named handle for the same stream
    cuda_stream = 1


def _stream_completions_published_per_post(rounds: int):
    """A NIXL transfer in flight after post() (UCX over TCP makes it asynchronous) waited with
    wait(stream=) on a host stand-in stream, round after round on one handle: the consumer launched behind
    each wait must see that round's bytes, and done_seq must have reached the round."""
    from tensorwire.stream_completion import DONE_SEQ

    with tw.init(timeout=INIT_TIMEOUT) as comm, HostStream() as stream:
        n = 1 << 24
        buffer = torch.zeros(2 * n, dtype=torch.uint8)
        seen, published = [], []
        if comm.rank == 1:
            buffer[:n].fill_(3)  # what rank 0 reads, every round
        with comm.register(buffer) as reg:
            comm.publish("buf", reg.descs)
            remote = comm.lookup("buf", 1 - comm.rank, timeout=WAIT)[0]
            comm.barrier(timeout=WAIT)
            if comm.rank == 0:
                with comm.prepare(tw.READ, buffer[n:], remote.narrow(0, n), transport="nixl") as x:
                    for _ in range(rounds):
                        buffer[n:].zero_()
                        x.post()
                        x.wait(stream=stream)
                        stream.launch(lambda: seen.append(int(buffer[n:].sum(dtype=torch.int64))))
                        stream.launch(lambda: published.append(int(x._streams().words.values[DONE_SEQ])))
                        stream.synchronize(WAIT)
            comm.barrier(timeout=WAIT)
    return seen, published


def test_a_stream_waits_for_each_post_of_a_nixl_transfer():
    """Every round's done_seq is published only once that round's bytes are there, and each
    wait(stream=) waits for exactly its own round."""
    rounds = 5
    seen, published = launch(_stream_completions_published_per_post, 2, rounds, env={"UCX_TLS": "tcp"})[0]
    assert seen == [3 * (1 << 24)] * rounds
    assert published == list(range(1, rounds + 1))


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(1e-4)


def _stream_waits_are_bounded():
    """Stream waits of NIXL transfers (UCX over TCP: in flight after post) on a host stand-in stream.
    Returns what rank 0 saw: the legacy default stream refused for waits and posts without losing anything,
    a stream released with an error once its own wait's timeout passed (and a later CPU wait not cut short by
    it), and a doorbell (stream post) that timed out leaving the handle failed but every ring answered."""
    from tensorwire.stream_completion import DONE_FLAG, DONE_SEQ, DOORBELL

    seen = {}
    with tw.init(timeout=INIT_TIMEOUT) as comm, HostStream() as side:
        n = 1 << 26
        buffer = torch.zeros(2 * n, dtype=torch.uint8)
        if comm.rank == 1:
            buffer[:n].fill_(3)
        with comm.register(buffer) as reg:
            comm.publish("buf", reg.descs)
            remote = comm.lookup("buf", 1 - comm.rank, timeout=WAIT)[0].narrow(0, n)
            comm.barrier(timeout=WAIT)
            if comm.rank == 0:
                local = buffer[n:]
                expected = 3 * n

                def landed() -> bool:
                    return int(local.sum(dtype=torch.int64)) == expected

                with comm.prepare(tw.READ, local, remote, transport="nixl") as x:
                    words = x._streams().words
                    x.post()
                    with pytest.raises(tw.InvalidArgumentError, match="legacy default stream") as refused:
                        x.wait(stream=_LegacyDefaultStream())
                    with pytest.raises(tw.InvalidArgumentError, match="legacy default stream"):
                        x.wait(stream=_CuStreamLegacy())
                    seen["refused"] = str(refused.value)
                    x.wait(timeout=WAIT)  # the post was not lost
                    seen["read_after_refusal"] = landed()

                    local.zero_()
                    with pytest.raises(tw.InvalidArgumentError, match="legacy default stream"):
                        x.post(stream=_LegacyDefaultStream())
                    x.post()  # still a CPU-posted handle
                    x.wait(timeout=WAIT)
                    seen["read_after_post_refusal"] = landed()

                    local.zero_()
                    x.post()
                    x.wait(stream=side, timeout=WAIT)  # completes in time: from now on each post publishes
                    _until(lambda: words.values[DONE_SEQ] == 3, "round 3: the stream was never released")
                    seen["in_time"] = landed()

                    local.zero_()
                    x.post()
                    x.wait(stream=side, timeout=1e-4)  # this post's own wait bounds its publisher
                    _until(lambda: words.values[DONE_SEQ] == 4, "round 4: the stream was never released")
                    with pytest.raises(tw.WaitTimeoutError, match="stream was released") as late:
                        _until(lambda: x.status() is None, "round 4: the timeout never reached the handle")
                    seen["cpu_post_timeout"] = str(late.value)
                    _until(lambda: x.status() is tw.Status.DONE, "round 4: the READ never completed")

                    local.zero_()
                    x.post()  # no stream waits for this one: round 4's short timeout must not cut it short
                    x.wait(timeout=WAIT)
                    seen["cpu_wait_after_timeout"] = landed()
                    side.synchronize(WAIT)

                with comm.prepare(tw.READ, local, remote, transport="nixl") as z:  # one wait per stream post
                    local.zero_()
                    z.post(stream=side)
                    with pytest.raises(tw.InvalidArgumentError, match="was not waited"):
                        z.post(stream=side)
                    z.wait(stream=side)
                    with pytest.raises(tw.InvalidArgumentError, match="already waited on"):
                        z.wait(stream=side)
                    side.synchronize(WAIT)
                    seen["one_wait_per_stream_post"] = landed()

                with comm.prepare(tw.READ, local, remote, transport="nixl") as y:
                    words = y._streams().words
                    local.zero_()
                    y.post(stream=side)
                    _until(lambda: words.values[DONE_FLAG] == 1, "the first ring was never served")
                    y.wait(stream=side, timeout=1e-4)  # bounds the rings that follow
                    side.synchronize(WAIT)
                    seen["first_ring"] = landed()
                    local.zero_()
                    y.post(stream=side)
                    _until(lambda: words.values[DONE_FLAG] == 1, "the timed-out ring's stream was never released")
                    with pytest.raises(tw.WaitTimeoutError, match="post\\(stream=\\)") as late:
                        y.wait(stream=side)
                    seen["doorbell_timeout"] = str(late.value)
                    for call in (lambda: y.post(stream=side), y.status):  # the handle stays failed
                        with pytest.raises(tw.WaitTimeoutError, match="close it and prepare a new one"):
                            call()
                    _until(landed, "the stuck READ never landed")
                    local.zero_()
                    words.values[DONE_FLAG] = 0
                    side.write_value(words.addr(DOORBELL), 1)  # a captured graph replaying rings without Python
                    _until(lambda: words.values[DONE_FLAG] == 1 and words.values[DOORBELL] == 0,
                           "a ring after the timeout was never answered")
                    time.sleep(0.1)  # a READ posted for that ring would land meanwhile (64 MiB over TCP: ~50 ms)
                    seen["doorbell_answered_after_timeout"] = int(local.sum(dtype=torch.int64)) == 0  # nothing moved
            comm.barrier(timeout=6 * WAIT)  # rank 1 waits here for all of rank 0's rounds (64 MiB each, over TCP)
    return seen


def _stream_waits_released_while_progress_is_stuck():
    """Rank 0's progress thread is held inside a backend call (as UCX's staged copies into GPU memory can be:
    docs/architecture.md, Known limits) while host stand-in streams wait: a stream waiting for a CPU post, a
    doorbell's stream and a stream waiting for a notification that never comes must each be released once
    their own timeout passes, with the error reaching the next call, and everything must work again afterwards."""
    from tensorwire.stream_completion import DONE_FLAG

    seen = {}
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        n = 1 << 24
        buffer = torch.zeros(2 * n, dtype=torch.uint8)
        buffer[:n].fill_(comm.rank + 1)
        with comm.register(buffer) as reg:
            comm.publish("buf", reg.descs)
            remote = comm.lookup("buf", 1 - comm.rank, timeout=WAIT)[0].narrow(0, n)
            comm.barrier(timeout=WAIT)
            if comm.rank == 0:
                local, backend = buffer[n:], comm.runtime.transports["nixl"]
                unstick, stuck_calls = threading.Event(), []

                def stuck_in_progress_thread(call):
                    def status(request):
                        if threading.current_thread().name == "tensorwire-progress":
                            stuck_calls.append(call)
                            unstick.wait(3 * WAIT)  # a status call that returns only once the GPU moves on
                        return call(request)
                    return status

                def released_while_stuck(post_on_stream: bool) -> bool:
                    """A fresh handle posted (on a stream or from the CPU) and waited on a stream: released by
                    its 0.2 s timeout, with the error on the next call."""
                    with comm.prepare(tw.READ, local, remote, transport="nixl") as t, HostStream() as stream:
                        t.post(stream=stream) if post_on_stream else t.post()
                        t.wait(stream=stream, timeout=0.2)
                        stream.synchronize(WAIT)  # released
                        released = not unstick.is_set()
                        with pytest.raises(tw.WaitTimeoutError, match="stream was released"):
                            t.status()
                    return released

                try:
                    with comm.prepare(tw.READ, local, remote, transport="nixl") as y, HostStream() as side:
                        words = y._streams().words  # a doorbell: served, then stuck
                        y.post(stream=side)
                        _until(lambda: words.values[DONE_FLAG] == 1, "the first ring was never served")
                        y.wait(stream=side, timeout=0.2)  # bounds the next ring; consumes the flag
                        side.synchronize(WAIT)
                        backend.status = stuck_in_progress_thread(type(backend).status.__get__(backend))
                        y.post(stream=side)
                        _until(lambda: words.values[DONE_FLAG] == 1, "a doorbell's stream was never released")
                        seen["ring_released_while_stuck"] = bool(stuck_calls) and not unstick.is_set()
                        with pytest.raises(tw.WaitTimeoutError, match="close it and prepare a new one"):
                            y.post(stream=side)
                    # The progress thread is still held: a CPU post's stream wait, then a ring it never picks up.
                    seen["wait_released_while_stuck"] = released_while_stuck(post_on_stream=False)
                    seen["unpicked_ring_released_while_stuck"] = released_while_stuck(post_on_stream=True)
                    with HostStream() as stream:
                        comm.wait_notification(1, stream=stream, timeout=0.2)
                        comm.wait_notification(1, stream=stream, timeout=60)  # must not stretch the first
                        words, slot = comm._notifications._words, comm._notifications._slots[1]  # rank 1's word
                        _until(lambda: words.values[slot] == 1, "a notification's stream wait was never released")
                        time.sleep(0.3)
                        seen["notification_released_while_stuck"] = not unstick.is_set() and words.values[slot] == 1
                        with pytest.raises(tw.WaitTimeoutError, match="nothing from rank 1"):
                            comm.wait_notification(1, timeout=WAIT)
                finally:  # a failure above must not leave the progress thread held
                    unstick.set()
                del backend.status
                with comm.prepare(tw.READ, local, remote, transport="nixl") as z:  # all works again
                    local.zero_()
                    z.post()
                    z.wait(timeout=WAIT)
                    seen["read_after"] = int(local.sum(dtype=torch.int64)) == 2 * n
            comm.barrier(timeout=3 * WAIT)
    return seen


def test_stream_waits_are_released_on_time_while_the_progress_thread_is_stuck():
    """Stream timeouts fire from their own thread: a progress thread held inside a backend call (UCX can wait
    there for the very stream the timeout releases) delays none of them."""
    seen = launch(_stream_waits_released_while_progress_is_stuck, 2, env={"UCX_TLS": "tcp"})[0]
    assert seen == {"wait_released_while_stuck": True, "ring_released_while_stuck": True,
                    "unpicked_ring_released_while_stuck": True, "notification_released_while_stuck": True,
                    "read_after": True}, seen


@pytest.mark.slow
def test_stream_waits_refuse_the_legacy_default_stream_and_time_out():
    """CPU-driven transfers refuse the legacy default stream (for waits and posts, losing nothing); a stream
    waiting for a CPU post is released with a WaitTimeoutError once that wait's timeout passed, which does not
    bound later CPU waits; a stream post's doorbell that timed out leaves the handle failed (every call raises)
    while later rings are still answered."""
    seen = launch(_stream_waits_are_bounded, 2, env={"UCX_TLS": "tcp"})[0]
    assert "side stream" in seen["refused"] and seen["read_after_refusal"] and seen["read_after_post_refusal"], seen
    assert seen["in_time"] and seen["cpu_wait_after_timeout"], seen
    assert "not done after 0.0001s" in seen["cpu_post_timeout"], seen
    assert seen["first_ring"] and seen["one_wait_per_stream_post"], seen
    assert "post(stream=)" in seen["doorbell_timeout"] and "0.0001s" in seen["doorbell_timeout"], seen
    assert seen["doorbell_answered_after_timeout"], seen
