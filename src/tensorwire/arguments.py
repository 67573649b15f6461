"""The checks of the communicator's public calls: what ``register``, ``prepare`` and ``prepare_blocks`` accept.

Each raises ``InvalidArgumentError`` naming the call, the observed value and the fix, before anything is
registered, loaded or posted: bad input loses nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends import registry
from .backends.base import Op, Segment
from .descriptors import TensorDesc
from .errors import InvalidArgumentError
from .registration import LocalMemoryMap, Registration, as_tensor_list, segment_of

__all__ = ["check_rank", "check_key", "check_op", "check_transport", "new_segments", "prepare_arguments",
           "segment_pairs", "refuse_overlaps"]


def check_rank(rank: int, world_size: int, fn: str) -> None:
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"{fn}: rank {rank!r} is outside [0, {world_size})")


def check_key(key: str, fn: str) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"{fn}: key must be a non-empty str, got {key!r}")


def check_op(op: Op, fn: str) -> None:
    if not isinstance(op, Op):
        raise InvalidArgumentError(f"{fn}: op={op!r}; pass tw.READ or tw.WRITE")


def check_transport(transport: str | None, fn: str) -> None:
    if transport is not None and transport not in registry.FORCEABLE:
        raise InvalidArgumentError(f"{fn}: transport={transport!r}; pass one of {registry.FORCEABLE} or None")


def new_segments(tensors: torch.Tensor | Sequence[torch.Tensor], local_map: LocalMemoryMap
                 ) -> tuple[list[torch.Tensor], list[Segment]]:
    """``register``'s tensors and their byte ranges: contiguous, non-empty, overlapping neither each other nor
    what is registered already."""
    tensors = as_tensor_list(tensors, "register")
    segments = [segment_of(t, i, "register") for i, t in enumerate(tensors)]
    for i, (t, s) in enumerate(zip(tensors, segments)):
        if s.nbytes == 0:
            raise InvalidArgumentError(
                f"register: tensor {i} has zero bytes (shape {tuple(t.shape)}); register only non-empty tensors")
        clash = local_map.overlapping(s)
        if clash is None:
            clash = next((o for o in segments[:i] if _overlap(o, s)), None)
        if clash is not None:
            raise InvalidArgumentError(
                f"register: tensor {i} [0x{s.addr:x}, +{s.nbytes}) overlaps registered range "
                f"[0x{clash.addr:x}, +{clash.nbytes}); register each byte range once and transfer views of it")
    return tensors, segments


def _overlap(a: Segment, b: Segment) -> bool:
    return (a.kind == b.kind and a.device_index == b.device_index and a.addr < b.addr + b.nbytes
            and b.addr < a.addr + a.nbytes)


def prepare_arguments(op: Op, local, remote, notify: bytes | None, transport: str | None, world_size: int
                      ) -> tuple[list[torch.Tensor], list[TensorDesc], int]:
    """``prepare``'s arguments checked: the local tensors, the remote descriptors (of one rank) and that rank."""
    check_op(op, "prepare")
    local_tensors = as_tensor_list(local, "prepare")
    if isinstance(remote, TensorDesc):
        remote_descs = [remote]
    else:
        remote_descs = list(remote) if isinstance(remote, (list, tuple)) else None
    if not remote_descs:
        raise InvalidArgumentError(f"prepare: remote must be a TensorDesc or a non-empty list of them, got {remote!r}")
    for i, d in enumerate(remote_descs):
        if not isinstance(d, TensorDesc):
            raise InvalidArgumentError(
                f"prepare: remote item {i} is a {type(d).__name__}; pass TensorDesc values from lookup()")
    if len(local_tensors) != len(remote_descs):
        raise InvalidArgumentError(
            f"prepare: {len(local_tensors)} local tensors but {len(remote_descs)} remote descriptors; item i of "
            "each list pairs up")
    peers = sorted({d.rank for d in remote_descs})
    if len(peers) > 1:
        raise InvalidArgumentError(
            f"prepare: remote descriptors belong to ranks {peers}; one transfer reaches one rank, prepare one per rank")
    check_rank(peers[0], world_size, "prepare")
    check_transport(transport, "prepare")
    if notify is not None and (not isinstance(notify, (bytes, bytearray)) or len(notify) == 0):
        raise InvalidArgumentError(
            f"prepare: notify must be non-empty bytes (NIXL does not deliver empty messages), got {notify!r}; "
            "pass e.g. notify=b'done'")
    return local_tensors, remote_descs, peers[0]


def segment_pairs(local_map: LocalMemoryMap, local_tensors: list[torch.Tensor], remote_descs: list[TensorDesc]
                  ) -> tuple[list[tuple[Segment, Segment]], list[Registration]]:
    """(local, remote) segments of the non-empty items, and the registration holding each local one."""
    pairs: list[tuple[Segment, Segment]] = []
    registrations: list[Registration] = []
    for i, (t, d) in enumerate(zip(local_tensors, remote_descs)):
        s = segment_of(t, i, "prepare")
        if s.nbytes != d.nbytes:
            raise InvalidArgumentError(
                f"prepare: item {i}: local tensor has {s.nbytes} bytes, remote descriptor {d.nbytes}; sizes must match")
        if s.nbytes == 0:
            continue
        registration = local_map.find(s)
        if registration is None:
            raise InvalidArgumentError(
                f"prepare: local tensor {i} ({s.nbytes} bytes at 0x{s.addr:x} on {t.device}) is not inside any "
                "registered tensor; call comm.register(...) on it (or on the tensor it views) first")
        registrations.append(registration)
        pairs.append((s, Segment(d.addr, d.nbytes, d.kind, d.device_index)))
    return pairs, registrations


def refuse_overlaps(pairs: list[tuple[Segment, Segment]]) -> None:
    """A transfer within one rank whose source and destination bytes overlap cannot be one copy."""
    for i, (a, _) in enumerate(pairs):
        for j, (_, b) in enumerate(pairs):
            if _overlap(a, b):
                raise InvalidArgumentError(
                    f"prepare: local item {i} [0x{a.addr:x}, +{a.nbytes}) overlaps remote item {j} [0x{b.addr:x}, "
                    f"+{b.nbytes}) in this rank's own memory; copy through a separate buffer, or use "
                    "non-overlapping views")
