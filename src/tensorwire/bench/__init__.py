"""Benchmarks of tensorwire (not tests): ``tensorwire bench <name>`` runs them.

- ``timing``: the one timing primitive (warm-up, time-budgeted repetitions, median and p10/p90).
- ``command``: what the subcommands share (flags, size arguments, the JSON header and file). Each subcommand
  module has ``HELP``, ``add_arguments`` and ``main`` (the shape is described in ``tensorwire.cli``).
- ``p2p``: READ/WRITE between two local ranks beside raw NIXL and a local copy; idle CPU. Split by concern:
  ``p2p_records`` (sizes, path names, ``Record``, ``BenchResult``), ``p2p_rank`` (one rank's measuring),
  ``inbox`` (the byte checks), ``raw_nixl`` (the baseline), ``report`` (tables, comparisons, JSON).
- ``moe``: MoE dispatch and combine per backend beside a copy of the same bytes.
- ``plot``: GB/s as a small PNG (optional; needs matplotlib).
"""

from __future__ import annotations

from .timing import Budget, CudaEventClock, HostClock, Timing, measure

__all__ = ["Budget", "Timing", "HostClock", "CudaEventClock", "measure"]
