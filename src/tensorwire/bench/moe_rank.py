"""One rank of ``tensorwire bench moe`` (run by ``launch``): the routing, each engine's dispatch and combine timed
and checked, the copies they are held against (what each is: ``tensorwire.bench.moe``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..errors import TransferError
from .command import progress
from .moe_cases import MoeBenchConfig
from .record import Record
from .timing import CudaEventClock, HostClock, Timing, steadiest, summarize, time_call

__all__ = ["rank_main"]


def rank_main(config: MoeBenchConfig) -> list[Record]:
    import tensorwire as tw
    from tensorwire import moe

    if config.quiet_nixl:
        from ..backends.nixl import quiet_nixl_logging

        quiet_nixl_logging()
    records: list[Record] = []
    with tw.init(timeout=min(config.timeout_s, 300.0)) as comm:
        device = comm.device if config.memory == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)  # the ranks share the machine's cores; one thread each, as the copy has
        dtype = getattr(torch, config.dtype)
        for tokens in config.tokens:
            x, topk_idx, topk_weights = _routing(config, comm.rank, tokens, device, dtype)
            rows = int((topk_idx >= 0).sum())
            nbytes = rows * config.hidden * x.element_size()
            copy = steadiest(lambda: _copy_timing(nbytes, device, config))  # noqa: B023 (called at once)
            shared_copy = _shared_copy_timing(comm, nbytes, device, config)
            progress("moe", f"{config.memory} T={tokens} H={config.hidden} top-{config.topk}",
                     quiet=config.quiet or comm.rank != 0)
            case_start = len(records)
            for engine in config.engines:
                capacity = None
                if config.capacity_factor is not None:
                    capacity = max(1, int(config.capacity_factor * tokens * config.topk))
                dispatch, combine, y = _time_engine(moe, comm, engine, x, topk_idx, topk_weights, config, capacity)
                _check(y, x, topk_idx, topk_weights, engine, comm.rank)
                for op, timing in (("dispatch", dispatch), ("combine", combine)):
                    records.append(_record(config, engine, op, tokens, rows, nbytes, timing, copy, shared_copy,
                                           device, capacity))
                if engine == "cuda" and config.graphs:
                    capacity = config.world_size * tokens * config.topk
                    dispatch, combine, y = _time_graphs(moe, comm, x, topk_idx, topk_weights, config, capacity)
                    _check(y, x, topk_idx, topk_weights, "cuda (graph)", comm.rank)
                    for op, timing in (("dispatch", dispatch), ("combine", combine)):
                        records.append(_record(config, "cuda (graph)", op, tokens, rows, nbytes, timing, copy,
                                               shared_copy, device, capacity))
            if comm.rank == 0 and config.partial is not None:
                config.partial.add(records[case_start:])
            comm.barrier()
    return records


def _routing(config: MoeBenchConfig, rank: int, tokens: int, device: torch.device, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(config.seed * 1009 + rank)
    scores = torch.rand(tokens, config.num_experts, generator=generator)
    topk_idx = scores.topk(config.topk, dim=1).indices
    topk_idx[torch.rand(tokens, config.topk, generator=generator) < 0.1] = -1
    topk_weights = torch.rand(tokens, config.topk, generator=generator)
    x = torch.randn(tokens, config.hidden, generator=generator).to(dtype)
    return x.to(device), topk_idx.to(device), topk_weights.to(device)


def _clock(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Seconds one call takes, read by the benchmarks' clocks (``timing``): the wall clock on the host, CUDA
    events around the call's stream work on a GPU (blocks until the GPU ran it). One call at a time: the
    ranks' calls are collective, so repetitions are counted by the caller, not time-budgeted."""
    clock = CudaEventClock() if device.type == "cuda" else HostClock()

    def one_call(fn: Callable[[], Any]) -> float:
        return time_call(fn, clock)

    return one_call


def _time_engine(moe: Any, comm: Any, engine: str, x: torch.Tensor, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, config: MoeBenchConfig, capacity: int | None):
    """Samples of dispatch and of combine, timed in alternation (a combine needs its dispatch); the last
    combine's output."""
    clock = _clock(x.device)
    last: dict[str, Any] = {}

    def dispatch() -> None:
        last["d"] = moe.dispatch(x, topk_idx, topk_weights, num_experts=config.num_experts, comm=comm,
                                 engine=engine, capacity=capacity)

    def combine() -> None:
        last["y"] = moe.combine(last["d"].recv_x, last["d"])

    dispatch_s: list[float] = []
    combine_s: list[float] = []
    for i in range(config.warmup + config.reps):
        dispatch_took, combine_took = clock(dispatch), clock(combine)
        last["d"].check()
        if i >= config.warmup:
            dispatch_s.append(dispatch_took)
            combine_s.append(combine_took)
    return summarize(dispatch_s), summarize(combine_s), last["y"]


def _time_graphs(moe: Any, comm: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 config: MoeBenchConfig, capacity: int):
    """The ``cuda`` engine with ``capacity``: one eager step (sets up its buffers), then dispatch and
    combine captured in two CUDA graphs and replayed in alternation, each replay timed with events."""
    def dispatch():
        return moe.dispatch(x, topk_idx, topk_weights, num_experts=config.num_experts, comm=comm, engine="cuda",
                            capacity=capacity)

    first = dispatch()
    moe.combine(first.recv_x, first)
    torch.cuda.synchronize()
    dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(dispatch_graph, capture_error_mode="thread_local"):
        d = dispatch()
    with torch.cuda.graph(combine_graph, capture_error_mode="thread_local"):
        y = moe.combine(d.recv_x, d)
    clock = _clock(x.device)
    dispatch_s: list[float] = []
    combine_s: list[float] = []
    for i in range(config.warmup + config.reps):
        dispatch_took, combine_took = clock(dispatch_graph.replay), clock(combine_graph.replay)
        if i >= config.warmup:
            dispatch_s.append(dispatch_took)
            combine_s.append(combine_took)
    d.check()
    return summarize(dispatch_s), summarize(combine_s), y


def _copy_timing(nbytes: int, device: torch.device, config: MoeBenchConfig) -> Timing:
    """The same bytes copied inside this rank, the same number of times."""
    source, target = _copy_buffers(nbytes, device)
    clock = _clock(device)
    for _ in range(config.warmup):
        clock(lambda: target.copy_(source))
    return summarize([clock(lambda: target.copy_(source)) for _ in range(config.reps)])


def _copy_buffers(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    source = torch.ones(max(nbytes, 1), dtype=torch.uint8, device=device)
    return source, torch.empty_like(source)


def _shared_copy_timing(comm: Any, nbytes: int, device: torch.device, config: MoeBenchConfig) -> Timing:
    """The copy of ``_copy_timing``, made by every rank at the same time: after a barrier each rank times
    ``reps`` back-to-back copies as one interval (the ranks leave the barrier a little apart; one interval
    over many copies keeps that skew small against the whole). Each sample is the interval over ``reps``, so
    it carries no per-copy launch gap: at small sizes it is faster than ``_copy_timing``'s."""
    source, target = _copy_buffers(nbytes, device)
    clock = _clock(device)

    def copies() -> None:
        for _ in range(config.reps):
            target.copy_(source)

    samples = []
    for _ in range(3):
        comm.barrier()
        samples.append(clock(copies) / config.reps)
    return summarize(samples)


def _check(y: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, engine: str,
           rank: int) -> None:
    """Identity experts: y = x * (sum of the valid weights)."""
    expected = x.float() * torch.where(topk_idx >= 0, topk_weights, 0.0).sum(1, keepdim=True)
    tolerance = 1e-4 if x.dtype == torch.float32 else 3e-2
    if not torch.allclose(y.float(), expected, rtol=tolerance, atol=tolerance):
        worst = float((y.float() - expected).abs().max())
        raise TransferError(
            f"bench moe: engine {engine!r} combined wrong values on rank {rank} (max error {worst:.3g})")


def _record(config: MoeBenchConfig, engine: str, op: str, tokens: int, rows: int, nbytes: int, timing: Timing,
            copy: Timing, shared_copy: Timing, device: torch.device, capacity: int | None) -> Record:
    """The record of one engine's ``op``, held against the copy of the same bytes; the shared copy beside (its
    ratio None too when it was unsteady)."""
    def measured(path: str, transport: str, measured_timing: Timing, **params: Any) -> Record:
        return Record.measured("moe", device.type, op, path, transport, nbytes, measured_timing, **params)

    record = measured(
        engine, engine.split(" (")[0], timing, tokens=tokens, hidden=config.hidden, topk=config.topk,
        num_experts=config.num_experts, world_size=config.world_size, dtype=config.dtype, capacity=capacity, rows=rows,
        copy_median_us=copy.median_us, copy_gbps=copy.gbps(nbytes), shared_copy_median_us=shared_copy.median_us,
        shared_copy_gbps=shared_copy.gbps(nbytes))
    shared_ratio = record.against(measured("shared copy", "copy", shared_copy)).ratio
    record = replace(record, params={**record.params, "ratio_to_shared_copy": shared_ratio})
    return record.against(measured("copy", "copy", copy))
