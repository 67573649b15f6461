"""The count row: what every rank contributes to the count round that starts each MoE collective.

Every collective of ``tensorwire.moe`` starts by gathering one int64 row per rank on every rank: a header,
then the rank's counts (pairs per expert for ``dispatch``, rows per destination for ``all_to_all_v``)::

    [errors, row_bytes, capacity, num_experts, count_0, ..., count_{E-1}]

Because every rank sees every header, a mistake made on one rank (an expert id out of range, a different
hidden size) is reported by *every* rank, with the same message, instead of leaving the others waiting.
The same error bits are what the ``cuda`` engine ORs into its device error word when it checks on the device.

Non-goals: moving the rows (the engines) and their metadata (``rows``).
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError

__all__ = [
    "ERROR_EXPERT_OUT_OF_RANGE",
    "ERROR_MISMATCH",
    "ERROR_OVERFLOW",
    "HEADER",
    "NO_CAPACITY",
    "check_capacity",
    "check_count_rows",
    "count_row",
]

HEADER = 4  # errors, row_bytes, capacity (NO_CAPACITY: exact shapes), num_experts
# Error bits: in a count row's header (out of range), and in the cuda engine's device error word (all).
ERROR_EXPERT_OUT_OF_RANGE = 1
ERROR_MISMATCH = 2  # ranks disagree on num_experts, row bytes or capacity
ERROR_OVERFLOW = 4  # some rank receives more rows than the capacity
NO_CAPACITY = -1


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
