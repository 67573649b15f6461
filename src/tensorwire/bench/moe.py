"""MoE dispatch and combine per engine, beside a local copy of the same bytes, between local ranks.

``run_moe_bench(args)`` launches ``world_size`` ranks (``tensorwire.testing.launch``); every rank routes
``T`` tokens of ``H`` elements to ``topk`` of ``num_experts`` experts (a fixed random routing, 10% of the
slots empty), then, per engine, runs ``warmup`` untimed and ``reps`` timed dispatch + combine pairs
(identity experts). Every rank makes the same calls (they are collective), so repetitions are counted,
not time-budgeted. Rank 0 reports.

Bytes are counted as DeepEP counts them: once per (token, expert) pair, ``rows x H x element size``,
where ``rows`` are the pairs rank 0 sends (dispatch) or gets back (combine). Beside each engine's
number stands a copy of the same bytes inside rank 0 (``dst.copy_(src)``, host memory or device
memory), timed in the same run, and the ratio; and the same copy made by every rank at once (``shared
copy``), the yardstick where ranks share one device: two ranks on one GPU both move their bytes through
its memory in every step, as their dispatches do, so a step cannot beat both copies made together (with a
GPU per rank the two copies agree). Times: median and p10/p90 in microseconds; host memory
is timed with ``perf_counter``, GPU memory with CUDA events. Every rank checks its combine output
(``x * sum of valid weights``) after timing: an engine that moved wrong bytes fails the benchmark.

With ``graphs=True`` the ``cuda`` engine is also timed as ``cuda (graph)``: dispatch and combine with
``capacity = world_size * T * topk`` (the most a rank can receive: no overflow possible), each captured
once in a CUDA graph and replayed, so the time is the device's, without the Python launch cost an eager
call pays on every step.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..backends.nixl_setup import INSTALL_NIXL, nixl_installed
from ..errors import InvalidArgumentError, TransferError
from ..moe import collectives
from ..moe.selection import ENGINES
from .command import (
    add_common_arguments,
    announce,
    at_least,
    check_plot,
    finish,
    header,
    header_lines,
    memories,
    progress,
)
from .partial import PartialRecords, Table, measured_records
from .record import STEADY_SPREAD, Record
from .timing import CudaEventClock, HostClock, Timing, steadiest, summarize, time_call

__all__ = ["MoeBenchConfig", "format_moe_report", "run_moe_bench", "skip_reason", "HELP", "add_arguments", "main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoeBenchConfig:
    """What to measure. ``memory`` "cpu" or "cuda"; None fields take the memory's defaults (see below)."""

    memory: str = "cpu"
    tokens: tuple[int, ...] | None = None  # cpu (128, 512), cuda (128, 4096)
    hidden: int | None = None  # cpu 1024, cuda 7168
    topk: int = 8
    num_experts: int | None = None  # cpu 32, cuda 256 (rounded up to a multiple of world_size)
    engines: tuple[str, ...] | None = None  # cpu ("torch", "nixl"); cuda ("cuda", "nixl", "torch"); minus skipped
    world_size: int = 2
    dtype: str | None = None  # cpu float32, cuda bfloat16
    capacity_factor: float | None = None  # capacity = factor * T * topk rows (None: exact shapes)
    warmup: int = 3
    reps: int = 20
    seed: int = 0
    timeout_s: float = 600.0
    quiet_nixl: bool = True
    graphs: bool = False  # also time the cuda engine's steps captured in CUDA graphs
    skipped: tuple[tuple[str, str], ...] = ()  # (engine, why it cannot run here), filled in by resolved()
    quiet: bool = False  # no progress lines on stderr
    partial: PartialRecords | None = None  # where rank 0 adds each case's records as it measures them

    def resolved(self) -> MoeBenchConfig:
        """Defaults filled in for ``memory``; checked."""
        if self.memory not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"bench moe: memory={self.memory!r}; pass 'cpu' or 'cuda'")
        gpu = self.memory == "cuda"
        if gpu and not torch.cuda.is_available():
            raise InvalidArgumentError(
                f"bench moe: memory='cuda' but torch {torch.__version__} sees no GPU; "
                "pass memory='cpu'"
            )
        requested = self.engines or (("cuda", "nixl", "torch") if gpu else ("torch", "nixl"))
        unknown = sorted(set(requested) - set(ENGINES))
        if unknown:
            raise InvalidArgumentError(f"bench moe: unknown engine(s) {unknown}; pass some of {', '.join(ENGINES)}")
        gpus = torch.cuda.device_count() if gpu else 0
        reasons = {b: skip_reason(b, self.memory, self.world_size, gpus) for b in requested}
        engines = tuple(b for b in requested if reasons[b] is None)
        if not engines:
            raise InvalidArgumentError("bench moe: no requested engine can run here: " + "; ".join(
                f"{b}: {reasons[b]}" for b in requested))
        experts = self.num_experts or (256 if gpu else 32)
        experts = -(-experts // self.world_size) * self.world_size
        config = replace(
            self, tokens=tuple(self.tokens or ((128, 4096) if gpu else (128, 512))),
            hidden=self.hidden or (7168 if gpu else 1024),
            num_experts=experts, engines=engines, dtype=self.dtype or ("bfloat16" if gpu else "float32"),
            skipped=tuple((b, reasons[b]) for b in requested if reasons[b] is not None),
        )
        if config.dtype not in _DTYPES:
            raise InvalidArgumentError(f"bench moe: dtype={config.dtype!r}; pass one of {sorted(_DTYPES)}")
        if not 1 <= config.topk <= config.num_experts:
            raise InvalidArgumentError(
                f"bench moe: topk={config.topk} must be in [1, "
                f"num_experts={config.num_experts}]"
            )
        if config.world_size < 1 or config.warmup < 0 or config.reps < 1:
            raise InvalidArgumentError("bench moe: world_size >= 1, warmup >= 0 and reps >= 1 are required")
        return config


def skip_reason(engine: str, memory: str, world_size: int, gpu_count: int) -> str | None:
    """Why ``engine`` cannot run ``world_size`` local ranks on ``memory`` ("cpu"/"cuda") of a host with
    ``gpu_count`` GPUs, or None when it can. Ranks take the GPUs in turn, so more ranks than GPUs put two
    ranks on one GPU. Local: no GPU work, no process group is made."""
    if engine == "cuda" and memory != "cuda":
        return "it moves GPU memory only; pass --memory cuda"
    if engine == "nixl" and not nixl_installed():
        return f"nixl is not installed ({INSTALL_NIXL})"
    if engine == "cuda" and importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton, or tensorwire[cuda])"
    if engine == "torch":
        if memory == "cuda" and world_size > gpu_count:
            return (f"NCCL needs a GPU of its own per rank and {world_size} ranks share {gpu_count} GPU(s); "
                    f"pass --ranks {max(gpu_count, 1)} or fewer to time it")
        available, reason = collectives.availability(torch.device(memory))
        if not available:
            return reason
    return None


def run_moe_bench(args: Any = None, **overrides: Any) -> list[Record]:
    """Run the benchmark; rank 0's records, one per (tokens, engine, op): the engine is the record's
    ``path``, the copy its ``reference``, the routing's shape and the shared copy in its ``params``.

    ``args``: a ``MoeBenchConfig``, or any object (e.g. an ``argparse.Namespace``) whose attributes named
    like ``MoeBenchConfig``'s fields override the defaults; keywords override both. Raises
    ``RankFailedError``/``WaitTimeoutError`` (``TensorwireError``) when a rank fails, ``TransferError`` when a
    engine moved wrong bytes.
    """
    from ..testing import launch

    config = moe_config(args, **overrides)
    for engine, reason in config.skipped:
        print(f"bench moe: skipping engine {engine!r}: {reason}", file=sys.stderr, flush=True)
    results = launch(_rank_main, config.world_size, config, timeout=config.timeout_s)
    return results[0]


def moe_config(args: Any = None, **overrides: Any) -> MoeBenchConfig:
    """The resolved configuration ``run_moe_bench(args, **overrides)`` runs (see there)."""
    config = args if isinstance(args, MoeBenchConfig) else MoeBenchConfig()
    if args is not None and not isinstance(args, MoeBenchConfig):
        known = {f for f in MoeBenchConfig.__dataclass_fields__}
        config = replace(config, **{k: v for k, v in vars(args).items() if k in known and v is not None})
    config = replace(config, **overrides)
    for name in ("tokens", "engines"):
        value = getattr(config, name)
        if isinstance(value, (str, int)):
            config = replace(config, **{name: (value,)})
    return config.resolved()


# --- one rank -------------------------------------------------------------------------------------
def _rank_main(config: MoeBenchConfig) -> list[Record]:
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
        dtype = _DTYPES[config.dtype]
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


_MOE_HEADING = (f"{'engine':12} {'op':8} {'mem':4} {'T':>5} {'H':>5} {'K':>2} {'rows':>6} {'median us':>10} "
                f"{'p10-p90 us':>17} {'GB/s':>7} {'copy GB/s':>9} {'BW/copy':>8} {'shared GB/s':>11} {'BW/shared':>9}")


def moe_rows(records: list[Record]) -> list[str]:
    """One fixed-width line per record (units and ratio columns as in every ``tensorwire bench`` report)."""
    lines = []
    for r in records:
        p = r.params
        lines.append(
            f"{r.path:12} {r.op:8} {r.memory:4} {p['tokens']:>5} {p['hidden']:>5} {p['topk']:>2} "
            f"{p['rows']:>6} {r.median_us:>10.1f} {r.p10_us:>8.1f}-{r.p90_us:<8.1f} {r.gbps:>7.2f} "
            f"{p['copy_gbps']:>9.2f} {r.ratio_text():>8} {p.get('shared_copy_gbps', float('nan')):>11.2f} "
            f"{_shared_ratio_text(p):>9}"
        )
    return lines


MOE_TABLE = Table([_MOE_HEADING, "-" * len(_MOE_HEADING)], moe_rows, ["", *textwrap.wrap(
    "BW/copy: GB/s over the same bytes copied inside rank 0 alone (measured again while unsteady, 3 tries); "
    "BW/shared: over every rank copying its bytes at the same time (the yardstick when ranks share a device); "
    f"unsteady: that copy's p10-p90 spread exceeded {STEADY_SPREAD:.0%} of its median, no ratio taken", 116)])


def format_moe_report(records: list[Record]) -> str:
    """The whole table at once: the heading, every record's row, the legend."""
    return "\n".join([*MOE_TABLE.heading, *moe_rows(records), *MOE_TABLE.legend])


def _shared_ratio_text(params: dict[str, Any]) -> str:
    if "ratio_to_shared_copy" not in params:  # results from before the shared copy was measured
        return ""
    ratio = params["ratio_to_shared_copy"]
    return "unsteady" if ratio is None else f"{ratio:.2f}x"


def method_rows(config: MoeBenchConfig) -> list[tuple[str, str]]:
    """How ``bench moe`` measures (the header's method rows)."""
    return [
        ("routing", f"T={','.join(map(str, config.tokens))} tokens of H={config.hidden} {config.dtype} per rank, top-"
                    f"{config.topk} of {config.num_experts} experts, 10% of the slots empty; {config.world_size} "
                    f"ranks; engines {', '.join(config.engines)}"),
        ("timing", f"{config.warmup} untimed then {config.reps} timed dispatch + combine pairs (collective: counted, "
                   "not time-budgeted); host: wall clock, GPU: CUDA events; median, p10, p90"),
        ("reference", "the same bytes copied inside rank 0 (copy) and by every rank at once (shared); a reference "
                      f"whose p10-p90 spread exceeds {STEADY_SPREAD:.0%} of its median is flagged, not divided by"),
    ]


# --- the command: tensorwire bench moe -------------------------------------------------------------
HELP = "MoE dispatch/combine per engine between local ranks, beside a copy of the same bytes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tensorwire bench moe``."""
    parser.epilog = ("Needs: per engine, what it runs on (nixl: the nixl package; torch: Gloo, or NCCL on GPUs; cuda: "
                     "a CUDA device, Triton and CUDA IPC between the ranks); an engine this machine lacks is skipped, "
                     "saying why. Starts its ranks as local processes on 127.0.0.1.")
    parser.description = ("MoE dispatch and combine per engine between local ranks, each beside a copy of the "
                          "same bytes inside rank 0 and made by every rank at once.")
    add_common_arguments(parser, graphs_help="GPU: also time the cuda engine's dispatch and combine captured in "
                                             "CUDA graphs and replayed")
    parser.add_argument("--ranks", type=at_least(int, 1), default=2, metavar="N",
                        help="local ranks (default 2; 1 times the kernels on a GPU no other rank shares)")
    parser.add_argument("--engines", default=None, metavar="LIST",
                        help="comma-separated engines to time (default: every one that runs here)")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark: the header on stdout, then each case's rows as soon as it is measured, then the legend;
    write ``--json`` / ``--plot``; blocks until every rank is done. Ctrl-C stops every rank: the rows measured stay
    the report (exit 130)."""
    from ..backends.nixl import quiet_nixl_logging

    quiet_nixl_logging()
    check_plot(args)
    memory = memories(args)[-1]  # one memory per run: cuda where torch sees a GPU and --memory allows it
    engines = None
    if args.engines is not None:
        engines = tuple(dict.fromkeys(b.strip() for b in args.engines.split(",") if b.strip()))
        unknown = sorted(set(engines) - set(ENGINES))
        if unknown or not engines:
            args.parser.error(f"--engines {args.engines!r}: unknown or no engine {unknown}; pass a "
                              f"comma-separated list of {', '.join(ENGINES)}")
    config = moe_config(memory=memory, timeout_s=args.timeout, graphs=args.graphs, world_size=args.ranks,
                        engines=engines, quiet=args.quiet)
    head = header(args.argv)
    title = f"tensorwire bench moe: dispatch and combine between {config.world_size} local ranks"
    announce(header_lines(title, head, method_rows(config)))
    records, interrupted = measured_records(lambda partial: run_moe_bench(replace(config, partial=partial)), "moe",
                                            MOE_TABLE)

    def plot(records: list[Record], path: Path) -> None:
        from .plot import plot_moe

        plot_moe(records, path, title=" ".join(["tensorwire", *args.argv]))

    return finish(args, head, records, MOE_TABLE.legend, plot, interrupted)
