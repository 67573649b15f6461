"""The reference of ``tensorwire bench fleet``'s first READ: raw NIXL's first contact between two processes.

A holder process makes a bare NIXL agent configured as tensorwire's (``nixl_setup.make_agent``), registers a pool
of ``FIRST_POOL_BLOCKS`` blocks and hands its agent metadata to a reader process over a pipe (the side channel a
raw NIXL user builds). The reader, whose agent and landing buffer already exist, times what tensorwire's first
READ also pays: loading the holder's metadata (``add_remote_agent``), describing ``FIRST_READ_BLOCKS`` blocks on
both sides and one READ of them, polled until done, then checks the bytes. A fresh pair of processes per contact:
a first contact happens once per pair of agents.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import torch

from ..errors import TransferError, WaitTimeoutError

__all__ = ["raw_first_contacts"]

_POLL_S = 60.0  # one raw READ on loopback takes microseconds once connected; this bounds a broken one


def raw_first_contacts(pool_blocks: int, read_blocks: int, block_bytes: int, contacts: int,
                       timeout_s: float) -> list[float]:
    """Seconds of each of ``contacts`` raw-NIXL first contacts (metadata load + first READ of ``read_blocks``
    random blocks of ``block_bytes``). Blocks; ``WaitTimeoutError`` past ``timeout_s`` for one contact."""
    ctx = mp.get_context("spawn")
    out = []
    for contact in range(contacts):
        holder_end, reader_end = ctx.Pipe()
        result_theirs, result_ours = ctx.Pipe(duplex=False)
        processes = [ctx.Process(target=_holder, args=(holder_end, pool_blocks, block_bytes), daemon=True),
                     ctx.Process(target=_reader, args=(reader_end, result_ours, pool_blocks, read_blocks,
                                                       block_bytes, contact), daemon=True)]
        for process in processes:
            process.start()
        try:
            if not result_theirs.poll(timeout_s):
                raise WaitTimeoutError(f"bench fleet: raw NIXL's first contact {contact} did not finish within "
                                       f"{timeout_s:g}s")
            status, value = result_theirs.recv()
            if status != "ok":
                raise TransferError(f"bench fleet: raw NIXL's first contact failed: {value}")
            out.append(value)
        finally:
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
    return out


def _agent(name: str) -> Any:
    from ..backends.nixl_setup import import_nixl, make_agent, quiet_nixl_logging

    quiet_nixl_logging()
    api, bindings = import_nixl()
    return make_agent(api, bindings, name, progress_wakeup_ms=10.0)


def _pool(blocks: int, block_bytes: int) -> torch.Tensor:
    return torch.arange(blocks * block_bytes // 4, dtype=torch.int32).view(blocks, block_bytes // 4)


def _holder(conn: Any, pool_blocks: int, block_bytes: int) -> None:
    agent = _agent("bench-raw-holder")
    pool = _pool(pool_blocks, block_bytes)
    registration = agent.register_memory([pool])
    conn.send((agent.get_agent_metadata(), pool.data_ptr()))
    conn.recv()  # the reader is done
    agent.deregister_memory(registration)


def _reader(conn: Any, result: Any, pool_blocks: int, read_blocks: int, block_bytes: int, seed: int) -> None:
    try:
        agent = _agent("bench-raw-reader")
        landing = torch.zeros(pool_blocks, block_bytes // 4, dtype=torch.int32)
        registration = agent.register_memory([landing])
        ids = np.random.default_rng(seed).permutation(pool_blocks)[:read_blocks]
        metadata, remote_base = conn.recv()
        start = time.perf_counter()
        name = agent.add_remote_agent(metadata)
        local = agent.get_xfer_descs([(landing[i].data_ptr(), block_bytes, 0) for i in ids], "DRAM")
        remote = agent.get_xfer_descs([(remote_base + int(i) * block_bytes, block_bytes, 0) for i in ids], "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, name)
        state = agent.transfer(handle)
        deadline = time.monotonic() + _POLL_S
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(handle)
        seconds = time.perf_counter() - start
        if state != "DONE" or not torch.equal(landing[torch.as_tensor(ids)], _pool(pool_blocks, block_bytes)[ids]):
            raise TransferError(f"raw READ ended in state {state!r} or landed wrong bytes")
        agent.release_xfer_handle(handle)
        agent.deregister_memory(registration)
        result.send(("ok", seconds))
    except BaseException as e:  # noqa: BLE001 - reported to the command
        result.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.send(None)
