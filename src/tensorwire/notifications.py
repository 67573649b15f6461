"""Notifications: the message a WRITE's ``notify=`` delivers after its data, and the waits for it.

Sending. A transport with a message channel (NIXL) sends a transfer's notification itself once the data is in
place; the others hand theirs to the ``Outbox`` (``outbox.py``).

Receiving. The ``Inbox`` (``progress.py``) queues what every message channel delivered, per sender.
``Notifications.wait`` takes the next one, sleeping. ``Notifications.wait_on_stream`` makes a GPU stream wait
instead: the progress thread counts each sender's arrivals into a pinned host word, and the stream waits until
the word reaches the number of notifications awaited from that sender so far (``cuStreamWaitValue32``). A wait
nobody answers within its timeout, or whose sender is gone, is released by storing that number (the deadline
thread, or the progress thread): the stream moves on, the error is kept and raised by the next
``wait_notification``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from . import cuda
from .deadlines import warn_from_progress_thread
from .errors import InvalidArgumentError, PeerLostError, WaitTimeoutError
from .progress import wait_until
from .runtime import Runtime

__all__ = ["Notifications"]


class Notifications:
    """``wait_notification``'s CPU and stream forms for one communicator (at most ``senders`` senders waited on
    with a stream: a launcher's world size, or a cap in a fleet, whose ranks are not dense)."""

    def __init__(self, runtime: Runtime, senders: int) -> None:
        self._runtime = runtime
        self._inbox = runtime.inbox
        self._senders = senders
        self._words: cuda.HostWords | None = None  # per-sender arrival counters the GPU waits on, by slot
        self._slots: dict[int, int] = {}  # sender rank -> its word (assigned at its first stream wait)
        self._awaited: collections.Counter = collections.Counter()  # stream waits enqueued per sender
        self._delivered: collections.Counter = collections.Counter()  # arrivals counted into the words per sender
        self._lock = threading.Lock()  # arrivals (progress thread) vs. timeouts (deadline thread)
        self._errors: collections.deque = collections.deque()  # stream waits' failures, for the next call

    def raise_kept_error(self) -> None:
        """Raise the oldest failure of a stream wait (a timeout, a lost sender), if any."""
        if self._errors:
            raise self._errors.popleft()

    def wait(self, from_rank: int, timeout_s: float) -> bytes:
        """The next message from ``from_rank``. Blocks (sleeping); ``WaitTimeoutError`` after ``timeout_s``,
        ``PeerLostError`` once the sender is gone."""
        message: list[bytes] = []

        def arrived() -> bool:
            m = self._inbox.try_pop(from_rank)
            if m is not None:
                message.append(m)
            return bool(message)

        runtime = self._runtime
        wait_until(arrived, timeout_s, lambda: f"wait_notification: nothing from rank {from_rank}", runtime.config,
                   runtime.alive(from_rank, f"wait_notification(from_rank={from_rank})"))
        return message[0]

    def wait_on_stream(self, from_rank: int, stream: Any, timeout_s: float) -> None:
        """Make ``stream`` wait for the next message from ``from_rank`` (consumed). Returns at once."""
        cuda.refuse_legacy_default_stream(stream, f"wait_notification(from_rank={from_rank}, stream=)")
        if self._words is None:
            self._words = cuda.HostWords(self._senders)
        if from_rank not in self._slots:
            if len(self._slots) >= self._senders:
                raise InvalidArgumentError(
                    f"wait_notification(stream=): {self._senders} senders are waited on with streams already, the "
                    f"most this communicator counts; wait for rank {from_rank} on the CPU (without stream=)")
            self._slots[from_rank] = len(self._slots)
        self._awaited[from_rank] += 1
        target = self._awaited[from_rank]
        deadlines = self._runtime.deadlines
        key = ("notification", from_rank, target)
        deadlines.arm(key, time.monotonic() + timeout_s, lambda: self._release(from_rank, target, WaitTimeoutError(
            f"wait_notification(stream=): nothing from rank {from_rank} within {timeout_s:.3g}s; the stream was "
            "released and what it read since is not valid; check that rank")))
        cuda.stream_wait_value(stream, self._words.addr(self._slots[from_rank]), target)  # before waking progress
        self._runtime.engine.watch(lambda: self._deliver(from_rank, target, key), on_error=self._keep)

    def _deliver(self, from_rank: int, target: int, key: tuple) -> bool:
        """Progress thread: count ``from_rank``'s arrivals into its word up to ``target``."""
        delivered, words = self._delivered, self._words
        while delivered[from_rank] < target:
            if self._inbox.try_pop(from_rank) is None:
                reason = self._runtime.peer_lost(from_rank)
                if reason is None:
                    return False
                self._runtime.deadlines.disarm(key)  # it will not come: release the stream now, not at the timeout
                self._release(from_rank, target, PeerLostError(
                    f"wait_notification(stream=): rank {from_rank} is gone ({reason}); the stream was released and "
                    "what it read since is not valid"))
                return True
            with self._lock:
                if delivered[from_rank] < target:  # else its deadline released it: this one came late
                    delivered[from_rank] += 1
                    words.values[self._slots[from_rank]] = delivered[from_rank]
        self._runtime.deadlines.disarm(key)
        return True

    def _release(self, from_rank: int, target: int, error: Exception) -> None:
        """Let the stream waiting for ``from_rank``'s ``target``-th message go, and keep ``error``."""
        with self._lock:
            if self._delivered[from_rank] >= target:
                return
            self._delivered[from_rank] = target  # what arrives late counts toward a later wait
            self._words.values[self._slots[from_rank]] = target
        self._keep(error)

    def _keep(self, error: Exception) -> None:
        self._errors.append(error)
        warn_from_progress_thread(f"tensorwire: {error}")

    def release_stream_waits(self) -> int:
        """At close: store every awaited count (no stream may wait for a thread that stops); how many senders'
        waits were still pending."""
        pending = 0
        if self._words is not None:
            for rank, awaited in self._awaited.items():
                slot = self._slots[rank]
                if self._words.values[slot] != awaited:
                    pending += 1
                    self._words.values[slot] = awaited
        return pending
