"""The ``tensorwire`` command: ``tensorwire doctor`` and ``tensorwire bench``.

Thin: argument parsing, NIXL's log noise kept off stdout, and exit codes (0 done, 1 an error, 2 bad
usage). The work lives in ``tensorwire.doctor`` and ``tensorwire.bench``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from .errors import TensorwireError

__all__ = ["main", "quiet_nixl_logging", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNIT = {"": 0, "k": 10, "m": 20, "g": 30}


def quiet_nixl_logging() -> None:
    """Keep NIXL's Python INFO lines ("Initialized NIXL agent ...") off stdout in this process.

    NIXL configures its ``nixl`` logger on import (INFO, a handler on stdout), so it must be imported before
    it is adjusted; warnings still show, on stderr. For the CLI only: the library leaves logging alone.
    """
    from .backends.nixl import _import_nixl

    try:
        _import_nixl()
    except TensorwireError:
        return  # nothing to quiet; the doctor reports why nixl does not import
    logger = logging.getLogger("nixl")
    logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def parse_size(text: str) -> int:
    """``4096``, ``4K``, ``4KiB``, ``64M``, ``1G`` (binary units) -> bytes."""
    match = _SIZE.match(text)
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4096, 4K, 64KiB, 16M or 1G")
    return int(match[1]) << _UNIT[match[2].lower()]


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(sorted({parse_size(part) for part in text.split(",") if part.strip()}))


def _at_least(kind: type, minimum: int = 0):
    def parse(text: str):
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below {minimum}; pass {minimum} or more")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorwire", description="tensorwire diagnostics and benchmarks")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser("doctor", help="what works here: backends, versions, CUDA, VRAM, UCX transports",
                                 description="Diagnose this machine; exits 0 whenever it could diagnose.")
    doctor.add_argument("--timeout", type=_at_least(float), default=15.0,
                        help="seconds each 2-process probe may take (default 15)")
    doctor.set_defaults(handler=_doctor, subparser=doctor)

    bench = commands.add_parser(
        "bench", help="READ/WRITE between two local ranks beside raw NIXL and a local copy",
        description="Point-to-point READ/WRITE from rank 0 to rank 1 (two local processes), each size timed for "
                    "tensorwire, a bare NIXL agent pair and a local copy of the same bytes.")
    bench.add_argument("what", nargs="?", choices=["p2p", "moe"], default="p2p",
                       help="p2p (default): READ/WRITE between two ranks; moe: dispatch/combine per backend")
    bench.add_argument("--memory", choices=["cpu", "cuda", "all"], default="all",
                       help="memory to benchmark; 'all' (default) is cpu plus cuda when torch sees a GPU")
    bench.add_argument("--sizes", type=_sizes, default=None, metavar="LIST",
                       help="comma-separated sizes, e.g. 4K,64K,1M (default: 4K,64K,1M,16M,64M; GPU up to 1G)")
    bench.add_argument("--time-budget", type=_at_least(float), default=0.3, metavar="S",
                       help="seconds of timed calls per measurement, at least --min-reps calls (default 0.3)")
    bench.add_argument("--min-reps", type=_at_least(int), default=20, help="fewest timed calls (default 20)")
    bench.add_argument("--iters", type=_at_least(int), default=None,
                       help="time exactly this many calls instead of the time budget")
    bench.add_argument("--warmup", type=_at_least(float), default=0.05, metavar="S",
                       help="seconds of untimed warm-up per measurement (default 0.05)")
    bench.add_argument("--idle-seconds", type=_at_least(float), default=2.0, metavar="S",
                       help="how long to measure an idle communicator's CPU; 0 skips it (default 2)")
    bench.add_argument("--raw-config", choices=["sleeping", "tensorwire", "nixl-default"], default="sleeping",
                       help="how the raw NIXL agents are built: 'sleeping' (default) NIXL's defaults but a sleeping "
                            "progress thread; 'tensorwire' exactly tensorwire's agent configuration; "
                            "'nixl-default' every NIXL default (a progress thread that spins a core)")
    bench.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every record to PATH")
    bench.add_argument("--plot", type=Path, default=None, metavar="PNG",
                       help="plot GB/s against size to PNG (needs matplotlib)")
    bench.add_argument("--timeout", type=_at_least(float), default=900.0, metavar="S",
                       help="give up after this many seconds (default 900)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument("--graphs", action="store_true",
                       help="GPU: also time transfers (p2p) and the cuda backend's dispatch and combine (moe) "
                            "captured in CUDA graphs and replayed")
    bench.add_argument("--ranks", type=_at_least(int, 1), default=2, metavar="N",
                       help="moe: local ranks (default 2; 1 times the kernels on a GPU no other rank shares)")
    bench.add_argument("--backends", default=None, metavar="LIST",
                       help="moe: comma-separated backends to time (default: every one that runs here)")
    bench.set_defaults(handler=_bench, subparser=bench)
    return parser


def _doctor(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    from .doctor import diagnose

    quiet_nixl_logging()
    diagnose(lambda line: print(line, flush=True), timeout_s=args.timeout, quiet=True)
    return 0


def _bench_moe(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """``tensorwire bench moe``: dispatch and combine per backend beside a copy of the same bytes."""
    import torch

    from .bench import moe, report
    from .moe.selection import BACKENDS

    memory = "cuda" if args.memory != "cpu" and torch.cuda.is_available() else "cpu"
    if args.memory == "cuda" and memory != "cuda":
        parser.error(f"--memory cuda: torch {torch.__version__} sees no CUDA device; use --memory cpu")
    backends = None
    if args.backends is not None:
        backends = tuple(dict.fromkeys(b.strip() for b in args.backends.split(",") if b.strip()))
        unknown = sorted(set(backends) - set(BACKENDS))
        if unknown or not backends:
            parser.error(f"--backends {args.backends!r}: unknown or no backend {unknown}; pass a comma-separated "
                         f"list of {', '.join(BACKENDS)}")
    records = moe.run_moe_bench(memory=memory, timeout_s=args.timeout, graphs=args.graphs, world_size=args.ranks,
                                backends=backends)
    print(moe.format_moe_report(records), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": report.header(argv), "records": records}, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot is not None:
        from .bench.plot import plot_moe

        plot_moe(records, args.plot, title=" ".join(["tensorwire", *argv]))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    import torch

    from .bench import p2p, report, timing

    quiet_nixl_logging()
    if args.plot is not None:
        from .bench.plot import require_matplotlib

        try:
            require_matplotlib()
        except TensorwireError as e:
            parser.error(str(e))
    if args.what == "moe":
        return _bench_moe(args, parser, argv)
    for flag, given in (("--ranks", args.ranks != 2), ("--backends", args.backends is not None)):
        if given:
            parser.error(f"{flag} applies to 'tensorwire bench moe'; the p2p bench runs rank 0 -> rank 1")
    has_cuda = torch.cuda.is_available()
    if args.memory == "cuda" and not has_cuda:
        parser.error(f"--memory cuda: torch {torch.__version__} sees no CUDA device; use --memory cpu "
                     "(or run 'tensorwire doctor')")
    memories = ("cpu", "cuda") if args.memory == "all" and has_cuda else ("cuda",) if args.memory == "cuda" else ("cpu",)
    budget = timing.Budget(time_s=args.time_budget, min_reps=max(args.min_reps, 1), warmup_s=args.warmup,
                           iters=args.iters or None)
    config = p2p.BenchConfig(
        memories=memories,
        host_sizes=args.sizes or p2p.HOST_SIZES,
        cuda_sizes=args.sizes or p2p.CUDA_SIZES,
        budget=budget,
        idle_s=args.idle_seconds,
        raw_config=args.raw_config,
        quiet_nixl=True,
        progress=not args.quiet,
        timeout_s=args.timeout,
        graphs=args.graphs,
    )
    head = report.header(argv)
    result = p2p.run(config)
    print(report.format_report(result, head, config), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(result, head, config), indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot is not None:
        from .bench.plot import plot

        plot(result.records, args.plot, title=f"tensorwire bench, {head['hostname']}, {head['date'][:10]}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tensorwire`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args, args.subparser, argv)
    except KeyboardInterrupt:
        print(f"tensorwire {args.command}: interrupted", file=sys.stderr)
        return 130
    except (TensorwireError, OSError) as e:
        print(f"tensorwire {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
