"""``tensorwire bench kv``: KV-cache block transfers between two local ranks, side by side with their
references, measured in the same run.

Rank 1 owns a *source* pool (its values encode rank, block and position) and an *inbox* pool; rank 0 owns a
*landing* pool and a source pool of its own. A READ case moves ``blocks`` ids of rank 1's source pool into
rank 0's landing pool; a WRITE case moves rank 0's source blocks into rank 1's inbox. Ids are a random
permutation of the pool's blocks (``random``) or ``0..n-1`` (``contiguous``, which NIXL merges into one
descriptor). The real layout (``llama70b-tp8``) is Llama-3-70B at TP8: 80 layers x K/V views of 4 KiB per
block, 512 blocks (an 8k-token prompt at 16 tokens per block).

Paths per case (rank 0 drives every one):

- ``tensorwire``: ``prepare_blocks`` once, then per request ``post(ids)`` + ``wait``; on GPU ``post(stream=)``
  + ``wait(stream=)`` with the ids in device tensors, timed with CUDA events around each call (the GPU
  references likewise), so a request shorter than its CPU launch reads as the launch. ``post`` is also timed
  alone on the host (p50/p99) with host (numpy) ids: checking and translating them included; on host memory,
  where ``shm`` and NIXL copy inside ``post``, that time includes the copy.
- ``tensorwire (nixl)``: the same with ``transport="nixl"`` (host memory; the default there is ``shm``).
- ``raw nixl descs``: a bare NIXL agent builds an Nx3 descriptor array per request and calls
  ``initialize_xfer``; ``raw nixl prepped``: per-block descriptor lists prepped once, ``make_prepped_xfer``
  with int32 indices per request (what vLLM's NixlConnector does). Host memory, and GPU for <= 10k blocks
  (UCX READs one GPU's memory over TCP: ~0.4 GB/s).
- ``tensorwire eager`` (GPU): ``synchronize(); post(host ids); wait(); synchronize()`` on the host clock, ids
  fresh per request, against ``copy + sync`` (``synchronize(); copy_; synchronize()``) timed the same way.
- ``contiguous copy``: one copy of the same number of bytes inside rank 0 (device copy on GPU), the
  hardware's reference; ``torch gather`` (GPU): ``index_select`` + ``index_copy_`` between two local pools.

Each tensorwire path's bytes are checked after timing (READ: against the source formula; WRITE: read back).
Non-goals: cross-host figures (run two ranks on two hosts with torchrun for those).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from .command import (
    MEMORY_CHOICES,
    announce,
    check_plot,
    finish,
    header,
    header_lines,
    list_of,
    memories,
    parse_sizes,
    positive,
    require_nixl,
)
from .kv_cases import LLAMA, LLAMA_BLOCKS, LLAMA_VIEWS, OPS, PATTERNS, Case, KvBenchConfig, cases
from .kv_report import TABLE, plot_kv
from .kv_tp import main_tp, parse_orders, parse_pairs
from .partial import measured_records
from .record import Record

__all__ = ["HELP", "KvBenchConfig", "Case", "cases", "run", "add_arguments", "main"]

HELP = "KV-cache block READ/WRITE by id between two local ranks beside raw NIXL, a contiguous copy and a gather"


# --- the command ---------------------------------------------------------------------------------------------
def run(config: KvBenchConfig) -> list[Record]:
    """Launch the two ranks; rank 0's records. Raises ``RankFailedError`` when a rank fails (including wrong
    bytes: ``TransferError``)."""
    from ..testing import launch
    from .kv_rank import rank_main

    return launch(rank_main, 2, config, timeout=config.timeout_s)[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tensorwire bench kv``, spelled and checked as in the other benchmarks."""
    parser.epilog = ("Needs: the nixl package for the raw NIXL reference (--no-raw leaves it out); for --memory cuda, "
                     "a CUDA device torch sees; room in /dev/shm for the pools (host memory). Starts its two ranks as "
                     "local processes on 127.0.0.1.")
    defaults = KvBenchConfig()
    parser.add_argument("--memory", choices=MEMORY_CHOICES, default="all",
                        help="memory to benchmark; 'all' (default) is cpu plus cuda when torch sees a GPU")
    parser.add_argument("--blocks", type=list_of(int, minimum=1), default=defaults.blocks, metavar="LIST",
                        help="block counts, e.g. 1000,10000,50000 (default 1000,10000)")
    parser.add_argument("--block-bytes", type=parse_sizes, default=defaults.block_bytes, metavar="LIST",
                        help="bytes per block and view, multiples of 4, e.g. 4K,16K (default 16K)")
    parser.add_argument("--ops", type=list_of(str.upper, choices=OPS), default=defaults.ops, metavar="LIST",
                        help="READ, WRITE or READ,WRITE (the default)")
    parser.add_argument("--patterns", type=list_of(str.lower, choices=PATTERNS), default=defaults.patterns,
                        metavar="LIST", help="random (the default), contiguous or random,contiguous")
    parser.add_argument("--no-llama", action="store_true", help="skip the Llama-3-70B TP8 layout's READ")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw NIXL references")
    parser.add_argument("--time", type=positive, default=defaults.time_s, metavar="S",
                        help=f"seconds of timed calls per path (default {defaults.time_s})")
    parser.add_argument("--timeout", type=positive, default=defaults.timeout_s, metavar="S",
                        help=f"give up after this many seconds (default {defaults.timeout_s:.0f})")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every record to PATH")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="plot GB/s to PNG (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--tp", type=parse_pairs, default=None, metavar="P:D,...",
                        help="instead: KV handoffs from a producer at TP P to a consumer at TP D (tensorwire.kv), "
                             "beside D:D, e.g. 2:1,1:2,4:2")
    parser.add_argument("--orders", type=parse_orders, default=[("HND", "HND")], metavar="P:C,...",
                        help="with --tp: the order of a block's rows at the producer and the consumer, each pair "
                             "measured at each, e.g. HND,NHD,HND:NHD (default HND: heads outermost on both)")


def config_from(args: argparse.Namespace) -> KvBenchConfig:
    """The run ``args`` ask for; bad usage (``--memory cuda`` without a GPU, a block size not a multiple of 4)
    exits 2 through ``args.parser.error`` before anything is measured."""
    if not args.block_bytes or any(size % 4 for size in args.block_bytes):
        args.parser.error(f"--block-bytes {','.join(map(str, args.block_bytes))}: give multiples of 4")
    return KvBenchConfig(memory=memories(args), blocks=args.blocks, block_bytes=args.block_bytes, ops=args.ops,
                         patterns=args.patterns, llama=not args.no_llama, raw=not args.no_raw, time_s=args.time,
                         timeout_s=args.timeout, quiet=args.quiet)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark: the header on stdout, then each case's rows as soon as it is measured (a progress line
    per case on stderr as it starts), then the legend; write ``--json`` / ``--plot``; blocks until both ranks are
    done. Ctrl-C stops both ranks: the rows measured stay the report (exit 130). With ``--tp``: ``kv_tp.py``."""
    if args.tp:
        return main_tp(args)
    config = config_from(args)
    if config.raw:
        require_nixl(args, "bench kv's raw NIXL reference (--no-raw leaves it out)")
    check_plot(args)
    head = header(args.argv)
    announce(header_lines(TITLE, head, method_rows(config)))
    records, interrupted = measured_records(lambda partial: run(replace(config, partial=partial)), "kv", TABLE)
    return finish(args, head, records, TABLE.legend, plot_kv, interrupted, config=replace(config, partial=None))


TITLE = "tensorwire bench kv: KV-cache blocks by id, rank 0 <-> rank 1, two local processes"
def method_rows(config: KvBenchConfig) -> list[tuple[str, str]]:
    """How ``bench kv`` measures (the header's method rows)."""
    shapes = f"{','.join(map(str, config.blocks))} blocks x {','.join(f'{b // 1024} KiB' for b in config.block_bytes)}"
    return [
        ("cases", f"{'/'.join(config.memory)} memory, {','.join(config.ops)}, {','.join(config.patterns)} ids, "
                  f"{shapes}" + (f", plus {LLAMA} ({LLAMA_VIEWS} views x {LLAMA_BLOCKS} blocks x 4 KiB)"
                                 if config.llama else "")),
        ("tensorwire", "prepare_blocks once, then post(ids) + wait() per request; post alone timed too (host ids)"),
        ("raw nixl", "a bare agent: Nx3 descriptors + initialize_xfer per request ('descs'), or per-block lists "
                     "prepped once + make_prepped_xfer ('prepped'); its post is timed as tensorwire's: building the "
                     "request and NIXL's post (transfer)" if config.raw else "skipped (--no-raw)"),
        ("copy", "the same bytes copied contiguously inside rank 0: the reference, measured again while its p10-p90 "
                 "spread exceeds 20% (3 tries), then flagged 'unsteady' and not divided by"),
        ("timing", f"{config.time_s:g} s of timed requests per path (at least 5); median, p10, p90"),
    ]
