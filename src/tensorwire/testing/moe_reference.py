"""MoE inputs and a single-process reference written in plain torch, for the CPU and GPU test suites.

Every rank's inputs are a pure function of (case, rank), so each rank rebuilds all ranks' inputs locally and
computes what it must receive. Token rows encode their sender (``x[t, h] = rank * 1000 + t + h / 64``), so a
row from the wrong rank or token names where it came from. ``EXPERTS_PER_RANK`` experts live on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .data import assert_equal

if TYPE_CHECKING:
    from ..moe.engine import Dispatch

__all__ = ["EXPERTS_PER_RANK", "Case", "CASES", "make_inputs", "reference_dispatch", "scaled_expert",
           "reference_combine", "check_close", "check_dispatch", "a2a_counts", "a2a_rows"]

EXPERTS_PER_RANK = 4


@dataclass(frozen=True)
class Case:
    name: str
    topk: int
    dtype: torch.dtype = torch.float32
    tokens: int = 24  # rank r has tokens + 3 r tokens (unless it is the empty rank)
    hidden: int = 32
    drop: float = 0.15  # share of topk entries set to -1
    skew: bool = False  # experts of rank 0 get most of the traffic
    silent_rank: int | None = None  # routes every token nowhere: sends nothing
    empty_rank: int | None = None  # has T = 0 tokens
    seed: int = 0


CASES = [
    Case("k1", topk=1, seed=1),
    Case("k2-skewed", topk=2, skew=True, seed=2),
    Case("k4-silent-rank", topk=4, silent_rank=1, seed=3),
    Case("k8-empty-rank", topk=8, empty_rank=-1, drop=0.3, seed=4),
    Case("k4-bf16-skewed", topk=4, dtype=torch.bfloat16, skew=True, seed=5),
]


def make_inputs(case: Case, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, H], topk_idx [T, K] int64, topk_weights [T, K] float32) of ``rank``, deterministic."""
    generator = torch.Generator().manual_seed(case.seed * 7919 + rank)
    num_experts = EXPERTS_PER_RANK * world
    tokens = 0 if case.empty_rank is not None and rank == case.empty_rank % world else case.tokens + 3 * rank
    scores = torch.rand(tokens, num_experts, generator=generator)
    if case.skew:
        scores[:, :EXPERTS_PER_RANK] += 1.0  # rank 0's experts win most top-k slots
    topk_idx = scores.topk(case.topk, dim=1).indices
    topk_idx[torch.rand(tokens, case.topk, generator=generator) < case.drop] = -1
    if rank == case.silent_rank:
        topk_idx.fill_(-1)
    topk_weights = torch.rand(tokens, case.topk, generator=generator)
    values = rank * 1000 + torch.arange(tokens, dtype=torch.float64)[:, None] + torch.arange(case.hidden) / 64
    return values.to(case.dtype), topk_idx, topk_weights


def reference_dispatch(inputs: list, rank: int, world: int) -> dict:
    """What ``rank`` receives: rows grouped by local expert, source ranks in order, tokens in order."""
    local = EXPERTS_PER_RANK
    rows, src_rank, src_idx, weights, per_expert = [], [], [], [], []
    for expert in range(rank * local, (rank + 1) * local):
        before = len(src_rank)
        for source, (x, topk_idx, topk_weights) in enumerate(inputs):
            for t, k in (topk_idx == expert).nonzero().tolist():  # row-major: token order, then k
                rows.append(x[t])
                src_rank.append(source)
                src_idx.append(t)
                weights.append(topk_weights[t, k])
        per_expert.append(len(src_rank) - before)
    hidden, dtype = inputs[0][0].shape[1], inputs[0][0].dtype
    return {
        "recv_x": torch.stack(rows) if rows else torch.empty(0, hidden, dtype=dtype),
        "recv_src_rank": torch.tensor(src_rank, dtype=torch.int64),
        "recv_src_idx": torch.tensor(src_idx, dtype=torch.int64),
        "recv_weights": torch.stack(weights) if weights else torch.empty(0),
        "tokens_per_expert": torch.tensor(per_expert, dtype=torch.int64),
    }


def scaled_expert(recv_x: torch.Tensor, tokens_per_expert: torch.Tensor, rank: int) -> torch.Tensor:
    """Expert e multiplies its rows by (e + 1), computed in float32 and rounded to the rows' dtype."""
    local = tokens_per_expert.numel()
    experts = torch.repeat_interleave(torch.arange(local) + rank * local, tokens_per_expert.cpu())
    factor = torch.ones(recv_x.shape[0])
    factor[: experts.numel()] = (experts + 1).float()
    return (recv_x.float() * factor.to(recv_x.device)[:, None]).to(recv_x.dtype)


def reference_combine(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      scaled: bool) -> torch.Tensor:
    """``y[t] = sum over valid k (in k order) of w[t, k] * expert(x[t])``, float32 accumulation."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(topk_idx.shape[1]):
        factor = (topk_idx[:, k] + 1).float() if scaled else torch.ones(x.shape[0])
        expert_out = (x.float() * factor[:, None]).to(x.dtype)
        contribution = expert_out.float() * topk_weights[:, k].float()[:, None]
        y += torch.where((topk_idx[:, k] >= 0)[:, None], contribution, 0.0)
    return y.to(x.dtype)


def check_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact for float32, within bfloat16 rounding otherwise."""
    if expected.dtype == torch.float32:
        assert_equal(got, expected, what)
    else:
        assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: {m}")


def check_dispatch(d: Dispatch, expected: dict, rows: int, what: str) -> None:
    """Exact receive order (the contract defines it), the same contents as sets per expert, counts."""
    n = expected["recv_src_rank"].numel()
    assert d.recv_x.shape[0] == rows, f"{what}: recv_x has {d.recv_x.shape[0]} rows, expected {rows}"
    assert int(d.num_recv_rows) == n, f"{what}: num_recv_rows {int(d.num_recv_rows)} != {n}"
    assert_equal(d.tokens_per_expert, expected["tokens_per_expert"], f"{what}: tokens_per_expert")
    assert_equal(d.recv_x[:n], expected["recv_x"], f"{what}: recv_x")
    assert_equal(d.recv_src_rank[:n], expected["recv_src_rank"], f"{what}: recv_src_rank")
    assert_equal(d.recv_src_idx[:n], expected["recv_src_idx"], f"{what}: recv_src_idx")
    assert_equal(d.recv_weights[:n], expected["recv_weights"].to(d.recv_weights.dtype), f"{what}: recv_weights")
    start = 0
    for local, count in enumerate(expected["tokens_per_expert"].tolist()):
        block = slice(start, start + count)
        got = set(zip(d.recv_src_rank[block].tolist(), d.recv_src_idx[block].tolist()))
        want = set(zip(expected["recv_src_rank"][block].tolist(), expected["recv_src_idx"][block].tolist()))
        assert got == want, f"{what}: local expert {local} got (rank, token) {sorted(got)}, expected {sorted(want)}"
        start += count


def a2a_counts(seed: int, world: int) -> list[list[int]]:
    """counts[s][r]: rows rank s sends to rank r (zeros included)."""
    return [[(seed + 3 * s + 5 * r + s * r) % 5 for r in range(world)] for s in range(world)]


def a2a_rows(sender: int, n: int, offset: int = 0) -> torch.Tensor:
    """``[n, 3]`` int64 rows that encode their sender: ``sender * 1000 + offset + flat index``."""
    values = sender * 1000 + offset + torch.arange(n * 3, dtype=torch.int64)
    return values.view(n, 3)
