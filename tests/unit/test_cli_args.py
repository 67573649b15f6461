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
