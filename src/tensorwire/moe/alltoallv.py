"""``all_to_all_v``: every rank sends a variable number of rows to every rank.

The same machinery as ``dispatch`` with one "expert" per rank and the rows already in send order: the
count rows are gathered everywhere (so a mistake on one rank is reported by all), then rows move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidArgumentError
from . import selection
from .engine import check_open

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["all_to_all_v"]


def all_to_all_v(send: torch.Tensor, send_counts: torch.Tensor | Sequence[int], *, comm: Communicator,
                 engine: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``send[sum(send_counts[:r]) : +send_counts[r]]`` go to rank ``r``.

    Args:
        send: ``[N, ...]`` any dtype, CPU or CUDA; rows grouped by destination rank. The row shape
            (``send.shape[1:]``) and dtype must match on every rank.
        send_counts: ``[W]`` integers (a tensor on any device, or a list) summing to ``N``.
        engine: ``"torch"``, ``"nixl"``, ``"cuda"`` or None for the fastest available.

    Returns ``(recv, recv_counts)``: ``recv [sum(recv_counts), ...]`` on send's device, rows grouped by
    source rank in rank order; ``recv_counts [W]`` int64 on send's device. Collective; exact shapes, so
    it synchronises with the host once (to size ``recv``) and blocks until the rows have arrived.
    """
    from ..communicator import Communicator

    if not isinstance(comm, Communicator):
        raise InvalidArgumentError(
            "all_to_all_v: comm must be a tensorwire Communicator (tw.init()), "
            f"got {type(comm).__name__}"
        )
    check_open(comm, "all_to_all_v")
    if not isinstance(send, torch.Tensor) or send.dim() < 1:
        shape = tuple(send.shape) if isinstance(send, torch.Tensor) else type(send).__name__
        raise InvalidArgumentError(f"all_to_all_v: send must be a tensor with a row dimension [N, ...], got {shape}")
    if send.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"all_to_all_v: send is on {send.device}; pass a CPU or CUDA tensor")
    counts = _host_counts(send_counts, comm.world_size)
    if sum(counts) != send.shape[0]:
        raise InvalidArgumentError(
            f"all_to_all_v: send_counts {counts} sum to {sum(counts)} but send has {send.shape[0]} rows; "
            "the counts must cover every row, grouped by destination rank"
        )
    chosen = selection.engine(comm, engine, send.device, "all_to_all_v")
    recv, recv_counts = chosen.all_to_all_v(send.contiguous(), counts)
    return recv, torch.tensor(recv_counts, dtype=torch.int64).to(send.device)


def _host_counts(send_counts: torch.Tensor | Sequence[int], world_size: int) -> list[int]:
    """The counts as a host list (one host sync for a device tensor), validated."""
    if isinstance(send_counts, torch.Tensor):
        if send_counts.dim() != 1 or send_counts.dtype.is_floating_point or send_counts.dtype == torch.bool:
            raise InvalidArgumentError(
                f"all_to_all_v: send_counts must be a 1-D integer tensor [world_size={world_size}], got "
                f"shape {tuple(send_counts.shape)} {send_counts.dtype}"
            )
        counts = [int(c) for c in send_counts.tolist()]
    elif isinstance(send_counts, (list, tuple)) and all(
            isinstance(c, int) and not isinstance(c, bool) for c in send_counts):
        counts = list(send_counts)
    else:
        raise InvalidArgumentError(
            "all_to_all_v: send_counts must be an int64 tensor or a list of ints, "
            f"got {type(send_counts).__name__}"
        )
    if len(counts) != world_size:
        raise InvalidArgumentError(
            f"all_to_all_v: send_counts has {len(counts)} entries; "
            f"pass one per rank ({world_size})"
        )
    if any(c < 0 for c in counts):
        raise InvalidArgumentError(
            f"all_to_all_v: send_counts {counts} has negative entries; "
            "counts are row numbers >= 0"
        )
    return counts
