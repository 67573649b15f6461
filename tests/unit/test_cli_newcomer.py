"""What a new user meets first, in this process: every ``bench`` flag is checked before anything runs (exit 2
with the reason, never a traceback), ``--version``, a misspelt benchmark lists the real ones, and tensorwire's
warnings have a class of their own."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import warnings

import pytest
import torch

import tensorwire as tw
from tensorwire.cli import main


def _refused(argv: list[str], capsys) -> str:
    """Run ``tensorwire *argv``, expect bad usage (exit 2) and return what it printed on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, words", [
    (["bench", "kv", "--memory", "gpu"], "invalid choice: 'gpu'"),
    (["bench", "kv", "--ops", "FOO"], "give one or more of read,write"),
    (["bench", "kv", "--patterns", "zigzag"], "give one or more of random,contiguous"),
    (["bench", "kv", "--time=-1"], "give a positive number of seconds"),
    (["bench", "kv", "--time", "nan"], "give a positive number of seconds"),
    (["bench", "kv", "--timeout", "0"], "give a positive number of seconds"),
    (["bench", "kv", "--blocks", "0"], "every value must be 1 or more"),
    (["bench", "kv", "--blocks=-5"], "every value must be 1 or more"),
    (["bench", "kv", "--blocks", "ten"], "give comma-separated int values"),
    (["bench", "kv", "--block-bytes", "6"], "give multiples of 4"),
    (["bench", "p2p", "--memory", "gpu"], "invalid choice: 'gpu'"),
    (["bench", "p2p", "--timeout", "0"], "give a positive number of seconds"),
    (["bench", "p2p", "--time-budget", "inf"], "not a finite number"),
    (["bench", "moe", "--memory", "gpu"], "invalid choice: 'gpu'"),
    (["bench", "fleet", "--memory", "gpu"], "invalid choice: 'gpu'"),
])
def test_every_bench_flag_is_checked_before_anything_runs(argv, words, capsys):
    assert words in _refused(argv, capsys).lower()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("name", ["p2p", "moe", "kv"])
def test_cuda_memory_without_a_gpu_is_refused_not_measured_on_the_host(name, capsys):
    err = _refused(["bench", name, "--memory", "cuda"], capsys)
    assert "--memory cuda" in err and "sees no cuda device" in err.lower() and "--memory cpu" in err, err


def test_kv_reads_its_flags_as_the_other_benchmarks_do():
    from tensorwire.bench import kv
    from tensorwire.cli import _parser

    parser, _ = _parser()
    args = parser.parse_args(["bench", "kv", "--memory", "all", "--blocks", "300,100", "--block-bytes", "4K",
                              "--ops", "read", "--patterns", "contiguous", "--time", "0.05"])
    config = kv.config_from(args)
    assert config.memory == (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
    assert (config.blocks, config.block_bytes, config.ops, config.patterns, config.time_s) == (
        (300, 100), (4096,), ("READ",), ("contiguous",), 0.05)


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tensorwire {tw.__version__}"
    assert tw.__version__ == importlib.metadata.version("tensorwire")


@pytest.mark.parametrize("argv", [["bench", "frob"], ["bench", "--memory", "cpu", "frob"]])
def test_a_misspelt_benchmark_lists_the_benchmarks(argv, capsys):
    err = _refused(argv, capsys)
    assert "'frob'" in err and all(f"'{name}'" in err for name in ("p2p", "moe", "kv", "fleet")), err


def test_tensorwire_warnings_have_their_own_class():
    from tensorwire.deadlines import warn_from_progress_thread

    assert issubclass(tw.TensorwireWarning, RuntimeWarning)  # filters on RuntimeWarning keep catching ours
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_from_progress_thread("tensorwire: a background failure")
    assert [w.category for w in caught] == [tw.TensorwireWarning]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=tw.TensorwireWarning)
        warn_from_progress_thread("tensorwire: filtered by class")
    assert caught == []


_HELPS = [[], ["doctor"], ["directory"], ["bench"], ["bench", "p2p"], ["bench", "moe"], ["bench", "kv"],
          ["bench", "fleet"], ["bench", "vllm"]]


@pytest.mark.parametrize("command", _HELPS, ids=lambda command: " ".join(["tensorwire", *command, "--help"]))
def test_help_imports_no_torch(command):
    """Every ``--help`` (and ``import tensorwire``) is answered without torch or numpy: they take seconds to import
    on a busy machine, and nothing of them is needed to print what the command takes."""
    code = ("import contextlib, io, sys\n"
            "from tensorwire.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as shown, contextlib.suppress(SystemExit):\n"
            f"    main({[*command, '--help']!r})\n"
            "assert 'usage: tensorwire' in shown.getvalue(), shown.getvalue()\n"
            "print(sorted(name for name in ('torch', 'numpy') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"imported by --help: {done.stdout.strip()}"


def test_the_public_names_resolve_on_first_use_and_backends_stays_the_function():
    """``import tensorwire`` imports what a name needs when it is first used; ``tw.backends`` stays the function even
    after the ``tensorwire.backends`` package's modules were imported."""
    code = ("import sys, tensorwire as tw\n"
            "assert 'torch' not in sys.modules\n"
            "import tensorwire.backends.registry\n"
            "assert callable(tw.backends) and tw.READ is tw.Op.READ\n"
            "missing = [name for name in tw.__all__ if getattr(tw, name, None) is None]\n"
            "assert not missing, missing\n"
            "assert tw.init.__module__ == 'tensorwire.joining' and 'torch' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_doctor_never_calls_a_backend_missing_that_needs_nothing():
    """A backend that is unavailable with nothing to fix (socket messages where NIXL carries them) reads "not used",
    never "no" beside "none needed"."""
    from tensorwire.doctor import _availability

    for info in tw.backends().values():
        word = _availability(info)
        assert word == ("yes" if info.available else "no" if info.fix else "not used"), (info, word)
        assert "none needed" not in info.fix, info
