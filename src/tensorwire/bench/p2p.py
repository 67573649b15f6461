"""``tensorwire bench``: point-to-point READ and WRITE between two local ranks, beside raw NIXL and a copy.

Two processes (``tensorwire.testing.launch``). Rank 0 initiates every transfer; rank 1 is the passive target
a one-sided transfer has, and only checks the bytes that landed. For each (memory, op, size), rank 0
measures, on the same registered buffers:

- ``tensorwire``: one ``comm.prepare`` handle, reused; a repetition is ``post()`` + ``wait()``. The record
  says which transport tensorwire chose (``Transfer.transport``); where that is not ``nixl`` (GPU memory
  on one host takes ``cuda_ipc``; host buffers, which live in a file of ``/dev/shm`` when it has room,
  take ``shm``), ``tensorwire (nixl)`` forces NIXL too, the row to hold against raw NIXL.
- ``raw nixl``: a second, bare ``nixl_agent`` per rank, as a raw NIXL user would drive it: metadata through
  a store, ``initialize_xfer`` once, then per repetition ``transfer()`` + a tight ``check_xfer_state`` loop.
  It is built by tensorwire's own ``_make_agent`` with NIXL's defaults except a sleeping progress thread
  (``RAW_CONFIGS``: NIXL's spinning default would distort both sides on a small machine), so the comparison
  isolates what tensorwire adds: its Python layers and its choice of NIXL thread-safety mode.
- ``tensorwire (in-process)`` (WRITE): rank 0's outbox into its own inbox through ``comm.prepare`` (the
  ``local`` transport), timed like the copy: the wall clock around ``post()`` + ``wait()`` on the host, CUDA
  events around ``post(stream=)`` + ``wait(stream=)`` on a GPU.
- ``tensorwire (graph)`` (GPU, ``graphs=True``): ``post(stream=)`` + ``wait(stream=)`` captured once in a
  CUDA graph and replayed: the post-to-completion time on the stream.
- ``wait(stream=)`` return (GPU): how long ``wait(stream=)`` keeps the CPU while the largest WRITE is still in
  flight, per transport (the one tensorwire chooses, and NIXL forced), and whether the transfer was indeed
  still in flight when the call returned (an event recorded after the wait had not fired).
- ``copy``: ``dst.copy_(src)`` of the same bytes inside rank 0: host memory with one thread (a transfer is
  one stream of bytes), plus torch's default thread count as ``copy-mt`` (JSON).

The GPU rows ``tensorwire (stream)``, ``tensorwire (graph)``, ``tensorwire (in-process)`` and ``copy`` are
timed with CUDA events, each chunk of calls enqueued before the GPU may start it
(``CudaEventClock(queue_ahead=True)``): a row is the GPU's time for the work, as a serving loop that keeps its
GPU fed sees it, not the CPU's launch rate (an eager 4 KiB copy is mostly launch). What the CPU pays for a
transfer is in the ``tensorwire`` row: the wall clock around ``post()`` + ``wait()``.

The transfer paths are timed interleaved (``measure_interleaved``): run to run, this VM's 64 MiB copies
wander by 15%, which back-to-back measurement turned into fake ratios. Each rank's buffer is
``[outbox | inbox]``: READ pulls the peer's outbox into the local inbox, WRITE pushes the local outbox into
the peer's inbox. Outboxes hold ``rank_pattern`` bytes. Every path must first move the right bytes on its
own (the inbox is checked, then cleared; rank 1 checks its own when rank 0 asks through the store) and all
must still be right after the timing, so a path that moved wrong bytes, or none, fails the benchmark
instead of reporting a fast number.

Before any of that, both ranks measure the CPU an idle, connected communicator costs (getrusage).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.base import Op
from ..descriptors import MemoryKind, TensorDesc
from ..errors import InvalidArgumentError, TransferError
from ..testing.data import first_mismatch, rank_pattern
from .command import add_common_arguments, at_least, check_plot, memories, parse_sizes, write_json
from .timing import Budget, Clock, CudaEventClock, HostClock, Timing, measure, measure_interleaved, summarize

__all__ = [
    "HOST_SIZES", "CUDA_SIZES", "RAW_CONFIGS", "BenchConfig", "Record", "BenchResult", "run", "rank_pattern",
    "first_mismatch", "format_size", "TENSORWIRE_STREAM", "TENSORWIRE_IN_PROCESS", "TENSORWIRE_GRAPH",
    "HELP", "add_arguments", "main",
]

HOST_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
CUDA_SIZES = HOST_SIZES + (256 << 20, 1 << 30)
TENSORWIRE, TENSORWIRE_NIXL, RAW, COPY, COPY_MT = "tensorwire", "tensorwire (nixl)", "raw nixl", "copy", "copy-mt"
TENSORWIRE_STREAM = "tensorwire (stream)"  # stream-ordered transports timed with CUDA events, like the copy
TENSORWIRE_IN_PROCESS = "tensorwire (in-process)"  # between two ranges of rank 0: the local transport
TENSORWIRE_GRAPH = "tensorwire (graph)"  # post(stream=) + wait(stream=) captured in a CUDA graph, replayed
STREAM_ORDERED = ("cuda_ipc", "local")
_TENSORWIRE_PATHS = (TENSORWIRE, TENSORWIRE_STREAM, TENSORWIRE_GRAPH, TENSORWIRE_IN_PROCESS, TENSORWIRE_NIXL)
RAW_CONFIGS = {
    "sleeping": "a bare nixl_agent per rank from tensorwire's _make_agent with NIXL's defaults (UCX, error mode "
                "peer, 1 worker, thread sync NONE) except a sleeping progress thread, pthrDelay={delay_us} µs, "
                "instead of NIXL's Python default 0, which spins a core per agent",
    "tensorwire": "a bare nixl_agent per rank configured exactly as tensorwire's own (_make_agent's defaults: "
                  "sleeping progress thread, pthrDelay={delay_us} µs, and tensorwire's thread sync mode), so only "
                  "tensorwire's Python layers differ",
    "nixl-default": "a bare nixl_agent per rank with every NIXL Python default, pthrDelay=0 included: its "
                    "progress thread spins a core per agent (distorts timings when threads outnumber cores)",
}
_IDLE_BYTES = 1 << 20
WAIT_RETURN_REPS = 20


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``memories`` among "cpu", "cuda"; sizes in bytes per memory."""

    memories: tuple[str, ...] = ("cpu",)
    host_sizes: tuple[int, ...] = HOST_SIZES
    cuda_sizes: tuple[int, ...] = CUDA_SIZES
    budget: Budget = field(default_factory=Budget)
    idle_s: float = 2.0
    raw_config: str = "sleeping"
    quiet_nixl: bool = False
    progress: bool = True
    timeout_s: float = 600.0
    graphs: bool = False  # GPU: also time post(stream=) + wait(stream=) replayed from a CUDA graph

    def sizes(self, memory: str) -> tuple[int, ...]:
        return self.host_sizes if memory == "cpu" else self.cuda_sizes


@dataclass(frozen=True)
class Record:
    """One measured path of one (memory, op, size); times in µs, bandwidth in GB/s at the median."""

    memory: str
    op: str
    size: int
    path: str
    median_us: float
    p10_us: float
    p90_us: float
    gbps: float
    reps: int
    transport: str  # what moved the bytes: "nixl", "cuda_ipc", "local" or "torch" (copies)
    threads: int | None = None  # host copies only

    @staticmethod
    def of(memory: str, op: str, size: int, path: str, timing: Timing, transport: str,
           threads: int | None = None) -> Record:
        return Record(memory, op, size, path, timing.median_us, timing.p10_us, timing.p90_us,
                      timing.gbps(size), timing.reps, transport, threads)


@dataclass
class BenchResult:
    records: list[Record]
    idle: list[dict[str, float]]  # per rank: rank, wall_s, cpu_s, cores
    raw_config: str  # the description of how the raw NIXL agents were built
    progress_wakeup_ms: float
    default_threads: int  # torch's thread count in rank 0 (copy-mt)
    ucx_version: str | None
    others: dict[str, float | None] = field(default_factory=dict)  # CPU other processes took meanwhile
    wait_returns: list[dict[str, Any]] = field(default_factory=list)  # GPU: see _bench_wait_returns


# --- the raw NIXL baseline ---------------------------------------------------------------------------
class _RawNixl:
    """A bare NIXL agent per rank, driven as a raw NIXL user would (see the module docstring)."""

    def __init__(self, rank: int, store: Any, raw_config: str, wakeup_ms: float) -> None:
        from ..backends.nixl import _import_nixl, _make_agent

        api, bindings = _import_nixl()
        self.rank = rank
        self.name, self.peer_name = f"bench-raw-rank{rank}", f"bench-raw-rank{1 - rank}"
        self.store = store  # also carries the benchmark's own requests (see _InboxChecker)
        if raw_config == "sleeping":
            self.agent = _make_agent(api, bindings, self.name, wakeup_ms, sync_mode="NONE")
        elif raw_config == "tensorwire":
            self.agent = _make_agent(api, bindings, self.name, wakeup_ms)
        else:
            self.agent = api.nixl_agent(self.name)
        self._registrations: list[Any] = []

    def register(self, tensor: torch.Tensor) -> None:
        self._registrations.append(self.agent.register_memory([tensor]))

    def exchange_metadata(self) -> None:
        """Publish this agent's metadata (after every registration) and load the peer's."""
        self.store.set(f"raw-md/{self.rank}", self.agent.get_agent_metadata())
        self.agent.add_remote_agent(self.store.get(f"raw-md/{1 - self.rank}"))

    def prepare(self, op: str, local: torch.Tensor, remote: TensorDesc) -> Any:
        mem_type = "DRAM" if remote.kind is MemoryKind.CPU else "VRAM"
        local_descs = self.agent.get_xfer_descs(local)
        remote_descs = self.agent.get_xfer_descs([(remote.addr, remote.nbytes, max(remote.device_index, 0))], mem_type)
        return self.agent.initialize_xfer(op, local_descs, remote_descs, self.peer_name)

    def post_and_wait(self, handle: Any) -> None:
        agent = self.agent
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(f"bench: raw NIXL transfer to {self.peer_name} ended in state {state!r}")

    def close(self) -> None:
        """Deregister and drop the agent. Idempotent."""
        if self.agent is None:
            return
        for registration in self._registrations:
            self.agent.deregister_memory(registration)
        self._registrations = []
        self.agent = None  # dropping the agent joins its progress thread


# --- one rank ----------------------------------------------------------------------------------------
@dataclass
class _Side:
    """This rank's buffers for one memory kind."""

    memory: str
    buffer: torch.Tensor  # [outbox | inbox], registered with tensorwire and raw NIXL
    half: int  # bytes in each box
    own: torch.Tensor  # what this rank's outbox holds
    peer: torch.Tensor  # what the peer's outbox holds
    copy_dst: torch.Tensor | None  # rank 0: destination of the local copy
    registration: Any
    remote: TensorDesc | None = None  # the peer's buffer
    shared_file: str | None = None  # the host buffer's file in /dev/shm, removed at the end

    @property
    def outbox(self) -> torch.Tensor:
        return self.buffer[: self.half]

    @property
    def inbox(self) -> torch.Tensor:
        return self.buffer[self.half:]

    def sync(self) -> None:
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)


def _rank_main(config: BenchConfig) -> dict[str, Any]:
    """One rank of the benchmark (run by ``launch``). Rank 0 returns the records."""
    import datetime as dt

    import torch.distributed as dist

    import tensorwire as tw

    from ..bootstrap import resolve_environment

    if config.quiet_nixl:
        from ..backends.nixl import quiet_nixl_logging

        quiet_nixl_logging()
    env = resolve_environment()
    # Our own store, lent to tw.init, also carries the raw agents' metadata under "bench/".
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0,
                          timeout=dt.timedelta(seconds=config.timeout_s), wait_for_workers=False)
    comm = tw.init(timeout=config.timeout_s, store=store)
    bench_store = dist.PrefixStore("bench/", store)
    result: dict[str, Any] = {"rank": comm.rank}
    try:
        result["idle"] = _measure_idle(comm, config.idle_s) if config.idle_s > 0 else None
        raw = _RawNixl(comm.rank, bench_store, config.raw_config, comm.config.progress_wakeup_ms)
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
    # Rank 0 hosts the store: it must outlive rank 1's last use of it (close() announces departure).
    if comm.rank == 1:
        bench_store.set("closed", b"1")
    else:
        bench_store.wait(["closed"])
    return result


def _measure_idle(comm: Any, seconds: float) -> dict[str, float]:
    """CPU an idle, connected communicator burns, in cores: getrusage(RUSAGE_SELF) user+sys over ``seconds``.

    Both ranks register 1 MiB and READ 4 KiB from each other first, so endpoints exist on both sides, then
    sleep through the same window between two barriers (a barrier waits in a blocking socket call).
    """
    buffer = torch.zeros(_IDLE_BYTES, dtype=torch.uint8)
    with comm.register(buffer) as registration:
        comm.publish("bench/idle", registration.descs)
        remote = comm.lookup("bench/idle", 1 - comm.rank)[0]
        comm.read(buffer[:4096], remote.narrow(4096, 4096))
        comm.barrier()
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        time.sleep(seconds)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
        comm.barrier()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"rank": comm.rank, "wall_s": wall, "cpu_s": cpu, "cores": cpu / wall}


def _bench_all(comm: Any, raw: _RawNixl, config: BenchConfig) -> tuple[list[Record], list[dict[str, Any]]]:
    sides = [_make_side(comm, raw, memory, max(config.sizes(memory))) for memory in config.memories]
    raw.exchange_metadata()
    for side in sides:
        side.remote = comm.lookup(f"bench/{side.memory}", 1 - comm.rank)[0]
    records: list[Record] = []
    wait_returns: list[dict[str, Any]] = []
    checker = _InboxChecker(raw.store)
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
            side.registration.close()
            if side.shared_file is not None:
                os.unlink(side.shared_file)  # the mapping lives on until the buffer is freed
    return records, wait_returns


def _make_side(comm: Any, raw: _RawNixl, memory: str, size: int) -> _Side:
    device = comm.device if memory == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own, peer = rank_pattern(size, comm.rank, device), rank_pattern(size, 1 - comm.rank, device)
    shared_file = None
    if device.type == "cuda":
        buffer = torch.zeros(2 * size, dtype=torch.uint8, device=device)
    else:
        buffer, shared_file = _host_buffer(2 * size)
    buffer[:size].copy_(own)
    copy_dst = torch.zeros(size, dtype=torch.uint8, device=device) if comm.rank == 0 else None
    registration = comm.register(buffer)
    raw.register(buffer)
    comm.publish(f"bench/{memory}", registration.descs)
    side = _Side(memory, buffer, size, own, peer, copy_dst, registration, shared_file=shared_file)
    side.sync()
    return side


def _host_buffer(nbytes: int) -> tuple[torch.Tensor, str | None]:
    """A zeroed host buffer in a file of ``/dev/shm`` when it has room for both ranks' (a peer on this host
    then reaches it through the ``shm`` transport, as a user's shared buffer would be), else anonymous
    memory, which NIXL carries. Returns the buffer and its file."""
    directory = "/dev/shm"
    try:
        stats = os.statvfs(directory)
    except OSError:
        return torch.zeros(nbytes, dtype=torch.uint8), None
    if stats.f_bavail * stats.f_frsize < 4 * nbytes:  # a full tmpfs would kill a writer with SIGBUS
        return torch.zeros(nbytes, dtype=torch.uint8), None
    path = os.path.join(directory, f"tensorwire-bench-{os.getpid()}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), path


def _bench_size(comm: Any, raw: _RawNixl, side: _Side, size: int, config: BenchConfig,
                checker: _InboxChecker) -> list[Record]:
    """Rank 0: READ then WRITE of ``size`` bytes. The transfer paths are timed interleaved (they are what is
    compared); each must first move the right bytes on its own, and all still do after the timing."""
    records: list[Record] = []
    remote_outbox, remote_inbox = side.remote.narrow(0, size), side.remote.narrow(side.half, size)
    cases = ((Op.READ, side.inbox[:size], remote_outbox), (Op.WRITE, side.outbox[:size], remote_inbox))
    for op, local, remote in cases:
        if config.progress:
            print(f"bench: {side.memory} {op.value:<5} {format_size(size)}", file=sys.stderr, flush=True)
        with contextlib.ExitStack() as stack:
            paths = _transfer_paths(comm, raw, op, local, remote, stack)
            for name, (once, _) in paths.items():
                once()
                _check_path(side, size, op, name, checker)
            compared = {name: once for name, (once, _) in paths.items()}
            if side.memory == "cpu":  # the host copy is the yardstick: time it alongside, on one thread
                compared[COPY] = functools.partial(side.copy_dst[:size].copy_, side.outbox[:size])
                paths[COPY] = (compared[COPY], "torch")
                stack.enter_context(_torch_threads(1))
            timings = measure_interleaved(compared, HostClock(), config.budget)
            _check_path(side, size, op, " + ".join(p for p in paths if p != COPY), checker)
        records += [Record.of(side.memory, op.value, size, name, timings[name], transport,
                              threads=1 if name == COPY else None)
                    for name, (_, transport) in paths.items()]
        records += _bench_other_copies(side, size, op.value, config.budget)
        if paths[TENSORWIRE][1] in STREAM_ORDERED:
            records.append(_bench_on_stream(comm, side, size, op, local, remote, config.budget, checker))
            if config.graphs:
                records.append(_bench_graph(comm, side, size, op, local, remote, config.budget, checker))
        if op is Op.WRITE:
            records.append(_bench_in_process(comm, side, size, config.budget))
    return records


def _bench_in_process(comm: Any, side: _Side, size: int, budget: Budget) -> Record:
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
        _check_inbox(side, size, what, expected=side.own)
        with _torch_threads(1):  # as the host copy it is compared with
            timing = measure(once, clock, budget)
        _check_inbox(side, size, what, expected=side.own)  # still the right bytes after the timing
        return Record.of(side.memory, Op.WRITE.value, size, TENSORWIRE_IN_PROCESS, timing, transfer.transport)


def _bench_wait_returns(comm: Any, side: _Side, checker: _InboxChecker) -> list[dict[str, Any]]:
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
                start = time.perf_counter_ns()
                transfer.wait(stream=stream)
                returns_s.append((time.perf_counter_ns() - start) * 1e-9)
                after = torch.cuda.Event()
                after.record(stream)
                in_flight += not after.query()
                after.synchronize()
            _check_path(side, size, Op.WRITE, f"wait(stream=) over {transfer.transport}", checker)
            timing = summarize(returns_s)
            out.append({"transport": transfer.transport, "op": Op.WRITE.value, "size": size,
                        "median_us": timing.median_us, "p10_us": timing.p10_us, "p90_us": timing.p90_us,
                        "first_us": returns_s[0] * 1e6, "reps": timing.reps, "in_flight": in_flight})
    return out


def _bench_on_stream(comm: Any, side: _Side, size: int, op: Op, local: torch.Tensor, remote: TensorDesc,
                     budget: Budget, checker: _InboxChecker) -> Record:
    """A stream-ordered transport timed the way the device copy is: ``post(stream=)`` + ``wait(stream=)``
    between two CUDA events on the current stream, so no CPU round trip sits inside the interval."""
    stream = torch.cuda.current_stream()
    with comm.prepare(op, local, remote) as transfer:

        def once() -> None:
            transfer.post(stream=stream)
            transfer.wait(stream=stream)

        once()
        stream.synchronize()
        _check_path(side, size, op, f"{TENSORWIRE_STREAM}", checker)
        timing = measure(once, _gpu_clock(), budget)
        return Record.of(side.memory, op.value, size, TENSORWIRE_STREAM, timing, transfer.transport)


def _bench_graph(comm: Any, side: _Side, size: int, op: Op, local: torch.Tensor, remote: TensorDesc,
                 budget: Budget, checker: _InboxChecker) -> Record:
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
        _check_path(side, size, op, TENSORWIRE_GRAPH, checker)
        timing = measure(graph.replay, _gpu_clock(), budget)
        torch.cuda.current_stream().synchronize()  # no replay may still run when the handle closes
        return Record.of(side.memory, op.value, size, TENSORWIRE_GRAPH, timing, transfer.transport)


@contextlib.contextmanager
def _torch_threads(count: int):
    """Run the block with ``count`` torch intra-op threads (it does not touch NIXL, which has its own)."""
    default = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(default)


def _transfer_paths(comm: Any, raw: _RawNixl, op: Op, local: torch.Tensor, remote: TensorDesc,
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


def _post_and_wait(transfer: Any) -> Callable[[], None]:
    """One repetition of the tensorwire path: post the prepared handle, wait for it."""
    def once() -> None:
        transfer.post()
        transfer.wait()

    return once


def _check_path(side: _Side, size: int, op: Op, path: str, checker: _InboxChecker) -> None:
    """Rank 0 checks its own inbox after a READ path and asks rank 1 to check its inbox after a WRITE."""
    if op is Op.READ:
        _check_inbox(side, size, f"{path} READ")
    else:
        checker.ask(side.memory, size, f"{path} WRITE")


def _gpu_clock() -> CudaEventClock:
    """The clock of every GPU row: CUDA events with each chunk of calls queued before the GPU runs it, so a
    row is the GPU's time for the work (the CPU's launch cost is the ``tensorwire`` row's, host-timed). One
    per measurement: its first call runs outside the gate."""
    return CudaEventClock(queue_ahead=True)


def _bench_other_copies(side: _Side, size: int, op: str, budget: Budget) -> list[Record]:
    """The copies not timed with the transfers: on the GPU the copy (CUDA events), on the host the copy
    with torch's default thread count (``copy-mt``, JSON only)."""
    src, dst = side.outbox[:size], side.copy_dst[:size]
    copy_once = functools.partial(dst.copy_, src)
    if side.memory == "cuda":
        return [Record.of(side.memory, op, size, COPY, measure(copy_once, _gpu_clock(), budget), "torch")]
    return [Record.of(side.memory, op, size, COPY_MT, measure(copy_once, HostClock(), budget), "torch",
                      threads=torch.get_num_threads())]


def _check_inbox(side: _Side, size: int, what: str, expected: torch.Tensor | None = None) -> None:
    """The first ``size`` bytes of this rank's inbox must be ``expected`` (default: the peer's outbox); then
    clear them for the next path. Raises ``TransferError`` naming ``what`` moved wrong bytes."""
    side.sync()
    expected = side.peer if expected is None else expected
    index = first_mismatch(side.inbox[:size], expected[:size])
    if index is not None:
        raise TransferError(
            f"bench: after the {what}s of {size} bytes ({side.memory}), byte {index} of an inbox is "
            f"{int(side.inbox[index])} but the source holds {int(expected[index])}: the transfer moved wrong "
            "bytes or none; run 'tensorwire doctor'"
        )
    side.inbox[:size].zero_()
    side.sync()


class _InboxChecker:
    """Rank 0 asks, through the store, and rank 1 checks (and clears) its inbox after each WRITE path."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._sequence = 0

    def ask(self, memory: str, size: int, what: str) -> None:
        """Rank 0: block until rank 1 checked; re-raise its finding here, where the path is known."""
        reply = self._call(f"check {memory} {size} {what}")
        if reply != "ok":
            raise TransferError(reply)

    def finish(self) -> None:
        self._call("done")

    def serve(self, sides: dict[str, _Side]) -> None:
        """Rank 1: answer requests until rank 0 says ``done``."""
        while True:
            request = self._store.get(f"ask/{self._sequence}").decode()
            if request == "done":
                self._store.set(f"answer/{self._sequence}", b"ok")
                return
            _, memory, size, what = request.split(" ", 3)
            try:
                _check_inbox(sides[memory], int(size), what)
                reply = "ok"
            except TransferError as e:
                reply = str(e)
            self._store.set(f"answer/{self._sequence}", reply.encode())
            self._sequence += 1

    def _call(self, request: str) -> str:
        self._store.set(f"ask/{self._sequence}", request.encode())
        reply = self._store.get(f"answer/{self._sequence}").decode()
        self._sequence += 1
        return reply


# --- orchestration -----------------------------------------------------------------------------------
def run(config: BenchConfig) -> BenchResult:
    """Launch the two ranks, wait for them, and gather the result. Raises ``RankFailedError`` (a
    ``TensorwireError``) when a rank fails, ``WaitTimeoutError`` after ``config.timeout_s``."""
    from ..testing import launch

    if config.raw_config not in RAW_CONFIGS:
        raise InvalidArgumentError(f"bench: raw_config={config.raw_config!r}; choose one of {sorted(RAW_CONFIGS)}")
    before = _CpuSnapshot.now()
    rank0, rank1 = launch(_rank_main, 2, config, timeout=config.timeout_s)
    others = _CpuSnapshot.now().others_since(before)
    delay_us = int(max(rank0["progress_wakeup_ms"], 1.0) * 1000)
    return BenchResult(
        records=rank0["records"],
        idle=[r["idle"] for r in (rank0, rank1) if r["idle"] is not None],
        raw_config=RAW_CONFIGS[config.raw_config].format(delay_us=delay_us),
        progress_wakeup_ms=rank0["progress_wakeup_ms"],
        default_threads=rank0["default_threads"],
        ucx_version=rank0.get("ucx_version"),
        others=others,
        wait_returns=rank0["wait_returns"],
    )


@dataclass(frozen=True)
class _CpuSnapshot:
    """Machine-wide busy and steal CPU seconds (/proc/stat; None elsewhere) and this process tree's own."""

    busy_s: float | None
    steal_s: float | None
    own_s: float  # this process plus its reaped children: the ranks, once launch has joined them
    wall_s: float

    @staticmethod
    def now() -> _CpuSnapshot:
        busy = steal = None
        try:
            with open("/proc/stat") as stat:
                ticks = [int(x) for x in stat.readline().split()[1:]]
            per_second = os.sysconf("SC_CLK_TCK")
            busy = (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / per_second  # user nice system irq softirq
            steal = ticks[7] / per_second
        except (OSError, ValueError, IndexError):
            pass
        own = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return _CpuSnapshot(busy, steal, sum(r.ru_utime + r.ru_stime for r in own), time.perf_counter())

    def others_since(self, before: _CpuSnapshot) -> dict[str, float | None]:
        """Average cores other processes used (``other_cores``) and the hypervisor stole (``steal_cores``):
        anything above a few hundredths on a machine with few cores disturbed the timings."""
        wall = self.wall_s - before.wall_s
        if self.busy_s is None or before.busy_s is None or wall <= 0:
            return {"other_cores": None, "steal_cores": None}
        others = (self.busy_s - before.busy_s) - (self.own_s - before.own_s)
        return {"other_cores": max(others, 0.0) / wall, "steal_cores": (self.steal_s - before.steal_s) / wall}


def format_size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


# --- the command: tensorwire bench [p2p] -------------------------------------------------------------
HELP = "READ/WRITE between two local ranks beside raw NIXL and a local copy (the default)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tensorwire bench p2p`` (also those of plain ``tensorwire bench``)."""
    parser.description = ("Point-to-point READ/WRITE from rank 0 to rank 1 (two local processes), each size timed "
                          "for tensorwire, a bare NIXL agent pair and a local copy of the same bytes.")
    add_common_arguments(parser, graphs_help="GPU: also time transfers captured in CUDA graphs and replayed")
    parser.add_argument("--sizes", type=parse_sizes, default=None, metavar="LIST",
                        help="comma-separated sizes, e.g. 4K,64K,1M (default: 4K,64K,1M,16M,64M; GPU up to 1G)")
    parser.add_argument("--time-budget", type=at_least(float), default=0.3, metavar="S",
                        help="seconds of timed calls per measurement, at least --min-reps calls (default 0.3)")
    parser.add_argument("--min-reps", type=at_least(int), default=20, help="fewest timed calls (default 20)")
    parser.add_argument("--iters", type=at_least(int), default=None,
                        help="time exactly this many calls instead of the time budget")
    parser.add_argument("--warmup", type=at_least(float), default=0.05, metavar="S",
                        help="seconds of untimed warm-up per measurement (default 0.05)")
    parser.add_argument("--idle-seconds", type=at_least(float), default=2.0, metavar="S",
                        help="how long to measure an idle communicator's CPU; 0 skips it (default 2)")
    parser.add_argument("--raw-config", choices=list(RAW_CONFIGS), default="sleeping",
                        help="how the raw NIXL agents are built: 'sleeping' (default) NIXL's defaults but a "
                             "sleeping progress thread; 'tensorwire' exactly tensorwire's agent configuration; "
                             "'nixl-default' every NIXL default (a progress thread that spins a core)")
    # Flags of 'bench moe', accepted here only to say where they belong (argparse would just call them unknown).
    for flag in ("--ranks", "--backends"):
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write ``--json`` / ``--plot``; blocks until both ranks are done."""
    from ..backends.nixl import quiet_nixl_logging
    from . import report

    for flag, value in (("--ranks", args.ranks), ("--backends", args.backends)):
        if value is not None:
            args.parser.error(f"{flag} applies to 'tensorwire bench moe'; the p2p bench runs rank 0 -> rank 1")
    quiet_nixl_logging()
    check_plot(args)
    config = BenchConfig(
        memories=memories(args),
        host_sizes=args.sizes or HOST_SIZES,
        cuda_sizes=args.sizes or CUDA_SIZES,
        budget=Budget(time_s=args.time_budget, min_reps=max(args.min_reps, 1), warmup_s=args.warmup,
                      iters=args.iters or None),
        idle_s=args.idle_seconds,
        raw_config=args.raw_config,
        quiet_nixl=True,
        progress=not args.quiet,
        timeout_s=args.timeout,
        graphs=args.graphs,
    )
    head = report.header(args.argv)
    result = run(config)
    print(report.format_report(result, head, config), flush=True)
    if args.json is not None:
        write_json(args.json, report.to_json(result, head, config))
    if args.plot is not None:
        from .plot import plot

        plot(result.records, args.plot, title=f"tensorwire bench, {head['hostname']}, {head['date'][:10]}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
