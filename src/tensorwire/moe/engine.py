"""What an MoE engine is: the ``Engine`` interface, the ``Dispatch`` it returns, and the shared skeleton.

Every engine runs a dispatch as the same four steps, which ``SkeletonEngine.dispatch`` strings together:

    1. count round   every rank's count row (``count_rows``) reaches every rank      (engine: ``count_round``)
    2. placement     where each block of rows lands, from the count matrix (``layout.placement``)
    3. capacity      an overflowing ``capacity`` is refused on every rank alike
    4. move rows     the rows (and their metadata, ``rows``) go to their final place   (engine: ``move_rows``)

The host-synchronised engines (``torch``, ``nixl``) write only the exchange of step 1 and the row move of
step 4; the ``cuda`` engine also keeps steps 2 and 3 on the device (no host sync, CUDA-graph capturable).
``combine`` checks that the dispatch is fresh and hands it to the engine's ``return_rows``.

``Dispatch`` holds what the caller reads (the received tensors) in public fields and what only the engine
reads (its layout, weights and buffers) in a private ``DispatchHandle``.

Non-goals: picking an engine (``selection``), validating user input (``dispatch``, ``combine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import ClosedError
from .count_rows import HEADER, check_capacity, check_count_rows, count_row
from .layout import Placement, SendLayout, placement, send_layout
from .rows import check_fresh

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["Dispatch", "DispatchHandle", "Engine", "Received", "SkeletonEngine", "check_open"]


@dataclass(frozen=True)
class DispatchHandle:
    """The engine's side of a ``Dispatch``: the engine itself, this rank's send layout and routing weights
    (combine sums with them), the dispatch's number on its engine (``check_fresh``) and the engine's own
    ``state`` (split sizes, buffers, block tables)."""

    engine: Engine
    layout: SendLayout
    topk_weights: torch.Tensor
    dispatch_index: int
    state: Any


@dataclass(eq=False, repr=False)
class Dispatch:
    """What ``dispatch`` returns on each rank (N = rows received; ``capacity`` rows when it was given).

    Received side, on x's device:
      - ``recv_x [N, H]`` (x's dtype): one row per (token, expert) pair routed to this rank, grouped by
        local expert, source-rank order inside a group, token order inside a source.
      - ``tokens_per_expert [E // W]`` int64: the group sizes.
      - ``recv_src_rank [N]``, ``recv_src_idx [N]`` int64: the rank and token index each row came from.
      - ``recv_weights [N]`` (topk_weights' dtype): the routing weight of each row's pair.
      - ``num_recv_rows`` 0-dim int64: the valid rows (``N`` itself on the exact path; with ``capacity`` the
        rows past it are unspecified).
    Also ``capacity``, the ``engine`` name, ``num_tokens`` (this rank's ``T``) and ``combined``. What
    ``combine`` needs of the send side stays with the engine.

    On the ``"cuda"`` engine ``recv_x`` is a view of the engine's receive buffer (no copy; strided when a
    row is not a multiple of 64 bytes), and so are ``recv_src_rank`` and ``recv_src_idx`` (valid until the
    second dispatch after this one). ``recv_x`` holds the received rows until this dispatch is combined, when
    ``combine`` stores the expert outputs into it (clone it to keep the inputs, e.g. for a backward pass).
    Computing the experts in place into ``recv_x`` and passing it as ``expert_out`` saves combine that copy.
    After ``combine`` the peers read those rows until they are done with their own combine: do not write
    ``recv_x`` again before the next dispatch. The buffer has two halves, taken in turn by the dispatches
    issued on the host; a dispatch captured in a CUDA graph uses the half it was captured with on every
    replay, so combine an eager dispatch before replaying a graph that dispatches.

    ``check()`` reports a device-side error (capacity overflow, an expert id out of range, a timed-out
    wait) of the ``cuda`` engine; it synchronises with the host. The other engines raise such errors
    from the call itself.
    """

    recv_x: torch.Tensor
    tokens_per_expert: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_weights: torch.Tensor
    num_recv_rows: torch.Tensor
    capacity: int | None
    engine: str
    num_tokens: int
    _handle: DispatchHandle
    combined: bool = False

    def check(self) -> None:
        """Raise the error the engine recorded on the device, if any. Synchronises with the host."""
        self._handle.engine.check("dispatch")

    def __repr__(self) -> str:
        return (f"Dispatch(engine={self.engine!r}, recv_x={tuple(self.recv_x.shape)} {self.recv_x.dtype} on "
                f"{self.recv_x.device}, num_tokens={self.num_tokens}, capacity={self.capacity}, "
                f"combined={self.combined})")



@dataclass(frozen=True)
class Received:
    """What an engine's row move gives back: the received side of ``Dispatch`` (same names, shapes and
    devices) and the engine's ``state`` for combine."""

    recv_x: torch.Tensor
    tokens_per_expert: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_weights: torch.Tensor
    num_recv_rows: torch.Tensor
    state: Any = None


class Engine(Protocol):
    """One MoE engine, created once per communicator (``selection``) and closed with it. Every method
    but ``check`` and ``close`` is collective: every rank calls it, in the same order."""

    name: str

    def send_layout(self, topk_idx: torch.Tensor, num_experts: int, world_size: int) -> SendLayout:
        """The send order of ``topk_idx [T, K]`` (``layout.send_layout``'s result; no host sync)."""
        ...

    def dispatch(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor,
                 capacity: int | None) -> Dispatch: ...

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatch) -> torch.Tensor: ...

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]: ...

    def check(self, fn: str) -> None:
        """Raise an error recorded on the device (syncs with the host); nothing on the host engines."""
        ...

    def close(self) -> None:
        """Release what the engine holds (buffers, transfers, process groups). Local, idempotent."""
        ...


def check_open(comm: Communicator, fn: str) -> None:
    """Refuse a call on a closed communicator, as the communicator's own calls do."""
    if comm.closed:
        raise ClosedError(f"{fn}: the communicator is closed; create a new one with tw.init()")


class SkeletonEngine:
    """The dispatch skeleton (module docstring) with host steps 2 and 3; a subclass gives ``exchange_counts``
    (or overrides ``count_round``), ``move_rows``, ``return_rows`` and ``all_to_all_v``."""

    name = ""
    send_layout = staticmethod(send_layout)

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dispatches = 0  # counted on the host, the same on every rank

    def dispatch(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor,
                 capacity: int | None) -> Dispatch:
        row_bytes = x.shape[1] * x.element_size()
        counts = self.count_round(layout.expert_counts, layout.out_of_range, row_bytes, capacity, layout.num_experts,
                                  "dispatch")
        where = self.place(counts, capacity, "dispatch")
        self.dispatches += 1
        got = self.move_rows(x, layout, topk_weights, where, capacity)
        return Dispatch(
            recv_x=got.recv_x, tokens_per_expert=got.tokens_per_expert, recv_src_rank=got.recv_src_rank,
            recv_src_idx=got.recv_src_idx, recv_weights=got.recv_weights, num_recv_rows=got.num_recv_rows,
            capacity=capacity, engine=self.name, num_tokens=layout.num_tokens,
            _handle=DispatchHandle(self, layout, topk_weights, self.dispatches, got.state),
        )

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatch) -> torch.Tensor:
        handle = dispatched._handle
        check_fresh(self.dispatches, handle.dispatch_index)
        return self.return_rows(expert_out, handle, dispatched.num_tokens)

    # --- the steps --------------------------------------------------------------------------------
    def count_round(self, counts: torch.Tensor, errors: torch.Tensor | int, row_bytes: int, capacity: int | None,
                    num_experts: int, fn: str) -> Any:
        """Step 1: every rank's count row ``[W, HEADER + n]`` int64 on the host, checked on every rank."""
        rows = self.exchange_counts(count_row(counts, errors, row_bytes, capacity, num_experts), fn)
        check_count_rows(rows, fn)
        return rows

    def place(self, counts: Any, capacity: int | None, fn: str) -> Any:
        """Steps 2 and 3: this rank's ``Placement`` (host tensors) from the count rows, capacity checked."""
        where = placement(counts[:, HEADER:], self.rank)
        check_capacity(where.rows_per_rank.tolist(), capacity, fn)
        return where

    def exchange_counts(self, row: torch.Tensor, fn: str) -> torch.Tensor:
        """Every rank's ``row`` (this rank's count row, int64) as ``[W, row.numel()]`` on the host."""
        raise NotImplementedError

    def move_rows(self, x: torch.Tensor, layout: SendLayout, topk_weights: torch.Tensor, where: Placement,
                  capacity: int | None) -> Received:
        """Step 4: this rank's rows to their places, the rows that reached this rank back."""
        raise NotImplementedError

    def return_rows(self, expert_out: torch.Tensor, handle: DispatchHandle, num_tokens: int) -> torch.Tensor:
        """combine: ``expert_out`` back along the dispatch's pairs, summed with the weights: ``[T, H]``."""
        raise NotImplementedError

    def check(self, fn: str) -> None:
        """Host engines raise from the call itself: nothing is left to report."""

    def close(self) -> None:
        """Nothing but what the communicator releases itself."""
