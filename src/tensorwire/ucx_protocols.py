"""UCX's protocol tables (its log with ``UCX_PROTO_INFO=y``), read into rows: which transport UCX picked for which
operation, memory types and sizes. ``tensorwire doctor`` shows them for its 2-process probe."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ProtoRow", "parse_proto_info", "transfer_rows", "warnings_and_errors"]

_LOG_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s?")
_TITLE = re.compile(r"^(?P<endpoint>.*?)\s+(?P<scope>\S+)\s+cfg#\d+$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\-]+)")


@dataclass(frozen=True)
class ProtoRow:
    """One row of a UCX protocol table: for sizes ``size_range`` of ``operation``, use ``config``."""

    endpoint: str
    scope: str  # "self", "intra-node", "inter-node"
    operation: str  # e.g. "remote memory write by ucp_put*(multi) from host memory to host"
    size_range: str
    description: str
    config: str  # e.g. "cma/memory", "cuda_ipc/cuda", "50% on rc_mlx5/mlx5_0:1 and 50% on ..."

    @property
    def op(self) -> str | None:
        if "ucp_put" in self.operation:
            return "WRITE"
        if "ucp_get" in self.operation:
            return "READ"
        return None

    @property
    def memories(self) -> tuple[str, ...]:
        """Memory types UCX detected, e.g. ``("host", "host")`` or ``("cuda", "cuda")``."""
        return tuple(re.findall(r"(?:from|to|into) (\w+)", self.operation))

    @property
    def transports(self) -> list[str]:
        return ["/".join(t) for t in _TRANSPORT.findall(self.config)]


def parse_proto_info(text: str) -> list[ProtoRow]:
    """Every row of every protocol table in UCX log text (``UCX_PROTO_INFO=y``), in order."""
    rows: list[ProtoRow] = []
    title: re.Match | None = None
    operation: str | None = None
    for raw in text.splitlines():
        line = _LOG_PREFIX.sub("", raw).strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:
            match = _TITLE.match(cells[0])
            if match:
                title, operation = match, None
            else:
                operation = cells[0]
        elif len(cells) == 3 and title is not None and operation and cells[0] != "Range":
            rows.append(ProtoRow(title["endpoint"], title["scope"], operation, *cells))
    return rows


def transfer_rows(rows: list[ProtoRow]) -> list[ProtoRow]:
    """The put/get rows between processes (not the loopback ``self`` tables), without duplicates."""
    seen, out = set(), []
    for row in rows:
        key = (row.op, row.memories, row.size_range, row.description, row.config)
        if row.op and row.scope != "self" and key not in seen:
            seen.add(key)
            out.append(row)
    return out


def warnings_and_errors(text: str) -> list[str]:
    """UCX's WARN and ERROR lines in log text, without their timestamp prefix."""
    return [_LOG_PREFIX.sub("", line).strip() for line in text.splitlines() if re.search(r"\b(WARN|ERROR)\b", line)]
