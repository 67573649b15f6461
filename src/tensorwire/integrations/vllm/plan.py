"""One engine step's work for the workers (the connector metadata's content), made by the scheduler side."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorwire.kv import Handoff, Load

__all__ = ["Plan"]


@dataclass
class Plan:
    loads: list[Load] = field(default_factory=list)  # consumer: start these
    holds: list[Handoff] = field(default_factory=list)  # producer: keep these handoffs' blocks for their consumer
    refused: list[str] = field(default_factory=list)  # reasons of handoffs refused and recomputed (for the stats)
