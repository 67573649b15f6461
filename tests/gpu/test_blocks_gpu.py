"""KV-cache block transfers of GPU memory: the Triton kernel in one process (``local``) and between two
processes sharing a GPU (``cuda_ipc``), NIXL forced, host and device ids, and a 10k-block post captured in
a CUDA graph and replayed with new ids. Every result is compared with plain indexing; every GPU wait is
bounded (an event polled with a deadline).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.testing.suite import GPU_ENV, INIT_TIMEOUT, WAIT, drain, launch

pytestmark = pytest.mark.gpu


def pool(rank: int, num_blocks: int, shapes, device, dtype=torch.int32) -> list[torch.Tensor]:
    """Views ``[num_blocks, *shape]`` whose values encode (rank, view, block, index in block)."""
    views = []
    for i, shape in enumerate(shapes):
        per_block = int(np.prod(shape))
        values = torch.arange(num_blocks * per_block, dtype=torch.int64, device=device).view(num_blocks, *shape)
        views.append(((values + (rank * 16 + i) * 7919) % 2**31).to(dtype) if dtype != torch.uint8
                     else (values * 31 + rank * 7 + i).to(torch.uint8))
    return views


def check(got: list[torch.Tensor], before: list[torch.Tensor], source: list[torch.Tensor], dst_ids, src_ids, what: str):
    dst_ids, src_ids = (torch.as_tensor(x, device=got[0].device).long() for x in (dst_ids, src_ids))
    for i, (g, b, s) in enumerate(zip(got, before, source)):
        want = b.clone()
        want[dst_ids] = s[src_ids]
        assert torch.equal(g, want), f"{what}: view {i} differs from plain indexing"


@pytest.fixture
def comm():
    with tw.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=tw.testing.free_port(),
                 timeout=INIT_TIMEOUT) as comm:
        yield comm


@pytest.mark.parametrize("dtype, shapes", [
    (torch.int32, [(2, 16, 8, 16), (64,)]),  # aligned: 128-bit words
    (torch.uint8, [(6,), (3, 5)]),  # 6- and 15-byte blocks: byte words
])
def test_local_gpu_blocks_host_and_device_ids(comm, dtype, shapes):
    device = comm.device
    num_blocks = 300
    source = pool(0, num_blocks, shapes, device, dtype)
    target = pool(1, num_blocks, shapes, device, dtype)
    rng = np.random.default_rng(0)
    with comm.register_blocks(source) as src_pool, comm.register_blocks(target) as dst_pool:
        with comm.prepare_blocks(tw.READ, dst_pool, src_pool.desc) as x:
            assert x.transport == "local"
            for ids_on in ("host", "device32", "device64"):
                dst_ids, src_ids = rng.permutation(num_blocks)[:200], rng.integers(0, num_blocks, 200)
                if ids_on != "host":
                    kind = torch.int32 if ids_on == "device32" else torch.int64
                    dst_ids, src_ids = (torch.as_tensor(a, dtype=kind, device=device) for a in (dst_ids, src_ids))
                before = [t.clone() for t in target]
                x.post(dst_ids, src_ids)
                x.wait(timeout=WAIT)
                check(target, before, source, dst_ids, src_ids, f"local READ, {ids_on} ids")
        with comm.prepare_blocks(tw.WRITE, src_pool, dst_pool.desc) as x:
            before = [t.clone() for t in target]
            bad = torch.tensor([num_blocks, -1, 5], device=device)  # on the device: the kernel skips 0 and 1
            x.post(torch.tensor([7, 8, 9], device=device), bad)
            x.wait(timeout=WAIT)
            check(target, before, source, [5], [9], "out-of-range device ids move nothing")


def test_repeated_posts_of_every_id_count_and_alignment(comm):
    """Posts after the first launch go straight to Triton's compiled kernel (kept per id dtype and alignment):
    every count of host ids (their staged device copies land at different alignments) and device ids sliced
    off by one element must still move exactly the blocks plain indexing names."""
    device, num_blocks = comm.device, 300
    source, target = pool(0, num_blocks, [(64,)], device), pool(1, num_blocks, [(64,)], device)
    rng = np.random.default_rng(3)
    with comm.register_blocks(source) as src_pool, comm.register_blocks(target) as dst_pool, \
            comm.prepare_blocks(tw.READ, dst_pool, src_pool.desc) as x:
        for n in (1, 3, 4, 5, 17, 200, 2, 4):
            for ids_on in ("host", "device, offset by one"):
                dst_ids, src_ids = rng.permutation(num_blocks)[:n + 1], rng.integers(0, num_blocks, n + 1)
                if ids_on == "host":
                    dst_ids, src_ids = dst_ids[1:], src_ids[1:]
                else:
                    dst_ids, src_ids = (torch.as_tensor(a, device=device)[1:] for a in (dst_ids, src_ids))
                before = [t.clone() for t in target]
                x.post(dst_ids, src_ids)
                x.wait(timeout=WAIT)
                check(target, before, source, dst_ids, src_ids, f"{n} {ids_on} ids")


def test_host_ids_of_any_count_launch_the_kernel_compiled_at_prepare(comm):
    """Host ids are staged 16-byte aligned whatever their count, so every eager post launches one of the two
    kernels compiled when the transfer was prepared (int32 and int64 ids, aligned), never Triton's JIT, which
    binds every argument in Python and would compile another variant inside the post."""
    device, num_blocks = comm.device, 20_000
    source, target = pool(0, num_blocks, [(64,)], device), pool(1, num_blocks, [(64,)], device)
    rng = np.random.default_rng(4)
    with comm.register_blocks(source) as src_pool, comm.register_blocks(target) as dst_pool, \
            comm.prepare_blocks(tw.READ, dst_pool, src_pool.desc) as x:
        compiled = x._request._compiled
        assert len(compiled) == 2, f"prepare compiled {len(compiled)} kernels, not 2 (int32 and int64 ids)"
        for n in (1, 3, 5, 17, 10_001, 4, 10_000):
            dst_ids, src_ids = rng.permutation(num_blocks)[:n], rng.integers(0, num_blocks, n)
            before = [t.clone() for t in target]
            x.post(dst_ids, src_ids)
            x.wait(timeout=WAIT)
            check(target, before, source, dst_ids, src_ids, f"{n} host ids")
            assert len(compiled) == 2, f"{n} host ids went through Triton's JIT: keys {sorted(map(str, compiled))}"


def _graph_capture(comm, x, source, target, num_blocks: int, n: int, replays: int) -> int:
    """Capture post(stream)+wait(stream) of n blocks with device ids; replay with new ids; count correct."""
    device = comm.device
    dst_ids = torch.zeros(n, dtype=torch.int64, device=device)
    src_ids = torch.zeros(n, dtype=torch.int64, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    x.post(dst_ids, src_ids, stream=stream)  # eager once: compiled and mapped before capture
    x.wait(stream=stream)
    drain(stream)
    with pytest.raises(tw.InvalidArgumentError, match="cannot be captured"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "the CUDA Graph is empty" (the post was refused)
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            x.post(np.arange(n), np.arange(n), stream=stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        x.post(dst_ids, src_ids, stream=stream)
        x.wait(stream=stream)
    generator = torch.Generator(device=device).manual_seed(1)
    correct = 0
    for _ in range(replays):
        dst_ids.copy_(torch.randperm(num_blocks, device=device, generator=generator)[:n])
        src_ids.copy_(torch.randint(0, num_blocks, (n,), device=device, generator=generator))
        before = [t.clone() for t in target]
        torch.cuda.current_stream(device).synchronize()
        graph.replay()
        drain(stream)
        want = [b.clone() for b in before]
        for w, s in zip(want, source):
            w[dst_ids] = s[src_ids]
        correct += all(torch.equal(t, w) for t, w in zip(target, want))
    return correct


def test_local_gpu_10k_blocks_in_a_cuda_graph(comm):
    num_blocks, n = 12000, 10000
    source = pool(0, num_blocks, [(4096,)], comm.device)  # 16 KiB blocks
    target = pool(1, num_blocks, [(4096,)], comm.device)
    with comm.register_blocks(source) as src_pool, comm.register_blocks(target) as dst_pool:
        with comm.prepare_blocks(tw.READ, dst_pool, src_pool.desc) as x:
            assert _graph_capture(comm, x, source, target, num_blocks, n, replays=5) == 5


# --- two processes on one GPU ---------------------------------------------------------------------------
def _two_gpu_ranks(transport: str | None):
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        num_blocks, shapes = 2048, [(2, 16, 8, 8), (256,)]
        views = pool(comm.rank, num_blocks, shapes, comm.device)
        with comm.register_blocks(views) as mine:
            comm.publish_blocks("kv", mine)
            peer = 1 - comm.rank
            remote = comm.lookup_blocks("kv", peer, timeout=WAIT)
            result = {}
            if comm.rank == 0:
                rng = np.random.default_rng(0)
                peer_views = pool(peer, num_blocks, shapes, comm.device)
                with comm.prepare_blocks(tw.READ, mine, remote, transport=transport) as x:
                    result["transport"] = x.transport
                    for ids_on in ("host", "device"):
                        dst_ids = rng.permutation(num_blocks // 2)[:1000] + num_blocks // 2  # upper half only
                        src_ids = rng.integers(0, num_blocks, 1000)
                        if ids_on == "device" and x.transport != "nixl":
                            dst_ids, src_ids = (torch.as_tensor(a, device=comm.device) for a in (dst_ids, src_ids))
                        before = [v.clone() for v in views]
                        x.post(dst_ids, src_ids)
                        x.wait(timeout=WAIT)
                        check(views, before, peer_views, dst_ids, src_ids, f"READ over {x.transport}, {ids_on} ids")
                    if x.transport == "cuda_ipc":
                        stream = torch.cuda.Stream()
                        stream.wait_stream(torch.cuda.current_stream())
                        before = [v.clone() for v in views]
                        x.post([1500, 1600], [3, 4], stream=stream)
                        x.wait(stream=stream)
                        drain(stream)
                        check(views, before, peer_views, [1500, 1600], [3, 4], "READ posted on a stream")
                comm.write_blocks(mine, [0, 1, 2], remote, [2045, 2046, 2047], notify=b"written", timeout=WAIT)
                comm.barrier(timeout=WAIT)
            else:
                assert comm.wait_notification(0, timeout=WAIT) == b"written"
                writer = pool(0, num_blocks, shapes, comm.device)
                for got, want in zip(views, writer):
                    assert torch.equal(got[2045:], want[:3]), "blocks written by rank 0"
                comm.barrier(timeout=WAIT)
            comm.barrier(timeout=WAIT)
    return result


@pytest.mark.parametrize("transport", [None, "nixl"])
def test_two_processes_on_one_gpu(transport):
    results = launch(_two_gpu_ranks, 2, transport, env=GPU_ENV)
    assert results[0]["transport"] == (transport or "cuda_ipc"), results


def _ipc_graph(n: int):
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        num_blocks = 12000
        views = pool(comm.rank, num_blocks, [(4096,)], comm.device)
        correct = -1
        with comm.register_blocks(views) as mine:
            comm.publish_blocks("kv", mine)
            remote = comm.lookup_blocks("kv", 1 - comm.rank, timeout=WAIT)
            if comm.rank == 0:
                peer_views = pool(1, num_blocks, [(4096,)], comm.device)
                with comm.prepare_blocks(tw.READ, mine, remote) as x:
                    assert x.transport == "cuda_ipc"
                    correct = _graph_capture(comm, x, peer_views, views, num_blocks, n, replays=5)
            comm.barrier(timeout=WAIT)
    return correct


def test_cuda_ipc_10k_blocks_in_a_cuda_graph():
    assert launch(_ipc_graph, 2, 10000, env=GPU_ENV)[0] == 5
