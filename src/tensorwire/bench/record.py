"""What every ``tensorwire bench`` benchmark records: one ``Record`` per measured path of one case, the same type
for ``p2p``, ``moe`` and ``kv``, and the one way records go to and come from a JSON file.

A record holds what all benchmarks share: which benchmark, the memory, the op, what was timed (``path``) and what
moved the bytes (``transport``), the bytes one timed call moves, the statistics of its timed calls (median, p10
and p90 in µs; GB/s at the median), and the reference it is held against with the ratio of their bandwidths. A
reference that is itself unsteady (p10 to p90 over ``STEADY_SPREAD`` of its median) is never divided by: the
record names it and its spread, and its ``ratio`` is None. What only one benchmark has (MoE's token count, KV's
block count, a copy's thread count) is in ``params``. ``from_dict`` also reads the records of JSON files written
before benchmarks shared this type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .timing import Timing

__all__ = ["Record", "STEADY_SPREAD", "compare_with", "records_to_json", "records_from_json"]

STEADY_SPREAD = 0.2  # (p90 - p10) / median above which a measurement is too unsteady to hold others against


@dataclass(frozen=True)
class Record:
    """One measured path of one case; times in µs, bandwidth in GB/s (1e9 bytes/s) at the median."""

    benchmark: str  # "p2p", "moe" or "kv"
    memory: str  # "cpu" or "cuda"
    op: str  # "READ" or "WRITE"; MoE: "dispatch" or "combine"
    path: str  # what was timed: "tensorwire", "raw nixl", "copy", ...; MoE: the backend
    transport: str  # what moved the bytes: "nixl", "cuda_ipc", "shm", "local"; "torch"/"copy" for copies
    nbytes: int  # bytes one timed call moves; ``gbps`` is them over the median
    reps: int
    median_us: float
    p10_us: float
    p90_us: float
    gbps: float
    reference: str | None = None  # the path held against this one: a copy of the same bytes
    ratio: float | None = None  # gbps over the reference's gbps (above 1 is faster); None: reference unsteady
    reference_spread: float | None = None  # the reference's (p90 - p10) / median
    params: dict[str, Any] = field(default_factory=dict, hash=False)  # benchmark-specific keys

    @staticmethod
    def measured(benchmark: str, memory: str, op: str, path: str, transport: str, nbytes: int, timing: Timing,
                 **params: Any) -> Record:
        """The record of ``timing``, the summary of calls that each moved ``nbytes``."""
        return Record(benchmark, memory, op, path, transport, nbytes, timing.reps, timing.median_us,
                      timing.p10_us, timing.p90_us, timing.gbps(nbytes), params=params)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how much the timed calls varied."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us > 0 else float("inf")

    def against(self, reference: Record) -> Record:
        """This record held against ``reference``, which moved the same bytes: the ratio of their GB/s, or None
        when the reference is unsteady (``STEADY_SPREAD``) or moved nothing measurable."""
        steady = reference.spread <= STEADY_SPREAD and reference.gbps > 0
        return replace(self, reference=reference.path, ratio=self.gbps / reference.gbps if steady else None,
                       reference_spread=reference.spread)

    def ratio_text(self) -> str:
        """The ratio as a report column shows it: ``0.52x``, ``unsteady`` (reference spread too wide) or empty."""
        if self.reference is None:
            return ""
        return "unsteady" if self.ratio is None else f"{self.ratio:.2f}x"

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON object: every field by name, ``params`` as a nested object."""
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Record:
        """A record read back from ``to_dict``, or from a record of an older benchmark JSON file (each benchmark
        had its own keys then: see ``_LEGACY``)."""
        if "benchmark" in data:
            return Record(**{**data, "params": dict(data.get("params") or {})})
        for marker, convert in _LEGACY:
            if marker in data:
                return convert(data)
        raise ValueError(f"not a benchmark record: keys {sorted(data)}")


def compare_with(records: Iterable[Record], reference_path: str, paths: Iterable[str] | None = None) -> list[Record]:
    """The records of one case, those on ``paths`` (default: every one) held against the record of
    ``reference_path``; unchanged when the case has no such record."""
    records = list(records)
    reference = next((r for r in records if r.path == reference_path), None)
    if reference is None:
        return records
    chosen = None if paths is None else set(paths)
    return [r.against(reference) if chosen is None or r.path in chosen else r for r in records]


def records_to_json(records: Iterable[Record]) -> list[dict[str, Any]]:
    """The ``records`` list of a benchmark's JSON file."""
    return [r.to_dict() for r in records]


def records_from_json(document: dict[str, Any]) -> list[Record]:
    """The records of a benchmark's JSON file, whichever benchmark and however old."""
    return [Record.from_dict(r) for r in document["records"]]


# --- records of the JSON files written before the benchmarks shared Record ---------------------------
_COMMON = ("memory", "op", "reps", "median_us", "p10_us", "p90_us", "gbps")


def _legacy_p2p(data: dict[str, Any]) -> Record:
    """``bench p2p``: the fields of today's, ``size`` for ``nbytes`` and ``threads`` beside them."""
    params = {"threads": data["threads"]} if data.get("threads") else {}
    return Record("p2p", data["memory"], data["op"], data["path"], data["transport"], data["size"], data["reps"],
                  data["median_us"], data["p10_us"], data["p90_us"], data["gbps"], params=params)


def _legacy_moe(data: dict[str, Any]) -> Record:
    """``bench moe``: ``backend`` (the path; ``cuda (graph)`` is moved by ``cuda``), ``bytes``, the copy's
    ratio as ``ratio_to_copy``, everything else a parameter."""
    params = {k: v for k, v in data.items() if k not in (*_COMMON, "backend", "bytes", "ratio_to_copy")}
    return Record("moe", data["memory"], data["op"], data["backend"], data["backend"].split(" (")[0],
                  data["bytes"], data["reps"], data["median_us"], data["p10_us"], data["p90_us"], data["gbps"],
                  reference="copy", ratio=data["ratio_to_copy"], params=params)


def _legacy_kv(data: dict[str, Any]) -> Record:
    """``bench kv``: ``total_us`` (and its p10/p90) for the median, the case's shape and ``post`` times beside."""
    timed = ("memory", "op", "path", "transport", "nbytes", "reps", "gbps", "total_us", "total_p10_us",
             "total_p90_us")
    params = {k: v for k, v in data.items() if k not in timed}
    return Record("kv", data["memory"], data["op"], data["path"], data["transport"], data["nbytes"], data["reps"],
                  data["total_us"], data["total_p10_us"], data["total_p90_us"], data["gbps"], params=params)


_LEGACY = (("backend", _legacy_moe), ("total_us", _legacy_kv), ("size", _legacy_p2p))
