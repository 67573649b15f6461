"""Completion without the CPU on GPU memory: wait(stream=), post(stream=), CUDA-graph capture,
wait_notification(stream=), and the transport chosen between two processes sharing a GPU.

Every GPU wait in these tests is bounded: the host polls an event with a deadline instead of
synchronizing, so a stream that never gets released fails the test instead of hanging it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.testing.data import assert_equal
from tensorwire.testing.suite import GPU_ENV, INIT_TIMEOUT, WAIT, drain, launch

pytestmark = pytest.mark.gpu


def _transports_between_processes_on_one_gpu():
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        buf = torch.zeros(1 << 16, dtype=torch.uint8, device=comm.device)
        with comm.register(buf) as reg:
            comm.publish("buf", reg.descs)
            peer = (comm.rank + 1) % comm.world_size
            remote = comm.lookup("buf", peer, timeout=WAIT)
            seen = {}
            for forced in (None, "nixl", "cuda_ipc"):
                with comm.prepare(tw.READ, buf, remote, transport=forced) as x:
                    seen[forced] = x.transport
            with comm.prepare(tw.READ, buf[:10], reg.descs[0].narrow(100, 10)) as x:
                seen["self"] = x.transport
            comm.barrier(timeout=WAIT)
    return seen


def test_gpu_memory_on_one_host_takes_cuda_ipc():
    """Same host + GPU memory -> cuda_ipc by default; nixl when forced; own memory -> local copy."""
    for seen in launch(_transports_between_processes_on_one_gpu, 2, env=GPU_ENV):
        assert seen == {None: "cuda_ipc", "nixl": "nixl", "cuda_ipc": "cuda_ipc", "self": "local"}, seen


def _graph_replays(transport: str, op_name: str, replays: int):
    """Rank 0 captures post(stream)+wait(stream) and a kernel on each side of it, then replays with new data.

    READ: rank 1 writes round i's data into its buffer; rank 0's graph reads it and a consumer kernel
    derives ``result`` from it. WRITE: rank 0's graph produces round i's data from a staging tensor set
    before the replay and writes it into rank 1's inbox, which rank 1 checks. Returns the correct rounds.
    """
    op = tw.READ if op_name == "READ" else tw.WRITE
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        n = 1 << 18
        mine = torch.zeros(n, dtype=torch.int32, device=comm.device)  # rank 1: READ source / WRITE inbox
        local = torch.zeros(n, dtype=torch.int32, device=comm.device)  # rank 0: READ target / WRITE source
        derived = torch.zeros(n, dtype=torch.int32, device=comm.device)
        staging = torch.zeros(n, dtype=torch.int32, device=comm.device)
        correct = 0
        with comm.register([mine, local]) as reg:
            comm.publish("mine", reg.descs[:1])
            if comm.rank == 0:
                x = comm.prepare(op, local, comm.lookup("mine", 1, timeout=WAIT), transport=transport)
                assert x.transport == transport
                derived.copy_(local).add_(1)  # run every kernel once before any stream waits
                local.copy_(staging)
                torch.cuda.synchronize()
                stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    if op is tw.WRITE:
                        local.copy_(staging)  # the producer kernel
                    x.post(stream=stream)
                    x.wait(stream=stream)
                    derived.copy_(local).add_(1)  # the consumer kernel
                comm.barrier(timeout=WAIT)
                for i in range(replays):
                    comm.barrier(timeout=WAIT)  # READ: rank 1 wrote round i's data
                    with torch.cuda.stream(stream):  # the replay is ordered after the new data, on one stream
                        staging.fill_(i * 7)
                        graph.replay()
                    drain(stream)
                    correct += bool((derived == i * 7 + 1).all())
                    comm.barrier(timeout=WAIT)  # WRITE: rank 1 may check now
                    comm.barrier(timeout=WAIT)
                x.close()
            else:
                comm.barrier(timeout=WAIT)
                for i in range(replays):
                    if op is tw.READ:
                        mine.fill_(i * 7)
                        torch.cuda.synchronize()
                    comm.barrier(timeout=WAIT)
                    comm.barrier(timeout=WAIT)
                    if op is tw.WRITE:
                        correct += bool((mine == i * 7).all())
                    comm.barrier(timeout=WAIT)
            comm.barrier(timeout=WAIT)
    return correct


@pytest.mark.parametrize("transport, op_name", [
    ("cuda_ipc", "READ"),
    ("cuda_ipc", "WRITE"),
    ("nixl", "WRITE"),
    ("nixl", "READ"),  # UCX moves it by TCP emulation on one GPU ('tensorwire doctor'): slow, still exact
])
def test_cuda_graph_replays_move_new_data_every_time(transport, op_name):
    """post(stream)+wait(stream) between a producer and a consumer kernel, captured once, replayed 1,000
    times with new data, every replay verified (READ on rank 0, WRITE on rank 1)."""
    replays = 1000
    results = launch(_graph_replays, 2, transport, op_name, replays, timeout=300, env=GPU_ENV)
    assert results[0 if op_name == "READ" else 1] == replays
    if op_name == "WRITE":
        assert results[0] == replays  # rank 0's own consumer saw its source too


def _wait_on_stream_orders_the_consumer(transport: str, op_name: str):
    """READ: a kernel after wait(stream=) sums the 1 GiB that arrived. WRITE: a kernel after wait(stream=)
    zeroes the 1 GiB source, and the target must still have received every byte of it."""
    op = tw.READ if op_name == "READ" else tw.WRITE
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        n = 1 << 28  # 1 GiB of int32
        source_rank = 1 if op is tw.READ else 0
        big = torch.full((n,), 5 if comm.rank == source_rank else 0, dtype=torch.int32, device=comm.device)
        returns_us, received = [], []
        with comm.register(big) as reg:
            comm.publish("big", reg.descs)
            torch.cuda.synchronize()
            comm.barrier(timeout=WAIT)
            stream = torch.cuda.Stream()  # not the legacy default stream: a nixl wait is refused there
            for _ in range(3):
                if comm.rank == 0:
                    with comm.prepare(op, big, comm.lookup("big", 1, timeout=WAIT), transport=transport) as x:
                        if op is tw.READ:
                            big.zero_()
                        else:
                            big.fill_(5)
                        torch.cuda.synchronize()  # a CPU post (nixl) must not race the kernel above
                        x.post(stream=stream) if transport != "nixl" else x.post()
                        t0 = time.perf_counter()
                        x.wait(stream=stream)
                        returns_us.append((time.perf_counter() - t0) * 1e6)
                        with torch.cuda.stream(stream):
                            if op is tw.READ:
                                total = big.sum(dtype=torch.int64)  # the consumer, ordered after the transfer
                            else:
                                big.zero_()  # reuses the source: only safe once the WRITE is complete
                        drain(stream, 60)
                    if op is tw.READ:
                        assert int(total) == 5 * n, f"consumer ran before the data arrived: sum {int(total)}"
                comm.barrier(timeout=60)
                if comm.rank == 1 and op is tw.WRITE:
                    received.append(int(big.sum(dtype=torch.int64)))
                    big.zero_()
                    torch.cuda.synchronize()
                comm.barrier(timeout=60)
    return returns_us if comm.rank == 0 else received


@pytest.mark.parametrize("transport, op_name", [("cuda_ipc", "READ"), ("cuda_ipc", "WRITE"), ("nixl", "WRITE")])
def test_wait_on_stream_returns_at_once_and_orders_the_consumer(transport, op_name):
    """wait(stream=) returns to the CPU at once; the kernel after it runs only once the 1 GiB has moved."""
    results = launch(_wait_on_stream_orders_the_consumer, 2, transport, op_name, timeout=300, env=GPU_ENV)
    returns_us = results[0]
    print(f"wait(stream=) returned after {returns_us} us ({transport} {op_name})")
    assert min(returns_us) < 1000, returns_us  # far below the ~0.6 ms the 1 GiB transfer itself takes
    if op_name == "WRITE":
        assert results[1] == [5 * (1 << 28)] * 3, f"the target received {results[1]}: the source was reused too early"


def _staged_read_with_a_consumer_behind_its_stream_wait(rounds: int):
    """Rank 0 READs 4 MiB of rank 1's GPU memory over NIXL (UCX stages it through host buffers between two
    processes on one GPU), posts from the CPU, waits on a side stream with a 3 s timeout and queues a first,
    never-run reduction behind the wait. UCX's unpacking copy can then wait for that stream (docs/architecture.md,
    Known limits). Each round: the stream must drain in bounded time and the sum must be right, unless the
    handle reported the timeout; then the handle must still work from the CPU."""
    outcomes = []
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        n = 1 << 20
        buf = torch.full((n,), 5 if comm.rank == 1 else 0, dtype=torch.int32, device=comm.device)
        torch.cuda.synchronize()
        with comm.register(buf) as reg:
            comm.publish("buf", reg.descs)
            comm.barrier(timeout=WAIT)
            if comm.rank == 0:
                stream = torch.cuda.Stream()
                with comm.prepare(tw.READ, buf, comm.lookup("buf", 1, timeout=WAIT), transport="nixl") as x:
                    for _ in range(rounds):
                        buf.zero_()
                        torch.cuda.synchronize()
                        x.post()
                        x.wait(stream=stream, timeout=3.0)
                        with torch.cuda.stream(stream):
                            total = buf.sum(dtype=torch.int64)
                        drain(stream, 60)
                        try:
                            x.wait(timeout=WAIT)
                            outcomes.append("right" if int(total) == 5 * n else f"wrong sum {int(total)}, no error")
                        except tw.WaitTimeoutError as e:
                            assert "stream was released" in str(e), e
                            outcomes.append("released by its timeout")
                            x.wait(timeout=WAIT)  # the READ itself completes once the stream moved on
                        buf.zero_()
                        torch.cuda.synchronize()
                        x.post()
                        x.wait(timeout=WAIT)
                        assert int(buf.sum(dtype=torch.int64)) == 5 * n, "the handle no longer reads right"
            comm.barrier(timeout=3 * WAIT)
    return outcomes


def test_a_stream_wait_on_a_staged_nixl_read_is_bounded():
    """The stream drains in bounded time even where UCX's staged copy waits for it; a consumer never reads
    wrong bytes silently: either the sum is right or the handle raised WaitTimeoutError."""
    outcomes = launch(_staged_read_with_a_consumer_behind_its_stream_wait, 2, 3, timeout=200, env=GPU_ENV)[0]
    print(f"staged nixl READ with a consumer behind its stream wait: {outcomes}")
    assert len(outcomes) == 3 and all(o in ("right", "released by its timeout") for o in outcomes), outcomes


def _notification_on_stream(transport: str, rounds: int):
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        n = 1 << 18
        recv = torch.zeros(n, dtype=torch.int32, device=comm.device)
        src = torch.zeros(n, dtype=torch.int32, device=comm.device)
        result = torch.zeros(n, dtype=torch.int32, device=comm.device)
        correct = 0
        with comm.register([recv, src]) as reg:
            comm.publish("recv", reg.descs[:1])
            result.copy_(recv)
            torch.cuda.synchronize()
            if comm.rank == 0:
                stream = torch.cuda.Stream()
                comm.barrier(timeout=WAIT)
                for i in range(rounds):
                    comm.wait_notification(1, stream=stream)
                    with torch.cuda.stream(stream):
                        result.copy_(recv)
                    comm.barrier(timeout=WAIT)  # only now does rank 1 write
                    drain(stream)
                    correct += bool((result == i + 3).all())
                    comm.barrier(timeout=WAIT)
            else:
                with comm.prepare(tw.WRITE, src, comm.lookup("recv", 0, timeout=WAIT), notify=b"go",
                                  transport=transport) as x:
                    comm.barrier(timeout=WAIT)
                    for i in range(rounds):
                        comm.barrier(timeout=WAIT)
                        src.fill_(i + 3)
                        torch.cuda.synchronize()
                        x.post()
                        x.wait(timeout=WAIT)
                        comm.barrier(timeout=WAIT)
            comm.barrier(timeout=WAIT)
    return correct


@pytest.mark.parametrize("transport", ["cuda_ipc", "nixl"])
def test_wait_notification_on_stream_releases_the_consumer(transport):
    """The target's stream waits for the peer's WRITE+notify; the consumer kernel sees that round's data."""
    rounds = 20
    assert launch(_notification_on_stream, 2, transport, rounds, timeout=200, env=GPU_ENV)[0] == rounds


def _peer_pointer_reads_the_peers_bytes():
    from tensorwire import cuda

    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        n = 1 << 16
        mine = torch.full((n,), comm.rank + 7, dtype=torch.uint8, device=comm.device)
        with comm.register(mine) as reg:
            comm.publish("mine", reg.descs)
            torch.cuda.synchronize()
            comm.barrier(timeout=WAIT)
            peer = 1 - comm.rank
            remote = comm.lookup("mine", peer, timeout=WAIT)[0].narrow(1024, 4096)
            pointer = comm.peer_pointer(remote)
            host = torch.zeros(4096, dtype=torch.uint8).pin_memory()
            cu = cuda.driver()
            cuda.check(cu.cuMemcpyDtoH(host.data_ptr(), pointer, 4096), "cuMemcpyDtoH")
            assert comm.peer_pointer(reg.descs[0]) == mine.data_ptr()
            comm.barrier(timeout=WAIT)
    return int(host.min()), int(host.max())


def test_peer_pointer_maps_a_same_host_peers_range():
    """peer_pointer gives a device pointer in this process to a peer's registered GPU bytes."""
    results = launch(_peer_pointer_reads_the_peers_bytes, 2, env=GPU_ENV)
    assert results == [(8, 8), (7, 7)], results


def _transfers_from_a_fresh_thread():
    """A thread that has made no CUDA call (a serving engine's loader thread) prepares and posts a READ and a block
    READ of the peer's GPU memory; the driver has no context on such a thread until tensorwire binds one."""
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        peer = 1 - comm.rank
        mine = torch.full((1 << 16,), comm.rank + 1, dtype=torch.uint8, device=comm.device)
        got = torch.zeros_like(mine)
        blocks = torch.full((8, 1024), comm.rank + 1, dtype=torch.int32, device=comm.device)
        torch.cuda.synchronize()
        with comm.register([mine, got]) as reg, comm.register_blocks(blocks) as pool:
            comm.publish("mine", reg.descs[:1])
            comm.publish_blocks("pool", pool)
            remote = comm.lookup("mine", peer, timeout=WAIT)
            remote_pool = comm.lookup_blocks("pool", peer, timeout=WAIT)
            comm.barrier(timeout=WAIT)
            outcome = {}

            def worker():
                try:
                    with comm.prepare(tw.READ, got, remote[0]) as read:
                        read.post()
                        read.wait(timeout=WAIT)
                        outcome["transport"] = read.transport
                    with comm.prepare_blocks(tw.READ, pool, remote_pool) as block_read:
                        block_read.post([0, 1], [6, 7])
                        block_read.wait(timeout=WAIT)
                except Exception as e:  # reported to the test, which names it
                    outcome["error"] = f"{type(e).__name__}: {e}"

            thread = threading.Thread(target=worker)
            thread.start()
            thread.join(timeout=60)
            assert not thread.is_alive(), "the transfer thread did not finish"
            assert "error" not in outcome, outcome["error"]
            assert outcome["transport"] == "cuda_ipc", outcome
            assert_equal(got, torch.full_like(got, peer + 1), "READ from a fresh thread")
            assert_equal(blocks[:2], torch.full((2, 1024), peer + 1, dtype=torch.int32, device=comm.device),
                         "block READ from a fresh thread")
            assert_equal(blocks[2:], torch.full((6, 1024), comm.rank + 1, dtype=torch.int32, device=comm.device),
                         "blocks not named by the READ")
            comm.barrier(timeout=WAIT)
    return True


def test_a_thread_that_never_used_cuda_prepares_and_posts():
    """vLLM's connector loads from a thread of its own: cuda_ipc's IPC mapping, copies and the block kernel work
    there (they failed with CUDA_ERROR_INVALID_CONTEXT)."""
    assert launch(_transfers_from_a_fresh_thread, 2, env=GPU_ENV) == [True, True]
