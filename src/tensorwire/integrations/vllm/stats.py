"""``get_kv_connector_stats``: what the connector reports to vLLM's metrics, comparable with NixlConnector's
(``transfer_duration`` in seconds, ``bytes_transferred`` per transfer, failures), plus blocks and requests per
transfer, the first-contact time, and why loads failed or handoffs were refused (counts per reason)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .worker import StatsLog

__all__ = ["TensorwireKVConnectorStats"]


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
