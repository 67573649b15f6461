"""Transport backends behind one ``Backend`` protocol, and what is available here."""

from __future__ import annotations

from .base import Backend, BackendInfo, Capabilities, Op, Segment, Status

__all__ = ["Backend", "BackendInfo", "Capabilities", "Op", "Segment", "Status", "backends"]


def backends() -> dict[str, BackendInfo]:
    """Every transport tensorwire has (in the order it prefers them), with whether it works here and why not.
    Cheap; creates no peers."""
    from . import registry

    return registry.infos()
