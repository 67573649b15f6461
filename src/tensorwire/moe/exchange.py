"""What every MoE backend shares: the count row each rank contributes, its checks, row metadata, the
weighted sum of combine, and the ``Engine`` interface a backend implements.

The count row. Every collective of ``tensorwire.moe`` starts by gathering one int64 row per rank on every
rank: a header, then the rank's counts (pairs per expert for ``dispatch``, rows per destination for
``all_to_all_v``)::

    [errors, row_bytes, capacity, num_experts, count_0, ..., count_{E-1}]

Because every rank sees every header, a mistake made on one rank (an expert id out of range, a different
hidden size) is reported by *every* rank, with the same message, instead of leaving the others waiting.

Row metadata. Each dispatched row travels with three int64 words: the source rank, the source token index
and the routing weight (widened to float64, whose bits are stored; exact for float16/bfloat16/float32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import InvalidArgumentError
from .layout import SendLayout

if TYPE_CHECKING:
    from .dispatch import Dispatch

__all__ = [
    "ERROR_EXPERT_OUT_OF_RANGE",
    "ERROR_MISMATCH",
    "ERROR_OVERFLOW",
    "HEADER",
    "META_COLUMNS",
    "Engine",
    "check_capacity",
    "check_count_rows",
    "check_fresh",
    "count_row",
    "next_power_of_two",
    "pack_meta",
    "unpack_meta",
    "weighted_sum",
]

HEADER = 4  # errors, row_bytes, capacity (-1: exact shapes), num_experts
# Error bits: in a count row's header (out of range), and in the cuda backend's device error word (all).
ERROR_EXPERT_OUT_OF_RANGE = 1
ERROR_MISMATCH = 2  # ranks disagree on num_experts, row bytes or capacity
ERROR_OVERFLOW = 4  # some rank receives more rows than the capacity
META_COLUMNS = 3  # source rank, source token index, weight bits (float64)
NO_CAPACITY = -1


class Engine(Protocol):
    """One MoE backend. Every method is collective: every rank calls it, in the same order."""

    name: str

    def send_layout(self, topk_idx: torch.Tensor, num_experts: int, world_size: int) -> SendLayout:
        """The send order of ``topk_idx [T, K]`` (``layout.send_layout``'s result; no host sync)."""
        ...

    def dispatch(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor,
                 capacity: int | None) -> Dispatch: ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatch) -> torch.Tensor: ...

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]: ...


def next_power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def count_row(counts: torch.Tensor, errors: torch.Tensor | int, row_bytes: int, capacity: int | None,
              num_experts: int) -> torch.Tensor:
    """``[errors, row_bytes, capacity, num_experts, *counts]`` as int64 on ``counts``' device. Device ops
    only (no host sync; graph-safe): ``errors`` may be a 0-dim device tensor."""
    device = counts.device
    # Fill kernels rather than torch.tensor(list): a host->device copy would sync or, in a CUDA graph,
    # replay from a host buffer that no longer exists.
    first = (errors.reshape(1).to(torch.int64) if isinstance(errors, torch.Tensor)
             else torch.full((1,), errors, dtype=torch.int64, device=device))
    rest = [torch.full((1,), value, dtype=torch.int64, device=device)
            for value in (row_bytes, NO_CAPACITY if capacity is None else capacity, num_experts)]
    return torch.cat([first, *rest, counts.to(torch.int64)])


def check_count_rows(rows: torch.Tensor, fn: str) -> None:
    """Raise the same ``InvalidArgumentError`` on every rank when any rank's header shows a mistake.
    ``rows [W, HEADER + n]`` int64 on the host."""
    header = rows[:, :HEADER].tolist()
    bad = [r for r, h in enumerate(header) if h[0] & ERROR_EXPERT_OUT_OF_RANGE]
    if bad:
        raise InvalidArgumentError(
            f"{fn}: topk_idx on rank(s) {bad} holds expert ids outside [-1, {header[bad[0]][3]}); "
            "pass ids in [0, num_experts), or -1 for 'no expert'"
        )
    for column, what, fix in ((3, "num_experts", "pass the same num_experts on every rank"),
                              (1, "row size in bytes (hidden size x element size)",
                               "pass the same hidden size and dtype on every rank"),
                              (2, "capacity", "pass the same capacity= on every rank")):
        values = [h[column] for h in header]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {'None' if column == 2 and v == NO_CAPACITY else v}"
                              for r, v in enumerate(values))
            raise InvalidArgumentError(f"{fn}: the ranks disagree on the {what} ({shown}); {fix}")


def check_capacity(rows_per_rank: list[int], capacity: int | None, fn: str) -> None:
    """On the host-synchronised paths an overflowing capacity is an error on every rank, before any row
    moves (never a silent truncation)."""
    if capacity is None:
        return
    worst = max(range(len(rows_per_rank)), key=lambda r: rows_per_rank[r])
    if rows_per_rank[worst] > capacity:
        raise InvalidArgumentError(
            f"{fn}: capacity={capacity} is too small: rank {worst} receives {rows_per_rank[worst]} rows; "
            f"pass capacity >= {rows_per_rank[worst]} (or capacity=None for exact shapes)"
        )


def pack_meta(out: torch.Tensor, rank: int, token_of_row: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Fill ``out [n, 3]`` int64 with (rank, token index, float64 bits of the weight) per row."""
    out[:, 0] = rank
    out[:, 1] = token_of_row
    out[:, 2] = weights.to(torch.float64).view(torch.int64)
    return out


def unpack_meta(meta: torch.Tensor, weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``meta [n, 3]`` int64 -> (source rank [n] int64, source token [n] int64, weight [n] ``weight_dtype``)."""
    weights = meta[:, 2].contiguous().view(torch.float64).to(weight_dtype)
    return meta[:, 0].contiguous(), meta[:, 1].contiguous(), weights


def weighted_sum(returned: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor,
                 usable: torch.Tensor | None = None) -> torch.Tensor:
    """``y [T, H]``: ``y[t] = sum over valid k, in k order, of topk_weights[t, k] * returned[position(t, k)]``,
    accumulated in float32 and cast to ``returned.dtype``.

    ``returned [R, H]`` holds the expert outputs in this rank's send order (rows past the valid ones may
    be garbage, even NaN: they are selected away, never multiplied in). ``usable [T, K]`` bool further
    masks pairs (e.g. dropped by a capacity overflow). Device ops only: no host sync, graph-safe.
    """
    num_tokens, topk = layout.num_tokens, layout.topk
    hidden = returned.shape[1]
    result = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=returned.device)
    if returned.shape[0] == 0 or num_tokens == 0:
        return result.to(returned.dtype)
    valid = layout.valid if usable is None else layout.valid & usable
    position = layout.position_of_pair.clamp(max=returned.shape[0] - 1)
    weights = topk_weights.to(torch.float32)
    for k in range(topk):
        rows = returned.index_select(0, position[:, k]).to(torch.float32)
        contribution = rows * weights[:, k].unsqueeze(1)
        result += torch.where(valid[:, k].unsqueeze(1), contribution, 0.0)
    return result.to(returned.dtype)


def check_fresh(dispatches_now: int, dispatch_index: int) -> None:
    """Backends that reuse their buffers every second dispatch refuse to combine an older dispatch."""
    later = dispatches_now - dispatch_index
    if later >= 2:
        raise InvalidArgumentError(
            f"combine: {later} dispatches ran after this one on the same communicator and backend; receive "
            "buffers alternate between two dispatches, so combine each dispatch before the second one after it"
        )
