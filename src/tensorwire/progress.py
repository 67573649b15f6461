"""How tensorwire waits without spinning a core, and where notifications queue.

Waiting. Progress itself belongs to the backends (NIXL's UCX progress thread sleeps on the worker's
event fd). A waiter polls ``ready()``: back to back for a short spin (a 4 KiB transfer completes in
microseconds), then sleeping between polls for a growing fraction of the time already waited, so a long
transfer costs a few percent of a core and finishes at most ~3% late, never past ``max_sleep``.

Notifications. A backend delivers notifications to exactly one consumer (NIXL's ``get_new_notifs``
consumes them); the ``Inbox`` is that consumer and queues them per sender, in arrival order.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from .config import Config
from .errors import WaitTimeoutError

__all__ = ["wait_until", "Inbox"]


def wait_until(ready: Callable[[], bool], timeout_s: float, describe: Callable[[], str], config: Config) -> None:
    """Returns once ``ready()`` is true; raises ``WaitTimeoutError`` after ``timeout_s``. Blocks the CPU
    thread (sleeping), never the GPU."""
    if ready():
        return
    start = time.perf_counter()
    spin_end = start + config.spin_us * 1e-6
    deadline = start + timeout_s
    max_sleep = config.max_sleep_us * 1e-6
    while True:
        if ready():
            return
        now = time.perf_counter()
        if now >= deadline:
            raise WaitTimeoutError(f"{describe()}: not done after {timeout_s:.3g}s; pass a larger timeout= or check the peer")
        if now >= spin_end:
            time.sleep(min(max_sleep, (now - start) / 32, deadline - now))


class Inbox:
    """Per-sender FIFO of notification messages, filled by polling one backend."""

    def __init__(self, poll: Callable[[], list[tuple[int, bytes]]]) -> None:
        self._poll = poll
        self._queues: dict[int, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def pump(self) -> None:
        """Move newly arrived notifications into the per-sender queues."""
        with self._lock:
            for sender, message in self._poll():
                self._queues[sender].append(message)

    def try_pop(self, sender: int) -> bytes | None:
        with self._lock:
            queue = self._queues.get(sender)
            if queue:
                return queue.popleft()
        self.pump()
        with self._lock:
            queue = self._queues.get(sender)
            return queue.popleft() if queue else None
