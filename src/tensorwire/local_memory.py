"""``LocalMemory``: this rank's registered memory, its epochs, and the memory map peers load.

Registering hands every range to each transport that moves its memory kind; each registration (and each block
pool over the user's registrations) gets an epoch of its own, stamped on its descriptors, and the map is
published again (``Peers.publish``). Deregistering runs the other way: the map without the ranges first (peers'
prepares refuse them), then the peers' prepared transfers to them are revoked (``tensorwire.revocation``), then
the transports let go.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from . import arguments
from .backends.base import Segment
from .descriptors import TensorDesc
from .peers import Peers
from .registration import LocalMemoryMap, Registration
from .revocation import Revocations
from .runtime import Runtime

__all__ = ["LocalMemory"]


class LocalMemory:
    """What this rank registered. ``map`` resolves tensors to their registration; ``epoch`` is the last published
    map's; ``closing`` (set by the communicator's ``close``) stops republishing the map one registration at a time."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._transports = runtime.transports
        self.map = LocalMemoryMap()
        self.epoch = 0
        self._map_lock = threading.RLock()  # an epoch and the map published under it are one step
        self.closing = False
        self.registrations: weakref.WeakSet[Registration] = weakref.WeakSet()
        self._pool_spans: dict[int, list[TensorDesc]] = {}  # epoch -> spans of an open pool in user registrations
        self._peers: Peers | None = None
        self._revocations: Revocations | None = None

    def connect(self, peers: Peers, revocations: Revocations) -> None:
        """Where the map is published and deregistered memory revoked (made after this object: they read its
        ranges)."""
        self._peers, self._revocations = peers, revocations

    def register(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> Registration:
        """See ``Communicator.register``."""
        tensors, segments = arguments.new_segments(tensors, self.map)
        handles: list[dict] = []
        try:
            for s in segments:
                handles.append({})
                for name, backend in self._transports.items():
                    if s.kind in backend.capabilities.memory_kinds:
                        handles[-1][name] = backend.register(s)
        except Exception:
            self._release_handles(handles)
            raise
        rank = self._runtime.rank
        with self._map_lock:
            epoch = self.epoch + 1
            descs = [TensorDesc(rank, s.addr, s.nbytes, s.kind, s.device_index, epoch) for s in segments]
            registration = Registration(self._deregister, tensors, segments, handles, descs)
            for s, t in zip(segments, tensors):
                self.map.add(s, registration, t)
            self.registrations.add(registration)
            self.publish()
        return registration

    def _deregister(self, registration: Registration, handles: list | None) -> None:
        """Unmap, republish, revoke peers' transfers (blocks for their answers), release; ``handles=None``: a
        ``close()`` again after the peers' answers timed out waits for them once more."""
        epochs = sorted({d.epoch for d in registration.descs})
        if handles is None:
            if not self._runtime.closed:
                self._revocations.retry(epochs)
            return
        for s in registration.segments:
            self.map.remove(s)
        pools = [epoch for epoch, spans in self._pool_spans.items()  # pools in it go with it
                 if any(d.contains(span) for span in spans for d in registration.descs)]
        for epoch in pools:
            del self._pool_spans[epoch]
        if self._runtime.closed:
            return  # the backends are gone and took the registrations with them
        if not self.closing:
            self.publish()  # first the map without these ranges: peers' prepares refuse them
        tensors = registration.release_tensors()  # kept alive by the release while peers may still post
        epochs = sorted(set(epochs) | set(pools))
        self._revocations.revoke(epochs, self.epoch, lambda: (self._release_handles(handles), tensors.clear()),
                                 wait=not self.closing)

    def _release_handles(self, handles: list[dict]) -> None:
        for per_backend in handles:
            for name, handle in per_backend.items():
                self._transports[name].deregister(handle)

    def publish(self) -> None:
        """Publish the map under a new epoch. One store write."""
        with self._map_lock:
            self.epoch += 1
            self._peers.publish(self._runtime.rank, self.epoch, self.published_ranges())

    def republish(self) -> None:
        """A transport's metadata became ready (called on the thread that started it): publish the map again, now
        with that metadata, unless the first map is still to come (it carries it) or the communicator closes."""
        with self._map_lock:
            if self.epoch > 0 and not self.closing and not self._runtime.closed:
                self.publish()

    def published_ranges(self) -> list[TensorDesc]:
        """The registered ranges, and the spans of the pools in them that have their own epoch (a descriptor of
        such a pool is valid while its spans are published: until the pool closes)."""
        return self.map.descs() + [d for spans in self._pool_spans.values() for d in spans]

    def regions(self) -> tuple[list[TensorDesc], int]:
        """What a transfer to this very rank is checked against: the published ranges and their epoch."""
        return self.published_ranges(), self.epoch

    def expose_pool(self, spans: list[Segment]) -> int:
        """Publish ``spans`` (a pool's, inside registrations) under a new epoch; return it."""
        rank = self._runtime.rank
        with self._map_lock:
            epoch = self.epoch + 1
            self._pool_spans[epoch] = [TensorDesc(rank, s.addr, s.nbytes, s.kind, s.device_index, epoch)
                                       for s in spans]
            self.publish()
        return epoch

    def withdraw_pool(self, epoch: int) -> None:
        """The pool exposed under ``epoch`` closed: its spans leave the map (a peer's ``prepare_blocks`` refuses
        its descriptor) and the peers' transfers to it are revoked; the memory stays the user's."""
        if self._pool_spans.pop(epoch, None) is None or self._runtime.closed:
            return  # withdrawn with the registration holding it
        if not self.closing:
            self.publish()
        self._revocations.revoke([epoch], self.epoch, lambda: None, wait=not self.closing)
