"""Registered local memory: the ``Registration`` handle and the map that resolves tensors to it.

A ``Registration`` owns its byte ranges for the backend (and keeps the tensors alive); its ``descs``
are what other ranks may address. ``LocalMemoryMap`` answers "which registration holds these bytes?"
so that views inside a registered tensor can be transferred without registering them again.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .backends.base import Segment
from .descriptors import MemoryKind, TensorDesc
from .errors import InvalidArgumentError, WaitTimeoutError
from .lifetime import Closeable

__all__ = ["Registration", "LocalMemoryMap", "as_tensor_list", "segment_of"]


def as_tensor_list(tensors: torch.Tensor | Sequence[torch.Tensor], fn: str) -> list[torch.Tensor]:
    """One tensor or a non-empty list of tensors, else ``InvalidArgumentError`` naming ``fn``."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if not isinstance(tensors, (list, tuple)):
        raise InvalidArgumentError(f"{fn}: expected a tensor or a list of tensors, got {type(tensors).__name__}")
    if len(tensors) == 0:
        raise InvalidArgumentError(f"{fn}: the tensor list is empty; pass at least one tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{fn}: item {i} is a {type(t).__name__}, not a torch.Tensor")
    return list(tensors)


def segment_of(tensor: torch.Tensor, index: int, fn: str) -> Segment:
    """The bytes of a contiguous CPU or CUDA tensor."""
    if not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"{fn}: tensor {index} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}); "
            "call .contiguous() first"
        )
    if tensor.device.type == "cpu":
        kind, device_index = MemoryKind.CPU, -1
    elif tensor.device.type == "cuda":
        kind, device_index = MemoryKind.CUDA, tensor.device.index
    else:
        raise InvalidArgumentError(
            f"{fn}: tensor {index} is on {tensor.device}; only cpu and cuda tensors are supported")
    return Segment(tensor.data_ptr(), tensor.numel() * tensor.element_size(), kind, device_index)


class Registration(Closeable):
    """Memory registered with a communicator's backend. Context manager; ``close()`` is idempotent."""

    def __init__(self, deregister: Callable[[Registration, list[dict[str, Any]]], None], tensors: list[torch.Tensor],
                 segments: list[Segment], handles: list[dict[str, Any]], descs: list[TensorDesc]) -> None:
        self._deregister = deregister  # the communicator's: unmap, republish, revoke peers' transfers, release
        self._tensors = tensors  # keeps the memory alive while registered
        self.segments = segments
        self._handles = handles
        self.descs: list[TensorDesc] = descs
        self.closed = False
        self._unanswered = False  # closed, but a live peer has not acknowledged the revocation yet
        self.transfers: weakref.WeakSet = weakref.WeakSet()  # prepared on this memory: closed with it

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors)

    def close(self) -> None:
        """Deregister the memory, closing the transfers prepared on it. Not collective; blocks until every peer
        that may hold a transfer to it has acknowledged the revocation or is gone (at most
        ``2 * TENSORWIRE_LIVENESS_S``; see ``tensorwire.revocation``): once it returns no peer can write into the
        memory and it may be reused at once. ``WaitTimeoutError`` when a live peer did not answer in time: the
        memory stays registered (do not reuse it); calling ``close()`` again waits for the answers once more."""
        if self.closed:
            if self._unanswered:
                self._deregister(self, None)  # None: wait again for the peers' answers
                self._unanswered = False
            return
        self.closed = True
        for transfer in list(self.transfers):  # no post may touch memory the backend no longer holds
            transfer.close()
        try:
            self._deregister(self, self._handles)
        except WaitTimeoutError:
            self._unanswered = True
            raise
        finally:
            self._tensors = []

    def release_tensors(self) -> list[torch.Tensor]:
        """Hand the tensors over (to keep alive while peers may still write into them); no longer held here."""
        tensors, self._tensors = self._tensors, []
        return tensors

    def _leak_message(self) -> str:
        return (f"a Registration of {len(self.segments)} tensor(s) was garbage-collected without close(); "
                "call reg.close() or use 'with comm.register(...)'")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Registration({len(self.segments)} tensors, {sum(s.nbytes for s in self.segments)} bytes, {state})"


class LocalMemoryMap:
    """Sorted, non-overlapping registered ranges of one process, keyed by (memory kind, device)."""

    def __init__(self) -> None:
        self._starts: list[tuple[int, int, int]] = []  # (kind, device, addr) sorted
        self._entries: list[tuple[Segment, Registration, torch.Tensor]] = []

    def _key(self, s: Segment) -> tuple[int, int, int]:
        return (int(s.kind), s.device_index, s.addr)

    def find(self, s: Segment) -> Registration | None:
        """The registration whose range contains ``s``, if any."""
        i = bisect.bisect_right(self._starts, self._key(s)) - 1
        if i < 0:
            return None
        seg, reg, _ = self._entries[i]
        if (seg.kind == s.kind and seg.device_index == s.device_index and seg.addr <= s.addr
                and s.addr + s.nbytes <= seg.addr + seg.nbytes):
            return reg
        return None

    def view(self, s: Segment) -> torch.Tensor:
        """A flat uint8 tensor over ``s``, which must lie inside a registered range."""
        i = bisect.bisect_right(self._starts, self._key(s)) - 1
        seg, _, tensor = self._entries[i]
        offset = s.addr - seg.addr
        return tensor.view(-1).view(torch.uint8)[offset:offset + s.nbytes]

    def overlapping(self, s: Segment) -> Segment | None:
        i = bisect.bisect_right(self._starts, (int(s.kind), s.device_index, s.addr + s.nbytes - 1)) - 1
        if i < 0:
            return None
        seg, _, _ = self._entries[i]
        if (seg.kind == s.kind and seg.device_index == s.device_index and seg.addr < s.addr + s.nbytes
                and s.addr < seg.addr + seg.nbytes):
            return seg
        return None

    def add(self, s: Segment, reg: Registration, tensor: torch.Tensor) -> None:
        i = bisect.bisect_right(self._starts, self._key(s))
        self._starts.insert(i, self._key(s))
        self._entries.insert(i, (s, reg, tensor))

    def remove(self, s: Segment) -> None:
        i = bisect.bisect_left(self._starts, self._key(s))
        if i < len(self._starts) and self._starts[i] == self._key(s):
            del self._starts[i]
            del self._entries[i]

    def segments(self) -> list[Segment]:
        return [s for s, _, _ in self._entries]

    def descs(self) -> list[TensorDesc]:
        """Every registered range as its registration published it (with that registration's epoch)."""
        return [reg.descs[reg.segments.index(s)] for s, reg, _ in self._entries]
