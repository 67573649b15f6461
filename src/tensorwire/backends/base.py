"""The interface every transport backend implements, and how a backend declares what it can do.

A backend moves bytes between registered ranges. It knows nothing of tensors, ranks' stores or
validation: the communicator hands it checked ``Segment`` lists and a peer it has already loaded.
Adding a backend is one file implementing ``Backend`` (built by ``create`` from the one ``BackendContext``
every backend gets) plus its line in ``registry.py``.

What a backend can do beyond ``Backend`` is declared twice, once as data for the code that decides
(``Capabilities``: nobody asks a backend's name or class) and once as a ``Protocol`` with the methods that
come with it, which a type checker sees:

| capability        | protocol           | methods                                                    |
|-------------------|--------------------|------------------------------------------------------------|
| ``message_channel``| ``MessageChannel`` | ``send_notification``, ``notifications``, ``loaded_peers``  |
| ``stream_ordered`` | ``StreamOrdered``  | ``completion_event``                                       |
| ``first_touch``    | ``FirstTouch``     | ``touch``                                                  |
| ``peer_pointers``  | ``PeerPointers``   | ``pointer``                                                |
| (any backend)      | ``UnbundledPost``  | ``poster``: the CPU hot path's post, resolved once          |

A block request (``prepare_blocks``) is a ``BlockRequest``: the ids bound for the posts to come
(``bindings``) and whether it takes ids that live on the GPU.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from ..config import Config
from ..descriptors import MemoryKind

if TYPE_CHECKING:  # only named in annotations here: `import tensorwire` (its Op, Status) does not import torch
    import torch

__all__ = ["Op", "Status", "Segment", "Capabilities", "BackendInfo", "BackendContext", "Backend", "Poster",
           "MessageChannel", "StreamOrdered", "FirstTouch", "PeerPointers", "UnbundledPost", "BlockRequest",
           "Bindings",
           "StreamOrderedRequest", "StreamOrderedCompletion", "SameProcessMemory"]


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
        """The backend's own poster (``UnbundledPost``), or a plain ``post`` call for backends without one."""
        if isinstance(backend, UnbundledPost):
            return backend.poster(request, notify)
        return Poster(functools.partial(backend.post, request, notify), Status.DONE, _same, _same)


def _same(value: Any) -> Any:
    return value


class StreamOrderedRequest:
    """Completion of copies enqueued on a CUDA stream: the event recorded after them (``None`` until the
    first post). Stream-ordered backends' requests derive from this."""

    event: torch.cuda.Event | None = None

    def record(self, stream: torch.cuda.Stream) -> None:
        if self.event is None:
            import torch

            self.event = torch.cuda.Event()
        self.event.record(stream)

    def status(self) -> Status:
        return Status.DONE if self.event is None or self.event.query() else Status.IN_PROGRESS


class StreamOrderedCompletion:
    """The completion half of a stream-ordered backend (``StreamOrdered``), whose requests derive from
    ``StreamOrderedRequest``."""

    def status(self, request: StreamOrderedRequest) -> Status:
        return request.status()

    def completion_event(self, request: StreamOrderedRequest) -> torch.cuda.Event | None:
        return request.event


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
    # Delivers notifications itself (``MessageChannel``): a transfer's ``notify=`` is sent by the backend once the
    # data is in place; the first remote one also carries the notifications of the transports without one.
    message_channel: bool = False
    # Maps a peer's GPU allocation at the first transfer that touches it, which may wait for the device to go
    # idle: ``prepare`` touches each remote allocation once (``FirstTouch``) before a stream can wait on it.
    first_touch: bool = False
    peer_pointers: bool = False  # maps peers' GPU memory into this process for kernels (``PeerPointers``)


@dataclass(frozen=True)
class BackendContext:
    """What every backend is built from (``transports.Transports`` hands the same one to each ``create``).

    ``local_view(segment)``: a flat uint8 tensor over a registered range of this process; ``peer_lost(rank,
    fresh=False)``: why ``rank`` is gone, or None while it is alive (``Liveness.lost``); ``net_devices``: the
    network devices a transport may listen on (None: every one); ``timeout_s``: the communicator's timeout;
    ``on_ready()``: what a backend that starts in the background calls (on its own thread) once its
    ``metadata()`` exists (the communicator publishes its map again)."""

    rank: int
    config: Config
    local_view: Callable[[Segment], torch.Tensor]
    peer_lost: Callable[..., str | None]
    net_devices: str | None = None
    timeout_s: float = 300.0
    on_ready: Callable[[], None] = lambda: None


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

    @classmethod
    def create(cls, context: BackendContext) -> Backend | None:
        """The backend of one communicator, or None where it cannot work here (the transport is then left out;
        a transport the communicator cannot do without raises ``BackendUnavailableError``). Blocks while it
        starts."""

    def register(self, segment: Segment) -> Any:
        """Make ``segment`` usable by this backend; returns an opaque handle for ``deregister``."""

    def deregister(self, handle: Any) -> None: ...

    def metadata(self) -> bytes | None:
        """What a peer needs to reach this process and its registered memory (changes on register); None while a
        backend that starts in the background is not ready (it calls ``BackendContext.on_ready`` then)."""

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

    def prepare_blocks(self, op: Op, local: Any, remote: Any, peer: int) -> BlockRequest:
        """A reusable block request between two ``block_copy.BlockLayout`` pools; posted like any request."""

    def bind_blocks(self, request: BlockRequest, local_ids: Any, remote_ids: Any, notify: bytes | None) -> None:
        """Queue the block ids (and notification) the next post of a block request moves."""

    def close(self) -> None: ...


class Bindings(Protocol):
    """The block ids bound to a block request for the posts to come (``block_copy.BlockBindings``)."""

    def unbind_last(self) -> None:
        """Take back the last binding (its post failed)."""


class BlockRequest(Protocol):
    """A prepared block request: ``bindings`` holds the ids bound for the posts to come (a failed post takes its
    binding back with ``bindings.unbind_last()``); ``takes_device_ids``: ids may stay on the pool's GPU (a kernel
    reads them there), else they are read on the host."""

    bindings: Bindings
    takes_device_ids: bool


class MessageChannel(Backend, Protocol):
    """A backend with ``Capabilities.message_channel``: it delivers messages between ranks itself."""

    def send_notification(self, peer: int, message: bytes) -> None:
        """A standalone message to ``peer`` (whose metadata is loaded), delivered after every earlier one."""

    def notifications(self) -> list[tuple[int, bytes]]:
        """Messages that arrived since the last call, as ``(sender rank, message)``, in order per sender."""

    def loaded_peers(self) -> frozenset[int]:
        """The ranks it can send messages to now."""


class StreamOrdered(Backend, Protocol):
    """A backend with ``Capabilities.stream_ordered``: its requests' copies run on a CUDA stream."""

    def completion_event(self, request: Any) -> torch.cuda.Event | None:
        """The event recorded after the request's copies (None before the first post), which
        ``Transfer.wait(stream=)`` makes a stream wait on."""


class FirstTouch(Backend, Protocol):
    """A backend with ``Capabilities.first_touch``."""

    def touch(self, peer: int, remote: Segment, local_kind: MemoryKind, local_device: int) -> Any:
        """Post a 1-byte READ of ``remote`` (leaving the peer's bytes as they are); returns the request to poll
        with ``status`` and ``release``."""


class PeerPointers(Backend, Protocol):
    """A backend with ``Capabilities.peer_pointers``."""

    def pointer(self, peer: int, segment: Segment, device_index: int) -> int:
        """A device pointer on ``device_index`` to ``segment`` of ``peer``'s GPU memory (``reaches`` it)."""


@runtime_checkable
class UnbundledPost(Protocol):
    """A backend whose ``post`` is offered unbundled for the CPU hot path (``Poster``; NIXL resolves its C call
    once)."""

    def poster(self, request: Any, notify: bytes | None) -> Poster: ...
