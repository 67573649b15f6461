"""``TransferState``: what the threads that touch one ``Transfer`` share, in one place.

One user thread drives a transfer (``post`` / ``status`` / ``wait`` / ``close``), but three more threads act on
it: the *progress* thread (publishes CPU posts' completions for streams and serves doorbells:
``stream_completion.py``; polls the watches whose failures it keeps), the *deadline* thread (releases a stream
whose wait or ring outlived its timeout) and the *revocation* thread (fails transfers to memory its owner
deregistered: ``revocation.py``; the user thread does the same to its own transfers when it deregisters memory
they reach). Every field they share is here, with who writes it and under which lock:

================  =====================================  ================================  ======================
field             written by                             read by                           lock
================  =====================================  ================================  ======================
``state``         user                                   user, deadline                    none (one writer)
``posts``         user                                   user, progress, deadline          none (one writer)
``post_call``     user (prepare, close); cleared with    user (the hot path)               ``lock`` for clearing
                  ``stuck``
``stuck``         deadline (a ring timed out),           every thread                      ``lock`` for writing
                  revocation (or user, own memory)
``posting``       user (around the backend's post call)  revocation (``quiet``)            none (see below)
errors            progress, deadline                     user (``take_error``)             ``lock``
closing events    user (``close``)                       progress (``drained``)            none (set once)
================  =====================================  ================================  ======================

Why the hot path takes no lock: ``state`` and ``posts`` have one writer, the user thread, so its own reads
need none, and a reader on another thread sees a whole value (one reference store under the GIL): ``posts``
is counted up before a post is made and ``state`` is stored after it, so the deadline thread never takes an
earlier post for a later one. ``post_call`` is read without the lock: a revocation stores ``stuck`` and clears
``post_call`` together under ``lock``, and every later post takes the slow path, which raises ``stuck``. A post
that read ``post_call`` just before may still be on its way into the backend: the CPU post raises ``posting``
before it reads ``post_call`` (the second read, the one it calls) and lowers it after the call returned, and a
revocation clears ``post_call`` before it reads ``posting`` (``quiet``). Under the GIL each is one store or
load, in program order, so either the revocation sees ``posting`` raised (and waits for the call to return), or
the post reads ``post_call`` cleared (and raises): no post reaches the backend after ``quiet()`` said so.

``lock`` (re-entrant) also serialises the stores into the transfer's pinned stream words
(``stream_completion.py``), so a release and the failure it reports are one step: nobody sees the word
stored without the error kept.

Errors raised on other threads are queued and raised by the user thread's next calls, one per call, oldest
first: ``fail`` appends under ``lock``, ``take_error`` pops under it, so an error kept between a read and a
clear is never lost. At most ``MAX_KEPT_ERRORS`` are kept (a graph replayed against a dead peer fails every
ring and calls no Python); the rest are counted and reported by one last ``TransferError``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from .backends.base import Status
from .errors import TransferError

__all__ = ["TransferState", "MAX_KEPT_ERRORS"]

def without_frames(error: BaseException) -> BaseException:
    """``error`` with the tracebacks of it and of what caused it dropped, returned. A kept error raised again later
    needs its message, not the frames it passed through: they hold the transfer, its request and the backend's
    agent, a cycle that outlived ``close`` until a gc pass."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return error


MAX_KEPT_ERRORS = 64  # failures from other threads kept for the user's next calls; later ones are counted


class TransferState:
    """The cross-thread state of one transfer (see the module docstring for who writes what).

    ``state`` (``Status`` of the last post, None before the first), ``posts`` (CPU posts so far: the sequence
    number stream waits compare against) and ``post_call`` (the bound CPU post, None once closed, empty,
    revoked or failed for good) are plain attributes; the rest is reached through methods."""

    __slots__ = ("lock", "state", "posts", "post_call", "posting", "_stuck", "_errors", "_errors_not_kept",
                 "_closing")

    def __init__(self, post_call: Callable[[], Any] | None) -> None:
        self.lock = threading.RLock()
        self.state: Status | None = None
        self.posts = 0
        self.post_call = post_call
        self.posting = False  # a CPU post is between reading post_call and the backend call's return
        self._stuck: Exception | None = None
        self._errors: collections.deque[Exception] = collections.deque()
        self._errors_not_kept = 0
        self._closing: list | None = None

    # --- failures from other threads ------------------------------------------------------------
    def fail(self, error: Exception) -> None:
        """Keep ``error`` (seen on the progress or deadline thread) for the user thread's next call, without its
        frames (``without_frames``). Any thread."""
        without_frames(error)
        with self.lock:
            if len(self._errors) < MAX_KEPT_ERRORS:
                self._errors.append(error)
            else:
                self._errors_not_kept += 1

    def take_error(self) -> Exception | None:
        """The oldest kept failure, removed; None if there is none. The user thread's calls raise it."""
        if not self._errors and not self._errors_not_kept:  # the common case, without the lock: an error kept
            return None  # concurrently stays queued for the next call
        with self.lock:
            if self._errors:
                return self._errors.popleft()
            if not self._errors_not_kept:
                return None
            count, self._errors_not_kept = self._errors_not_kept, 0
        return TransferError(f"{count} more failure(s) of this transfer on the progress or deadline thread were "
                             f"not kept (the first {MAX_KEPT_ERRORS} were raised one per call); close it and prepare "
                             "a new one")

    # --- failed for good ------------------------------------------------------------------------
    @property
    def stuck(self) -> Exception | None:
        """Why the transfer is failed for good (every later call raises it), or None. Any thread, no lock."""
        return self._stuck

    def fail_for_good(self, error: Exception) -> bool:
        """Fail the transfer for good with ``error`` unless it is already (then False). Clears ``post_call``: the
        CPU post's hot path then takes the slow path, which raises. Any thread; callers may hold ``lock``."""
        with self.lock:
            if self._stuck is not None:
                return False
            self._stuck, self.post_call = without_frames(error), None
            return True

    def revoke(self, error: Exception) -> None:
        """The peer deregistered the memory this transfer reaches: fail it for good with ``error``, also when it
        already failed otherwise (what the memory's owner did is the reason that lasts). The revocation thread, or
        the user thread deregistering memory its own transfers reach."""
        with self.lock:
            self._stuck, self.post_call = without_frames(error), None

    # --- closing --------------------------------------------------------------------------------
    def close_after(self, events: list) -> None:
        """``close()`` recorded ``events`` on the streams that could still ring or wait: the request is released
        once they have run. User thread; stored once (an unrecorded event would read as done)."""
        self._closing = events

    def drained(self) -> bool:
        """Closed, and the GPU work that could still ring this transfer's doorbell has run. Progress thread."""
        closing = self._closing
        return closing is not None and all(event.query() for event in closing)
