"""Explicit lifetimes: one base for handles that own something until ``close()``.

``close()`` is idempotent and deterministic; ``with`` closes on exit. A handle that is garbage-collected
while open is closed locally from ``__del__`` with a ``ResourceWarning`` naming what leaked: never a
collective, never a raise.
"""

from __future__ import annotations

import warnings

__all__ = ["Closeable"]


class Closeable:
    closed: bool = True  # subclasses set False once they own something

    def close(self) -> None:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def _leak_message(self) -> str:
        return f"a {type(self).__name__} was garbage-collected without close(); call close() or use 'with'"

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            warnings.warn(f"tensorwire: {self._leak_message()}", ResourceWarning, stacklevel=2)
            try:
                self.close()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass
