"""Rows on the move: the metadata each dispatched row carries, sizes, combine's weighted sum, buffer reuse.

Row metadata. Each dispatched row travels with three int64 words: the source rank, the source token index
and the routing weight (widened to float64, whose bits are stored; exact for float16/bfloat16/float32).

Non-goals: where rows go (``layout``), the count round (``count_rows``), moving bytes (the engines).
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from .layout import SendLayout

__all__ = ["META_COLUMNS", "check_fresh", "next_power_of_two", "pack_meta", "row_bytes", "unpack_meta",
           "weighted_sum", "in_receive_order"]

META_COLUMNS = 3  # source rank, source token index, weight bits (float64)


def next_power_of_two(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): buffers grow geometrically, kernels take
    power-of-two blocks."""
    return 1 << max(int(n) - 1, 0).bit_length()


def row_bytes(send: torch.Tensor) -> int:
    """Bytes of one row of ``send [N, ...]`` (defined for N = 0 too)."""
    count = 1
    for size in send.shape[1:]:
        count *= size
    return count * send.element_size()


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


# float32 rows weighted_sum gathers at once, per device type: a GPU wants few ops (each eager op is a launch,
# ~5 us), a CPU wants the rows to stay in its caches (measured on 2 cores, T=2048, K=8, H=1024: 4 MiB chunks
# 2x faster than one 64 MiB chunk, and than the per-k loop).
_COMBINE_CHUNK_BYTES = {"cuda": 256 << 20, "cpu": 4 << 20}


def weighted_sum(returned: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor,
                 usable: torch.Tensor | None = None) -> torch.Tensor:
    """``y [T, H]``: ``y[t] = sum over valid k, in k order, of topk_weights[t, k] * returned[position(t, k)]``,
    accumulated in float32 and cast to ``returned.dtype``.

    ``returned [R, H]`` holds the expert outputs in this rank's send order (rows past the valid ones may
    be garbage, even NaN: they are selected away, never multiplied in). ``usable [T, K]`` bool further
    masks pairs (e.g. dropped by a capacity overflow). Device ops only: no host sync, graph-safe.

    All K rows of a chunk of tokens are gathered in one op and weighted in two, then added in k order: 5 + K
    ops per chunk instead of 5 per k (an eager GPU step pays a launch for each), with the same float32
    arithmetic. A chunk's float32 rows take at most ``_COMBINE_CHUNK_BYTES`` of the device type.
    """
    num_tokens, topk = layout.num_tokens, layout.topk
    hidden = returned.shape[1]
    result = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=returned.device)
    if returned.shape[0] == 0 or num_tokens == 0:
        return result.to(returned.dtype)
    dropped = ~(layout.valid if usable is None else layout.valid & usable)
    position = layout.position_of_pair.clamp(max=returned.shape[0] - 1)
    weights = topk_weights.to(torch.float32)
    budget = _COMBINE_CHUNK_BYTES.get(returned.device.type, _COMBINE_CHUNK_BYTES["cpu"])
    chunk = max(1, budget // max(1, topk * hidden * 4))
    for start in range(0, num_tokens, chunk):
        tokens = slice(start, min(num_tokens, start + chunk))
        rows = returned.index_select(0, position[tokens].reshape(-1)).to(torch.float32)
        rows = rows.view(-1, topk, hidden).mul_(weights[tokens].unsqueeze(2))
        rows.masked_fill_(dropped[tokens].unsqueeze(2), 0.0)  # after the product: garbage rows may be NaN
        out = result[tokens]
        for k in range(topk):
            out += rows[:, k]
    return result.to(returned.dtype)


def in_receive_order(arrived: torch.Tensor, arrival_row: torch.Tensor, rows: int) -> torch.Tensor:
    """A new ``[rows, ...]`` tensor whose row ``j`` is ``arrived[arrival_row[j]]`` for ``j < n`` (``arrived
    [n, ...]`` as received, ``arrival_row [n]`` int64 on its device: the inverse of where each arrived row goes)
    and zeros past ``n`` (the rows a ``capacity`` leaves empty). A gather: on the host ~3x faster than the
    scatter (``index_copy_``) it replaces. Device ops only."""
    out = torch.empty(rows, *arrived.shape[1:], dtype=arrived.dtype, device=arrived.device)
    out[arrived.shape[0]:] = 0
    torch.index_select(arrived, 0, arrival_row, out=out[:arrived.shape[0]])
    return out


def check_fresh(dispatches_now: int, dispatch_index: int) -> None:
    """Engines that reuse their buffers every second dispatch refuse to combine an older dispatch."""
    later = dispatches_now - dispatch_index
    if later >= 2:
        raise InvalidArgumentError(
            f"combine: {later} dispatches ran after this one on the same communicator and engine; receive "
            "buffers alternate between two dispatches, so combine each dispatch before the second one after it"
        )
