"""What every test folder shares: a ``gpu`` test is skipped, with the reason, where torch sees no GPU; the
``processes`` a test starts are killed after it; ``kv_fleet``, a directory for one module's KV pairs.

The suite's helpers live in ``tensorwire.testing`` (``data``: values that encode their sender; ``suite``:
the bounded timeouts and ``launch``; ``scenarios`` and ``moe_reference``: what CPU and GPU tests share), so
test modules import them from there and never from each other.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    reason = (
        f"no CUDA device: torch.cuda.is_available() is False "
        f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    )
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def processes():
    """A list the test appends the ``subprocess.Popen`` it starts to: each is killed (if still running; resumed
    first, should the test have stopped it) after it."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def kv_fleet():
    """``(address, token)`` of a ``tensorwire directory`` of a new job, for the KV pairs of one test module."""
    from tensorwire.bench.vllm_parties import start_directory

    token = secrets.token_hex(16)
    directory, address = start_directory(token)
    yield address, token
    directory.close()
