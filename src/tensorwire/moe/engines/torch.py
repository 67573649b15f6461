"""The ``"torch"`` MoE engine: torch.distributed collectives (Gloo on host, NCCL on GPU). The reference.

Its exchange all-gathers the count rows; its row move copies the rows into send order, all-to-alls them
(they arrive grouped by source rank) and permutes them on the receiver into local-expert-major order.
combine: the inverse permutation, the reverse all-to-all (rows arrive in this rank's send order), then the
weighted sum. One host sync per call (the split sizes all-to-all needs on the host); on the host each call
blocks, on GPU the NCCL work is stream-ordered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import collectives
from ..count_rows import HEADER
from ..engine import DispatchHandle, Received, SkeletonEngine
from ..layout import Placement, SendLayout, segment_positions
from ..rows import META_COLUMNS, in_receive_order, pack_meta, row_bytes, unpack_meta, weighted_sum

__all__ = ["TorchEngine"]


@dataclass(frozen=True)
class _State:
    """What combine needs: the split sizes of the dispatch (host) and the receiver permutation (device)."""

    send_splits: list[int]  # rows this rank sent to each rank
    recv_splits: list[int]  # rows this rank received from each rank
    final_position: torch.Tensor  # [N] int64: where the i-th row as received (source-major) was placed


class TorchEngine(SkeletonEngine):
    name = "torch"

    def exchange_counts(self, row: torch.Tensor, fn: str) -> torch.Tensor:
        return collectives.all_gather(self.comm, row).cpu()  # the call's one host sync

    def move_rows(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor, where: Placement,
                  capacity: int | None) -> Received:
        comm, me, hidden = self.comm, self.rank, x.shape[1]
        num_sent, num_received = int(where.pairs_per_rank[me]), int(where.rows_per_rank[me])
        send_splits = where.send_counts.sum(1).tolist()
        recv_splits = where.recv_counts.sum(1).tolist()

        rows_to_send = layout.token_of_row[:num_sent]
        send_x = x.index_select(0, rows_to_send)
        send_meta = pack_meta(torch.empty(num_sent, META_COLUMNS, dtype=torch.int64, device=x.device), me,
                              rows_to_send, topk_weights.reshape(-1).index_select(0, layout.order[:num_sent]))
        raw_x = torch.empty(num_received, hidden, dtype=x.dtype, device=x.device)
        raw_meta = torch.empty(num_received, META_COLUMNS, dtype=torch.int64, device=x.device)
        collectives.all_to_all(comm, raw_x, send_x, recv_splits, send_splits)
        collectives.all_to_all(comm, raw_meta, send_meta, recv_splits, send_splits)

        # Rows arrive source-major, each source's block in (local expert, token) order; move block
        # (source, expert) to where the receive order puts it.
        final = segment_positions(where.recv_start.reshape(-1).to(x.device),
                                  where.recv_counts.reshape(-1).to(x.device), num_received)
        # Gathered through the inverse permutation: a scatter (index_copy_) takes ~3x as long on the host.
        arrival_row = torch.empty_like(final)
        arrival_row[final] = torch.arange(num_received, device=x.device)
        out_rows = num_received if capacity is None else capacity
        recv_x = in_receive_order(raw_x, arrival_row, out_rows)
        meta = in_receive_order(raw_meta, arrival_row, out_rows)
        src_rank, src_idx, weights = unpack_meta(meta, topk_weights.dtype)
        return Received(recv_x=recv_x, tokens_per_expert=where.tokens_per_expert.to(x.device),
                        recv_src_rank=src_rank, recv_src_idx=src_idx, recv_weights=weights,
                        num_recv_rows=torch.tensor(num_received, dtype=torch.int64).to(x.device),
                        state=_State(send_splits, recv_splits, final))

    def return_rows(self, expert_out: torch.Tensor, handle: DispatchHandle, num_tokens: int) -> torch.Tensor:
        state: _State = handle.state
        back = expert_out.index_select(0, state.final_position)  # receive order -> as received (source-major)
        returned = torch.empty(sum(state.send_splits), expert_out.shape[1], dtype=expert_out.dtype,
                               device=expert_out.device)
        collectives.all_to_all(self.comm, returned, back, state.send_splits, state.recv_splits)
        return weighted_sum(returned, handle.layout, handle.topk_weights)

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        comm = self.comm
        counts = torch.tensor(send_counts, dtype=torch.int64).to(send.device)
        rows = self.count_round(counts, 0, row_bytes(send), None, comm.world_size, "all_to_all_v")
        recv_counts = rows[:, HEADER + comm.rank].tolist()
        recv = torch.empty(sum(recv_counts), *send.shape[1:], dtype=send.dtype, device=send.device)
        collectives.all_to_all(comm, recv, send, recv_counts, send_counts)
        return recv, recv_counts

    def close(self) -> None:
        """Abort this communicator's process groups (local; the peers may be gone)."""
        collectives.shutdown(self.comm)
