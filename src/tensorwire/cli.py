"""The ``tensorwire`` command (also ``python -m tensorwire``): ``tensorwire doctor``, ``bench`` and ``directory``.

Thin: argument parsing and exit codes (0 done, 1 an error, 2 bad usage). The work lives in
``tensorwire.doctor`` and ``tensorwire.bench``; nothing in the library imports this module.

Benchmarks are subcommands, ``tensorwire bench <name>``, one module ``tensorwire.bench.<name>`` each, listed
in ``BENCH_COMMANDS``. Adding one is writing that module and adding its name there. The module provides:

- ``HELP: str``: one line for ``tensorwire bench --help``;
- ``add_arguments(parser: argparse.ArgumentParser) -> None``: its flags (``tensorwire.bench.command`` has the
  shared ones, ``add_common_arguments``, and the size and range types); it may set ``parser.description``;
- ``main(args: argparse.Namespace) -> int``: runs it and returns the exit code. Besides its own flags ``args``
  carries ``args.parser`` (its parser: ``args.parser.error(text)`` refuses bad usage with exit code 2) and
  ``args.argv`` (the command line after ``tensorwire``, for result headers). A ``TensorwireError`` or
  ``OSError`` it raises is printed as ``tensorwire bench: error: ...`` with exit code 1.

``tensorwire bench`` without a name runs the first of ``BENCH_COMMANDS`` (``p2p``), and a name may follow the
flags (``tensorwire bench --memory cuda moe``), as before benchmarks were subcommands.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from . import __version__
from .bench.command import at_least, parse_size
from .errors import TensorwireError

__all__ = ["main", "quiet_nixl_logging", "parse_size", "BENCH_COMMANDS"]


def quiet_nixl_logging() -> None:
    """``tensorwire.backends.nixl.quiet_nixl_logging``, imported when called: parsing and ``--help`` need no torch."""
    from .backends.nixl import quiet_nixl_logging as quiet

    quiet()

# modules of tensorwire.bench; the first runs when no name is given
BENCH_COMMANDS = ("p2p", "moe", "kv", "fleet", "vllm")


def _bench_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.bench.{name}")


def _parser() -> tuple[argparse.ArgumentParser, frozenset[str]]:
    """The parser, and the flags of bench subcommands that take a value (see ``_with_bench_name``)."""
    parser = argparse.ArgumentParser(prog="tensorwire", description="tensorwire diagnostics and benchmarks")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser("doctor", help="what works here: backends, versions, CUDA, VRAM, UCX transports",
                                 description="Diagnose this machine; exits 0 whenever it could diagnose.",
                                 epilog="Needs nothing but tensorwire. Looks at the nixl package and the UCX it "
                                        "bundles, torch's CUDA devices, /dev/shm, and this environment: "
                                        "TENSORWIRE_DIRECTORY (the fleet directory it names is checked), "
                                        "TENSORWIRE_JOB_TOKEN, MASTER_ADDR, UCX_*, PYTORCH_CUDA_ALLOC_CONF. Its "
                                        "probes start two local processes on 127.0.0.1.")
    doctor.add_argument("--timeout", type=at_least(float), default=15.0,
                        help="seconds each 2-process probe may take (default 15)")
    doctor.add_argument("--clean", action="store_true",
                        help="accepted for older scripts: the doctor always removes the /dev/shm files that killed "
                             "tensorwire processes left (never a live process's)")
    doctor.set_defaults(handler=_doctor, parser=doctor)

    directory = commands.add_parser(
        "directory", help="run a fleet's directory (members join with TENSORWIRE_DIRECTORY=tcp://HOST:PORT)",
        description="Run the embedded directory where fleet members meet, until interrupted (SIGINT/SIGTERM). "
                    "It holds the members' sealed records only; transfers never go through it.",
        epilog="Needs: a free port on an address of this machine that the members reach. Members join with "
               "TENSORWIRE_DIRECTORY=tcp://HOST:PORT and TENSORWIRE_NAME (or init(directory=, name=)), all with "
               "the same TENSORWIRE_JOB_TOKEN.")
    directory.add_argument("--host", default="127.0.0.1",
                           help="address to listen on, one of this machine's (default 127.0.0.1)")
    directory.add_argument("--port", type=at_least(int, 0), default=29700,
                           help="port to listen on; 0 picks a free one (default 29700)")
    directory.add_argument("--grace", type=at_least(float), default=None, metavar="S",
                           help="seconds after the start in which joins wait while the members of a restarted "
                                "directory put their ranks back (default: twice TENSORWIRE_LIVENESS_S, the members' "
                                "lease; 0 for a directory that no member has met yet)")
    directory.add_argument("--state", default=None, metavar="FILE",
                           help="file that keeps the rank counter's high-water mark, so that a directory started "
                                "again never hands out a rank twice, however fast members joined (default: "
                                "~/.local/state/tensorwire/directory-HOST-PORT.rank, in a folder of this user's own; "
                                "'none' for no file)")
    directory.set_defaults(handler=_directory, parser=directory)

    bench = commands.add_parser(
        "bench", help="benchmarks: " + ", ".join(BENCH_COMMANDS) + f" (default {BENCH_COMMANDS[0]})",
        description=f"Benchmarks of tensorwire. Without a NAME, '{BENCH_COMMANDS[0]}' runs.",
        epilog="Needs: what each benchmark needs, its --help says (tensorwire bench NAME --help); all of them start "
               "their ranks as local processes.")
    names = bench.add_subparsers(dest="bench", metavar="NAME")
    takes_value: set[str] = set()
    for name in BENCH_COMMANDS:
        module = _bench_module(name)
        subparser = names.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(subparser)
        subparser.set_defaults(handler=module.main, parser=subparser)
        # argparse lists a parser's flags only in this attribute; read, never changed.
        takes_value.update(o for action in subparser._actions if action.nargs != 0 for o in action.option_strings)
    return parser, frozenset(takes_value)


def _with_bench_name(argv: list[str], takes_value: frozenset[str]) -> list[str]:
    """``argv`` with the benchmark's name right after ``bench``, where argparse wants a subcommand: moved
    there from behind the flags, or the default inserted. Values of flags (``takes_value``) are skipped."""
    if not argv or argv[0] != "bench" or (len(argv) > 1 and argv[1] in ("-h", "--help", *BENCH_COMMANDS)):
        return argv
    index = 1
    while index < len(argv):
        token = argv[index]
        if token in BENCH_COMMANDS:
            return ["bench", token, *argv[1:index], *argv[index + 1:]]
        if not token.startswith("-"):
            # A word that is no flag's value and no benchmark: a misspelt name. Left in the NAME position,
            # argparse refuses it listing the benchmarks.
            return ["bench", token, *argv[1:index], *argv[index + 1:]]
        index += 2 if token in takes_value else 1
    return ["bench", BENCH_COMMANDS[0], *argv[1:]]


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose

    quiet_nixl_logging()
    diagnose(lambda line: print(line, flush=True), timeout_s=args.timeout, quiet=True)
    return 0


def _directory(args: argparse.Namespace) -> int:
    from .meeting.directory import serve
    from .meeting.directory_state import default_path

    state = args.state
    if state is None and args.port:
        state = default_path(args.host, args.port)
    serve(args.host, args.port, lambda line: print(line, flush=True), grace_s=args.grace,
          state=None if state in (None, "none") else state)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tensorwire`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, takes_value = _parser()
    args = parser.parse_args(_with_bench_name(argv, takes_value))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    args.argv = argv  # as typed: results record the command that made them
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(f"tensorwire {args.command}: interrupted", file=sys.stderr)
        return 130
    except (TensorwireError, OSError) as e:
        print(f"tensorwire {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
