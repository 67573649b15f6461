"""``Outbox``: the notifications of the transports without a message channel, sent in order after their copy.

A transport with a message channel (``Capabilities.message_channel``: NIXL) sends a transfer's notification
itself once the data is in place. The others (``cuda_ipc``, ``shm``, ``local``, the tests' ``fake``) hand theirs
here: it is sent through the messenger (the first remote message channel; into this rank's own inbox for itself)
once the copy completed, and after every message queued to that peer before it, so a peer never sees a
notification ahead of the data or out of order.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from .deadlines import warn_from_progress_thread
from .progress import ProgressEngine

__all__ = ["Outbox"]


class Outbox:
    """Notifications of copying transports, sent in order once their copy completed. Never blocks: the
    progress thread drains what cannot be sent at once."""

    def __init__(self, engine: ProgressEngine, send: Callable[[int, bytes], None]) -> None:
        self._engine = engine
        self._send = send  # (peer, message): through NIXL, or into this rank's inbox
        self._queues: dict[int, collections.deque] = {}  # per peer: (done, message) in posting order
        self._lock = threading.Lock()

    def send_after(self, peer: int, message: bytes, done: Callable[[], bool]) -> None:
        """Deliver ``message`` to ``peer`` once ``done()`` (its copy completed) and after every message queued
        to ``peer`` before it: a later copy may complete first, its message must not."""
        with self._lock:
            queue = self._queues.setdefault(peer, collections.deque())
            if not queue and done():
                self._send(peer, message)
                return
            queue.append((done, message))
            if len(queue) > 1:
                return  # the watch started for the first queued message drains this one too
        self._engine.watch(lambda: self._drain(peer))

    def _drain(self, peer: int) -> bool:
        with self._lock:
            queue = self._queues[peer]
            while queue:
                done, message = queue[0]
                try:
                    if not done():
                        break
                    queue.popleft()
                    self._send(peer, message)
                except Exception as e:  # noqa: BLE001 - one lost message must not strand the ones behind it
                    if queue and queue[0][1] is message:
                        queue.popleft()
                    warn_from_progress_thread(
                        f"tensorwire: a notification could not be sent and was dropped ({e}); the peer's "
                        "wait_notification for it will time out: check that the peer is alive and reachable "
                        "('tensorwire doctor')")
            return not queue
