"""Where every (token, expert) pair goes, computed with torch ops on the routing's device, no host sync.

Vocabulary (one name per concept, used across ``tensorwire.moe``):

- ``W`` ranks, ``E`` experts, ``L = E // W`` local experts per rank; expert ``e`` lives on rank ``e // L``
  as its local expert ``e % L``.
- A *pair* is one valid entry ``(t, k)`` of ``topk_idx [T, K]`` (``-1`` means "no expert").
- The *send order* of a rank lists its pairs grouped by destination rank, then by local expert, then by
  token (a stable sort on the expert id, since ``e = rank * L + local_expert``). Invalid pairs come last.
- The *count matrix* ``counts [W(source), E]``: row ``s`` is rank ``s``'s number of pairs per expert.
  Every engine gathers it on every rank, so every rank can compute every other rank's layout. Seen as
  ``[W(source), W(destination), L]`` it gives everything below.
- The *receive order* of rank ``r`` groups rows by local expert, source ranks in order inside a group,
  each source's rows in its send order (so by token): row blocks ``(l, s)``, ``l`` major.

Non-goals: deciding routing (the caller's ``topk_idx``), moving bytes (the engines).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Placement", "SendLayout", "exclusive_cumsum", "placement", "segment_positions", "send_layout"]


def exclusive_cumsum(values: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``cumsum - values``: where each block starts when blocks of ``values`` rows are laid end to end."""
    return torch.cumsum(values, dim=dim) - values


@dataclass(frozen=True)
class SendLayout:
    """The send side of one rank's routing. Every tensor is int64 (``valid`` bool) on the routing's device.

    - ``order [T*K]``: flat pair index ``t * K + k`` of the j-th row of the send order (invalid pairs last).
    - ``position_of_pair [T, K]``: inverse of ``order``: the send-order position of ``(t, k)``
      (``>= num_pairs`` for invalid pairs).
    - ``expert_of_pair [T, K]``: ``topk_idx``, ``E`` where invalid.
    - ``expert_counts [E]``: pairs per expert.
    - ``out_of_range``: 0-dim bool, some entry is ``>= E`` or ``< -1`` (those count as "no expert").
    Derived on access (one device op each, no host sync): ``token_of_row [T*K]`` (``order // K``, the token
    each send-order row copies), ``valid [T, K]`` (``0 <= topk_idx < E``), ``n_tokens_to_rank [W]`` (pairs
    per destination rank) and ``num_pairs`` (0-dim).
    """

    num_tokens: int
    topk: int
    num_experts: int
    world_size: int
    order: torch.Tensor
    position_of_pair: torch.Tensor
    expert_of_pair: torch.Tensor
    expert_counts: torch.Tensor
    out_of_range: torch.Tensor

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def token_of_row(self) -> torch.Tensor:
        return torch.div(self.order, max(self.topk, 1), rounding_mode="floor")

    @property
    def valid(self) -> torch.Tensor:
        return self.expert_of_pair < self.num_experts

    @property
    def n_tokens_to_rank(self) -> torch.Tensor:
        return self.expert_counts.view(self.world_size, -1).sum(1)

    @property
    def num_pairs(self) -> torch.Tensor:
        return self.expert_counts.sum()


def send_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> SendLayout:
    """The send order of ``topk_idx [T, K]`` (int64, any device). Device ops only: no host sync,
    CUDA-graph safe. Entries outside ``[-1, E)`` are treated as ``-1`` and reported in ``out_of_range``."""
    num_tokens, topk = topk_idx.shape
    device = topk_idx.device
    flat = topk_idx.reshape(-1)
    in_range = (flat >= 0) & (flat < num_experts)
    out_of_range = ((flat >= num_experts) | (flat < -1)).any()
    # Invalid pairs get the key E so that the stable sort puts them after every real expert.
    key = torch.where(in_range, flat, torch.full_like(flat, num_experts))
    # Narrow keys sort in fewer radix passes (int64: 8 passes, int16: 2); the order is the same.
    narrow = torch.int16 if num_experts < 2**15 else torch.int32
    order = torch.argsort(key.to(narrow), stable=True)
    counts_with_invalid = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts_with_invalid.scatter_add_(0, key, torch.ones_like(key))
    expert_counts = counts_with_invalid[:num_experts]
    position = torch.empty_like(order)
    position.scatter_(0, order, torch.arange(order.numel(), dtype=torch.int64, device=device))
    return SendLayout(
        num_tokens=num_tokens,
        topk=topk,
        num_experts=num_experts,
        world_size=world_size,
        order=order,
        position_of_pair=position.view(num_tokens, topk),
        expert_of_pair=key.view(num_tokens, topk),
        expert_counts=expert_counts,
        out_of_range=out_of_range,
    )


@dataclass(frozen=True)
class Placement:
    """Where rows go, for one rank ``rank``, derived from the count matrix. int64 tensors on its device.

    Sender view (this rank's pairs):
      - ``send_counts [W, L]``: rows this rank sends to ``(destination, local expert)``.
      - ``send_start [W, L]``: where that block starts in this rank's send order.
      - ``destination_start [W, L]``: where it lands in the destination's receive order.
    Receiver view (rows that reach this rank):
      - ``recv_counts [W, L]``: rows from ``(source, local expert)``.
      - ``recv_start [W, L]``: where that block starts in this rank's receive order.
      - ``return_start [W, L]``: where that block started in the source's send order (where combine
        sends the expert outputs back to).
      - ``tokens_per_expert [L]``, ``num_recv_rows`` (0-dim).
    Every rank:
      - ``rows_per_rank [W]``: rows each rank receives; ``pairs_per_rank [W]``: rows each rank sends.
    """

    send_counts: torch.Tensor
    send_start: torch.Tensor
    destination_start: torch.Tensor
    recv_counts: torch.Tensor
    recv_start: torch.Tensor
    return_start: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_recv_rows: torch.Tensor
    rows_per_rank: torch.Tensor
    pairs_per_rank: torch.Tensor


def placement(counts: torch.Tensor, rank: int) -> Placement:
    """Everything ``rank`` needs from the count matrix ``counts [W, E]`` (int64, any device). Device ops
    only: no host sync, CUDA-graph safe."""
    world_size, num_experts = counts.shape
    by_block = counts.view(world_size, world_size, num_experts // world_size)  # [source, destination, l]
    per_expert_total = by_block.sum(0)  # [destination, l]
    expert_start = exclusive_cumsum(per_expert_total, dim=1)  # [destination, l]: start of expert l's group
    sources_before = exclusive_cumsum(by_block, dim=0)  # [source, destination, l]
    # Each source's send order is its row of the matrix read (destination, l) major.
    send_order_start = exclusive_cumsum(counts, dim=1).view_as(by_block)  # [source, destination, l]
    return Placement(
        send_counts=by_block[rank],
        send_start=send_order_start[rank],
        destination_start=expert_start + sources_before[rank],
        recv_counts=by_block[:, rank, :],
        recv_start=expert_start[rank].unsqueeze(0) + sources_before[:, rank, :],
        return_start=send_order_start[:, rank, :],
        tokens_per_expert=per_expert_total[rank],
        num_recv_rows=per_expert_total[rank].sum(),
        rows_per_rank=per_expert_total.sum(1),
        pairs_per_rank=counts.sum(1),
    )


def segment_positions(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """For ``total`` rows laid end to end in segments of ``lengths`` (int64 [n]), the position each row
    takes when segment ``i`` is moved to start at ``starts[i]``. ``total`` must equal ``lengths.sum()``
    (known on the host: passing it keeps CUDA free of a sync)."""
    device = lengths.device
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)
    offset = torch.arange(total, dtype=torch.int64, device=device) - exclusive_cumsum(lengths)[segment]
    return starts[segment] + offset
