"""Benchmarks of tensorwire (not tests): ``tensorwire bench <name>`` runs them.

- ``timing``: the one clock (warm-up, time-budgeted repetitions, median and p10/p90; single calls; a reference
  measured again while unsteady).
- ``record``: ``Record``, the one result type every benchmark emits, and its JSON form; a reference whose spread
  exceeds ``STEADY_SPREAD`` is flagged, never divided by.
- ``command``: what the subcommands share (flags, size arguments, the header every benchmark prints, progress
  lines, the JSON header and file). Each subcommand module has ``HELP``, ``add_arguments`` and ``main`` (the shape
  is described in ``tensorwire.cli``).
- ``partial``: the records measured so far, which a run cut short by Ctrl-C still reports.
- ``p2p``: READ/WRITE between two local ranks beside raw NIXL and a local copy; idle CPU. Split by concern:
  ``p2p_records`` (sizes, path names, ``BenchResult``), ``p2p_rank`` (one rank's measuring),
  ``p2p_inbox`` (the byte checks), ``raw_nixl`` (the baseline agent, shared with ``kv``), ``p2p_report`` (tables,
  comparisons, JSON).
- ``moe``: MoE dispatch and combine per engine beside a copy of the same bytes.
- ``kv``: KV-cache block READ/WRITE by id beside raw NIXL and a contiguous copy; ``kv_raw`` the raw NIXL paths,
  ``kv_report`` its table.
- ``fleet``: members launched apart meeting in a directory: join, first READ from a never-seen member, the
  steady READ beside one launcher world, descriptors per member; ``fleet_parties`` its processes,
  ``fleet_report`` its report.
- ``plot``: GB/s as a small PNG (optional; needs matplotlib).
"""

from __future__ import annotations

from .record import Record
from .timing import Budget, CudaEventClock, HostClock, Timing, measure

__all__ = ["Budget", "Timing", "HostClock", "CudaEventClock", "measure", "Record"]
