"""Explicit lifetimes: one base for handles that own something until ``close()``.

``close()`` is idempotent and deterministic; ``with`` closes on exit. A handle that is garbage-collected
while open gets a ``ResourceWarning`` naming what leaked, and ``__del__`` releases what is local to this process
and free to release at once (``_release_local``): it never blocks, never does I/O (a store write, a message to a
peer, a wait for a transfer in flight), never raises. What needs those (revoking peers' transfers to memory,
withdrawing a pool's epoch) is left to the communicator's ``close()``, which closes everything it still holds.
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

    def _release_local(self) -> None:
        """Release, without blocking or I/O, what this handle holds of this process only (``__del__``)."""

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            warnings.warn(f"tensorwire: {self._leak_message()}", ResourceWarning, stacklevel=2)
            try:
                self._release_local()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass
