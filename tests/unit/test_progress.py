"""Waiting: the per-sender notification inbox, bounded waits, timer slack, warnings from the progress
thread, and the deadline thread."""

from __future__ import annotations

import sys

import pytest

import tensorwire as tw
from tensorwire import config
from tensorwire.progress import Inbox, wait_until


# --- progress helpers ----------------------------------------------------------------------------
def test_inbox_queues_per_sender_in_order():
    """The Inbox keeps one FIFO per sender; popping one sender never consumes another's messages."""
    batches = [[(2, b"2a"), (1, b"1a"), (2, b"2b")], [(1, b"1b")], []]

    def poll():
        return batches.pop(0) if batches else []

    inbox = Inbox(poll)
    assert inbox.try_pop(2) == b"2a"
    assert inbox.try_pop(2) == b"2b"
    assert inbox.try_pop(2) is None
    assert inbox.try_pop(1) == b"1a"
    assert inbox.try_pop(1) == b"1b"
    assert inbox.try_pop(1) is None
    assert inbox.try_pop(3) is None


def test_wait_until_times_out_with_description():
    """wait_until returns as soon as ready() holds and raises WaitTimeoutError with the description otherwise."""
    cfg = config.Config(timeout_s=1.0, progress_wakeup_ms=10.0, spin_us=50.0, max_sleep_us=1000.0)
    calls = []
    wait_until(lambda: calls.append(1) or len(calls) >= 3, 1.0, lambda: "never", cfg)
    assert len(calls) == 3
    with pytest.raises(tw.WaitTimeoutError, match="the thing I waited for"):
        wait_until(lambda: False, 0.05, lambda: "the thing I waited for", cfg)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux thread setting")
def test_a_sleeping_wait_tightens_the_thread_timer_slack_and_restores_it():
    """Past its spin, wait_until sleeps with 1 µs timer slack (the default 50 µs made each short sleep ~50 µs
    late); the caller's thread gets its own slack back afterwards, also when the wait times out."""
    from tensorwire import progress

    def slack() -> int:
        return progress._PRCTL(progress._PR_GET_TIMERSLACK, 0, 0, 0, 0)

    cfg = config.Config(timeout_s=1.0, progress_wakeup_ms=10.0, spin_us=0.0, max_sleep_us=1000.0)
    before, seen = slack(), []
    wait_until(lambda: seen.append(slack()) or len(seen) >= 3, 1.0, lambda: "x", cfg)
    assert seen[0] == before and seen[-1] == progress._FINE_SLACK_NS, seen  # the first poll runs before any sleep
    assert slack() == before
    with pytest.raises(tw.WaitTimeoutError):
        wait_until(lambda: False, 0.01, lambda: "x", cfg)
    assert slack() == before


def test_a_progress_thread_warning_never_raises():
    """Warnings the progress thread issues (a stream released by a timeout) must not raise where a filter turns
    warnings into errors: the raise would skip the release after it, or end the thread."""
    import warnings

    from tensorwire.progress import warn_from_progress_thread

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_from_progress_thread("released")
    assert [str(w.message) for w in caught] == ["released"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_from_progress_thread("released")  # does not raise



def test_deadlines_run_each_action_once_at_its_time_and_sleep_otherwise():
    """An armed action runs once, not before its deadline; arming an armed key keeps the earlier deadline and
    its action; disarming forgets it; an action that raises warns and spares the others; a deadline beyond
    what a thread can sleep does not end the thread; the thread does not wake while nothing is due, nor when a
    later deadline than the one it sleeps until is armed."""
    import threading
    import time

    from tensorwire.progress import Deadlines

    deadlines = Deadlines()
    ran: list[tuple[str, float]] = []
    done = threading.Event()

    def action(name: str):
        return lambda: ran.append((name, time.monotonic()))

    def boom():
        raise RuntimeError("boom")

    start = time.monotonic()
    try:
        deadlines.arm("huge", start + 1e10, action("huge"))  # beyond threading.TIMEOUT_MAX
        deadlines.arm("a", start + 0.10, action("a-later"))
        deadlines.arm("a", start + 0.05, action("a"))  # earlier: replaces
        deadlines.arm("b", start + 0.06, action("b"))
        deadlines.arm("b", start + 0.20, action("b-later"))  # later: the first stays
        deadlines.arm("c", start + 0.02, action("c"))
        deadlines.disarm("c")
        deadlines.arm("boom", start + 0.01, boom)
        deadlines.arm("last", start + 0.15, done.set)
        with pytest.warns(RuntimeWarning, match="a timeout action failed: RuntimeError: boom"):
            assert done.wait(5), "the last action never ran: the thread ended or overslept"
        assert [name for name, _ in ran] == ["a", "b"], ran
        assert ran[0][1] >= start + 0.05 and ran[1][1] >= start + 0.06, (start, ran)
        time.sleep(0.05)
        woken = deadlines.wakeups
        deadlines.arm("far", time.monotonic() + 100, action("far"))  # earlier than "huge": wakes it once
        time.sleep(0.05)
        woken_after_far = deadlines.wakeups
        deadlines.arm("farther", time.monotonic() + 200, action("farther"))  # later than "far": no wake
        time.sleep(0.1)
        assert woken_after_far == woken + 1 and deadlines.wakeups == woken_after_far, (woken, woken_after_far,
                                                                                      deadlines.wakeups)
    finally:
        deadlines.close()
    assert not deadlines._thread.is_alive() and [name for name, _ in ran] == ["a", "b"]
