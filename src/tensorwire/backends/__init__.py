"""Transport backends behind one ``Backend`` protocol, and what is available here."""

from __future__ import annotations

from .base import Backend, BackendInfo, Capabilities, Op, Segment, Status

__all__ = ["Backend", "BackendInfo", "Capabilities", "Op", "Segment", "Status", "backends"]


def backends() -> dict[str, BackendInfo]:
    """Every backend tensorwire knows, with whether it works here and why not. Cheap; creates no peers."""
    from . import nixl

    return {"nixl": nixl.info()}
