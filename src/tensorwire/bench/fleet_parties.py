"""The processes of ``tensorwire bench fleet`` (the command and its records are ``fleet.py``).

Every party is a fresh process that imports tensorwire, says it is ready, and then does what the command's
process asks over a pipe, one request at a time, replying ``("ok", result)`` or ``("error", traceback)``
(after which it exits). Nothing here goes through tensorwire but the transfers and the directory.

- ``holder``: a fleet member of the first launch. ``join`` times ``tw.init(directory=, name=)`` and registers
  and publishes a small pool (``first``: ``FIRST_POOL_BLOCKS`` blocks) and, on ``member-0`` only, the large
  pool the steady state reads (``steady``, in a ``/dev/shm`` file so that ``shm`` can reach it too).
- ``reader``: a member of a second launch, started after the holders are up. ``first`` reaches holders it
  never contacted by name (``rank_of`` + ``lookup_blocks`` + ``prepare_blocks`` + the first READ, each timed);
  ``steady`` prepares the READ of ``member-0``'s large pool, and ``round`` times posts of it.
- ``world_rank``: the same large-pool READ between the two ranks of one launcher world
  (``tensorwire.testing.launch``); rank 0 takes ``warm`` / ``round`` requests like the reader, rank 1 holds the
  pool until ``stop``.

Block values encode their owner: word w of block b is ``b * 7919 + w + owner``, so a READ that landed another
member's bytes, or none, fails the benchmark instead of reporting a number.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..errors import TransferError
from ..shared_memory import remove_own_files, shared_empty
from .timing import HostClock

__all__ = ["FIRST_POOL_BLOCKS", "FIRST_READ_BLOCKS", "holder", "reader", "world_rank", "descriptors"]

FIRST_POOL_BLOCKS = 64  # each holder's small pool
FIRST_READ_BLOCKS = 16  # the first READ from a never-seen member: random ids of its small pool
_STEADY_OWNER, _WORLD_OWNER = 5_000_000, 7_000_000
_WAIT_S = 60.0


def _values(blocks: int, block_bytes: int, owner: int, out: torch.Tensor | None = None) -> torch.Tensor:
    words = block_bytes // 4
    base = torch.arange(words, dtype=torch.int32)[None, :] + torch.arange(blocks, dtype=torch.int32)[:, None] * 7919
    return torch.add(base, owner, out=out)


def _expected(ids: np.ndarray, block_bytes: int, owner: int) -> torch.Tensor:
    words = block_bytes // 4
    ids = torch.as_tensor(ids, dtype=torch.int32)
    return torch.arange(words, dtype=torch.int32)[None, :] + ids[:, None] * 7919 + owner


def _shm_values(blocks: int, block_bytes: int, owner: int) -> torch.Tensor:
    """A ``[blocks, block_bytes / 4]`` int32 pool in a ``/dev/shm`` file (as a serving engine's KV cache) that
    lives as long as the returned tensor (``shared_empty``)."""
    return _values(blocks, block_bytes, owner, out=shared_empty((blocks, block_bytes // 4), dtype=torch.int32))


def descriptors() -> dict[str, int]:
    """This process's open file descriptors, and how many of them are sockets."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return {"fds": len(fds), "sockets": sockets}


@contextmanager
def _join_phases(phases: dict[str, float]):
    """Time the parts of ``tw.init`` a fleet member pays, by wrapping the constructors it runs: the directory
    connection with the rank claim and the liveness listener (``Rendezvous``), the NIXL agent with its UCX
    backend (``NixlBackend``), the name claim and member record (``Membership``). Milliseconds into ``phases``;
    the wrappers cost microseconds and are removed on exit."""
    from ..backends.nixl import NixlBackend
    from ..meeting import Rendezvous
    from ..meeting.membership import Membership

    wrapped = {"directory: connect, rank, liveness": Rendezvous, "nixl agent (started)": NixlBackend,
               "directory: name, record": Membership}
    originals = {name: cls.__init__ for name, cls in wrapped.items()}

    def timed(name: str, original: Callable) -> Callable:
        def init(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                original(self, *args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + (time.perf_counter() - start) * 1e3
        return init

    for name, cls in wrapped.items():
        cls.__init__ = timed(name, originals[name])
    try:
        yield
    finally:
        for name, cls in wrapped.items():
            cls.__init__ = originals[name]


def _join(directory: str, name: str, timeout_s: float) -> tuple[Any, dict[str, Any]]:
    import tensorwire as tw

    phases: dict[str, float] = {}
    with _join_phases(phases):
        start = time.perf_counter()
        comm = tw.init(directory=directory, name=name, timeout=timeout_s)
        join_ms = (time.perf_counter() - start) * 1e3
    phases["other"] = join_ms - sum(phases.values())
    return comm, {"rank": comm.rank, "join_ms": join_ms, "phases": phases}


def _serve(conn: Any, env: dict[str, str], party: Callable[[], dict[str, Callable]]) -> None:
    """Answer the command's requests ``(what, *args)`` with ``party``'s handlers until ``stop``."""
    os.environ.update(env)  # this process's own environment, set before tensorwire reads it
    try:
        handlers = party()
        conn.send(("ok", "ready"))
        while True:
            what, *args = conn.recv()
            conn.send(("ok", handlers[what](*args)))
            if what == "stop":
                break
    except BaseException as e:  # noqa: BLE001 - every failure goes to the command, which stops every party
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        conn.close()
        remove_own_files()  # os._exit runs no finalizer
        os._exit(1)
    conn.close()
    remove_own_files()
    os._exit(0)  # backend threads must not hold a finished party


# --- a member of the first launch ------------------------------------------------------------------------------
def holder(conn: Any, env: dict[str, str], directory: str, name: str, member: int, steady: tuple[int, int] | None,
           timeout_s: float) -> None:
    """``name`` (``member-<member>``): ``join``, ``fds``, ``stop``. ``steady``: (blocks, block bytes) of the large
    pool this member also holds, or None."""
    state: dict[str, Any] = {}

    def join(block_bytes: int) -> dict[str, Any]:
        comm, joined = _join(directory, name, timeout_s)
        state["comm"] = comm
        small = _values(FIRST_POOL_BLOCKS, block_bytes, member * 1000)
        start = time.perf_counter()
        state["pools"] = [comm.register_blocks(small)]
        comm.publish_blocks("first", state["pools"][0])
        joined["serving_ms"] = joined["join_ms"] + (time.perf_counter() - start) * 1e3
        if steady is not None:
            state["shared"] = _shm_values(*steady, _STEADY_OWNER)
            state["pools"].append(comm.register_blocks(state["shared"]))
            comm.publish_blocks("steady", state["pools"][1])
        return {**joined, **descriptors()}

    def stop() -> dict[str, int]:
        for pool in state.get("pools", []):
            pool.close()
        if "comm" in state:
            state["comm"].close()
        state.pop("shared", None)  # its /dev/shm file goes with it
        return descriptors()

    _serve(conn, env, lambda: {"join": join, "fds": descriptors, "stop": stop})


# --- a member of the second launch ---------------------------------------------------------------------------
class _SteadyRead:
    """READs of ``blocks`` random ids of a peer's large pool into a local one, one request per post, prepared
    once per transport; what ``round`` times. Shared by the fleet's reader and the launcher world's rank 0."""

    def __init__(self, comm: Any, remote: Any, blocks: int, block_bytes: int, owner: int,
                 transports: tuple[str, ...]) -> None:
        import tensorwire as tw

        self.owner, self.block_bytes = owner, block_bytes
        self.landing = torch.zeros(blocks, block_bytes // 4, dtype=torch.int32)
        self.pool = comm.register_blocks(self.landing)
        rng = np.random.default_rng(blocks)
        self.local_ids, self.remote_ids = rng.permutation(blocks), rng.permutation(blocks)
        self.transfers = {t: comm.prepare_blocks(tw.READ, self.pool, remote, transport=t) for t in transports}

    def _call(self, transport: str) -> Callable[[], None]:
        x = self.transfers[transport]
        return lambda: (x.post(self.local_ids, self.remote_ids), x.wait(timeout=_WAIT_S))

    def warm(self, transport: str) -> float:
        """Three untimed-for-the-record calls, the bytes of the last checked; the median call in seconds."""
        self.landing.zero_()
        samples = HostClock().time_calls(self._call(transport), 3)
        self.check(transport)
        return sorted(samples)[1]

    def round(self, transport: str, reps: int) -> list[float]:
        """``reps`` timed calls (seconds each), Python's collector paused as ``timing.measure`` does."""
        import gc

        gc.collect()
        gc.disable()
        try:
            return HostClock().time_calls(self._call(transport), reps)
        finally:
            gc.enable()

    def check(self, transport: str) -> None:
        n = min(1000, len(self.local_ids))
        landed = self.landing[torch.as_tensor(self.local_ids[:n])]
        if not torch.equal(landed, _expected(self.remote_ids[:n], self.block_bytes, self.owner)):
            raise TransferError(f"bench fleet: the steady READ over {transport} landed wrong bytes")

    def close(self) -> None:
        for x in self.transfers.values():
            x.close()
        self.pool.close()


class _Reader:
    """A reader's state across the command's requests: its communicator, the small pool its first READs land in
    (and their transfers, kept for ``stop``), and the steady-state read once ``steady`` set it up."""

    def __init__(self, directory: str, name: str, timeout_s: float) -> None:
        self.directory, self.name, self.timeout_s = directory, name, timeout_s
        self.comm: Any = None
        self.landing: torch.Tensor | None = None
        self.small: Any = None
        self.transfers: list[Any] = []
        self.steady_read: _SteadyRead | None = None

    def handlers(self) -> dict[str, Callable]:
        """What the command may ask: ``join``, ``first``, ``steady``, ``warm``, ``round``, ``check``, ``fds``,
        ``stop``."""
        return {"join": self.join, "first": self.first, "steady": self.steady, "fds": descriptors, "stop": self.stop,
                "warm": lambda transport: self.steady_read.warm(transport),
                "round": lambda transport, reps: self.steady_read.round(transport, reps),
                "check": lambda transport: self.steady_read.check(transport)}

    def join(self, block_bytes: int) -> dict[str, Any]:
        """Join the fleet and register the landing pool; the join's phases, ms until serving, and fds."""
        self.comm, joined = _join(self.directory, self.name, self.timeout_s)
        self.landing = torch.zeros(FIRST_POOL_BLOCKS, block_bytes // 4, dtype=torch.int32)
        start = time.perf_counter()
        self.small = self.comm.register_blocks(self.landing)
        joined["serving_ms"] = joined["join_ms"] + (time.perf_counter() - start) * 1e3
        return {**joined, **descriptors()}

    def first(self, targets: list[tuple[str, int]], block_bytes: int) -> list[dict[str, float]]:
        """Per target ``(name, member index)``: ms of each step of the first READ, and µs of the same READ again."""
        ids = np.random.default_rng(0).permutation(FIRST_POOL_BLOCKS)[:FIRST_READ_BLOCKS]
        return [self._first_read(target, member, ids, block_bytes) for target, member in targets]

    def _first_read(self, target: str, member: int, ids: np.ndarray, block_bytes: int) -> dict[str, float]:
        """The first READ of ``ids`` from ``target``, timed step by step (rank_of, lookup, prepare, read), its
        bytes checked, then the same READ again (the median of 5)."""
        import tensorwire as tw

        t0 = time.perf_counter()
        rank = self.comm.rank_of(target, timeout=self.timeout_s)
        t1 = time.perf_counter()
        remote = self.comm.lookup_blocks("first", rank, timeout=self.timeout_s)
        t2 = time.perf_counter()
        x = self.comm.prepare_blocks(tw.READ, self.small, remote, transport="nixl")
        t3 = time.perf_counter()
        x.post(ids, ids)
        x.wait(timeout=_WAIT_S)
        t4 = time.perf_counter()
        self.transfers.append(x)
        if not torch.equal(self.landing[torch.as_tensor(ids)], _expected(ids, block_bytes, member * 1000)):
            raise TransferError(f"bench fleet: the first READ from {target} landed wrong bytes")
        again = HostClock().time_calls(lambda: (x.post(ids, ids), x.wait(timeout=_WAIT_S)), 5)
        return {"rank_of_ms": (t1 - t0) * 1e3, "lookup_ms": (t2 - t1) * 1e3, "prepare_ms": (t3 - t2) * 1e3,
                "read_ms": (t4 - t3) * 1e3, "total_ms": (t4 - t0) * 1e3, "again_us": sorted(again)[2] * 1e6}

    def steady(self, source: str, blocks: int, block_bytes: int, transports: tuple[str, ...]) -> None:
        """Set up the steady-state READ of ``blocks`` from member ``source``."""
        remote = self.comm.lookup_blocks("steady", self.comm.rank_of(source, timeout=self.timeout_s),
                                         timeout=self.timeout_s)
        self.steady_read = _SteadyRead(self.comm, remote, blocks, block_bytes, _STEADY_OWNER, transports)

    def stop(self) -> dict[str, int]:
        """Close everything (in the order it depends on); the fds before that."""
        seen = descriptors()
        if self.steady_read is not None:
            self.steady_read.close()
        for x in self.transfers:
            x.close()
        if self.comm is not None:
            self.small.close()
            self.comm.close()
        return seen


def reader(conn: Any, env: dict[str, str], directory: str, name: str, timeout_s: float) -> None:
    """``name``: a fleet member that reads from the others (``_Reader``'s requests), until ``stop``."""
    _serve(conn, env, lambda: _Reader(directory, name, timeout_s).handlers())


# --- the launcher world ------------------------------------------------------------------------------------------
def world_rank(conns: tuple[Any, Any], blocks: int, block_bytes: int, transports: tuple[str, ...],
               timeout_s: float) -> None:
    """One rank of a 2-rank launcher world (``launch(world_rank, 2, ...)``) answering the command over
    ``conns[rank]``: rank 1 holds the large pool in a ``/dev/shm`` file until ``stop``; rank 0 reads it as the
    fleet's reader does (``warm``, ``round``, ``check``). The command stops rank 1 first: rank 0 hosts the
    store, and its ``close`` should find rank 1 departed already."""
    import tensorwire as tw

    comm = tw.init(timeout=timeout_s)
    conn = conns[comm.rank]
    if comm.rank == 1:  # the pool's /dev/shm file goes with the process (and with the tensor, were it freed)
        pool = comm.register_blocks(_shm_values(blocks, block_bytes, _WORLD_OWNER))
        comm.publish_blocks("steady", pool)
        conn.send(("ok", "ready"))
        conn.recv()  # stop
        pool.close()
        comm.close()
        conn.send(("ok", "stopped"))
        return
    steady = _SteadyRead(comm, comm.lookup_blocks("steady", 1, timeout=timeout_s), blocks, block_bytes, _WORLD_OWNER,
                         transports)
    handlers = {"warm": steady.warm, "round": steady.round, "check": steady.check}
    conn.send(("ok", "ready"))
    while True:
        what, *args = conn.recv()
        if what == "stop":
            break
        conn.send(("ok", handlers[what](*args)))
    steady.close()
    comm.close()
    conn.send(("ok", "stopped"))
