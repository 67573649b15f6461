"""The raw NIXL references of ``tensorwire bench kv``: the same blocks moved by a bare NIXL agent, as a raw NIXL
user would request them (``raw_nixl.RawNixl`` holds the agent and its peer):

- ``raw nixl descs``: an Nx3 ``(addr, len, device)`` descriptor array built per request, then
  ``initialize_xfer``;
- ``raw nixl prepped``: per-block descriptor lists prepped once, then ``make_prepped_xfer`` with int32 indices per
  request (what vLLM's NixlConnector does).

Descriptors are view-major (every block of view 0, then view 1, ...), as vLLM orders them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .raw_nixl import RawNixl
from .timing import Budget, HostClock, Timing, measure, time_call

__all__ = ["raw_block_paths"]


def _rows(bases: list[tuple[int, int]], ids: np.ndarray, block_bytes: int, device: int) -> np.ndarray:
    """Nx3 ``(addr, len, device)`` descriptors of ``ids`` in every view given as (address, bytes per block)."""
    addrs = np.concatenate([addr + ids.astype(np.uint64) * np.uint64(stride) for addr, stride in bases])
    rows = np.empty((len(addrs), 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addrs, block_bytes, device
    return rows


def raw_block_paths(raw: RawNixl, op: str, tensors: tuple[list[torch.Tensor], list[tuple[int, int]]], views: int,
                    block_bytes: int, ids: tuple[np.ndarray, np.ndarray],
                    budget: Budget) -> Iterator[tuple[str, Timing, list[float]]]:
    """``(path, timing of one request, host us to start one request: build and post)`` for each raw path, moving blocks
    ``ids[1]`` of the peer's views (``tensors[1]``: address and stride of each) to or from blocks ``ids[0]`` of
    ``tensors[0]`` (``[blocks, block_bytes / 4]`` int32 views, registered with ``raw``'s agent). ``op``: "READ" or
    "WRITE". Blocks while measuring."""
    local, peer = tensors
    local_ids, remote_ids = ids
    agent, peer_name = raw.agent, raw.peer_name
    mem = "VRAM" if local[0].is_cuda else "DRAM"
    device = max(local[0].device.index or 0, 0)
    local_bases = [(t.data_ptr(), t.stride(0) * 4) for t in local]

    def per_request() -> Any:
        return agent.initialize_xfer(op, agent.get_xfer_descs(_rows(local_bases, local_ids, block_bytes, device), mem),
                                     agent.get_xfer_descs(_rows(peer, remote_ids, block_bytes, device), mem), peer_name)

    blocks = local[0].shape[0]
    all_ids = np.arange(blocks)
    local_list = agent.prep_xfer_dlist("", _rows(local_bases, all_ids, block_bytes, device), mem)
    remote_list = agent.prep_xfer_dlist(peer_name, _rows(peer, all_ids, block_bytes, device), mem)
    view_offsets = np.arange(views, dtype=np.int64)[:, None] * blocks
    local_index = (view_offsets + local_ids[None, :]).astype(np.int32).ravel()
    remote_index = (view_offsets + remote_ids[None, :]).astype(np.int32).ravel()

    def prepped() -> Any:
        return agent.make_prepped_xfer(op, local_list, local_index, remote_list, remote_index)

    try:
        for name, build in (("raw nixl descs", per_request), ("raw nixl prepped", prepped)):
            post_us = [_post_us(build, raw) for _ in range(7)]  # as post is timed for tensorwire

            def request(build=build) -> None:
                handle = build()
                raw.post_and_wait(handle)
                handle.release()

            yield name, measure(request, HostClock(), budget), post_us[2:]
    finally:
        agent.release_dlist_handle(local_list)
        agent.release_dlist_handle(remote_list)


def _post_us(build: Callable[[], Any], raw: RawNixl) -> float:
    """Host us to start one raw NIXL request: building it and NIXL's post (``transfer``), as tensorwire's ``post``
    is timed (NIXL may move the bytes inside its post: UCX copies host memory of a same-host peer there). The
    wait and the release are not timed."""
    started: list[tuple[Any, str]] = []

    def start() -> None:
        handle = build()
        started.append((handle, raw.post(handle)))

    took = time_call(start)
    handle, state = started[0]
    raw.wait(handle, state)
    handle.release()
    return took * 1e6
