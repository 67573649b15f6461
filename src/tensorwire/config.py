"""Defaults, and the only reader of ``TENSORWIRE_*`` environment variables.

| variable                          | default | meaning                                              |
|-----------------------------------|---------|------------------------------------------------------|
| ``TENSORWIRE_TIMEOUT``            | 300     | seconds any wait may take when no timeout is given   |
| ``TENSORWIRE_PROGRESS_WAKEUP_MS`` | 10      | idle wake-up period of NIXL's event-driven progress  |
| ``TENSORWIRE_SPIN_US``            | 50      | a waiter polls without sleeping this long first      |
| ``TENSORWIRE_MAX_SLEEP_US``       | 1000    | longest sleep between two polls of a waiter          |

The library never writes ``os.environ``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .errors import InvalidArgumentError


def _read(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"config: {name}={raw!r} is not a number; unset it or give seconds/units as a number"
        ) from None
    if not math.isfinite(value):
        raise InvalidArgumentError(f"config: {name}={raw!r} is not finite; unset it or give a number")
    if value < 0:
        raise InvalidArgumentError(f"config: {name}={raw!r} is negative; give a value >= 0")
    return value


@dataclass(frozen=True)
class Config:
    timeout_s: float
    progress_wakeup_ms: float
    spin_us: float
    max_sleep_us: float


def load() -> Config:
    """Read the environment once; call it at ``tw.init`` time."""
    return Config(
        timeout_s=_read("TENSORWIRE_TIMEOUT", 300.0),
        progress_wakeup_ms=_read("TENSORWIRE_PROGRESS_WAKEUP_MS", 10.0),
        spin_us=_read("TENSORWIRE_SPIN_US", 50.0),
        max_sleep_us=_read("TENSORWIRE_MAX_SLEEP_US", 1000.0),
    )
