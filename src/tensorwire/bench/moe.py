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
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

from .command import add_common_arguments, announce, at_least, check_plot, finish, header, header_lines, memories
from .moe_cases import MoeBenchConfig, moe_config, skip_reason
from .partial import Table, measured_records
from .record import STEADY_SPREAD, Record

__all__ = ["MoeBenchConfig", "format_moe_report", "run_moe_bench", "moe_config", "skip_reason", "HELP",
           "add_arguments", "main"]


def run_moe_bench(args: Any = None, **overrides: Any) -> list[Record]:
    """Run the benchmark; rank 0's records, one per (tokens, engine, op): the engine is the record's
    ``path``, the copy its ``reference``, the routing's shape and the shared copy in its ``params``.

    ``args``: a ``MoeBenchConfig``, or any object (e.g. an ``argparse.Namespace``) whose attributes named
    like ``MoeBenchConfig``'s fields override the defaults; keywords override both. Raises
    ``RankFailedError``/``WaitTimeoutError`` (``TensorwireError``) when a rank fails, ``TransferError`` when a
    engine moved wrong bytes.
    """
    from ..testing import launch
    from .moe_rank import rank_main

    config = moe_config(args, **overrides)
    for engine, reason in config.skipped:
        print(f"bench moe: skipping engine {engine!r}: {reason}", file=sys.stderr, flush=True)
    results = launch(rank_main, config.world_size, config, timeout=config.timeout_s)
    return results[0]


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
        from ..moe.selection import ENGINES

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
