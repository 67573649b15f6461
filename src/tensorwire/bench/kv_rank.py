"""One rank of ``tensorwire bench kv`` (run by ``launch``): its pools, and on rank 0 every case's paths timed and
their bytes checked (what each path is: ``tensorwire.bench.kv``)."""

from __future__ import annotations

import itertools
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from ..errors import TransferError
from ..shared_memory import shared_empty
from .command import progress
from .kv_cases import Case, KvBenchConfig, cases
from .kv_raw import raw_block_paths
from .kv_report import COPY, EAGER, EAGER_COPY
from .raw_nixl import RawNixl, init_with_store, release_store
from .record import Record, compare_with
from .timing import Budget, CudaEventClock, HostClock, Timing, host_seconds, measure, quantile, steadiest, time_call

__all__ = ["rank_main"]

_RAW_GPU_MAX_BLOCKS = 10_000
_POST_TIMING_S = 1.0  # the longest ``post`` alone is timed per path (a Llama-sized request over NIXL: ~0.1 s each)


def _values(rank: int, role: int, views: int, blocks: int, block_bytes: int, device: torch.device,
            allocations: list[torch.Tensor]) -> list[torch.Tensor]:
    """``views`` tensors ``[blocks, block_bytes / 4]`` int32 whose words encode (rank, role, view, block, word),
    views of one allocation appended to ``allocations``. Host views live in one ``/dev/shm`` file
    (``shared_empty``: removed when the allocation is freed), as a serving engine's shared KV cache would, so
    that a peer on this host reaches them through ``shm``."""
    words = block_bytes // 4
    base = torch.arange(words, dtype=torch.int32, device=device)[None, :] + torch.arange(
        blocks, dtype=torch.int32, device=device)[:, None] * 7919
    if device.type == "cpu":
        storage = shared_empty(views * blocks * words, dtype=torch.int32)
    else:
        storage = torch.empty(views * blocks * words, dtype=torch.int32, device=device)
    allocations.append(storage)
    views_out = list(storage.view(views, blocks, words).unbind(0))  # one allocation: one contiguous reference copy
    for v, view in enumerate(views_out):
        torch.add(base, rank * 1_000_003 + role * 100_003 + v * 10_007, out=view)
    return views_out


def _expected(rank: int, role: int, view: int, ids: torch.Tensor, block_bytes: int) -> torch.Tensor:
    words = block_bytes // 4
    ids = ids.to(torch.int32)
    return (torch.arange(words, dtype=torch.int32, device=ids.device)[None, :] + ids[:, None] * 7919
            + (rank * 1_000_003 + role * 100_003 + view * 10_007))


class _Pools:
    """This rank's two pools for one (views, blocks, block bytes) shape: tensorwire and raw NIXL registered."""

    def __init__(self, comm: Any, raw: RawNixl | None, shape: tuple[int, int, int], device: torch.device) -> None:
        views, blocks, block_bytes = shape
        self.allocations: list[torch.Tensor] = []  # the views' storage: a host pool's file lives as long
        self.source = _values(comm.rank, 0, views, blocks, block_bytes, device, self.allocations)
        self.target = _values(comm.rank, 1, views, blocks, block_bytes, device, self.allocations)
        self.pools = [comm.register_blocks(self.source), comm.register_blocks(self.target)]
        if raw is not None:
            for tensor in self.source + self.target:
                raw.register(tensor)

    def close(self, raw: RawNixl | None) -> None:
        for pool in self.pools:
            pool.close()
        if raw is not None:
            raw.deregister_all()
        self.allocations.clear()  # host pools: their files go (the views keep the mappings while referenced)


# --- one rank ------------------------------------------------------------------------------------------------
def rank_main(config: KvBenchConfig) -> list[Record]:
    comm, bench_store = init_with_store(120.0)
    records: list[Record] = []
    raw = None
    if config.raw:  # configured as tensorwire's own agent: only tensorwire's layers differ
        raw = RawNixl(comm.rank, bench_store, "tensorwire", comm.config.progress_wakeup_ms, prefix="bench-kv-raw")
    # No cleanup on failure: a failing rank reports at once and the launcher stops both (closing first would
    # wait, bounded but long, for a peer that sits in a barrier waiting for this rank).
    for memory in config.memory:
        device = comm.device if memory == "cuda" else torch.device("cpu")
        if memory == "cuda":
            torch.cuda.set_device(device)
        by_shape: dict[tuple[int, int, int], list[Case]] = {}
        for case in cases(config, memory):
            by_shape.setdefault((case.views, case.blocks, case.block_bytes), []).append(case)
        for shape, shape_cases in by_shape.items():
            records += _bench_shape(comm, raw, config, shape, shape_cases, device)
    comm.barrier(timeout=config.timeout_s)
    if raw is not None:
        raw.close()
    comm.close()
    release_store(comm.rank, bench_store)
    return records


def _bench_shape(comm: Any, raw: RawNixl | None, config: KvBenchConfig, shape: tuple[int, int, int],
                 shape_cases: list[Case], device: torch.device) -> list[Record]:
    pools = _Pools(comm, raw, shape, device)
    tag = f"{shape[0]}x{shape[1]}x{shape[2]}-{device.type}"
    comm.publish_blocks(f"kv-source-{tag}", pools.pools[0])
    comm.publish_blocks(f"kv-target-{tag}", pools.pools[1])
    if raw is not None:
        raw.exchange_metadata(tag)
    records = []
    comm.barrier(timeout=120)
    if comm.rank == 0:
        remote_source = comm.lookup_blocks(f"kv-source-{tag}", 1, timeout=60)
        remote_target = comm.lookup_blocks(f"kv-target-{tag}", 1, timeout=60)
        peer_tensors = _remote_tensors(remote_source), _remote_tensors(remote_target)
        for case in shape_cases:
            progress("kv", case.label(), config.quiet)
            measured = _bench_case(comm, raw, config, case, pools, (remote_source, remote_target), peer_tensors)
            if config.partial is not None:
                config.partial.add(measured)
            records += measured
    comm.barrier(timeout=config.timeout_s)
    pools.close(raw)  # on success only, as in rank_main
    if raw is not None:
        raw.forget_peer()
    return records


def _remote_tensors(desc: Any) -> list[tuple[int, int]]:
    """(addr, stride) of each region of a peer's pool, for the raw NIXL descriptors."""
    return [(a, s) for a, s, _, _ in desc.regions]


def _bench_case(comm: Any, raw: RawNixl | None, config: KvBenchConfig, case: Case, pools: _Pools, remotes: tuple,
                peer_tensors: tuple) -> list[Record]:
    """Every path of one case, each held against the contiguous copy of the same bytes."""
    import tensorwire as tw

    op = tw.READ if case.op == "READ" else tw.WRITE
    on_gpu = case.memory == "cuda"
    rng = np.random.default_rng(case.blocks)
    count = case.blocks
    local_ids = rng.permutation(count) if case.pattern == "random" else np.arange(count)
    remote_ids = rng.permutation(count) if case.pattern == "random" else np.arange(count)
    local_pool = pools.pools[1] if op is tw.READ else pools.pools[0]  # READ lands in target; WRITE sends source
    remote = remotes[0] if op is tw.READ else remotes[1]
    budget = Budget(time_s=config.time_s, min_reps=5, warmup_reps=2, rounds=1)
    out = []
    transports = [None] + (["nixl"] if not on_gpu else [])
    for transport in transports:
        with comm.prepare_blocks(op, local_pool, remote, transport=transport) as x:
            post_us = _post_times(x, local_ids, remote_ids, config.post_reps, on_gpu)
            if on_gpu:
                ids = [torch.as_tensor(a, device=local_pool.device) for a in (local_ids, remote_ids)]
                stream = torch.cuda.Stream(local_pool.device)
                stream.wait_stream(torch.cuda.current_stream())

                def on_stream(x=x, ids=ids, stream=stream) -> None:
                    x.post(ids[0], ids[1], stream=stream)
                    x.wait(stream=stream)

                with torch.cuda.stream(stream):
                    timing = measure(on_stream, CudaEventClock(), budget)
                out.append(_record(case, EAGER, _eager_timing(x, local_ids, remote_ids, budget), x.transport, []))
            else:
                timing = measure(lambda x=x: (x.post(local_ids, remote_ids), x.wait(timeout=60)), HostClock(), budget)
            _verify(comm, x, case, pools, local_ids, remote_ids, local_pool, remote)
            name = "tensorwire" if transport is None else f"tensorwire ({transport})"
            out.append(_record(case, name, timing, x.transport, post_us))
    if raw is not None and (not on_gpu or count <= _RAW_GPU_MAX_BLOCKS):
        local = pools.target if op is tw.READ else pools.source
        peer = peer_tensors[0] if op is tw.READ else peer_tensors[1]
        for name, timing, post_us in raw_block_paths(raw, op.value, (local, peer), case.views, case.block_bytes,
                                                     (local_ids, remote_ids), budget):
            out.append(_record(case, name, timing, "nixl", post_us))
    out += _bench_local_references(case, pools, local_ids, remote_ids, budget)
    return compare_with(compare_with(out, COPY, [r.path for r in out if r.path != EAGER]), EAGER_COPY, [EAGER])


def _eager_timing(x: Any, local_ids: np.ndarray, remote_ids: np.ndarray, budget: Budget) -> Timing:
    """``synchronize(); post(ids); wait(); synchronize()`` on the host clock, ids in arrays fresh per request."""
    fresh = itertools.cycle([(local_ids.copy(), remote_ids.copy()) for _ in range(8)])

    def eager() -> None:
        local, remote = next(fresh)
        torch.cuda.synchronize()
        x.post(local, remote)
        x.wait(timeout=60)
        torch.cuda.synchronize()

    return measure(eager, HostClock(), budget)


def _post_times(x: Any, local_ids: np.ndarray, remote_ids: np.ndarray, reps: int, on_gpu: bool) -> list[float]:
    """Host time of ``post`` alone (host ids: checking and translating included), waited outside the timing:
    ``reps`` posts after 2 untimed, fewer (5 at least) where they take over ``_POST_TIMING_S`` in all."""
    samples = []
    started = host_seconds()
    for i in range(reps + 2):
        samples.append(time_call(lambda: x.post(local_ids, remote_ids)) * 1e6)
        x.wait(timeout=60)
        if i >= 6 and host_seconds() - started > _POST_TIMING_S:
            break
    if on_gpu:
        torch.cuda.synchronize()
    return samples[2:]


def _verify(comm: Any, x: Any, case: Case, pools: _Pools, local_ids: np.ndarray, remote_ids: np.ndarray,
            local_pool: Any, remote: Any) -> None:
    """The last post moved the right bytes (first 1000 pairs): READ against rank 1's formula, WRITE read back."""
    import tensorwire as tw

    n = min(1000, len(local_ids))
    device = local_pool.device
    local = torch.as_tensor(local_ids[:n], device=device)
    remote_sample = torch.as_tensor(remote_ids[:n], device=device)
    if x.op is tw.READ:
        for v, view in enumerate(pools.target):
            expected = _expected(1, 0, v, remote_sample, case.block_bytes)
            if not torch.equal(view[local], expected):
                raise TransferError(f"bench kv: {case} READ over {x.transport} moved wrong bytes into view {v}")
        return
    scratch = torch.arange(n, device=device)
    with comm.prepare_blocks(tw.READ, pools.pools[1], remote) as back:
        back.post(scratch, remote_sample)
        back.wait(timeout=60)
    for v, (view, sent) in enumerate(zip(pools.target, pools.source)):
        if not torch.equal(view[scratch], sent[local]):
            raise TransferError(f"bench kv: {case} WRITE over {x.transport} left wrong bytes in view {v}")
    for v, view in enumerate(pools.target):  # restore this rank's landing pool for the next READ checks
        view[scratch] = _expected(0, 1, v, scratch, case.block_bytes)


def _bench_local_references(case: Case, pools: _Pools, local_ids: np.ndarray, remote_ids: np.ndarray,
                            budget: Budget) -> list[Record]:
    """The same bytes copied contiguously inside this rank, and (GPU) torch's two-pass gather."""
    on_gpu = case.memory == "cuda"
    words = case.nbytes // 4  # the views of a pool are one allocation (see _values)
    source = pools.source[0].as_strided((words,), (1,))
    landing = pools.target[0].as_strided((words,), (1,))
    clock = CudaEventClock() if on_gpu else HostClock()

    def contiguous() -> None:
        landing.copy_(source)

    out = [_record(case, COPY, steadiest(lambda: measure(contiguous, clock, budget)), "copy", [])]
    if on_gpu:
        def copy_and_sync() -> None:
            torch.cuda.synchronize()
            landing.copy_(source)
            torch.cuda.synchronize()

        out.append(_record(case, EAGER_COPY, measure(copy_and_sync, HostClock(), budget), "copy", []))
        local = torch.as_tensor(local_ids, device=pools.source[0].device)
        remote = torch.as_tensor(remote_ids, device=pools.source[0].device)

        def gather() -> None:
            for d, s in zip(pools.target, pools.source):
                d.index_copy_(0, local, s.index_select(0, remote))

        out.append(_record(case, "torch gather", measure(gather, clock, budget), "copy", []))
    return out


def _record(case: Case, path: str, timing: Timing, transport: str, post_us: list[float]) -> Record:
    """The record of one path of ``case``: the case's shape in ``params``, with the host time of ``post``
    alone (p50, p99) where it was timed."""
    params = {k: v for k, v in asdict(case).items() if k not in ("memory", "op")}
    if post_us:
        params.update(post_p50_us=quantile(post_us, 0.5), post_p99_us=quantile(post_us, 0.99))
    return Record.measured("kv", case.memory, case.op, path, transport, case.nbytes, timing, **params)
