"""What ``tensorwire bench p2p`` measures and what it records: the sizes, the path names, the configuration
and the ``BenchResult`` of a run (its records are ``tensorwire.bench.record.Record``, re-exported here). Plain
values; nothing here measures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .partial import PartialRecords
from .record import Record
from .timing import Budget

__all__ = [
    "HOST_SIZES", "CUDA_SIZES", "TENSORWIRE", "TENSORWIRE_NIXL", "RAW", "COPY", "COPY_MT", "COPY_SYNC",
    "EAGER_PATHS", "TENSORWIRE_STREAM",
    "TENSORWIRE_IN_PROCESS", "TENSORWIRE_GRAPH", "TENSORWIRE_PATHS", "RAW_CONFIGS", "IDLE_BYTES",
    "WAIT_RETURN_REPS", "BenchConfig", "Record", "BenchResult", "format_size",
]

HOST_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
CUDA_SIZES = HOST_SIZES + (256 << 20, 1 << 30)
TENSORWIRE, TENSORWIRE_NIXL, RAW, COPY, COPY_MT = "tensorwire", "tensorwire (nixl)", "raw nixl", "copy", "copy-mt"
TENSORWIRE_STREAM = "tensorwire (stream)"  # stream-ordered transports timed with CUDA events, like the copy
TENSORWIRE_IN_PROCESS = "tensorwire (in-process)"  # between two ranges of rank 0: the local transport
TENSORWIRE_GRAPH = "tensorwire (graph)"  # post(stream=) + wait(stream=) captured in a CUDA graph, replayed
# GPU memory: the copy then a sync of its stream, on the wall clock: what an eager post() + wait() is held against
COPY_SYNC = "copy + sync"
EAGER_PATHS = (TENSORWIRE, TENSORWIRE_NIXL)  # post() + wait() on the CPU's wall clock
TENSORWIRE_PATHS = (TENSORWIRE, TENSORWIRE_STREAM, TENSORWIRE_GRAPH, TENSORWIRE_IN_PROCESS, TENSORWIRE_NIXL)
RAW_CONFIGS = {
    "sleeping": "a bare nixl_agent per rank from tensorwire's make_agent with NIXL's defaults (UCX, error mode "
                "peer, 1 worker, thread sync NONE) except a sleeping progress thread, pthrDelay={delay_us} us, "
                "instead of NIXL's Python default 0, which spins a core per agent",
    "tensorwire": "a bare nixl_agent per rank configured exactly as tensorwire's own (make_agent's defaults: "
                  "sleeping progress thread, pthrDelay={delay_us} us, and tensorwire's thread sync mode), so only "
                  "tensorwire's Python layers differ",
    "nixl-default": "a bare nixl_agent per rank with every NIXL Python default, pthrDelay=0 included: its "
                    "progress thread spins a core per agent (distorts timings when threads outnumber cores)",
}
IDLE_BYTES = 1 << 20


def __getattr__(name: str) -> object:
    """``STREAM_ORDERED``, the transports whose completion is ordered on a CUDA stream, computed on first use:
    asking the transports imports them, and torch with them, which ``tensorwire bench --help`` does without."""
    if name == "STREAM_ORDERED":
        from ..backends.registry import stream_ordered_names

        globals()[name] = stream_ordered_names()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
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
    partial: PartialRecords | None = None  # where rank 0 adds each case's records as it measures them

    def sizes(self, memory: str) -> tuple[int, ...]:
        return self.host_sizes if memory == "cpu" else self.cuda_sizes


@dataclass
class BenchResult:
    records: list[Record]  # benchmark "p2p"; a copy's thread count is params["threads"]
    idle: list[dict[str, float]]  # per rank: rank, wall_s, cpu_s, cores
    raw_config: str  # the description of how the raw NIXL agents were built
    progress_wakeup_ms: float
    default_threads: int  # torch's thread count in rank 0 (copy-mt)
    ucx_version: str | None
    others: dict[str, float | None] = field(default_factory=dict)  # CPU other processes took meanwhile
    wait_returns: list[dict[str, Any]] = field(default_factory=list)  # GPU: see _bench_wait_returns


def format_size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
