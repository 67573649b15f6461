"""``dispatch``: send each token to the ranks that hold its top-k experts, and the ``Dispatch`` it returns.

Experts are placed contiguously: with ``E`` experts on ``W`` ranks, expert ``e`` lives on rank
``e // (E // W)``. A token routed to ``K`` experts travels once per (token, expert) pair; the receiver gets
its rows grouped by local expert, source ranks in order inside a group, each source's rows in token order
(see ``tensorwire.moe.layout``). ``combine`` sends the expert outputs back along the same pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidArgumentError
from . import selection
from .layout import SendLayout

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["Dispatch", "DispatchResult", "dispatch"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    Send side, kept for ``combine``: ``layout`` (the send order and its inverse), ``topk_weights``,
    ``num_tokens``, the ``backend`` name and the ``comm``; ``state`` is what the backend keeps.

    On the ``"cuda"`` backend ``recv_x`` is a view of the backend's receive buffer (no copy; strided when a
    row is not a multiple of 64 bytes), and so are ``recv_src_rank`` and ``recv_src_idx`` (valid until the
    second dispatch after this one). ``recv_x`` holds the received rows until this dispatch is combined, when
    ``combine`` stores the expert outputs into it (clone it to keep the inputs, e.g. for a backward pass).
    Computing the experts in place into ``recv_x`` and passing it as ``expert_out`` saves combine that copy.
    After ``combine`` the peers read those rows until they are done with their own combine: do not write
    ``recv_x`` again before the next dispatch. The buffer has two halves, taken in turn by the dispatches
    issued on the host; a dispatch captured in a CUDA graph uses the half it was captured with on every
    replay, so combine an eager dispatch before replaying a graph that dispatches.

    ``check()`` reports a device-side error (capacity overflow, an expert id out of range, a timed-out
    wait) of the ``cuda`` backend; it synchronises with the host. The other backends raise such errors
    from the call itself.
    """

    recv_x: torch.Tensor
    tokens_per_expert: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_weights: torch.Tensor
    num_recv_rows: torch.Tensor
    capacity: int | None
    backend: str
    comm: Communicator
    num_tokens: int
    layout: SendLayout
    topk_weights: torch.Tensor
    state: Any = None
    engine: Any = None
    combined: bool = field(default=False)

    def check(self) -> None:
        """Raise the error the backend recorded on the device, if any. Synchronises with the host."""
        checker = getattr(self.engine, "check", None)
        if checker is not None:
            checker("dispatch")

    def __repr__(self) -> str:
        return (f"Dispatch(backend={self.backend!r}, recv_x={tuple(self.recv_x.shape)} {self.recv_x.dtype} on "
                f"{self.recv_x.device}, num_tokens={self.num_tokens}, capacity={self.capacity}, "
                f"combined={self.combined})")


DispatchResult = Dispatch


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int,
             comm: Communicator, backend: str | None = None, capacity: int | None = None) -> Dispatch:
    """Send every (token, expert) pair's row of ``x`` to the rank holding the expert. Collective: every
    rank calls it, in the same order, with the same ``num_experts``, hidden size, dtype and ``capacity``.

    Args:
        x: ``[T, H]`` float32/bfloat16/float16, contiguous, on CPU or CUDA. ``T`` may differ per rank, 0 too.
        topk_idx: ``[T, K]`` int64 on x's device; ``-1`` means "no expert".
        topk_weights: ``[T, K]`` floating point on x's device; used by ``combine`` on this rank.
        num_experts: ``E``, a multiple of the world size.
        backend: ``"torch"``, ``"nixl"``, ``"cuda"`` or None for the fastest available.
        capacity: receive rows per rank. None: exact shapes, one host sync. Given: ``recv_x`` has
            ``capacity`` rows, ``num_recv_rows`` says how many are valid; on ``"cuda"`` the call then makes
            no host sync and is CUDA-graph capturable (an overflow drops rows and is reported by
            ``Dispatch.check()``); the other backends still sync once and raise on overflow.

    Returns a ``Dispatch`` (see its docstring for every tensor).
    """
    _check_inputs(x, topk_idx, topk_weights, num_experts, comm, capacity)
    engine = selection.engine(comm, backend, x.device, "dispatch")
    layout = engine.send_layout(topk_idx, num_experts, comm.world_size)
    return engine.dispatch(x, layout, topk_weights, capacity)


def _check_inputs(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                  comm: Communicator, capacity: int | None) -> None:
    """Validate at the public boundary (``if ... raise``: never stripped by ``python -O``). No host sync:
    values inside the tensors are checked by the backends, on every rank alike."""
    from ..communicator import Communicator

    if not isinstance(comm, Communicator):
        raise InvalidArgumentError(
            "dispatch: comm must be a tensorwire Communicator (tw.init()), "
            f"got {type(comm).__name__}"
        )
    comm._check_open("dispatch")
    for name, value in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"dispatch: {name} must be a torch.Tensor, got {type(value).__name__}")
    if x.dim() != 2:
        raise InvalidArgumentError(
            f"dispatch: x must be [num_tokens, hidden], got shape {tuple(x.shape)}; "
            "reshape it to 2-D"
        )
    if x.dtype not in _FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"dispatch: x has dtype {x.dtype}; "
            "pass float32, bfloat16 or float16 (x.to(torch.bfloat16))"
        )
    if x.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"dispatch: x is on {x.device}; pass a CPU or CUDA tensor")
    if x.shape[1] == 0:
        raise InvalidArgumentError("dispatch: x has hidden size 0; pass rows of at least one element")
    if not x.is_contiguous():
        raise InvalidArgumentError(f"dispatch: x is not contiguous (strides {x.stride()}); call x.contiguous() first")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise InvalidArgumentError(
            f"dispatch: topk_idx has shape {tuple(topk_idx.shape)}, x {tuple(x.shape)}; pass topk_idx as "
            f"[num_tokens={x.shape[0]}, topk]"
        )
    if topk_idx.dtype != torch.int64:
        raise InvalidArgumentError(f"dispatch: topk_idx has dtype {topk_idx.dtype}; pass int64 (topk_idx.long())")
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise InvalidArgumentError(
            f"dispatch: topk_weights has shape {tuple(topk_weights.shape)} but topk_idx {tuple(topk_idx.shape)}; "
            "pass one weight per (token, k) entry"
        )
    if not topk_weights.dtype.is_floating_point:
        raise InvalidArgumentError(
            f"dispatch: topk_weights has dtype {topk_weights.dtype}; "
            "pass floating point weights (.float())"
        )
    for name, value in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if value.device != x.device:
            raise InvalidArgumentError(
                f"dispatch: {name} is on {value.device} but x on {x.device}; "
                "move it with .to(x.device)"
            )
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise InvalidArgumentError(f"dispatch: num_experts={num_experts!r}; pass a positive int")
    if num_experts % comm.world_size:
        raise InvalidArgumentError(
            f"dispatch: num_experts={num_experts} is not divisible by the world size {comm.world_size}; experts "
            f"are spread evenly, pass a multiple of {comm.world_size}"
        )
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
        raise InvalidArgumentError(
            f"dispatch: capacity={capacity!r}; "
            "pass a positive number of rows, or None for exact shapes"
        )
