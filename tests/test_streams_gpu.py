"""Completion without the CPU on GPU memory: wait(stream=), post(stream=), CUDA-graph capture,
wait_notification(stream=), and the transport chosen between two processes sharing a GPU.

Every GPU wait in these tests is bounded: the host polls an event with a deadline instead of
synchronizing, so a stream that never gets released fails the test instead of hanging it.
"""

from __future__ import annotations

import time

import pytest
import torch

import tensorwire as tw
from conftest import INIT_TIMEOUT, WAIT, launch

pytestmark = pytest.mark.gpu

GPU_ENV = {"CUDA_MODULE_LOADING": "EAGER"}  # lazy module loading can deadlock against a blocked stream


def _finish(stream: torch.cuda.Stream, seconds: float = 30.0) -> None:
    """Wait (bounded) until everything enqueued on ``stream`` so far has run."""
    event = torch.cuda.Event()
    event.record(stream)
    deadline = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the GPU stream did not drain within {seconds}s: a stream wait was never released")
        time.sleep(1e-4)


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
            comm.barrier(WAIT)
    return seen


def test_gpu_memory_on_one_host_takes_cuda_ipc():
    """Same host + GPU memory -> cuda_ipc by default; nixl when forced; own memory -> local copy."""
    for seen in launch(_transports_between_processes_on_one_gpu, 2, env=GPU_ENV):
        assert seen == {None: "cuda_ipc", "nixl": "nixl", "cuda_ipc": "cuda_ipc", "self": "local"}, seen


def _graph_replays(transport: str, replays: int):
    """Rank 0 captures READ(post+wait on the stream) + a consumer kernel; rank 1 changes its data each round."""
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        n = 1 << 18
        buf = torch.zeros(n, dtype=torch.int32, device=comm.device)
        recv = torch.zeros(n, dtype=torch.int32, device=comm.device)
        result = torch.zeros(n, dtype=torch.int32, device=comm.device)
        correct = 0
        with comm.register([buf, recv]) as reg:
            comm.publish("buf", reg.descs[:1])
            if comm.rank == 0:
                x = comm.prepare(tw.READ, recv, comm.lookup("buf", 1, timeout=WAIT), transport=transport)
                assert x.transport == transport
                result.copy_(recv).add_(1)  # run every kernel once before any stream waits
                torch.cuda.synchronize()
                stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    x.post(stream=stream)
                    x.wait(stream=stream)
                    result.copy_(recv).add_(1)
                comm.barrier(WAIT)
                for i in range(replays):
                    comm.barrier(WAIT)  # rank 1 wrote round i's data
                    graph.replay()
                    _finish(stream)
                    correct += bool((result == i * 7 + 1).all())
                    comm.barrier(WAIT)
                x.close()
            else:
                comm.barrier(WAIT)
                for i in range(replays):
                    buf.fill_(i * 7)
                    torch.cuda.synchronize()
                    comm.barrier(WAIT)
                    comm.barrier(WAIT)
            comm.barrier(WAIT)
    return correct


@pytest.mark.parametrize("transport", ["cuda_ipc", "nixl"])
def test_cuda_graph_replays_move_new_data_every_time(transport):
    """post(stream)+wait(stream)+consumer captured once, replayed 1,000 times, every replay verified."""
    replays = 1000
    assert launch(_graph_replays, 2, transport, replays, timeout=300, env=GPU_ENV)[0] == replays


def _wait_on_stream_orders_the_consumer(transport: str):
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        n = 1 << 28  # 1 GiB of int32
        big = torch.full((n,), 5 if comm.rank == 1 else 0, dtype=torch.int32, device=comm.device)
        returns_us = []
        with comm.register(big) as reg:
            comm.publish("big", reg.descs)
            torch.cuda.synchronize()
            comm.barrier(WAIT)
            if comm.rank == 0:
                stream = torch.cuda.current_stream()
                with comm.prepare(tw.READ, big, comm.lookup("big", 1, timeout=WAIT), transport=transport) as x:
                    for _ in range(3):
                        big.zero_()
                        torch.cuda.synchronize()  # a CPU post (nixl) must not race the zeroing
                        x.post(stream=stream) if transport != "nixl" else x.post()
                        t0 = time.perf_counter()
                        x.wait(stream=stream)
                        returns_us.append((time.perf_counter() - t0) * 1e6)
                        total = big.sum(dtype=torch.int64)  # the consumer, ordered after the transfer
                        _finish(stream, 60)
                        assert int(total) == 5 * n, f"consumer ran before the data arrived: sum {int(total)}"
            comm.barrier(WAIT)
    return returns_us


@pytest.mark.parametrize("transport", ["cuda_ipc", "nixl"])
def test_wait_on_stream_returns_at_once_and_orders_the_consumer(transport):
    """wait(stream=) returns to the CPU at once; a kernel after it sees the whole 1 GiB."""
    returns_us = launch(_wait_on_stream_orders_the_consumer, 2, transport, timeout=300, env=GPU_ENV)[0]
    print(f"wait(stream=) returned after {returns_us} us ({transport})")
    assert min(returns_us) < 1000, returns_us  # bounded far below the ~0.6 ms the transfer itself takes


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
                stream = torch.cuda.current_stream()
                comm.barrier(WAIT)
                for i in range(rounds):
                    comm.wait_notification(1, stream=stream)
                    result.copy_(recv)
                    comm.barrier(WAIT)  # only now does rank 1 write
                    _finish(stream)
                    correct += bool((result == i + 3).all())
                    comm.barrier(WAIT)
            else:
                with comm.prepare(tw.WRITE, src, comm.lookup("recv", 0, timeout=WAIT), notify=b"go",
                                  transport=transport) as x:
                    comm.barrier(WAIT)
                    for i in range(rounds):
                        comm.barrier(WAIT)
                        src.fill_(i + 3)
                        torch.cuda.synchronize()
                        x.post()
                        x.wait(WAIT)
                        comm.barrier(WAIT)
            comm.barrier(WAIT)
    return correct


@pytest.mark.parametrize("transport", ["cuda_ipc", "nixl"])
def test_wait_notification_on_stream_releases_the_consumer(transport):
    """The target's stream waits for the peer's WRITE+notify; the consumer kernel sees that round's data."""
    rounds = 20
    assert launch(_notification_on_stream, 2, transport, rounds, timeout=200, env=GPU_ENV)[0] == rounds
