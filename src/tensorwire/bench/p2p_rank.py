"""One rank of ``tensorwire bench p2p`` (run by ``launch``): the idle measurement, then, on rank 0, every
path of every (memory, op, size), timed and checked; rank 1 is the passive target and checks what landed.
What each path is and how it is clocked: ``tensorwire.bench.p2p``."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import torch

from ..backends.base import Op
from ..descriptors import TensorDesc
from ..shared_memory import SHM_DIRECTORY, shared_empty
from ..testing.data import rank_pattern
from .command import progress
from .p2p_inbox import InboxChecker, Side, check_inbox, check_path
from .p2p_records import (
    COPY,
    COPY_MT,
    COPY_SYNC,
    EAGER_PATHS,
    IDLE_BYTES,
    RAW,
    STREAM_ORDERED,
    TENSORWIRE,
    TENSORWIRE_GRAPH,
    TENSORWIRE_IN_PROCESS,
    TENSORWIRE_NIXL,
    TENSORWIRE_PATHS,
    TENSORWIRE_STREAM,
    WAIT_RETURN_REPS,
    BenchConfig,
    format_size,
)
from .raw_nixl import RawNixl, init_with_store, release_store
from .record import Record, compare_with
from .timing import (
    Budget,
    Clock,
    CudaEventClock,
    HostClock,
    Timing,
    measure,
    measure_interleaved,
    steadiest,
    summarize,
    time_call,
)

__all__ = ["rank_main"]


def rank_main(config: BenchConfig) -> dict[str, Any]:
    """One rank of the benchmark (run by ``launch``). Rank 0 returns the records."""
    if config.quiet_nixl:
        from ..backends.nixl import quiet_nixl_logging

        quiet_nixl_logging()
    # Our own store, lent to tw.init, also carries the raw agents' metadata under "bench/".
    comm, bench_store = init_with_store(config.timeout_s)
    result: dict[str, Any] = {"rank": comm.rank}
    try:
        result["idle"] = _measure_idle(comm, config.idle_s) if config.idle_s > 0 else None
        raw = RawNixl(comm.rank, bench_store, config.raw_config, comm.config.progress_wakeup_ms)
        try:
            result["records"], result["wait_returns"] = _bench_all(comm, raw, config)
        finally:
            raw.close()
        result["default_threads"] = torch.get_num_threads()
        result["progress_wakeup_ms"] = comm.config.progress_wakeup_ms
        if comm.rank == 0:
            from ..machine import ucx_version

            result["ucx_version"] = ucx_version()
        comm.barrier()
    finally:
        comm.close()
    release_store(comm.rank, bench_store)
    return result


def _measure_idle(comm: Any, seconds: float) -> dict[str, float]:
    """CPU an idle, connected communicator burns, in cores: getrusage(RUSAGE_SELF) user+sys over ``seconds``.

    Both ranks register 1 MiB and READ 4 KiB from each other first, so endpoints exist on both sides, then
    sleep through the same window between two barriers (a barrier waits in a blocking socket call).
    """
    buffer = torch.zeros(IDLE_BYTES, dtype=torch.uint8)
    with comm.register(buffer) as registration:
        comm.publish("bench/idle", registration.descs)
        remote = comm.lookup("bench/idle", 1 - comm.rank)[0]
        comm.read(buffer[:4096], remote.narrow(4096, 4096))
        comm.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall = time_call(functools.partial(time.sleep, seconds))
        after = resource.getrusage(resource.RUSAGE_SELF)
        comm.barrier()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"rank": comm.rank, "wall_s": wall, "cpu_s": cpu, "cores": cpu / wall}


def _bench_all(comm: Any, raw: RawNixl, config: BenchConfig) -> tuple[list[Record], list[dict[str, Any]]]:
    sides = [_make_side(comm, raw, memory, max(config.sizes(memory))) for memory in config.memories]
    raw.exchange_metadata()
    for side in sides:
        side.remote = comm.lookup(f"bench/{side.memory}", 1 - comm.rank)[0]
    records: list[Record] = []
    wait_returns: list[dict[str, Any]] = []
    checker = InboxChecker(raw.store)
    try:
        if comm.rank == 0:
            try:
                for side in sides:
                    for size in config.sizes(side.memory):
                        records += _bench_size(comm, raw, side, size, config, checker)
                    if side.memory == "cuda":
                        wait_returns += _bench_wait_returns(comm, side, checker)
            finally:
                checker.finish()
        else:
            checker.serve({side.memory: side for side in sides})
    finally:
        raw.close()  # before the tensors can go: nothing may stay registered over freed memory
        for side in sides:
            side.registration.close()  # a host buffer's /dev/shm file goes with the buffer (shared_empty)
    return records, wait_returns


def _make_side(comm: Any, raw: RawNixl, memory: str, size: int) -> Side:
    device = comm.device if memory == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own, peer = rank_pattern(size, comm.rank, device), rank_pattern(size, 1 - comm.rank, device)
    if device.type == "cuda":
        buffer = torch.zeros(2 * size, dtype=torch.uint8, device=device)
    else:
        buffer = _host_buffer(2 * size)
    buffer[:size].copy_(own)
    copy_dst = torch.zeros(size, dtype=torch.uint8, device=device) if comm.rank == 0 else None
    registration = comm.register(buffer)
    raw.register(buffer)
    comm.publish(f"bench/{memory}", registration.descs)
    side = Side(memory, buffer, size, own, peer, copy_dst, registration)
    side.sync()
    return side


def _host_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed host buffer in a file of ``/dev/shm`` (``tw.shared_empty``: a new file reads as zeros) when it
    has room for both ranks' and some to spare (a peer on this host then reaches it through the ``shm``
    transport, as a user's shared buffer would be), else anonymous memory, which NIXL carries."""
    try:
        stats = os.statvfs(SHM_DIRECTORY)
    except OSError:
        return torch.zeros(nbytes, dtype=torch.uint8)
    if stats.f_bavail * stats.f_frsize < 4 * nbytes:
        return torch.zeros(nbytes, dtype=torch.uint8)
    return shared_empty(nbytes, dtype=torch.uint8)


def _bench_size(comm: Any, raw: RawNixl, side: Side, size: int, config: BenchConfig,
                checker: InboxChecker) -> list[Record]:
    """Rank 0: READ then WRITE of ``size`` bytes. The transfer paths are timed interleaved (they are what is
    compared); each must first move the right bytes on its own, and all still do after the timing."""
    records: list[Record] = []
    remote_outbox, remote_inbox = side.remote.narrow(0, size), side.remote.narrow(side.half, size)
    cases = ((Op.READ, side.inbox[:size], remote_outbox), (Op.WRITE, side.outbox[:size], remote_inbox))
    for op, local, remote in cases:
        progress("p2p", f"{side.memory} {op.value:<5} {format_size(size)}", quiet=not config.progress)
        with contextlib.ExitStack() as stack:
            paths = _transfer_paths(comm, raw, op, local, remote, stack)
            for name, (once, _) in paths.items():
                once()
                check_path(side, size, op, name, checker)
            compared = {name: once for name, (once, _) in paths.items()}
            # The yardstick is timed alongside on the same clock: on the host the copy on one thread, on the GPU
            # the copy and a sync of its stream (an eager post() + wait() is a copy the CPU waits for).
            yardstick = COPY if side.memory == "cpu" else COPY_SYNC
            compared[yardstick] = _copy_call(side, size)
            paths[yardstick] = (compared[yardstick], "torch")
            if side.memory == "cpu":
                stack.enter_context(_torch_threads(1))
            timings = steadiest(lambda: measure_interleaved(compared, HostClock(), config.budget),  # noqa: B023
                                spread_of=lambda t: t[yardstick].spread)  # noqa: B023
            check_path(side, size, op, " + ".join(p for p in paths if p != yardstick), checker)
        case = [_record(side.memory, op.value, size, name, timings[name], transport,
                        **({"threads": 1} if name == COPY else {}))
                for name, (_, transport) in paths.items()]
        if side.memory == "cuda":
            case = compare_with(case, COPY_SYNC, paths=EAGER_PATHS)
        case += _bench_other_copies(side, size, op.value, config.budget)
        if paths[TENSORWIRE][1] in STREAM_ORDERED:
            case.append(_bench_on_stream(comm, side, size, op, local, remote, config.budget, checker))
            if config.graphs:
                case.append(_bench_graph(comm, side, size, op, local, remote, config.budget, checker))
        if op is Op.WRITE:
            case.append(_bench_in_process(comm, side, size, config.budget))
        held_against_copy = [p for p in TENSORWIRE_PATHS if side.memory == "cpu" or p not in EAGER_PATHS]
        records += compare_with(case, COPY, paths=held_against_copy)
        if config.partial is not None:
            config.partial.add(records[-len(case):])
    return records


def _record(memory: str, op: str, size: int, path: str, timing: Timing, transport: str, **params: int) -> Record:
    """The record of one path of ``tensorwire bench p2p``: each timed call moved ``size`` bytes."""
    return Record.measured("p2p", memory, op, path, transport, size, timing, **params)


def _bench_in_process(comm: Any, side: Side, size: int, budget: Budget) -> Record:
    """Rank 0's outbox into its own inbox through tensorwire (the ``local`` transport), clocked as the copy
    is: CUDA events around ``post(stream=)`` + ``wait(stream=)`` on a GPU, the wall clock on the host."""
    own_inbox = side.registration.descs[0].narrow(side.half, size)
    with comm.prepare(Op.WRITE, side.outbox[:size], own_inbox) as transfer:
        if side.buffer.is_cuda:
            stream = torch.cuda.current_stream()

            def once() -> None:
                transfer.post(stream=stream)
                transfer.wait(stream=stream)

            clock: Clock = _gpu_clock()
        else:
            once, clock = _post_and_wait(transfer), HostClock()
        what = f"{TENSORWIRE_IN_PROCESS} WRITE"
        once()
        check_inbox(side, size, what, expected=side.own)
        with _torch_threads(1):  # as the host copy it is compared with
            timing = measure(once, clock, budget)
        check_inbox(side, size, what, expected=side.own)  # still the right bytes after the timing
        return _record(side.memory, Op.WRITE.value, size, TENSORWIRE_IN_PROCESS, timing, transfer.transport)


def _bench_wait_returns(comm: Any, side: Side, checker: InboxChecker) -> list[dict[str, Any]]:
    """Rank 0: the CPU time ``wait(stream=)`` takes to return while a WRITE of the whole outbox is in flight,
    ``WAIT_RETURN_REPS`` times per transport (tensorwire's choice, then NIXL forced). A CPU-driven transport
    is posted from the CPU (``post()``), a stream-ordered one on the stream. Each repetition then records an
    event after the wait and asks, without waiting, whether it has fired: ``in_flight`` counts the
    repetitions where the transfer was still moving when the CPU got control back. On a side stream: a
    CPU-driven transport refuses stream waits on the legacy default stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the outbox was filled there
    size = side.half
    remote = side.remote.narrow(side.half, size)
    out: list[dict[str, Any]] = []
    for transport in (None, "nixl"):
        if transport == "nixl" and out and out[0]["transport"] == "nixl":
            break  # tensorwire already chose NIXL
        with comm.prepare(Op.WRITE, side.outbox, remote, transport=transport) as transfer:
            returns_s, in_flight = [], 0
            for _ in range(WAIT_RETURN_REPS):
                if transfer.transport in STREAM_ORDERED:
                    transfer.post(stream=stream)
                else:
                    transfer.post()  # CPU-driven: the case where wait(stream=) hands completion to a thread
                returns_s.append(time_call(functools.partial(transfer.wait, stream=stream)))
                after = torch.cuda.Event()
                after.record(stream)
                in_flight += not after.query()
                after.synchronize()
            check_path(side, size, Op.WRITE, f"wait(stream=) over {transfer.transport}", checker)
            timing = summarize(returns_s)
            out.append({"transport": transfer.transport, "op": Op.WRITE.value, "size": size,
                        "median_us": timing.median_us, "p10_us": timing.p10_us, "p90_us": timing.p90_us,
                        "first_us": returns_s[0] * 1e6, "reps": timing.reps, "in_flight": in_flight})
    return out


def _bench_on_stream(comm: Any, side: Side, size: int, op: Op, local: torch.Tensor, remote: TensorDesc,
                     budget: Budget, checker: InboxChecker) -> Record:
    """A stream-ordered transport timed the way the device copy is: ``post(stream=)`` + ``wait(stream=)``
    between two CUDA events on the current stream, so no CPU round trip sits inside the interval."""
    stream = torch.cuda.current_stream()
    with comm.prepare(op, local, remote) as transfer:

        def once() -> None:
            transfer.post(stream=stream)
            transfer.wait(stream=stream)

        once()
        stream.synchronize()
        check_path(side, size, op, f"{TENSORWIRE_STREAM}", checker)
        timing = measure(once, _gpu_clock(), budget)
        return _record(side.memory, op.value, size, TENSORWIRE_STREAM, timing, transfer.transport)


def _bench_graph(comm: Any, side: Side, size: int, op: Op, local: torch.Tensor, remote: TensorDesc,
                 budget: Budget, checker: InboxChecker) -> Record:
    """``post(stream=)`` + ``wait(stream=)`` captured once in a CUDA graph; each replay timed with CUDA
    events on the current stream (the graph replays there)."""
    with comm.prepare(op, local, remote) as transfer:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may use CUDA meanwhile
            capture = torch.cuda.current_stream()
            transfer.post(stream=capture)
            transfer.wait(stream=capture)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        check_path(side, size, op, TENSORWIRE_GRAPH, checker)
        timing = measure(graph.replay, _gpu_clock(), budget)
        torch.cuda.current_stream().synchronize()  # no replay may still run when the handle closes
        return _record(side.memory, op.value, size, TENSORWIRE_GRAPH, timing, transfer.transport)


@contextlib.contextmanager
def _torch_threads(count: int):
    """Run the block with ``count`` torch intra-op threads (it does not touch NIXL, which has its own)."""
    default = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(default)


def _transfer_paths(comm: Any, raw: RawNixl, op: Op, local: torch.Tensor, remote: TensorDesc,
                    stack: contextlib.ExitStack) -> dict[str, tuple[Callable[[], None], str]]:
    """``{path: (one repetition, transport)}``: tensorwire as it chooses, tensorwire over NIXL when it chose
    something else, and raw NIXL. Handles are released when ``stack`` closes."""
    paths: dict[str, tuple[Callable[[], None], str]] = {}
    for name, transport in ((TENSORWIRE, None), (TENSORWIRE_NIXL, "nixl")):
        if transport == "nixl" and paths[TENSORWIRE][1] == "nixl":
            break  # tensorwire already chose NIXL: the row would repeat the first
        transfer = stack.enter_context(comm.prepare(op, local, remote, transport=transport))
        paths[name] = (_post_and_wait(transfer), transfer.transport)
    handle = raw.prepare(op.value, local, remote)
    stack.callback(handle.release)
    paths[RAW] = (functools.partial(raw.post_and_wait, handle), "nixl")
    return paths


def _copy_call(side: Side, size: int) -> Callable[[], None]:
    """One repetition of the yardstick: ``size`` bytes of the outbox copied; on the GPU the copy and a sync of the
    current stream (the CPU waits for it, as ``wait()`` does)."""
    copy = functools.partial(side.copy_dst[:size].copy_, side.outbox[:size])
    if side.memory == "cpu":
        return copy
    stream = torch.cuda.current_stream()

    def copy_and_sync() -> None:
        copy()
        stream.synchronize()

    return copy_and_sync


def _post_and_wait(transfer: Any) -> Callable[[], None]:
    """One repetition of the tensorwire path: post the prepared handle, wait for it."""
    def once() -> None:
        transfer.post()
        transfer.wait()

    return once


def _gpu_clock() -> CudaEventClock:
    """The clock of every GPU row: CUDA events with each chunk of calls queued before the GPU runs it, so a
    row is the GPU's time for the work (the CPU's launch cost is the ``tensorwire`` row's, host-timed). One
    per measurement: its first call runs outside the gate."""
    return CudaEventClock(queue_ahead=True)


def _bench_other_copies(side: Side, size: int, op: str, budget: Budget) -> list[Record]:
    """The copies not timed with the transfers: on the GPU the copy (CUDA events), on the host the copy
    with torch's default thread count (``copy-mt``, JSON only)."""
    src, dst = side.outbox[:size], side.copy_dst[:size]
    copy_once = functools.partial(dst.copy_, src)
    if side.memory == "cuda":
        return [_record(side.memory, op, size, COPY, measure(copy_once, _gpu_clock(), budget), "torch")]
    return [_record(side.memory, op, size, COPY_MT, measure(copy_once, HostClock(), budget), "torch",
                    threads=torch.get_num_threads())]
