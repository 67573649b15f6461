"""``Runtime``: what every handle of one communicator shares, and the seam for the layers above it.

A transfer needs the communicator's threads (the progress engine, the deadlines), its pinned host words,
its timeouts and configuration, whether a peer is still alive, and the outbox for notifications of the
transports without a message channel; it needs none of the communicator's public calls. The communicator
creates one ``Runtime``, hands it to every ``Transfer`` (and block transfer, block pool), and closes it last;
handles never see the ``Communicator`` itself.

The same object is ``Communicator.runtime``, the public seam of the layers built on a communicator (MoE engines,
benchmarks), which use nothing private of it:

* ``store``: the job's store (sealed, every call bounded: ``meeting.Rendezvous``);
* ``channel(prefix)``: a notification channel of one's own (messages starting with ``prefix``, kept apart from
  the user's ``wait_notification``);
* ``transports``: the communicator's transports (``backends.transports.Transports``), asked by capability;
* ``close_with(obj)``: ``obj.close()`` runs first when the communicator closes;
* ``extension(key, create)``: one slot per extension (an engine cache), created on first use, dropped at close.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from . import cuda
from .backends.transports import Transports
from .config import Config
from .deadlines import Deadlines
from .errors import ClosedError, InvalidArgumentError, TensorwireWarning
from .meeting import Rendezvous
from .outbox import Outbox
from .progress import Inbox, ProgressEngine

__all__ = ["Runtime", "Channel"]


class Channel:
    """Messages that start with one prefix (``Runtime.channel``): ``try_pop(sender)`` takes the next one from
    ``sender`` (prefix included) or None, never blocking; ``send(peer, message)`` sends one (it must start with the
    prefix), in order after the earlier ones."""

    def __init__(self, prefix: bytes, inbox: Inbox, send: Callable[[int, bytes], None]) -> None:
        self.prefix = prefix
        self._inbox, self._send = inbox, send

    def try_pop(self, sender: int) -> bytes | None:
        return self._inbox.try_pop(sender, self.prefix)

    def take_all(self) -> list[tuple[int, bytes]]:
        """Every queued message of the channel, from any sender, as ``(sender, message)``, each sender's in order,
        after one poll of the message channels. Never blocks (for a receiver that cannot name its senders)."""
        return self._inbox.take_all(self.prefix)

    def send(self, peer: int, message: bytes) -> None:
        if not message.startswith(self.prefix):
            raise InvalidArgumentError(f"Channel.send: {message[:16]!r} does not start with this channel's prefix "
                                       f"{self.prefix!r}; prefix every message of the channel")
        self._send(peer, message)


class Runtime:
    """One communicator's shared machinery.

    ``engine``: the progress thread (completions nobody waits on with the CPU); ``deadlines``: the thread that
    releases stream waits on time; ``transfer_words``: pinned words for stream completion, four per transfer;
    ``stream_waiters``: objects streams may wait on (``release_stream_waits() -> int``: how many were pending);
    ``transfers``: the open transfers; ``outbox``: notifications sent once a copy completed; ``inbox``: what the
    message channels delivered, per sender; ``between_polls``: run by every sleeping wait (the communicator
    answers revocations there); ``dependents``: what ``close_with`` added."""

    def __init__(self, rank: int, config: Config, timeout_s: float, store: Rendezvous, transports: Transports,
                 inbox: Inbox) -> None:
        self.rank = rank
        self.config = config
        self.timeout_s = timeout_s
        self.store = store
        self.liveness = store.liveness
        self.transports = transports
        self.inbox = inbox
        self.engine = ProgressEngine(config)
        self.deadlines = Deadlines()
        self.transfer_words = cuda.HostWordSlabs(4)  # stream_completion's three words and a spare
        self.stream_waiters: weakref.WeakSet = weakref.WeakSet()
        self.transfers: weakref.WeakSet = weakref.WeakSet()
        self.outbox = Outbox(self.engine, self.send_notification)
        self.between_polls: Callable[[], None] = lambda: None
        # Makes a peer reachable by a standalone message (NIXL needs its metadata loaded): the communicator's.
        self.reach: Callable[[int], None] = lambda rank: None
        self.dependents: weakref.WeakSet = weakref.WeakSet()
        self._extensions: dict[str, Any] = {}
        self.closed = False

    # --- the seam for the layers above ------------------------------------------------------------
    def send_notification(self, peer: int, message: bytes) -> None:
        """Send ``message`` to ``peer`` through the messenger (into this rank's own inbox for itself). Non-blocking."""
        if peer == self.rank:
            self.inbox.push(self.rank, message)
        else:
            self.transports.messenger.send_notification(peer, message)

    def channel(self, prefix: bytes, handler: Callable[[int, bytes], None] | None = None) -> Channel:
        """A channel of messages starting with ``prefix`` (never seen by ``wait_notification``); with ``handler``,
        each arrival is handed to ``handler(sender, message)`` by whoever pumps the inbox instead of being queued."""
        if not isinstance(prefix, bytes) or not prefix:
            raise InvalidArgumentError(f"channel: prefix={prefix!r}; give non-empty bytes, e.g. b'myext'")
        self.inbox.open_channel(prefix, handler)
        return Channel(prefix, self.inbox, self._send_reaching)

    def _send_reaching(self, peer: int, message: bytes) -> None:
        """A channel's message: to a peer never contacted, after loading what its messages need (a store round trip,
        once); blocks only then."""
        if peer != self.rank:
            self.reach(peer)
        self.send_notification(peer, message)

    def close_with(self, dependent: Any) -> None:
        """Close ``dependent`` (anything with ``close()``) when the communicator closes, before its transfers and
        registrations; held weakly."""
        self.dependents.add(dependent)

    def extension(self, key: str, create: Callable[[], Any]) -> Any:
        """The object of extension ``key`` on this communicator, made by ``create()`` on first use."""
        if key not in self._extensions:
            self._extensions[key] = create()
        return self._extensions[key]

    def timeout(self, timeout: float | None) -> float:
        """``timeout`` checked (finite seconds >= 0), or the communicator's when None."""
        if timeout is None:
            return self.timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
                or timeout < 0):
            raise InvalidArgumentError(
                f"timeout={timeout!r}; give a finite number of seconds >= 0, or None for the default")
        return float(timeout)

    def check_open(self, fn: str) -> None:
        if self.closed:
            raise ClosedError(f"{fn}: the communicator is closed; create a new one with tw.init()")

    def alive(self, rank: int, what: str | Callable[[], str]) -> Callable[[], None] | None:
        """For ``wait_until``: raises ``PeerLostError`` once ``rank`` is gone (None for this rank)."""
        if rank == self.rank:
            return None
        liveness = self.liveness

        def alive() -> None:
            liveness.check(rank, what)
            self.between_polls()  # a sleeping wait also handles revocations that arrived

        return alive

    def peer_lost(self, rank: int, fresh: bool = False) -> str | None:
        """Why ``rank`` is gone, or None while it is alive (this rank never is)."""
        return None if rank == self.rank else self.liveness.lost(rank, fresh=fresh)

    def gone_among(self, ranks, seconds: float) -> tuple[int, str] | None:
        """The first of ``ranks`` found gone, with why, looking for up to ``seconds`` (sleeping between looks):
        for an error that a peer's death may have caused, reported before the liveness view has seen it (a
        transport noticed the closed connection first). None if all look alive after that. Blocks."""
        deadline = time.monotonic() + seconds
        while True:
            for rank in ranks:
                reason = self.peer_lost(rank, fresh=True)
                if reason is not None:
                    return rank, reason
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def start_threads(self) -> None:
        """Start the progress and deadline threads now, ahead of a latency-sensitive first stream wait."""
        self.engine.start()
        self.deadlines.start()

    def release_stream_waits(self) -> None:
        """Closing ends the progress thread: a GPU stream still waiting on a word it would have written must
        not wait forever. Release every such word (and warn: the bytes those streams read are not guaranteed)."""
        pending = sum(waiter.release_stream_waits() for waiter in list(self.stream_waiters))
        if pending:
            warnings.warn(
                f"tensorwire: close() released {pending} stream wait(s) that were not complete; close the "
                "communicator only after the GPU work that waits on its transfers has run", TensorwireWarning,
                stacklevel=4)

    def close(self, attempt: Callable[[Callable[[], Any]], None]) -> None:
        """Stop the threads (after the communicator released every stream wait); ``attempt`` runs each step
        and keeps its failure."""
        attempt(self.engine.close)
        attempt(self.deadlines.close)
        self._extensions.clear()
