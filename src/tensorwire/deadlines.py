"""``Deadlines``: actions that run at a time, on one thread of their own that sleeps until the earliest one;
``CallThread``: calls made on a thread of their own, so that the caller can stop waiting for one.

Used where a call or a wait must end on time even when the thread that would end it is stuck: the timeouts
that release GPU stream waits (``transfer``, ``communicator``) and the bound on store calls that torch's
client does not bound itself (``bootstrap``). Below everything that uses it; imports nothing of tensorwire.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

from .errors import TensorwireWarning

__all__ = ["CallThread", "Deadlines", "warn_from_progress_thread"]


def warn_from_progress_thread(message: str) -> None:
    """``warnings.warn(message, TensorwireWarning)`` for work a background thread (progress, deadlines) did. Never
    raises: a filter that turns warnings into errors must not stop the thread or the work after the warning (the
    error it reports also reaches its owner's next call)."""
    try:
        warnings.warn(message, TensorwireWarning, stacklevel=2)
    except Exception:  # noqa: BLE001 - an "error" filter raised the warning
        pass


class Deadlines:
    """Actions that run at a time, on their own thread: the timeouts that release GPU stream waits.

    An action only stores host memory and records an error: no CUDA call, no backend call, never blocking,
    so it runs on time even while the progress thread is stuck in a backend call. Each outstanding wait has
    its own key, disarmed when the wait completes, so the table holds only waits in flight; arming a key
    that is armed already keeps the earlier deadline (two stream waits for one completion: the shorter
    timeout bounds both). The thread sleeps until the earliest deadline, and indefinitely while none is
    armed, so an idle communicator costs nothing; arming a later deadline does not wake it. Entries are
    dropped outside the lock: a dropped action may hold the last reference to a transfer, whose finalizer
    must not run under it.
    """

    _LONGEST_SLEEP_S = 86400.0  # below threading.TIMEOUT_MAX: a huge timeout must not end the thread

    def __init__(self) -> None:
        self._due: dict[Hashable, tuple[float, Callable[[], None]]] = {}
        self._cond = threading.Condition()
        self._wakes_at = math.inf  # when the sleeping thread wakes by itself (inf: only when notified)
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.wakeups = 0  # times the thread woke up (it should only when something is due)

    def start(self) -> None:
        """Start the thread now, so that a latency-sensitive first ``arm`` does not pay ``Thread.start``."""
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="tensorwire-deadlines", daemon=True)
                self._thread.start()

    def arm(self, key: Hashable, deadline: float, action: Callable[[], None]) -> None:
        """Run ``action()`` at ``deadline`` (``time.monotonic()`` seconds) unless ``key`` is disarmed first
        (if ``key`` is armed already, the earlier of the two deadlines and its action stay). Never blocks (one
        lock); does nothing once closed."""
        if self._thread is None:
            self.start()
        with self._cond:
            if self._stopped:
                return
            armed = self._due.get(key)
            if armed is not None and armed[0] <= deadline:
                return
            self._due[key] = (deadline, action)
            if deadline < self._wakes_at:
                self._cond.notify()
        del armed  # outside the lock (see the class docstring)

    def disarm(self, key: Hashable) -> None:
        """Forget ``key``'s action. Not woken for it: a thread sleeping until that deadline wakes then, finds
        nothing due and sleeps on."""
        with self._cond:
            dropped = self._due.pop(key, None)
        del dropped

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            dropped, self._due = self._due, {}
            self._cond.notify()
        del dropped
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                actions = [self._due.pop(key)[1] for key, (deadline, _) in list(self._due.items()) if deadline <= now]
                if not actions:
                    self._wakes_at = min((deadline for deadline, _ in self._due.values()), default=math.inf)
                    self._cond.wait(min(self._wakes_at - now, self._LONGEST_SLEEP_S)
                                    if self._wakes_at != math.inf else None)
                    self._wakes_at = math.inf
                    self.wakeups += 1
                    continue
            for action in actions:
                try:
                    action()
                except Exception as e:  # noqa: BLE001 - one failed action must not stop the others
                    warn_from_progress_thread(f"tensorwire: a timeout action failed: {type(e).__name__}: {e}")
            del actions, action  # outside the lock


class _Call:
    __slots__ = ("fn", "done", "result", "error", "abandoned")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.done = fn, threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False


class CallThread:
    """Calls made on one daemon thread of its own, in order, so that the caller can stop waiting for one after a
    bound (``run``): the way to bound a blocking call that nothing can interrupt.

    The call is abandoned, not cancelled: the thread stays blocked in it, and every later call queues behind it
    (their callers give up at their own bounds). A daemon thread, so a blocked one does not hold the interpreter's
    exit. Idle, the thread sleeps on its queue; started by the first call.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any], bound_s: float) -> Any:
        """``fn()``'s result (or its exception), made on the thread; blocks at most ``bound_s`` seconds, then raises
        ``TimeoutError`` and leaves the call to the thread (a call not begun by then is skipped)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
        call = _Call(fn)
        self._calls.put(call)
        if not call.done.wait(bound_s):
            call.abandoned = True
            if not call.done.is_set():
                raise TimeoutError(f"no answer within {bound_s:.3g}s")
        if call.error is not None:
            raise call.error
        return call.result

    def close(self) -> None:
        """Let the thread end after the call it is in (if any); never blocks."""
        self._calls.put(None)

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            if call.abandoned:
                continue
            try:
                call.result = call.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                call.error = e
            call.done.set()
            del call  # drop the result before sleeping on the queue
