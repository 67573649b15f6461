"""Test data that says where it came from, and comparisons that say where it went wrong.

Used by the test suite, ``tensorwire doctor``'s transfer probe and ``tensorwire bench``: every byte a
rank sends encodes the rank, so a transfer that delivers misplaced, stale or foreign bytes is caught and
the message names the culprit. Nothing here blocks or talks to other processes.
"""

from __future__ import annotations

import torch

__all__ = ["rank_pattern", "first_mismatch"]


def rank_pattern(nbytes: int, rank: int, device: torch.device | str) -> torch.Tensor:
    """``nbytes`` uint8 on ``device``: a random stream seeded by ``rank``, so bytes that arrive misplaced,
    stale or from the wrong rank do not match."""
    generator = torch.Generator(device=device).manual_seed(7919 * (rank + 1))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def first_mismatch(got: torch.Tensor, expected: torch.Tensor) -> int | None:
    """Index of the first differing element of two 1-D tensors of one shape, or None when equal. Syncs
    with the device of ``got`` (the answer is a host integer)."""
    if torch.equal(got, expected):
        return None
    return int((got != expected).nonzero()[0, 0])
