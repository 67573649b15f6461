"""What every ``tensorwire bench <name>`` subcommand shares: argument types, the common flags, the outputs
(the JSON header that says where and with what a result was measured, the JSON file).

A subcommand is one module ``tensorwire.bench.<name>`` with ``add_arguments(parser)`` and ``main(args) -> int``
(the shape is described in ``tensorwire.cli``); these helpers keep their flags spelled and checked alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..machine import cpu_summary, gpu_names, hostname, software_versions

__all__ = ["parse_size", "parse_sizes", "at_least", "positive", "list_of", "MEMORY_CHOICES", "add_common_arguments",
           "memories", "write_json", "check_plot", "header", "header_lines", "announce", "progress",
           "finish", "require_nixl"]

MEMORY_CHOICES = ("cpu", "cuda", "all")  # --memory of every benchmark; 'all' is cpu plus cuda when torch sees a GPU

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNIT = {"": 0, "k": 10, "m": 20, "g": 30}


def parse_size(text: str) -> int:
    """``4096``, ``4K``, ``4KiB``, ``64M``, ``1G`` (binary units) -> bytes."""
    match = _SIZE.match(text)
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4096, 4K, 64KiB, 16M or 1G")
    return int(match[1]) << _UNIT[match[2].lower()]


def parse_sizes(text: str) -> tuple[int, ...]:
    """``4K,64K,1M`` -> the distinct sizes in bytes, ascending."""
    return tuple(sorted({parse_size(part) for part in text.split(",") if part.strip()}))


def at_least(kind: type, minimum: int = 0):
    """An argparse ``type=`` that converts with ``kind`` and refuses values below ``minimum``."""
    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; pass {minimum} or more")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below {minimum}; pass {minimum} or more")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value: 'x'"
    return parse


def positive(text: str) -> float:
    """An argparse ``type=`` for seconds: a finite number above 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds")
    return value


positive.__name__ = "float"


def list_of(kind: Callable[[str], Any], choices: tuple[str, ...] | None = None, minimum: int | None = None):
    """An argparse ``type=`` for a comma-separated list (``READ,WRITE``, ``1000,10000``): each part converted
    with ``kind``, checked against ``choices`` or ``minimum``; the distinct values in the order given."""
    def parse(text: str) -> tuple:
        try:
            values = tuple(dict.fromkeys(kind(part.strip()) for part in text.split(",") if part.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {kind.__name__} values") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list")
        if choices is not None and set(values) - set(choices):
            raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {','.join(choices)}")
        if minimum is not None and min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be {minimum} or more")
        return values

    parse.__name__ = "list"
    return parse


def add_common_arguments(parser: argparse.ArgumentParser, graphs_help: str) -> None:
    """The flags every benchmark takes: memory, outputs, time limit, progress lines, CUDA graphs."""
    parser.add_argument("--memory", choices=MEMORY_CHOICES, default="all",
                        help="memory to benchmark; 'all' (default) is cpu plus cuda when torch sees a GPU")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every record to PATH")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="plot GB/s to PNG (needs matplotlib)")
    parser.add_argument("--timeout", type=positive, default=900.0, metavar="S",
                        help="give up after this many seconds (default 900)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--graphs", action="store_true", help=graphs_help)


def memories(args: argparse.Namespace) -> tuple[str, ...]:
    """The memories ``--memory`` asks for that exist here: 'all' is cpu plus cuda when torch sees a GPU.
    ``--memory cuda`` without a GPU is a usage error (exit 2) naming the fix."""
    import torch

    has_cuda = torch.cuda.is_available()
    if args.memory == "cuda" and not has_cuda:
        args.parser.error(f"--memory cuda: torch {torch.__version__} sees no CUDA device; use --memory cpu "
                          "(or run 'tensorwire doctor')")
    if args.memory == "all":
        return ("cpu", "cuda") if has_cuda else ("cpu",)
    return (args.memory,)


def require_nixl(args: argparse.Namespace, needs: str) -> None:
    """Refuse the run before anything starts where ``nixl`` is not installed (exit 2, naming the extra): ``needs``
    says what of the benchmark needs it."""
    from ..backends.nixl_setup import INSTALL_NIXL, nixl_installed

    if not nixl_installed():
        args.parser.error(f"{needs} needs NIXL, and the nixl package is not installed: {INSTALL_NIXL}")


def check_plot(args: argparse.Namespace) -> None:
    """Refuse ``--plot`` before measuring anything when matplotlib does not import (exit 2, with why)."""
    if args.plot is None:
        return
    from ..errors import TensorwireError
    from .plot import require_matplotlib

    try:
        require_matplotlib()
    except TensorwireError as e:
        args.parser.error(str(e))


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` (parents created), one key per line, and say so on stderr."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def finish(args: argparse.Namespace, head: dict[str, Any], records: list, tail: list[str],
           plot: Callable[[list, Path], None], interrupted: bool, config: Any = None) -> int:
    """The end every benchmark shares, once its rows are on stdout (``partial.measured_records`` printed them as
    they came): print ``tail`` (the table's legend, a summary) when there was a row; write ``args.json`` (``head``
    with ``config``, a dataclass, the records and whether Ctrl-C cut the run) and ``args.plot`` (``plot(records,
    path)``, when there is something to plot). The exit code: 130 after Ctrl-C, else 0."""
    from dataclasses import asdict

    from .record import records_to_json

    if records and tail:
        print("\n".join(tail), flush=True)
    if args.json is not None:
        write_json(args.json, {"header": {**head, **({"config": asdict(config)} if config is not None else {})},
                               "records": records_to_json(records), "interrupted": interrupted})
    if args.plot is not None and records:
        plot(records, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 130 if interrupted else 0


def header(argv: list[str]) -> dict[str, Any]:
    """Where and with what the benchmark ran (the JSON header)."""
    return {
        "command": shlex.join(["tensorwire", *argv]),
        "hostname": hostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": software_versions(),
        "source": _source_revision(),
        "cpu": cpu_summary(),
        "gpus": gpu_names(),
    }


def _source_revision() -> dict[str, Any] | None:
    """The git commit of the tensorwire being measured, and whether its tracked files differ from it."""
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/tensorwire
    try:
        commit = subprocess.run(["git", "-C", package_dir, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5, check=False)
        if commit.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", package_dir, "status", "--porcelain", "--untracked-files=no", "--", "."],
                                capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "modified": bool(status.stdout.strip())}


def header_lines(title: str, head: dict[str, Any], method: list[tuple[str, str]], ucx: str | None = None) -> list[str]:
    """The header every benchmark prints on stdout before it measures: ``title``, the machine,
    the software (``ucx``: the version the ranks loaded, when known), then the ``method`` rows (label, text),
    wrapped at 116 columns."""
    v = head["versions"]
    rows = [
        ("machine", f"{head['cpu']['model']}, {head['cpu']['usable_cores']} cores; "
                    + (", ".join(head["gpus"]) if head["gpus"] else "no CUDA device")),
        ("software", f"tensorwire {v['tensorwire']}{_revision_text(head.get('source'))}, torch {v['torch']}, nixl "
                     f"{v['nixl']} ({v['nixl_module']}), UCX {ucx or v['ucx'] or '?'}, Python {v['python']}"),
        *method,
    ]
    lines = [title] + [f"  {label:<11} {text}" for label, text in rows]
    return [textwrap.fill(line, 116, subsequent_indent=" " * 14) for line in lines]


def announce(lines: list[str]) -> None:
    """Print the header (``header_lines``) on stdout, once, before anything is measured: the rows that follow as
    they are measured go there too, so that what is saved says where and how it was measured."""
    print("\n".join([*lines, ""]), flush=True)


def progress(benchmark: str, text: str, quiet: bool) -> None:
    """One progress line on stderr, ``bench <benchmark>: <text>``, as a case starts; nothing when ``quiet``."""
    if not quiet:
        print(f"bench {benchmark}: {text}", file=sys.stderr, flush=True)


def _revision_text(source: dict[str, Any] | None) -> str:
    if not source:
        return ""
    return f" (git {source['commit']}{', modified' if source['modified'] else ''})"
