"""``dispatch``: send each token to the ranks that hold its top-k experts (``Dispatch``: ``engine``).

Experts are placed contiguously: with ``E`` experts on ``W`` ranks, expert ``e`` lives on rank
``e // (E // W)``. A token routed to ``K`` experts travels once per (token, expert) pair; the receiver gets
its rows grouped by local expert, source ranks in order inside a group, each source's rows in token order
(see ``tensorwire.moe.layout``). ``combine`` sends the expert outputs back along the same pairs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import InvalidArgumentError
from . import selection
from .engine import Dispatch, check_open

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["Dispatch", "dispatch"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int,
             comm: Communicator, engine: str | None = None, capacity: int | None = None) -> Dispatch:
    """Send every (token, expert) pair's row of ``x`` to the rank holding the expert. Collective: every
    rank calls it, in the same order, with the same ``num_experts``, hidden size, dtype and ``capacity``.

    Args:
        x: ``[T, H]`` float32/bfloat16/float16, contiguous, on CPU or CUDA. ``T`` may differ per rank, 0 too.
        topk_idx: ``[T, K]`` int64 on x's device; ``-1`` means "no expert".
        topk_weights: ``[T, K]`` floating point on x's device; used by ``combine`` on this rank.
        num_experts: ``E``, a multiple of the world size.
        engine: ``"torch"``, ``"nixl"``, ``"cuda"`` or None for the fastest available.
        capacity: receive rows per rank. None: exact shapes, one host sync. Given: ``recv_x`` has
            ``capacity`` rows, ``num_recv_rows`` says how many are valid; on ``"cuda"`` the call then makes
            no host sync and is CUDA-graph capturable (an overflow drops rows and is reported by
            ``Dispatch.check()``); the other engines still sync once and raise on overflow.

    Returns a ``Dispatch`` (see its docstring for every tensor).
    """
    _check_inputs(x, topk_idx, topk_weights, num_experts, comm, capacity)
    chosen = selection.engine(comm, engine, x.device, "dispatch")
    layout = chosen.send_layout(topk_idx, num_experts, comm.world_size)
    return chosen.dispatch(x, layout, topk_weights, capacity)


def _check_inputs(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                  comm: Communicator, capacity: int | None) -> None:
    """Validate at the public boundary (``if ... raise``: never stripped by ``python -O``). No host sync:
    values inside the tensors are checked by the engines, on every rank alike."""
    from ..communicator import Communicator

    if not isinstance(comm, Communicator):
        raise InvalidArgumentError(
            "dispatch: comm must be a tensorwire Communicator (tw.init()), "
            f"got {type(comm).__name__}"
        )
    check_open(comm, "dispatch")
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
    _check_routing(x, topk_idx, topk_weights)
    _check_sizes(num_experts, comm.world_size, capacity)


def _check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """``topk_idx`` and ``topk_weights`` against ``x`` (shapes, dtypes, devices; no values)."""
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


def _check_sizes(num_experts: int, world_size: int, capacity: int | None) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise InvalidArgumentError(f"dispatch: num_experts={num_experts!r}; pass a positive int")
    if num_experts % world_size:
        raise InvalidArgumentError(
            f"dispatch: num_experts={num_experts} is not divisible by the world size {world_size}; experts "
            f"are spread evenly, pass a multiple of {world_size}"
        )
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
        raise InvalidArgumentError(
            f"dispatch: capacity={capacity!r}; "
            "pass a positive number of rows, or None for exact shapes"
        )
