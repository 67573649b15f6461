"""How tensorwire waits without spinning a core, and where notifications queue.

Waiting. Progress itself belongs to the backends (NIXL's UCX progress thread sleeps on the worker's
event fd). A waiter polls ``ready()``: back to back for a short spin (a 4 KiB transfer completes in
microseconds), then sleeping between polls for a growing fraction of the time already waited, so a long
transfer costs a few percent of a core and finishes at most ~3% late, never past ``max_sleep``.
While it sleeps, the waiting thread's timer slack is 1 µs instead of Linux's default 50 µs: with the
default, every short sleep overshoots by ~50 µs (measured: a 10 µs ``time.sleep`` took ~90 µs on a 2-core VM,
~30 µs with 1 µs slack), which alone made a 64 MiB GPU transfer look 30% slower than its copy.

Deadlines. A GPU stream waiting on a word the CPU stores is released when its timeout passes by its own
thread (``Deadlines``), not by the progress thread: the progress thread can be stuck inside a backend call
whose progress waits for that very stream (UCX unpacking a staged transfer into GPU memory, see
docs/architecture.md), and only the release unblocks it.

Notifications. A backend delivers notifications to exactly one consumer (NIXL's ``get_new_notifs``
consumes them); the ``Inbox`` is that consumer and queues them per sender, in arrival order.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import sys
import threading
import time
from collections.abc import Callable, Iterator

from .config import Config
from .deadlines import Deadlines, warn_from_progress_thread
from .errors import WaitTimeoutError

__all__ = ["wait_until", "Inbox", "Deadlines", "warn_from_progress_thread"]


def wait_until(ready: Callable[[], bool], timeout_s: float, describe: Callable[[], str], config: Config,
               alive: Callable[[], None] | None = None) -> None:
    """Returns once ``ready()`` is true; raises ``WaitTimeoutError`` after ``timeout_s``. Blocks the CPU
    thread (sleeping), never the GPU. ``alive()``, called between sleeps (not while spinning), raises when
    what is waited for can no longer come (a peer that is gone: ``PeerLostError``)."""
    if ready():
        return
    start = time.perf_counter()
    spin_end = start + config.spin_us * 1e-6
    deadline = start + timeout_s
    max_sleep = config.max_sleep_us * 1e-6

    def now_before_deadline() -> float:
        now = time.perf_counter()
        if now >= deadline:
            raise WaitTimeoutError(f"{describe()}: not done after {timeout_s:.3g}s; pass a larger timeout= or check "
                                   "the peer")
        return now

    while not ready():
        if now_before_deadline() >= spin_end:
            break
    else:
        return
    with fine_timer_slack():  # only waits that got past the spin pay the two system calls
        while not ready():
            now = now_before_deadline()
            if alive is not None:
                alive()
            time.sleep(min(max_sleep, (now - start) / 32, deadline - now))


_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_FINE_SLACK_NS = 1000


def _prctl():
    """libc's ``prctl`` on Linux, else None (elsewhere sleeps keep the platform's precision)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


_PRCTL = _prctl()


@contextlib.contextmanager
def fine_timer_slack() -> Iterator[None]:
    """Sleeps of the calling thread wake within ~1 µs of their deadline inside the block (Linux timer slack,
    a per-thread setting); the thread's previous slack is restored on exit."""
    if _PRCTL is None:
        yield
        return
    previous = _PRCTL(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    _PRCTL(_PR_SET_TIMERSLACK, _FINE_SLACK_NS, 0, 0, 0)
    try:
        yield
    finally:
        if previous > 0:
            _PRCTL(_PR_SET_TIMERSLACK, previous, 0, 0, 0)


class Inbox:
    """Per-sender FIFOs of notification messages, filled by polling the message channels (``poll``).

    Messages are routed by prefix into channels: a layer above (e.g. ``tensorwire.moe``, prefix
    ``b"twmoe"``) opens its own channel so its traffic never mixes with the user's, which lands in the
    default channel ``b""`` that ``wait_notification`` reads.
    """

    def __init__(self, poll: Callable[[], list[tuple[int, bytes]]]) -> None:
        self._poll = poll
        self._channels: dict[bytes, dict[int, collections.deque[bytes]]] = {
            b"": collections.defaultdict(collections.deque)
        }
        self._lock = threading.Lock()
        self._handlers: dict[bytes, Callable[[int, bytes], None]] = {}

    def open_channel(self, prefix: bytes, handler: Callable[[int, bytes], None] | None = None) -> None:
        """Route messages that start with ``prefix`` to their own channel (idempotent), or, with ``handler``, to
        ``handler(sender, message)`` as they arrive (called by whichever thread pumps, outside the lock)."""
        with self._lock:
            self._channels.setdefault(prefix, collections.defaultdict(collections.deque))
            if handler is not None:
                self._handlers[prefix] = handler

    def pump(self) -> None:
        """Move newly arrived notifications into their channel's per-sender queues."""
        handled = []
        with self._lock:
            for sender, message in self._poll():
                channel = next((p for p in self._channels if p and message.startswith(p)), b"")
                if channel in self._handlers:
                    handled.append((self._handlers[channel], sender, message))
                else:
                    self._channels[channel][sender].append(message)
        for handler, sender, message in handled:
            handler(sender, message)

    def push(self, sender: int, message: bytes) -> None:
        with self._lock:
            channel = next((p for p in self._channels if p and message.startswith(p)), b"")
            self._channels[channel][sender].append(message)

    def take_all(self, channel: bytes = b"") -> list[tuple[int, bytes]]:
        """Every queued message of ``channel`` from any sender, as ``(sender, message)``, each sender's in
        order, after polling the backend once."""
        self.pump()
        with self._lock:
            taken = [(sender, m) for sender, queue in self._channels[channel].items() for m in queue]
            for queue in self._channels[channel].values():
                queue.clear()
        return taken

    def try_pop(self, sender: int, channel: bytes = b"") -> bytes | None:
        """The oldest message from ``sender`` in ``channel``, polling the backend once if none is queued."""
        with self._lock:
            queue = self._channels[channel].get(sender)
            if queue:
                return queue.popleft()
        self.pump()
        with self._lock:
            queue = self._channels[channel].get(sender)
            return queue.popleft() if queue else None


class ProgressEngine:
    """A background thread for completions nobody waits on with the CPU.

    Work is a ``watch``: a callable polled until it returns True (it performs its own completion action,
    e.g. storing a flag the GPU waits on, or sending a notification once a copy's event fired). The
    thread sleeps on a condition variable while no watch exists, so an idle communicator costs nothing;
    with watches it polls back to back after a completion and backs off to ``max_sleep`` while nothing
    moves. It never calls CUDA APIs that a captured stream could block (only event queries and host
    memory stores).
    """

    def __init__(self, config: Config) -> None:
        self._max_sleep = config.max_sleep_us * 1e-6
        self._watches: list[Callable[[], bool]] = []
        self._on_error: dict[Callable[[], bool], Callable[[Exception], None]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, poll: Callable[[], bool], on_error: Callable[[Exception], None] | None = None) -> None:
        """Poll ``poll()`` from the progress thread until it returns True. If it raises, the watch ends and
        the exception goes to ``on_error`` (its owner raises it from its next call); without an owner it is
        warned about (``TensorwireWarning``). Never raises itself."""
        with self._cond:
            if on_error is not None:
                self._on_error[poll] = on_error
            self._watches.append(poll)
            self._start_locked()
            self._cond.notify()

    def start(self) -> None:
        """Start the thread now (it sleeps until the first watch), so that a latency-sensitive first
        ``watch`` (``wait(stream=)``) does not pay for ``Thread.start``, which waits for the new thread."""
        with self._cond:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="tensorwire-progress", daemon=True)
            self._thread.start()

    def still_watched(self, polls: list[Callable[[], bool]]) -> list[Callable[[], bool]]:
        """Those of ``polls`` still being polled (one lock acquisition for all of them)."""
        with self._cond:
            watched = set(self._watches)
        return [poll for poll in polls if poll in watched]

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._watches.clear()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _poll_once(self, poll: Callable[[], bool]) -> bool:
        """One call of ``poll``: True once its watch is over (done, or failed and handed to its owner)."""
        try:
            return poll()
        except Exception as e:  # noqa: BLE001 - handed to the watch's owner
            handler = self._on_error.get(poll)
            if handler is not None:
                handler(e)
            else:  # nobody will raise it: say so now
                warn_from_progress_thread(f"tensorwire: the progress thread's work failed: {e!r}")
            return True

    def _run(self) -> None:
        with fine_timer_slack():  # its back-off sleeps are short: the default slack would add ~50 µs to each
            self._poll_until_stopped()

    def _poll_until_stopped(self) -> None:
        idle_since = time.perf_counter()
        while True:
            with self._cond:
                while not self._watches and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
            with self._cond:
                watches = list(self._watches)
            finished = [poll for poll in watches if self._poll_once(poll)]
            if finished:
                with self._cond:
                    for poll in finished:
                        if poll in self._watches:
                            self._watches.remove(poll)
                        self._on_error.pop(poll, None)
            now = time.perf_counter()
            if finished:
                idle_since = now
                continue
            time.sleep(min(self._max_sleep, max(2e-5, (now - idle_since) / 32)))

