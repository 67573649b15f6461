"""``combine``: send expert outputs back to the tokens' ranks and sum them with the routing weights there.

Each received row goes back once, to the rank that dispatched it, where it lands in that rank's send order;
the weighted sum then runs on the source rank (so bytes cross the wire once per (token, expert) pair each
way, and the weights never travel back).
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from .engine import Dispatch, check_open

__all__ = ["combine"]


def combine(expert_out: torch.Tensor, dispatched: Dispatch) -> torch.Tensor:
    """``y [T, H]`` on this rank: ``y[t] = sum over valid k of topk_weights[t, k] * expert_out_of(t, k)``,
    accumulated in float32 (in k order), in ``expert_out``'s dtype, on its device.

    ``expert_out`` is ``[N, H]`` shaped, typed and placed like ``dispatched.recv_x``: row ``i`` is the expert
    output for ``recv_x[i]`` (rows past ``num_recv_rows`` are ignored). Collective, in dispatch order; each
    ``Dispatch`` is combined once, before the second dispatch after it. Host syncs and graph safety are
    those of the dispatch: none on ``"cuda"`` with ``capacity``, else the call blocks until done. On
    ``"cuda"`` the outputs are stored into ``recv_x``'s rows first, unless ``expert_out`` is ``recv_x`` itself.
    """
    if not isinstance(dispatched, Dispatch):
        raise InvalidArgumentError(
            "combine: the second argument must be what dispatch() returned, "
            f"got {type(dispatched).__name__}"
        )
    engine = dispatched._handle.engine
    check_open(engine.comm, "combine")
    if dispatched.combined:
        raise InvalidArgumentError("combine: this Dispatch was already combined; each dispatch is combined once "
                                   "(dispatch again for another pass)")
    if not isinstance(expert_out, torch.Tensor):
        raise InvalidArgumentError(f"combine: expert_out must be a torch.Tensor, got {type(expert_out).__name__}")
    expected = dispatched.recv_x
    if tuple(expert_out.shape) != tuple(expected.shape):
        raise InvalidArgumentError(
            f"combine: expert_out has shape {tuple(expert_out.shape)}, recv_x {tuple(expected.shape)}; "
            "return one output row per received row, same hidden size"
        )
    if expert_out.dtype != expected.dtype:
        raise InvalidArgumentError(f"combine: expert_out has dtype {expert_out.dtype}, recv_x {expected.dtype}; "
                                   f"cast it with .to({expected.dtype})")
    if expert_out.device != expected.device:
        raise InvalidArgumentError(f"combine: expert_out is on {expert_out.device}, recv_x on {expected.device}; "
                                   f"move it with .to('{expected.device}')")
    if expert_out is not expected:  # recv_x itself may be strided: passed as is, combine needs no copy
        expert_out = expert_out.contiguous()
    result = engine.combine(expert_out, dispatched)
    dispatched.combined = True
    return result
