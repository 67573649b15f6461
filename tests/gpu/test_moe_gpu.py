"""MoE dispatch / combine on GPU memory: the "cuda" and "nixl" backends between two processes sharing one
GPU, the "cuda" engine without any host sync, and a whole MoE step captured in a CUDA graph.

Inputs and the reference are ``tensorwire.testing.moe_reference`` (every rank rebuilds every rank's inputs). The "cuda"
engine sums in a Triton kernel (fused multiply-adds), so combine results are compared within rounding.
Every GPU wait of the engine is bounded (its watchdog opens a wait nobody releases and the next call
raises), and ``launch`` bounds the whole job.
"""

from __future__ import annotations

import pytest
import torch

import tensorwire as tw
from tensorwire import moe
from tensorwire.testing.data import assert_equal
from tensorwire.testing.moe_reference import (
    CASES,
    EXPERTS_PER_RANK,
    a2a_counts,
    a2a_rows,
    check_dispatch,
    make_inputs,
    reference_combine,
    reference_dispatch,
    scaled_expert,
)
from tensorwire.testing.suite import INIT_TIMEOUT, launch

pytestmark = pytest.mark.gpu

GPU_ENV = {"CUDA_MODULE_LOADING": "EAGER"}  # lazy module loading can deadlock against a waiting stream


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tolerance = 1e-5 if expected.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=tolerance, atol=tolerance,
                               msg=lambda m: f"{what}: {m}")


def _on(device, tensors):
    return [t.to(device) for t in tensors]


def _cases_on_one_gpu(engine: str):
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        world, me = comm.world_size, comm.rank
        num_experts = EXPERTS_PER_RANK * world
        for case in CASES:
            inputs = [make_inputs(case, r, world) for r in range(world)]
            expected = [reference_dispatch(inputs, r, world) for r in range(world)]
            x, topk_idx, topk_weights = _on(comm.device, inputs[me])
            reference = reference_combine(*inputs[me], scaled=True)
            what = f"{engine}/{case.name} rank {me}"
            d = moe.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, comm=comm, engine=engine)
            check_dispatch(d, expected[me], expected[me]["recv_src_rank"].numel(), what)
            _close(moe.combine(scaled_expert(d.recv_x, d.tokens_per_expert, me), d), reference, f"{what}: combine")
            capacity = max(e["recv_src_rank"].numel() for e in expected) + 5
            d = moe.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, comm=comm, engine=engine,
                             capacity=capacity)
            check_dispatch(d, expected[me], capacity, f"{what} capacity")
            _close(moe.combine(scaled_expert(d.recv_x, d.tokens_per_expert, me), d), reference,
                   f"{what}: combine with capacity")
            d.check()
        for seed, dtype in ((0, torch.int64), (1, torch.bfloat16)):
            counts = a2a_counts(seed, world)
            send = a2a_rows(me, sum(counts[me])).to(dtype).to(comm.device)
            recv, recv_counts = tw.all_to_all_v(send, counts[me], comm=comm, engine=engine)
            expected_rows = torch.cat([a2a_rows(s, sum(counts[s]))[sum(counts[s][:me]):sum(counts[s][:me + 1])]
                                       for s in range(world)]).to(dtype)
            assert_equal(recv, expected_rows, f"{engine} all_to_all_v rank {me}")
            assert recv_counts.device == send.device
        comm.barrier()
    return me


@pytest.mark.parametrize("engine", ["cuda", "nixl"])
def test_dispatch_combine_between_processes_on_one_gpu(engine):
    """Every case of the host suite, exact shapes and capacity, plus all_to_all_v, at world 2 on one GPU."""
    assert launch(_cases_on_one_gpu, 2, engine, env=GPU_ENV, timeout=600) == [0, 1]


# --- no host sync, CUDA graphs ---------------------------------------------------------------------
def _graph_safe_expert(d: moe.Dispatch, rank: int) -> torch.Tensor:
    """Expert e scales its rows by (e + 1), with no host sync (rows past the valid ones get factor 1)."""
    local = d.tokens_per_expert.numel()
    rows = torch.arange(d.recv_x.shape[0], device=d.recv_x.device)
    expert = torch.searchsorted(torch.cumsum(d.tokens_per_expert, 0), rows, right=True).clamp(max=local - 1)
    factor = (expert + rank * local + 1).to(torch.float32)
    return (d.recv_x.float() * factor[:, None]).to(d.recv_x.dtype)


def _routing(step: int, rank: int, world: int, tokens: int, topk: int, hidden: int):
    """A fresh routing of a fixed number of tokens for each replay (fixed shapes: graph inputs)."""
    generator = torch.Generator().manual_seed(10_000 + 97 * step + rank)
    scores = torch.rand(tokens, EXPERTS_PER_RANK * world, generator=generator)
    if step % 3 == 1:
        scores[:, :EXPERTS_PER_RANK] += 1.0  # skew some steps towards rank 0
    topk_idx = scores.topk(topk, dim=1).indices
    topk_idx[torch.rand(tokens, topk, generator=generator) < 0.2] = -1
    topk_weights = torch.rand(tokens, topk, generator=generator)
    x = (rank * 1000 + step + torch.arange(tokens, dtype=torch.float64)[:, None] + torch.arange(hidden) / 64).float()
    return x, topk_idx, topk_weights


def _step(comm, x, topk_idx, topk_weights, capacity):
    d = moe.dispatch(x, topk_idx, topk_weights, num_experts=EXPERTS_PER_RANK * comm.world_size, comm=comm,
                     engine="cuda", capacity=capacity)
    return d, moe.combine(_graph_safe_expert(d, comm.rank), d)


def _no_host_sync():
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        world, me = comm.world_size, comm.rank
        tokens, topk, hidden = 48, 4, 256
        capacity = world * tokens * topk
        inputs = [_on(comm.device, _routing(s, me, world, tokens, topk, hidden)) for s in range(3)]
        _step(comm, *inputs[0], capacity)  # first call of this shape: sets up buffers, compiles kernels
        torch.cuda.synchronize()
        results = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, topk_idx, topk_weights in inputs:
                results.append(_step(comm, x, topk_idx, topk_weights, capacity))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for step, (_, y) in enumerate(results):
            _close(y, reference_combine(*_routing(step, me, world, tokens, topk, hidden), scaled=True),
                   f"step {step} without host sync, rank {me}")
        results[-1][0].check()  # no overflow, timeout or bad id was flagged on the device
        comm.barrier()
    return me


def test_cuda_backend_makes_no_host_sync_with_capacity():
    """dispatch + expert + combine with capacity= under torch.cuda.set_sync_debug_mode('error')."""
    assert launch(_no_host_sync, 2, env=GPU_ENV, timeout=300) == [0, 1]


def _graph_replays(replays: int):
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        world, me = comm.world_size, comm.rank
        tokens, topk, hidden = 32, 4, 128
        capacity = world * tokens * min(topk, EXPERTS_PER_RANK)  # the most one rank can receive
        static = _on(comm.device, _routing(0, me, world, tokens, topk, hidden))
        _step(comm, *static, capacity)  # set up and compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            d, y = _step(comm, *static, capacity)
        for step in range(replays):
            routing = _routing(step, me, world, tokens, topk, hidden)
            for target, value in zip(static, routing):
                target.copy_(value)
            graph.replay()
            _close(y, reference_combine(*routing, scaled=True), f"replay {step}, rank {me}")
            if step % 10 == 0:
                everyone = [_routing(step, r, world, tokens, topk, hidden) for r in range(world)]
                expected = reference_dispatch(everyone, me, world)
                n = expected["recv_src_rank"].numel()
                assert int(d.num_recv_rows) == n, f"replay {step}: {int(d.num_recv_rows)} rows, expected {n}"
                assert_equal(d.tokens_per_expert, expected["tokens_per_expert"], f"replay {step}: tokens_per_expert")
                # combine stored the expert outputs into recv_x's rows (its documented contract)
                assert_equal(d.recv_x[:n], scaled_expert(expected["recv_x"], expected["tokens_per_expert"], me),
                             f"replay {step}: recv_x")
                assert_equal(d.recv_src_idx[:n], expected["recv_src_idx"], f"replay {step}: recv_src_idx")
        d.check()
        comm.barrier()
    return me


def test_moe_step_captured_in_a_cuda_graph_replays_with_new_routing():
    """dispatch -> expert -> combine captured once, replayed 100 times with new routing written into the
    graph's static inputs; every replay's output matches the reference."""
    assert launch(_graph_replays, 2, 100, env=GPU_ENV, timeout=600) == [0, 1]


def _peer_never_comes(timeout_s: float):
    """Both ranks make one step (collective set-up), then only rank 0 dispatches: its stream waits for
    rank 1's counts, which never come. The watchdog must open the wait and ``check()`` must report it."""
    import time

    with tw.init(timeout=INIT_TIMEOUT) as comm:
        torch.cuda.set_device(comm.device)
        world, me = comm.world_size, comm.rank
        tokens, topk, hidden = 16, 2, 64
        capacity = world * tokens * topk
        inputs = _on(comm.device, _routing(0, me, world, tokens, topk, hidden))
        _step(comm, *inputs, capacity)
        torch.cuda.synchronize()
        comm.barrier()
        outcome = None
        if me == 0:
            comm.timeout_s = timeout_s  # the watchdog's deadline
            d = moe.dispatch(*inputs, num_experts=EXPERTS_PER_RANK * world, comm=comm, engine="cuda",
                             capacity=capacity)
            done = torch.cuda.Event()
            done.record()
            deadline = time.monotonic() + timeout_s + 30
            while not done.query():  # bounded: the stream must drain once the watchdog opened the wait
                assert time.monotonic() < deadline, "the stream never drained: the watchdog did not open the wait"
                time.sleep(0.01)
            try:
                d.check()
            except tw.WaitTimeoutError as e:
                outcome = str(e)
        comm.barrier(timeout=timeout_s + 60)
    return outcome


def test_cuda_backend_reports_a_peer_that_never_comes():
    """A dispatch whose peer never takes part: its GPU wait is opened by the watchdog after the timeout (the
    stream drains) and ``check()`` raises WaitTimeoutError naming the cause."""
    outcome = launch(_peer_never_comes, 2, 3.0, env=GPU_ENV, timeout=300)
    assert outcome[1] is None and outcome[0] is not None and "not released by the peers" in outcome[0], outcome


def _in_flight_on_one_gpu():
    """Two dispatches in flight, then two combines in a row: a rank that runs ahead signals the second
    combine before its peer consumed the first one's signal; no signal may be lost (that would hang)."""
    with tw.init(timeout=60) as comm:
        torch.cuda.set_device(comm.device)
        world, me = comm.world_size, comm.rank
        num_experts = EXPERTS_PER_RANK * world
        for _ in range(20):
            batches = [_on(comm.device, make_inputs(CASES[i], me, world)) for i in (0, 2)]
            pending = [moe.dispatch(x, i, w, num_experts=num_experts, comm=comm, engine="cuda") for x, i, w in batches]
            for (x, topk_idx, topk_weights), d in zip(batches, pending):
                y = moe.combine(scaled_expert(d.recv_x, d.tokens_per_expert, me), d)
                _close(y, reference_combine(x.cpu(), topk_idx.cpu(), topk_weights.cpu(), scaled=True),
                       f"in flight, rank {me}")
        pending[-1].check()
        comm.barrier()
    return me


def test_cuda_backend_two_dispatches_in_flight_then_two_combines():
    assert launch(_in_flight_on_one_gpu, 2, env=GPU_ENV, timeout=300) == [0, 1]
