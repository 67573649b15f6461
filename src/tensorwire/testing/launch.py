"""Run ``fn(*args)`` in ``world_size`` fresh local processes, the way torchrun would.

Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and a free
``MASTER_PORT`` in its own environment before ``fn`` runs, so ``tw.init()`` works unchanged, and a fresh random
``TENSORWIRE_JOB_TOKEN`` shared by the job's ranks only (the launching process's environment is not changed).
The first rank to fail (exception or non-zero exit) stops every rank, and its traceback is raised here.

The launching process owns its ranks: Ctrl-C, which a terminal sends to the whole process group, stops the
launcher, and it stops them all (the ranks ignore SIGINT: a rank in the middle of a transfer is never cut
half-way through its own cleanup; the launcher kills it, then removes its files). SIGTERM to the group ends the
launcher the same way (while ``launch`` waits, SIGTERM raises ``SystemExit(143)`` in it, where nobody else
handles SIGTERM), and a rank's own SIGTERM removes the files it created (``shared_memory``). A rank dies with
the launching process even when that is killed with SIGKILL (Linux: ``PR_SET_PDEATHSIG``). Once its ranks are
gone the launcher removes the ``/dev/shm`` files they left (``shared_memory.remove_orphans``; a rank it killed, by
its pid, even while the kernel still tears it down), ignoring a second SIGINT or SIGTERM meanwhile: ``timeout``(1)
passes the SIGINT it gets on to its process group, so under it Ctrl-C comes twice.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import TensorwireError, WaitTimeoutError
from ..shared_memory import remove_files_of, remove_orphans, remove_own_files, start_time

__all__ = ["launch", "free_port", "RankFailedError"]


class RankFailedError(TensorwireError, RuntimeError):
    """A rank launched by ``launch`` raised or exited with a non-zero code."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(parent_pid: int) -> None:
    """This rank ignores Ctrl-C (the launcher stops it) and is killed when the launching process dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: a rank outlives a killed launcher until its own timeouts end it
    if os.getppid() != parent_pid:  # the launcher died before the call above
        os._exit(1)


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, env: dict[str, str],
           args: tuple, conn: Any, parent_pid: int) -> None:
    _die_with(parent_pid)
    faulthandler.enable()  # a rank killed by a signal (SIGSEGV in a native call) prints every thread's stack
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        result = fn(*args)
        # Plain pickle, not the connection's ForkingPickler: a tensor result must not share its storage
        # with the parent through a file descriptor that dies with this process.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        conn.close()
        remove_own_files()  # the traceback holds the tensors, and os._exit runs no finalizer
        os._exit(1)
    conn.close()
    remove_own_files()
    # Skip interpreter teardown: backend threads must not be able to hang a finished rank.
    os._exit(0)


def _raise_exit(number: int, _frame: object) -> None:
    raise SystemExit(128 + number)


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While the launcher waits, SIGTERM raises ``SystemExit(143)`` so that it still stops its ranks and removes
    their files (the default action would end it at once). Left alone off the main thread and where someone
    installed a SIGTERM handler of their own."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
            signal.SIG_DFL, _raise_exit):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_code(proc: Any) -> int | None:
    """The exit code of a finished rank process (after its pipe was drained), else None."""
    if proc.is_alive():
        return None
    proc.join(timeout=1)
    return proc.exitcode


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
           env: dict[str, str] | None = None, may_die: tuple[int, ...] = ()) -> list[Any]:
    """Run ``fn(*args)`` on ranks ``0..world_size-1``; returns their results in rank order.

    ``fn`` must be importable (module level). A rank that exits with code 0 without returning (e.g. a test
    simulating a crash with ``os._exit(0)``), or a rank in ``may_die`` that exits with any code (a test that
    kills it with SIGKILL), yields ``None``.
    ``env`` adds to each rank's environment; the
    ranks share a new random ``TENSORWIRE_JOB_TOKEN`` unless ``env`` names one (``""``: unauthenticated).
    Raises ``RankFailedError`` for the first failing rank and ``WaitTimeoutError`` after ``timeout`` seconds,
    killing every rank in both cases.
    The free port is picked before the ranks start, so another process can take it meanwhile: a job that
    fails because rank 0 found its port taken is started again on a new port (at most twice more).
    """
    with _sigterm_as_exit():
        for attempt in range(3):
            try:
                return _launch_once(fn, world_size, args, timeout, env, may_die)
            except RankFailedError as e:
                if "EADDRINUSE" not in str(e) or attempt == 2:
                    raise
    raise AssertionError("unreachable")


def _launch_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float,
                 env: dict[str, str] | None, may_die: tuple[int, ...] = ()) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs: list[Any] = []
    started: list[int | None] = []  # each rank's start time, which names its /dev/shm files
    env = {"TENSORWIRE_JOB_TOKEN": secrets.token_hex(16), **(env or {})}
    try:
        conns = []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fn, rank, world_size, port, dict(env or {}), args, child_conn,
                                                 os.getpid()),
                            name=f"tensorwire-rank{rank}", daemon=True)
            p.start()
            child_conn.close()
            procs.append(p)
            started.append(start_time(p.pid))
            conns.append(parent_conn)
        results = _wait_for_ranks(procs, conns, timeout, may_die)
    except BaseException:
        with _further_stops_ignored():  # a second Ctrl-C must not cut the cleanup short
            _stop_ranks(procs, started)
        raise
    _stop_ranks(procs, started)
    return results


def _wait_for_ranks(procs: list[Any], conns: list[Any], timeout: float, may_die: tuple[int, ...]) -> list[Any]:
    """Every rank's result, in rank order; raises for the first that fails, or once ``timeout`` passed."""
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    while pending:
        for rank in sorted(pending):
            conn, proc = conns[rank], procs[rank]
            if conn.poll():
                try:
                    kind, payload = pickle.loads(conn.recv_bytes())
                except EOFError:  # the rank exited without reporting (e.g. os._exit)
                    kind, payload = "eof", None
                if kind == "error":
                    raise RankFailedError(f"rank {rank} of {world_size} failed:\n{payload}")
                if kind == "ok":
                    results[rank] = payload
                    pending.discard(rank)
                    continue
            if _exit_code(proc) is not None:
                if proc.exitcode != 0 and rank not in may_die:
                    raise RankFailedError(f"rank {rank} of {world_size} exited with code {proc.exitcode}")
                pending.discard(rank)
        if time.monotonic() > deadline:
            raise WaitTimeoutError(
                f"launch: ranks {sorted(pending)} of {world_size} still running after {timeout:.0f}s; "
                "killed them all"
            )
        time.sleep(0.01)
    return results


def _stop_ranks(procs: list[Any], started: list[int | None]) -> None:
    """Kill the ranks still running, wait for them (bounded), then remove every ``/dev/shm`` file they created:
    those of a killed rank by its pid and start time, even while the kernel is still tearing it down (it runs no
    more code, so nothing of it can still need them), and the orphans of any other process gone meanwhile."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p, start in zip(procs, started):
        p.join(timeout=10)
        if p.pid is not None:
            remove_files_of(p.pid, start)
    remove_orphans()


@contextmanager
def _further_stops_ignored() -> Iterator[None]:
    """While the launcher stops its ranks after an interruption, SIGINT and SIGTERM are ignored: they ask for what
    is being done already, and ``timeout``(1) or a shell may send a second one to the group (``timeout`` passes the
    SIGINT it gets on to its own process group, so every process sees Ctrl-C twice). Off the main thread, where no
    handler can be changed, nothing is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
