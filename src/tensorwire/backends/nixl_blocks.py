"""NIXL's side of a block transfer (``NixlBackend.prepare_blocks``): the pools' regions as NIXL's compressed
descriptor lists, and the request that holds the two prepped lists and the NIXL requests bound for the posts to
come. Released with the transfer; it lets go of the agent then, so a request kept past its release does not keep
the agent's threads and sockets past the communicator's close."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Op
from .block_copy import BlockBindings, BlockLayout

__all__ = ["BlockRequest", "strided_rows"]


def strided_rows(layout: BlockLayout) -> np.ndarray:
    """NIXL's compressed descriptor list: per region ``(address, block bytes, device, stride, blocks)``."""
    device = max(layout.device_index, 0)
    return np.array([(r.addr, r.block_bytes, device, r.stride, layout.num_blocks) for r in layout.regions],
                    dtype=np.uint64)


class BlockRequest:
    """A block transfer over NIXL: the two prepped lists, and the NIXL requests bound for the posts to come
    (``_handle`` is the current one's, for ``status``)."""

    takes_device_ids = False  # ids become NIXL descriptor indices on the host

    def __init__(self, agent: Any, op: Op, local_list: Any, remote_list: Any, local_blocks: int,
                 remote_blocks: int, num_regions: int) -> None:
        self._agent, self.op = agent, op
        self.local_list, self.remote_list = local_list, remote_list
        self.local_blocks, self.remote_blocks = local_blocks, remote_blocks
        self._region_starts = None if num_regions == 1 else np.arange(num_regions, dtype=np.int64)[:, None]
        self.bindings = BlockBindings(on_drop=lambda binding: binding[0].release())

    def indices(self, ids: np.ndarray, num_blocks: int) -> np.ndarray:
        """Descriptor indices of ``ids`` in every region, region-major (adjacent blocks stay adjacent)."""
        if self._region_starts is None:
            return ids.astype(np.int32)
        return (self._region_starts * num_blocks + ids[None, :]).astype(np.int32).ravel()

    @property
    def _handle(self) -> Any:
        return self.bindings.current[0]._handle

    def release(self) -> None:
        """Release the bound requests and both lists, then let go of the agent: a request kept past its release
        (by its user, or a cycle) must not keep the agent, its threads and sockets, past the communicator's
        close."""
        self.bindings.clear()
        for dlist in (self.local_list, self.remote_list):
            if dlist is not None:
                self._agent.release_dlist_handle(dlist)
        self.local_list = self.remote_list = None
        self._agent = None
