"""Mixture-of-Experts dispatch/combine and all-to-all-v between the ranks of a communicator.

    import tensorwire as tw
    from tensorwire import moe

    d = moe.dispatch(x, topk_idx, topk_weights, num_experts=E, comm=comm)   # rows to the experts' ranks
    y = moe.combine(run_experts(d.recv_x, d.tokens_per_expert), d)         # weighted sum back home
    recv, recv_counts = tw.all_to_all_v(send, send_counts, comm=comm)

Engines (``engine=``): ``"torch"`` (torch.distributed: Gloo/NCCL; the reference), ``"nixl"`` (one-sided
WRITEs with notifications; host and GPU memory, across machines) and ``"cuda"`` (Triton kernels storing
into peers' GPU memory through CUDA IPC; no host sync and CUDA-graph capturable with ``capacity=``).
``tensorwire.moe.selection`` says which one ``None`` picks. Layout conventions: ``tensorwire.moe.layout``.

Inside: ``engine`` (the Engine interface, ``Dispatch``, the dispatch skeleton every engine runs),
``engines/`` (one module per engine, with its helpers), ``kernels/`` (the Triton kernels of ``cuda``),
``count_rows`` (the count round's format and checks), ``rows`` (row metadata, combine's weighted sum),
``collectives`` (the torch.distributed process groups of ``torch``).

Non-goals: routing (top-k selection), the experts themselves, autograd.
"""

from __future__ import annotations

from .alltoallv import all_to_all_v
from .combine import combine
from .dispatch import dispatch
from .engine import Dispatch
from .selection import ENGINES

__all__ = ["ENGINES", "Dispatch", "all_to_all_v", "combine", "dispatch"]
