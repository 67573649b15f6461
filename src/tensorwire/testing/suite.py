"""The bounded defaults of tensorwire's own test suite, and what its rank functions measure.

Nothing in the suite may hang: every launch, init, lookup, barrier and wait has a short timeout from here.
Rank functions are module-level functions of the test modules, run by ``launch`` in fresh processes.

A bound on how soon something must happen holds on a busy machine too (a laptop, a shared CI runner): ``pace()``
measures how far this machine is from idle (its run queue per usable core) and ``scaled(seconds)`` stretches a
bound by it. What the bound means stays (a configured timeout with its margin); only what "soon" costs here
changes. Lower bounds (a timeout must not fire early) are never scaled.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .launch import launch as launch_ranks

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["INIT_TIMEOUT", "WAIT", "LAUNCH_TIMEOUT", "GPU_ENV", "launch", "drain", "raises_after", "ring_peers",
           "rss_bytes", "cpu_seconds", "cores_used_while", "pace", "scaled", "close_patiently"]


def pace() -> float:
    """How many times slower than idle this machine runs a process now, at least 1: the runnable processes (the
    1-minute load average) per core this process may use. 1 where the load average cannot be read. Does not
    block."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, load / max(cores, 1))


def scaled(seconds: float) -> float:
    """``seconds``, a bound on how soon something must happen on an idle machine, at this machine's ``pace()``."""
    return seconds * pace()


def close_patiently(registration: Any, seconds: float = 30.0) -> None:
    """``registration.close()``, called again while it raises ``WaitTimeoutError`` (a live peer that did not
    acknowledge the revocation within ``2 x TENSORWIRE_LIVENESS_S``: on a busy machine its answer can come later;
    ``close()`` again waits more, as documented) until ``scaled(seconds)``. Blocks."""
    from ..errors import WaitTimeoutError

    deadline = time.monotonic() + scaled(seconds)
    while True:
        try:
            registration.close()
            return
        except WaitTimeoutError:
            if time.monotonic() >= deadline:
                raise


INIT_TIMEOUT = scaled(30.0)  # tw.init(timeout=...) in every rank
WAIT = scaled(10.0)  # lookups, barriers and transfer waits that must succeed
LAUNCH_TIMEOUT = 90.0  # the whole launched job on an idle machine (``launch`` scales it when it starts one)
GPU_ENV = {"CUDA_MODULE_LOADING": "EAGER"}  # GPU ranks: lazy module loading can deadlock against a blocked stream


def raises_after(call: Callable[[], Any], expected: Any) -> tuple[str, float]:
    """``(error type name, seconds)`` of ``call()``, which must raise ``expected`` (an exception type or a tuple
    of them); ``AssertionError`` naming the call if it returns instead: for asserting that a failure comes, and
    how soon."""
    start = time.monotonic()
    try:
        call()
    except expected as e:
        return type(e).__name__, time.monotonic() - start
    raise AssertionError(f"{call} returned instead of raising {expected}")


def drain(stream: Any, seconds: float = 30.0) -> None:
    """Wait, bounded, until everything enqueued on the CUDA ``stream`` so far has run: an event polled with a
    deadline instead of a synchronize, so a stream wait that is never released fails the test instead of
    hanging it (``TimeoutError``)."""
    import torch

    event = torch.cuda.Event()
    event.record(stream)
    deadline = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the GPU stream did not drain within {seconds}s: a stream wait was never released")
        time.sleep(1e-4)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None,
           env: dict | None = None, may_die: tuple = ()) -> list:
    """``tensorwire.testing.launch`` with the suite's timeout (``LAUNCH_TIMEOUT`` at this machine's pace when None);
    blocks until every rank returned (their results, by rank) or one failed (raised here, the others stopped)."""
    return launch_ranks(fn, world_size, *args, timeout=scaled(LAUNCH_TIMEOUT) if timeout is None else timeout, env=env,
                        may_die=may_die)


def ring_peers(comm: Communicator) -> tuple[int, int]:
    """(next, previous) rank on the ring."""
    return (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size


def rss_bytes() -> int:
    """Current resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    """User plus system CPU seconds of this process, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cores_used_while(fn: Callable[[], Any]) -> float:
    """CPU time of this process (all threads) divided by wall time, while ``fn()`` runs (it blocks as long)."""
    cpu_before, wall_before = cpu_seconds(), time.perf_counter()
    fn()
    return (cpu_seconds() - cpu_before) / (time.perf_counter() - wall_before)
