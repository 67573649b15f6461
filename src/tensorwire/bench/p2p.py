"""``tensorwire bench [p2p]``: point-to-point READ and WRITE between two local ranks, beside raw NIXL and a
copy. This module is the command and ``run``; one rank's measuring is ``p2p_rank.py``, the byte checks
``p2p_inbox.py``, the baseline ``raw_nixl.py``, the names and configuration ``p2p_records.py`` (the records are
``record.Record``, every tensorwire row held against the copy), the tables ``p2p_report.py``.

Two processes (``tensorwire.testing.launch``). Rank 0 initiates every transfer; rank 1 is the passive target
a one-sided transfer has, and only checks the bytes that landed. For each (memory, op, size), rank 0
measures, on the same registered buffers:

- ``tensorwire``: one ``comm.prepare`` handle, reused; a repetition is ``post()`` + ``wait()``. The record
  says which transport tensorwire chose (``Transfer.transport``); where that is not ``nixl`` (GPU memory
  on one host takes ``cuda_ipc``; host buffers, which live in a file of ``/dev/shm`` when it has room,
  take ``shm``), ``tensorwire (nixl)`` forces NIXL too, the row to hold against raw NIXL.
- ``raw nixl``: a second, bare ``nixl_agent`` per rank, as a raw NIXL user would drive it: metadata through
  a store, ``initialize_xfer`` once, then per repetition ``transfer()`` + a tight ``check_xfer_state`` loop.
  It is built by tensorwire's own ``make_agent`` with NIXL's defaults except a sleeping progress thread
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
import os
import resource
import sys
from dataclasses import dataclass, replace

from ..errors import InvalidArgumentError
from .command import (
    add_common_arguments,
    announce,
    at_least,
    check_plot,
    header_lines,
    memories,
    parse_sizes,
    require_nixl,
    write_json,
)
from .p2p_records import (
    CUDA_SIZES,
    HOST_SIZES,
    RAW_CONFIGS,
    TENSORWIRE,
    TENSORWIRE_GRAPH,
    TENSORWIRE_IN_PROCESS,
    TENSORWIRE_STREAM,
    BenchConfig,
    BenchResult,
    Record,
    format_size,
)
from .partial import measure_until_interrupted
from .timing import Budget, host_seconds

# Besides the command, the names this module always had: its measuring now lives in p2p_rank.py (one rank),
# p2p_inbox.py (the byte checks), raw_nixl.py (the baseline) and p2p_records.py (what a run records).
__all__ = [
    "HOST_SIZES", "CUDA_SIZES", "RAW_CONFIGS", "BenchConfig", "Record", "BenchResult", "run", "format_size",
    "TENSORWIRE", "TENSORWIRE_STREAM", "TENSORWIRE_IN_PROCESS", "TENSORWIRE_GRAPH",
    "HELP", "add_arguments", "main",
]


def __getattr__(name: str) -> object:
    """``rank_pattern`` and ``first_mismatch``, names this module always re-exported, imported on first use:
    ``tensorwire.testing.data`` imports torch, which ``tensorwire bench --help`` does without."""
    if name in ("rank_pattern", "first_mismatch"):
        from ..testing import data

        return getattr(data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- orchestration -----------------------------------------------------------------------------------
def run(config: BenchConfig) -> BenchResult:
    """Launch the two ranks, wait for them, and gather the result. Raises ``RankFailedError`` (a
    ``TensorwireError``) when a rank fails, ``WaitTimeoutError`` after ``config.timeout_s``."""
    from ..testing import launch
    from .p2p_rank import rank_main

    if config.raw_config not in RAW_CONFIGS:
        raise InvalidArgumentError(f"bench: raw_config={config.raw_config!r}; choose one of {sorted(RAW_CONFIGS)}")
    before = _CpuSnapshot.now()
    rank0, rank1 = launch(rank_main, 2, config, timeout=config.timeout_s)
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
        return _CpuSnapshot(busy, steal, sum(r.ru_utime + r.ru_stime for r in own), host_seconds())

    def others_since(self, before: _CpuSnapshot) -> dict[str, float | None]:
        """Average cores other processes used (``other_cores``) and the hypervisor stole (``steal_cores``):
        anything above a few hundredths on a machine with few cores disturbed the timings."""
        wall = self.wall_s - before.wall_s
        if self.busy_s is None or before.busy_s is None or wall <= 0:
            return {"other_cores": None, "steal_cores": None}
        others = (self.busy_s - before.busy_s) - (self.own_s - before.own_s)
        return {"other_cores": max(others, 0.0) / wall, "steal_cores": (self.steal_s - before.steal_s) / wall}


# --- the command: tensorwire bench [p2p] -------------------------------------------------------------
HELP = "READ/WRITE between two local ranks beside raw NIXL and a local copy (the default)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tensorwire bench p2p`` (also those of plain ``tensorwire bench``)."""
    parser.epilog = ("Needs: the nixl package (pip install 'tensorwire[nixl]': raw NIXL is the reference); for "
                     "--memory cuda, a CUDA device torch sees. Starts its two ranks as local processes on 127.0.0.1.")
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
    for flag in ("--ranks", "--engines"):
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark: the header on stdout, each case's rows as soon as it is measured (a progress line per case
    on stderr as it starts), then the legend and the summary; write ``--json`` / ``--plot``; blocks until both ranks
    are done. Ctrl-C stops both ranks at once: the rows measured stay the report (exit code 130)."""
    from ..backends.nixl import quiet_nixl_logging
    from . import p2p_report as report

    for flag, value in (("--ranks", args.ranks), ("--engines", args.engines)):
        if value is not None:
            args.parser.error(f"{flag} applies to 'tensorwire bench moe'; the p2p bench runs rank 0 -> rank 1")
    require_nixl(args, "bench p2p (tensorwire beside raw NIXL)")
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
    unfinished = _unfinished_result(config)
    announce(header_lines(report.TITLE, head, report.method_rows(config, unfinished.raw_config,
                                                                 unfinished.progress_wakeup_ms,
                                                                 unfinished.default_threads)))
    result, so_far = measure_until_interrupted(lambda partial: run(replace(config, partial=partial)), "p2p",
                                               report.TABLE)
    interrupted = result is None
    if interrupted:
        result = replace(unfinished, records=so_far)
    if result.records:
        print("\n".join(report.tail_lines(result, interrupted)), flush=True)
    if args.json is not None:
        write_json(args.json, {**report.to_json(result, head, config), "interrupted": interrupted})
    if args.plot is not None and result.records:
        from .plot import plot

        plot(result.records, args.plot, title=f"tensorwire bench, {head['hostname']}, {head['date'][:10]}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 130 if interrupted else 0


def _unfinished_result(config: BenchConfig) -> BenchResult:
    """What the header says before the ranks ran, and a run cut short reports: no records, no idle figures; the
    configuration the ranks will read (this machine's, this environment's)."""
    import torch

    from ..config import load

    wakeup_ms = load().progress_wakeup_ms
    return BenchResult(records=[], idle=[], ucx_version=None, progress_wakeup_ms=wakeup_ms,
                       raw_config=RAW_CONFIGS[config.raw_config].format(delay_us=int(max(wakeup_ms, 1.0) * 1000)),
                       default_threads=torch.get_num_threads())
