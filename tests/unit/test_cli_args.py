"""The ``tensorwire`` command's parsing, in this process: a benchmark's name is found where the user put it."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("argv, expected", [
    (["bench"], ["bench", "p2p"]),
    (["bench", "--memory", "cpu"], ["bench", "p2p", "--memory", "cpu"]),
    (["bench", "--memory", "cpu", "moe", "--ranks", "1"], ["bench", "moe", "--memory", "cpu", "--ranks", "1"]),
    (["bench", "--json", "moe"], ["bench", "p2p", "--json", "moe"]),  # a file named moe
    (["bench", "--json=out.json", "--graphs", "moe"], ["bench", "moe", "--json=out.json", "--graphs"]),
    (["bench", "moe", "--quiet"], ["bench", "moe", "--quiet"]),
    (["bench", "--help"], ["bench", "--help"]),
    (["doctor", "--timeout", "5"], ["doctor", "--timeout", "5"]),
])
def test_plain_bench_runs_p2p_and_a_name_may_follow_the_flags(argv, expected):
    from tensorwire.cli import _parser, _with_bench_name

    _, takes_value = _parser()
    assert _with_bench_name(argv, takes_value) == expected


def _help(parser, *path: str) -> str:
    """The --help text of the subcommand at ``path`` (``("bench", "kv")``) of ``parser``."""
    for name in path:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    return parser.format_help()


@pytest.mark.parametrize("path, names", [
    (("doctor",), ["TENSORWIRE_DIRECTORY", "UCX_", "/dev/shm"]),
    (("directory",), ["TENSORWIRE_DIRECTORY", "TENSORWIRE_JOB_TOKEN"]),
    (("bench",), ["NAME --help"]),
    (("bench", "p2p"), ["nixl", "CUDA device"]),
    (("bench", "moe"), ["nixl", "Triton", "NCCL"]),
    (("bench", "kv"), ["nixl", "--no-raw", "/dev/shm"]),
    (("bench", "fleet"), ["nixl", "/dev/shm", "directory"]),
    (("bench", "vllm"), ["vLLM", "$TENSORWIRE_VLLM_PYTHON", ".venv-vllm"]),
])
def test_every_help_names_what_the_command_needs_and_where_it_looks_for_it(path, names):
    from tensorwire.cli import _parser

    parser, _ = _parser()
    text = " ".join(_help(parser, *path).split())  # unwrapped
    assert "Needs" in text and all(name in text for name in names), text
