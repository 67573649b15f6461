"""Test data that says where it came from, and comparisons that say where it went wrong.

Used by the test suite, ``tensorwire doctor``'s transfer probe and ``tensorwire bench``: every value a rank
sends encodes the rank (``rank_values``: ``rank * 1000 + index``; ``rank_pattern``: bytes seeded by the
rank), so a transfer that delivers misplaced, stale or foreign data is caught and the message names the
culprit. Nothing here talks to other processes; comparisons sync with the tensors' device.
"""

from __future__ import annotations

import torch

__all__ = ["SENTINEL", "rank_values", "sentinel", "rank_pattern", "first_mismatch", "mismatch", "assert_equal"]

SENTINEL = -1  # what a receive buffer holds before anything arrived (exact in every dtype)


def rank_values(rank: int, n: int, dtype: torch.dtype = torch.float32, device="cpu", offset: int = 0) -> torch.Tensor:
    """``[n]`` of ``dtype`` on ``device``: ``rank * 1000 + index + offset``, computed exactly, then cast."""
    values = torch.arange(n, dtype=torch.int64) + (rank * 1000 + offset)
    return values.to(dtype).to(device)


def sentinel(n: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """A receive buffer ``[n]`` of ``dtype`` on ``device`` filled with ``SENTINEL``."""
    return torch.full((n,), SENTINEL, dtype=dtype, device=device)


def rank_pattern(nbytes: int, rank: int, device: torch.device | str) -> torch.Tensor:
    """``nbytes`` uint8 on ``device``: a random stream seeded by ``rank``, so bytes that arrive misplaced,
    stale or from the wrong rank do not match."""
    generator = torch.Generator(device=device).manual_seed(7919 * (rank + 1))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def first_mismatch(got: torch.Tensor, expected: torch.Tensor) -> int | None:
    """Index of the first differing element of two 1-D tensors of one shape, or None when equal."""
    if torch.equal(got, expected):
        return None
    return int((got != expected).nonzero()[0, 0])


def mismatch(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when equal (shape, dtype and values), else a short description of the first difference."""
    got, expected = got.detach().cpu(), expected.detach().cpu()
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"shape/dtype {tuple(got.shape)}/{got.dtype} != {tuple(expected.shape)}/{expected.dtype}"
    differ = got != expected
    if not bool(differ.any()):
        return None
    index = int(differ.nonzero()[0, 0]) if got.dim() else 0
    g, e = got.reshape(-1)[index].item(), expected.reshape(-1)[index].item()
    return f"{int(differ.sum())} of {got.numel()} elements differ; first at index {index}: got {g}, expected {e}"


def assert_equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise ``AssertionError`` unless exactly equal; the message says what was compared and where it differs."""
    problem = mismatch(got, expected)
    if problem is not None:
        raise AssertionError(f"{what}: {problem}")
