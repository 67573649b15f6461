"""Shared helpers for the tensorwire test suite.

Multi-process tests run module-level "rank functions" through ``tw.testing.launch``; each rank calls
``tw.init`` itself. Test data always encodes its sender: ``value = rank * 1000 + index`` (plus an
optional per-round offset), so a transfer that reaches the wrong rank or the wrong bytes shows up.

Rank functions import these helpers with ``from conftest import ...``: pytest puts this folder on
``sys.path`` and the spawned ranks inherit it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import tensorwire as tw

# Short, bounded timeouts everywhere: nothing in this suite may hang.
INIT_TIMEOUT = 30.0  # tw.init(timeout=...) in every rank
WAIT = 10.0  # lookups, barriers and transfer waits that must succeed
LAUNCH_TIMEOUT = 90.0  # the whole launched job
SENTINEL = -1  # what a receive buffer holds before anything arrived


# --- data ---------------------------------------------------------------------------------------
def rank_values(rank: int, n: int, dtype: torch.dtype = torch.float32, device="cpu", offset: int = 0) -> torch.Tensor:
    """``rank * 1000 + index + offset`` for ``index in range(n)``, computed exactly, then cast to ``dtype``."""
    values = torch.arange(n, dtype=torch.int64) + (rank * 1000 + offset)
    return values.to(dtype).to(device)


def sentinel(n: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """A receive buffer filled with ``SENTINEL`` (exact in every dtype used here)."""
    return torch.full((n,), SENTINEL, dtype=dtype, device=device)


def mismatch(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when equal, else a short description of the first differing element."""
    got, expected = got.detach().cpu(), expected.detach().cpu()
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"shape/dtype {tuple(got.shape)}/{got.dtype} != {tuple(expected.shape)}/{expected.dtype}"
    differ = got != expected
    if not bool(differ.any()):
        return None
    idx = int(differ.nonzero()[0, 0]) if got.dim() else 0
    g, e = got.reshape(-1)[idx].item(), expected.reshape(-1)[idx].item()
    return f"{int(differ.sum())} of {got.numel()} elements differ; first at index {idx}: got {g}, expected {e}"


def assert_equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Assert exact equality; the message says what was compared and where it first differs."""
    problem = mismatch(got, expected)
    assert problem is None, f"{what}: {problem}"


# --- ranks --------------------------------------------------------------------------------------
def ring_peers(comm: tw.Communicator) -> tuple[int, int]:
    """(next, previous) rank on the ring."""
    return (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size


def launch(fn, world_size: int, *args, timeout: float = LAUNCH_TIMEOUT, env: dict | None = None) -> list:
    """``tw.testing.launch`` with the suite's default timeout."""
    return tw.testing.launch(fn, world_size, *args, timeout=timeout, env=env)


def rss_bytes() -> int:
    """Current resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cores_used_while(fn) -> float:
    """CPU time of this process (all threads) divided by wall time, while ``fn()`` runs."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return (cpu_seconds() - c0) / (time.perf_counter() - t0)


# --- GPU marker ---------------------------------------------------------------------------------
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
