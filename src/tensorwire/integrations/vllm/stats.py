"""``get_kv_connector_stats``: what the connector reports to vLLM's metrics, comparable with NixlConnector's
(``transfer_duration`` in seconds, ``bytes_transferred`` per transfer, failures), plus blocks and requests per
transfer, the first-contact, claim and whole-load times, and why loads failed or handoffs were refused (counts per
reason); and the same as Prometheus metrics (``build_prom_metrics``), named as vLLM names NixlConnector's:

    vllm:tensorwire_xfer_time_seconds       histogram  a load's READs, post to the last completion
    vllm:tensorwire_load_time_seconds       histogram  a load from its claims to its last READ (what it costs)
    vllm:tensorwire_claim_time_seconds      histogram  the claims' round trip (single use; beside the READ)
    vllm:tensorwire_bytes_transferred       histogram  bytes per load
    vllm:tensorwire_num_blocks              histogram  blocks per load
    vllm:tensorwire_num_failed_transfers    counter    failed loads, label ``reason`` (lost, replayed, timeout...)
    vllm:tensorwire_num_refused_handoffs    counter    handoffs the scheduler refused, label ``reason``
    vllm:tensorwire_num_kv_expired_reqs     counter    producer holds freed at expiry, never read
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .worker import StatsLog

__all__ = ["TensorwireKVConnectorStats", "TensorwirePromMetrics"]

_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0]
_BYTES = [2 ** (10 + i) for i in range(1, 25, 2)]  # 2 KiB .. 8 GiB
_BLOCKS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


class TensorwireKVConnectorStats(KVConnectorStats):
    """``data``: ``StatsLog.FIELDS`` -> list of observations (one per load; failures and expiries as counts)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: [] for k in StatsLog.FIELDS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        durations = self.data["transfer_duration"]
        total_bytes = sum(self.data["bytes_transferred"])
        summary: dict[str, Any] = {
            "Num successful transfers": len(durations),
            "Num failed transfers": sum(self.data["num_failed_transfers"]),
            "Num KV expired reqs": sum(self.data["num_kv_expired_reqs"]),
        }
        # Why loads failed and why handoffs were refused, counted per reason (e.g. "Failed loads (lost)": 2).
        for key, label in (("failure_reasons", "Failed loads"), ("refused_handoffs", "Refused handoffs")):
            for reason, count in sorted(Counter(self.data.get(key, ())).items()):
                summary[f"{label} ({reason})"] = count
        if durations:
            summary.update({
                "Avg xfer time (ms)": round(statistics.fmean(durations) * 1e3, 3),
                "Avg claim time (ms)": round(statistics.fmean(self.data.get("claim_duration") or [0.0]) * 1e3, 3),
                "P90 xfer time (ms)": round(_quantile(durations, 0.9) * 1e3, 3),
                "Avg MB per transfer": round(total_bytes / len(durations) / 2**20, 3),
                "Throughput (MB/s)": round(total_bytes / 2**20 / max(sum(durations), 1e-9), 3),
                "Avg blocks per transfer": round(statistics.fmean(self.data["num_blocks"]), 1),
            })
        return summary


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class TensorwirePromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (the module's table), one child per engine; ``observe`` takes one
    ``TensorwireKVConnectorStats.data``."""

    _HISTOGRAMS = (  # (name, stats field, buckets, what it is)
        ("vllm:tensorwire_xfer_time_seconds", "transfer_duration", _SECONDS,
         "Histogram of the READ time of tensorwire KV loads (post to last completion)."),
        ("vllm:tensorwire_load_time_seconds", "load_duration", _SECONDS,
         "Histogram of tensorwire KV load time, claims to last READ (claim and READ overlap)."),
        ("vllm:tensorwire_claim_time_seconds", "claim_duration", _SECONDS,
         "Histogram of the claim round trip of tensorwire KV loads (single use)."),
        ("vllm:tensorwire_bytes_transferred", "bytes_transferred", _BYTES,
         "Histogram of bytes per tensorwire KV load."),
        ("vllm:tensorwire_num_blocks", "num_blocks", _BLOCKS, "Histogram of blocks per tensorwire KV load."),
    )

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._histograms = {
            field: self._per_engine(self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                                        labelnames=labelnames))
            for name, field, buckets, doc in self._HISTOGRAMS}
        self._failed = self._counter_cls(name="vllm:tensorwire_num_failed_transfers", labelnames=[*labelnames,
                                                                                                  "reason"],
                                         documentation="Failed tensorwire KV loads, by reason (lost, replayed, "
                                                       "timeout, layout, ...); vLLM recomputes or fails them.")
        self._refused = self._counter_cls(name="vllm:tensorwire_num_refused_handoffs",
                                          labelnames=[*labelnames, "reason"],
                                          documentation="kv_transfer_params the scheduler refused, by reason.")
        self._expired = self._per_engine(self._counter_cls(
            name="vllm:tensorwire_num_kv_expired_reqs", labelnames=labelnames,
            documentation="Producer holds freed at their expiry, never read (tracked on the producer)."))

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {engine: metric.labels(*values) for engine, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data, engine = transfer_stats_data, self.per_engine_labelvalues[engine_idx]
        for field, histogram in self._histograms.items():
            for value in data.get(field, ()):
                histogram[engine_idx].observe(value)
        for counter, field in ((self._failed, "failure_reasons"), (self._refused, "refused_handoffs")):
            for reason, count in Counter(data.get(field, ())).items():
                counter.labels(*engine, reason).inc(count)
        expired = sum(data.get("num_kv_expired_reqs", ()))
        if expired:
            self._expired[engine_idx].inc(expired)
