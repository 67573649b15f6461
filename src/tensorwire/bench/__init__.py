"""Benchmarks of tensorwire (not tests): ``tensorwire bench`` runs them.

- ``timing``: the one timing primitive (warm-up, time-budgeted repetitions, median and p10/p90).
- ``p2p``: READ/WRITE between two local ranks beside raw NIXL and a local copy; idle CPU.
- ``plot``: GB/s against size as a small PNG (optional; needs matplotlib).
"""

from __future__ import annotations

from .timing import Budget, CudaEventClock, HostClock, Timing, measure

__all__ = ["Budget", "Timing", "HostClock", "CudaEventClock", "measure"]
