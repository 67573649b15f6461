"""Same-process transport: a plain copy between two registered ranges of this process.

NIXL between two ranges of one process falls back to UCX's TCP emulation (0.4 GB/s on an H200, against
1.6 TB/s for a device copy), so transfers whose remote rank is this rank take this path instead.
Copies that touch GPU memory are stream-ordered (``cuMemcpyAsync`` on the stream given to ``post``, else the
current stream, as any PyTorch op; ``cuda.StreamCopies``) and CUDA-graph capturable; host copies complete
inside ``post``. Issuing the driver call directly rather than ``Tensor.copy_`` under a stream context costs
less CPU per post, which a 64 MiB device copy (~35 µs) notices; without cuda-python it is ``copy_``. A request
holds views of both ranges, so their memory outlives a registration closed while the transfer still exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import cuda
from ..descriptors import MemoryKind
from .base import (
    BackendContext,
    BackendInfo,
    Capabilities,
    Op,
    SameProcessMemory,
    Segment,
    Status,
    StreamOrderedCompletion,
    StreamOrderedRequest,
)
from .block_copy import BLOCK_COPY_REQUESTS, BlockLayout, copy_request

__all__ = ["LocalBackend", "info"]


def info() -> BackendInfo:
    return BackendInfo("local", True, "copies between ranges of one process (always)")


@dataclass
class _Request(StreamOrderedRequest):
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) uint8 views
    device_index: int | None  # the CUDA device the copies run on, None for host-only
    copies: cuda.StreamCopies | None = None  # the pairs as cuMemcpyAsync pieces, when cuda-python is there


class LocalBackend(SameProcessMemory, StreamOrderedCompletion):
    """The ``Backend`` protocol for ranges of this very process."""

    name = "local"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.CPU, MemoryKind.CUDA}), remote=False,
                                stream_ordered=True, same_process=True)

    def __init__(self, view: Callable[[Segment], torch.Tensor]) -> None:
        self._view = view  # resolves a registered segment of this process to a uint8 tensor

    @classmethod
    def create(cls, context: BackendContext) -> LocalBackend:
        return cls(context.local_view)

    def prepare(self, op: Op, local: list[Segment], remote: list[Segment], peer: int, notify: bytes | None) -> _Request:
        sources, destinations = (remote, local) if op is Op.READ else (local, remote)
        pairs = [(self._view(d), self._view(s)) for d, s in zip(destinations, sources)]
        devices = [s.device_index for s in local + remote if s.kind is MemoryKind.CUDA]
        if not devices:
            return _Request(pairs, None)
        request = _Request(pairs, devices[0])
        if cuda.availability()[0]:
            request.copies = cuda.StreamCopies([piece for d, s in zip(destinations, sources)
                                                for piece in cuda.copy_pieces(d.addr, s.addr, d.nbytes)],
                                               request.device_index, "local")
        return request

    def prepare_blocks(self, op: Op, local: BlockLayout, remote: BlockLayout, peer: int):
        """Blocks between two pools of this process: host rows (host memory) or the kernel (GPU memory)."""
        return copy_request(op is Op.READ, local, remote, [r.addr for r in remote.regions])

    def bind_blocks(self, request, local_ids, remote_ids, notify: bytes | None) -> None:
        request.bind(local_ids, remote_ids, notify)

    def post(self, request: _Request, notify: bytes | None, stream: torch.cuda.Stream | None = None) -> Status:
        if isinstance(request, BLOCK_COPY_REQUESTS):
            return request.post(stream)
        if request.device_index is None:
            for destination, source in request.pairs:
                destination.copy_(source)
            return Status.DONE
        if request.copies is not None:
            request.record(request.copies.enqueue(stream))
            return Status.IN_PROGRESS
        stream = stream or torch.cuda.current_stream(request.device_index)
        with torch.cuda.stream(stream):
            for destination, source in request.pairs:
                destination.copy_(source, non_blocking=True)
        request.record(stream)
        return Status.IN_PROGRESS

    def release(self, request: _Request) -> None:
        if isinstance(request, BLOCK_COPY_REQUESTS):
            return request.release()
        request.pairs, request.copies = [], None

    def close(self) -> None:
        pass
