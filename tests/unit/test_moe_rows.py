"""``moe.rows.weighted_sum``: combine's weighted sum, checked bit for bit against its definition."""

from __future__ import annotations

import pytest
import torch

from tensorwire.moe import rows
from tensorwire.moe.layout import send_layout


def _by_definition(returned, layout, topk_weights, usable):
    """``y[t] = sum over valid k, in k order, of w[t, k] * returned[position(t, k)]`` in float32, one k at a time."""
    valid = layout.valid & usable
    y = torch.zeros(layout.num_tokens, returned.shape[1], dtype=torch.float32)
    for t in range(layout.num_tokens):
        for k in range(layout.topk):
            if valid[t, k]:
                y[t] += returned[int(layout.position_of_pair[t, k])].float() * topk_weights[t, k].float()
    return y.to(returned.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [1 << 12, 1 << 30], ids=["many chunks", "one chunk"])
def test_weighted_sum_is_its_definition_bit_for_bit(monkeypatch, dtype, budget):
    monkeypatch.setitem(rows._COMBINE_CHUNK_BYTES, "cpu", budget)
    torch.manual_seed(0)
    tokens, topk, hidden, experts = 37, 4, 48, 8
    topk_idx = torch.randint(-1, experts, (tokens, topk))  # -1: no expert
    layout = send_layout(topk_idx, experts, 2)
    weights = torch.rand(tokens, topk)
    pairs = int(layout.num_pairs)
    returned = torch.randn(pairs + 3, hidden).to(dtype)
    returned[pairs:] = float("nan")  # garbage past the valid rows must never reach the sum
    usable = torch.rand(tokens, topk) > 0.2  # pairs dropped by a capacity overflow
    got = rows.weighted_sum(returned, layout, weights, usable)
    expected = _by_definition(returned, layout, weights, usable)
    assert not got.isnan().any()
    assert torch.equal(got, expected)
