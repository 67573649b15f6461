"""The ``"torch"`` MoE backend: torch.distributed collectives (Gloo on host, NCCL on GPU). The reference.

dispatch: all-gather the count rows (so every rank can check every rank's header and capacity), copy the
rows into send order, all-to-all them (they arrive grouped by source rank), then permute them on the
receiver into local-expert-major order. combine: the inverse permutation, the reverse all-to-all (rows
arrive in this rank's send order), then the weighted sum. One host sync per call (the split sizes
all-to-all needs on the host); on the host each call blocks, on GPU the NCCL work is stream-ordered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..backends import torchdist
from .dispatch import Dispatch
from .exchange import (
    HEADER,
    META_COLUMNS,
    check_capacity,
    check_count_rows,
    check_fresh,
    count_row,
    pack_meta,
    unpack_meta,
    weighted_sum,
)
from .layout import SendLayout, placement, segment_positions, send_layout

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["TorchEngine"]


@dataclass(frozen=True)
class _State:
    """What combine needs: the split sizes of the dispatch (host) and the receiver permutation (device)."""

    dispatch_index: int
    send_splits: list[int]  # rows this rank sent to each rank
    recv_splits: list[int]  # rows this rank received from each rank
    final_position: torch.Tensor  # [N] int64: where the i-th row as received (source-major) was placed


class TorchEngine:
    name = "torch"
    send_layout = staticmethod(send_layout)

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.dispatches = 0

    def _gather_rows(self, row: torch.Tensor, fn: str) -> torch.Tensor:
        """Every rank's count row, on the host (the one host sync), checked."""
        rows = torchdist.all_gather(self.comm, row).cpu()
        check_count_rows(rows, fn)
        return rows

    def dispatch(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor,
                 capacity: int | None) -> Dispatch:
        comm, me = self.comm, self.comm.rank
        hidden = x.shape[1]
        rows = self._gather_rows(count_row(layout.expert_counts, layout.out_of_range, hidden * x.element_size(),
                                           capacity, layout.num_experts), "dispatch")
        where = placement(rows[:, HEADER:], me)
        rows_per_rank = where.rows_per_rank.tolist()
        check_capacity(rows_per_rank, capacity, "dispatch")
        self.dispatches += 1
        num_sent, num_received = int(where.pairs_per_rank[me]), rows_per_rank[me]
        send_splits = where.send_counts.sum(1).tolist()
        recv_splits = where.recv_counts.sum(1).tolist()

        rows_to_send = layout.token_of_row[:num_sent]
        send_x = x.index_select(0, rows_to_send)
        send_meta = pack_meta(torch.empty(num_sent, META_COLUMNS, dtype=torch.int64, device=x.device), me,
                              rows_to_send, topk_weights.reshape(-1).index_select(0, layout.order[:num_sent]))
        raw_x = torch.empty(num_received, hidden, dtype=x.dtype, device=x.device)
        raw_meta = torch.empty(num_received, META_COLUMNS, dtype=torch.int64, device=x.device)
        torchdist.all_to_all(comm, raw_x, send_x, recv_splits, send_splits)
        torchdist.all_to_all(comm, raw_meta, send_meta, recv_splits, send_splits)

        # Rows arrive source-major, each source's block in (local expert, token) order; move block
        # (source, expert) to where the receive order puts it.
        final = segment_positions(where.recv_start.reshape(-1).to(x.device),
                                  where.recv_counts.reshape(-1).to(x.device), num_received)
        out_rows = num_received if capacity is None else capacity
        recv_x = torch.zeros(out_rows, hidden, dtype=x.dtype, device=x.device).index_copy_(0, final, raw_x)
        meta = torch.zeros(out_rows, META_COLUMNS, dtype=torch.int64, device=x.device).index_copy_(0, final, raw_meta)
        src_rank, src_idx, weights = unpack_meta(meta, topk_weights.dtype)
        return Dispatch(
            recv_x=recv_x, tokens_per_expert=where.tokens_per_expert.to(x.device), recv_src_rank=src_rank,
            recv_src_idx=src_idx, recv_weights=weights,
            num_recv_rows=torch.tensor(num_received, dtype=torch.int64).to(x.device), capacity=capacity,
            backend=self.name, comm=comm, num_tokens=layout.num_tokens, layout=layout, topk_weights=topk_weights,
            state=_State(self.dispatches, send_splits, recv_splits, final), engine=self,
        )

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatch) -> torch.Tensor:
        state: _State = dispatched.state
        check_fresh(self.dispatches, state.dispatch_index)
        back = expert_out.index_select(0, state.final_position)  # receive order -> as received (source-major)
        returned = torch.empty(sum(state.send_splits), expert_out.shape[1], dtype=expert_out.dtype,
                               device=expert_out.device)
        torchdist.all_to_all(self.comm, returned, back, state.send_splits, state.recv_splits)
        return weighted_sum(returned, dispatched.layout, dispatched.topk_weights)

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        comm = self.comm
        row_bytes = _row_bytes(send)
        counts = torch.tensor(send_counts, dtype=torch.int64).to(send.device)
        rows = self._gather_rows(count_row(counts, 0, row_bytes, None, comm.world_size), "all_to_all_v")
        recv_counts = rows[:, HEADER + comm.rank].tolist()
        recv = torch.empty(sum(recv_counts), *send.shape[1:], dtype=send.dtype, device=send.device)
        torchdist.all_to_all(comm, recv, send, recv_counts, send_counts)
        return recv, recv_counts


def _row_bytes(send: torch.Tensor) -> int:
    """Bytes of one row of ``send [N, ...]`` (defined for N = 0 too)."""
    count = 1
    for size in send.shape[1:]:
        count *= size
    return count * send.element_size()
