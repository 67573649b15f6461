"""The interface every transport backend implements, and how a backend declares what it can do.

A backend moves bytes between registered ranges. It knows nothing of tensors, ranks' stores or
validation: the communicator hands it checked ``Segment`` lists and a peer it has already loaded.
Adding a backend is one file implementing ``Backend``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from ..descriptors import MemoryKind

__all__ = ["Op", "Status", "Segment", "Capabilities", "BackendInfo", "Backend", "Poster", "StreamOrderedRequest",
           "StreamOrderedCompletion", "SameProcessMemory"]


class Op(enum.Enum):
    """READ pulls remote -> local; WRITE pushes local -> remote."""

    READ = "READ"
    WRITE = "WRITE"


class Status(enum.Enum):
    """State of a posted transfer."""

    DONE = "DONE"
    IN_PROGRESS = "IN_PROGRESS"
    ERROR = "ERROR"


@dataclass(frozen=True)
class Segment:
    """A byte range on one device of one process: ``[addr, addr + nbytes)``."""

    addr: int
    nbytes: int
    kind: MemoryKind
    device_index: int


class Poster(NamedTuple):
    """A CPU post bound to one request, for the hot path: ``call()`` posts and returns a raw result; equal
    to ``done`` means DONE, anything else goes through ``finish(result) -> Status``; an exception from
    ``call`` becomes ``error(exception)``."""

    call: Callable[[], Any]
    done: Any
    finish: Callable[[Any], Status]
    error: Callable[[Exception], Exception]

    @staticmethod
    def of(backend: Backend, request: Any, notify: bytes | None) -> Poster:
        """The backend's own poster, or a plain ``post`` call for backends without one."""
        poster = getattr(backend, "poster", None)
        if poster is not None:
            return poster(request, notify)
        return Poster(functools.partial(backend.post, request, notify), Status.DONE, lambda s: s, lambda e: e)


class StreamOrderedRequest:
    """Completion of copies enqueued on a CUDA stream: the event recorded after them (``None`` until the
    first post). Stream-ordered backends' requests derive from this."""

    event: torch.cuda.Event | None = None

    def record(self, stream: torch.cuda.Stream) -> None:
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record(stream)

    def status(self) -> Status:
        return Status.DONE if self.event is None or self.event.query() else Status.IN_PROGRESS


class StreamOrderedCompletion:
    """The completion half of a stream-ordered backend, whose requests derive from ``StreamOrderedRequest``
    and which has no message channel of its own (notifications travel through NIXL)."""

    def status(self, request: StreamOrderedRequest) -> Status:
        return request.status()

    def completion_event(self, request: StreamOrderedRequest) -> torch.cuda.Event | None:
        return request.event

    def notifications(self) -> list[tuple[int, bytes]]:
        return []


class SameProcessMemory:
    """The registration half of a backend that reaches ranges of this very process only: nothing to register
    or publish, and every range the communicator checked against this process's own map is reachable."""

    def register(self, segment: Segment) -> None:
        return None

    def deregister(self, handle: None) -> None:
        pass

    def metadata(self) -> bytes:
        return b""

    def load_peer(self, rank: int, metadata: bytes) -> None:
        pass

    def reaches(self, peer: int, remote: list[Segment]) -> bool:
        return True


@dataclass(frozen=True)
class Capabilities:
    """What a backend reaches and supports, as data (``registry.reachable`` picks a transport from these)."""

    memory_kinds: frozenset[MemoryKind]  # memory it moves, on either side
    remote: bool  # reaches other processes / hosts
    stream_ordered: bool  # completion can be ordered on a CUDA stream without the CPU
    same_process: bool = False  # reaches ranges of this very process
    same_host_only: bool = False  # its metadata means something on the same host only
    same_kind_only: bool = False  # both sides must be the same memory kind
    message_channel: bool = False  # delivers notifications itself (others send theirs through NIXL)


@dataclass(frozen=True)
class BackendInfo:
    """Whether a backend works here; ``reason`` says why not in plain words, ``fix`` what to do."""

    name: str
    available: bool
    reason: str
    fix: str = ""
    version: str = ""


class Backend(Protocol):
    """A transport. Calls are non-blocking unless said otherwise; none takes a lock of the caller's."""

    name: str
    capabilities: Capabilities

    def register(self, segment: Segment) -> Any:
        """Make ``segment`` usable by this backend; returns an opaque handle for ``deregister``."""

    def deregister(self, handle: Any) -> None: ...

    def metadata(self) -> bytes:
        """What a peer needs to reach this process and its registered memory (changes on register)."""

    def load_peer(self, rank: int, metadata: bytes) -> None:
        """Add or refresh a peer from its ``metadata()``."""

    def reaches(self, peer: int, remote: list[Segment]) -> bool:
        """Whether it can address every remote segment of ``peer`` (e.g. what the peer exported to it)."""

    def prepare(
        self, op: Op, local: list[Segment], remote: list[Segment], peer: int, notify: bytes | None
    ) -> Any:
        """Build a reusable request; the expensive step. Item i of ``local`` pairs with item i of ``remote``."""

    def post(self, request: Any, notify: bytes | None, stream: Any = None) -> Status:
        """Start (or restart) a prepared request; may complete inside the call. ``stream`` (a
        ``torch.cuda.Stream``) is honoured by stream-ordered backends only: they enqueue the copies on it."""

    def status(self, request: Any) -> Status:
        """Poll a posted request; drives the backend's progress."""

    def release(self, request: Any) -> None: ...

    def prepare_blocks(self, op: Op, local: Any, remote: Any, peer: int) -> Any:
        """A reusable block request between two ``block_copy.BlockLayout`` pools; posted like any request."""

    def bind_blocks(self, request: Any, local_ids: Any, remote_ids: Any, notify: bytes | None) -> None:
        """Queue the block ids (and notification) the next post of a block request moves."""

    # A backend may offer ``poster(request, notify) -> Poster``: ``post`` unbundled for the CPU hot path
    # (NIXL resolves its C call once).
    # Stream-ordered backends also offer ``completion_event(request) -> torch.cuda.Event | None``: the
    # event recorded after the request's copies, which ``Transfer.wait(stream=)`` makes a stream wait on.

    def notifications(self) -> list[tuple[int, bytes]]:
        """Notifications that arrived since the last call, as ``(sender rank, message)``, in order."""

    def close(self) -> None: ...
