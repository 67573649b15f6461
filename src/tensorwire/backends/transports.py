"""``Transports``: the backends of one communicator, built by the registry from one context, asked by capability.

Every transport of ``registry.TRANSPORTS`` is built with ``create(context)`` (one that cannot work here, such as
``cuda_ipc`` without CUDA, is left out); a test transport (``registry.TEST_TRANSPORTS``) only once a test asks
for it by name (``prepare(transport="fake")``). Code above asks what the transports *can do*, never which one
they are: the message channels whose notifications the inbox reads, the one that carries the messages of the
transports without a channel (``messenger``), the one that maps peers' GPU memory (``with_capability``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..errors import BackendUnavailableError, InvalidArgumentError
from . import registry
from .base import Backend, BackendContext, MessageChannel

__all__ = ["Transports"]


class Transports:
    """The live backends of one communicator, in the registry's preference order. Not thread-safe to build
    (the user's thread does, in ``init`` and ``prepare``); reading is safe from any thread."""

    def __init__(self, context: BackendContext) -> None:
        self._context = context
        self._backends: dict[str, Backend] = {}
        self._channels: list[MessageChannel] = []  # in preference order
        try:
            for entry in registry.TRANSPORTS:
                self._add(entry)
            remote = [channel for channel in self._channels if channel.capabilities.remote]
            if not remote:
                raise BackendUnavailableError(
                    f"tensorwire: none of the transports {list(self._backends)} has a message channel to other "
                    "ranks; notifications and revocations need one: run 'tensorwire doctor'")
        except BaseException:
            self.close(lambda step: step())
            raise
        # Carries the messages of the transports without a channel, revocations and map confirmations.
        self.messenger: MessageChannel = remote[0]

    def _add(self, entry: registry.Transport) -> Backend | None:
        backend = entry.backend_class().create(self._context)
        if backend is not None:
            self._backends[entry.name] = backend
            if backend.capabilities.message_channel:
                self._channels.append(backend)
        return backend

    def require(self, name: str, fn: str) -> None:
        """Build test transport ``name`` if a test asks for it and it is not built yet (a production transport
        is built at ``init`` or not at all)."""
        if name in self._backends or name not in registry.FORCEABLE or name in registry.NAMES:
            return
        if self._add(registry.transport(name)) is None:
            raise InvalidArgumentError(f"{fn}: transport={name!r} cannot work here; usable: {sorted(self._backends)}")

    def __getitem__(self, name: str) -> Backend:
        return self._backends[name]

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def __iter__(self) -> Iterator[str]:
        return iter(self._backends)

    def items(self) -> Iterator[tuple[str, Backend]]:
        return iter(list(self._backends.items()))

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def with_capability(self, capability: str) -> Any | None:
        """The first transport that declares ``capability`` (a ``Capabilities`` field), or None."""
        return next((b for b in self._backends.values() if getattr(b.capabilities, capability)), None)

    def notifications(self) -> list[tuple[int, bytes]]:
        """What arrived on every message channel since the last call, ``(sender rank, message)``, in order per
        channel and sender (the inbox's poll)."""
        channels = self._channels
        if len(channels) == 1:
            return channels[0].notifications()
        return [arrival for channel in channels for arrival in channel.notifications()]

    def close(self, attempt: Callable[[Callable[[], None]], None]) -> None:
        """Close every backend; ``attempt`` runs each close and keeps its failure."""
        for backend in list(self._backends.values()):
            attempt(backend.close)
