"""TransferState: what a transfer's threads share. A failure kept by another thread is never lost between a read
and a clear; failing for good is first-wins (a revocation always wins) and clears the bound post; closing is
drained once the recorded events have run."""

from __future__ import annotations

import re
import threading

import pytest

from tensorwire.backends.base import Status
from tensorwire.errors import RevokedError, TransferError, WaitTimeoutError
from tensorwire.transfer_state import MAX_KEPT_ERRORS, TransferState


def _delivered(error: Exception) -> int:
    """How many failures one taken error stands for (the summary of those not kept counts them)."""
    match = re.match(r"(\d+) more failure", str(error))
    return int(match.group(1)) if match else 1


def test_a_failure_kept_by_another_thread_while_the_user_takes_errors_is_never_lost():
    state = TransferState(post_call=None)
    fails, rounds = 4, 20_000
    started = threading.Barrier(fails + 1)

    def hammer(thread: int) -> None:
        started.wait()
        for i in range(rounds):
            state.fail(TransferError(f"thread {thread} failure {i}"))

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(fails)]
    for thread in threads:
        thread.start()
    started.wait()
    delivered = 0
    while any(t.is_alive() for t in threads):
        error = state.take_error()  # read and clear, racing the hammering threads
        if error is not None:
            delivered += _delivered(error)
    for thread in threads:
        thread.join()
    while (error := state.take_error()) is not None:
        delivered += _delivered(error)
    assert delivered == fails * rounds


def test_kept_failures_come_out_oldest_first_one_per_take_and_the_ones_not_kept_are_counted():
    state = TransferState(post_call=None)
    assert state.take_error() is None
    for i in range(MAX_KEPT_ERRORS + 5):
        state.fail(TransferError(f"failure {i}"))
    taken = [str(state.take_error()) for _ in range(MAX_KEPT_ERRORS)]
    assert taken == [f"failure {i}" for i in range(MAX_KEPT_ERRORS)]
    summary = state.take_error()
    assert isinstance(summary, TransferError) and str(summary).startswith("5 more failure(s)")
    assert state.take_error() is None


def test_failing_for_good_is_first_wins_clears_the_post_and_a_revocation_overrides_it():
    state = TransferState(post_call=lambda: Status.DONE)
    assert state.stuck is None and state.post_call is not None
    timed_out = WaitTimeoutError("ring timed out")
    assert state.fail_for_good(timed_out)
    assert state.stuck is timed_out and state.post_call is None
    assert not state.fail_for_good(TransferError("later"))
    assert state.stuck is timed_out
    revoked = RevokedError("revoked")
    state.revoke(revoked)
    assert state.stuck is revoked and state.post_call is None
    assert state.take_error() is None  # failed for good is not a kept failure: it is raised by every call


def test_fail_for_good_may_be_called_holding_the_lock_the_stream_words_are_stored_under():
    state = TransferState(post_call=None)
    with state.lock:  # what stream_completion does: the release and its error are one step
        assert state.fail_for_good(WaitTimeoutError("ring"))
        state.fail(TransferError("kept"))
    assert str(state.take_error()) == "kept"


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_drained_once_closed_and_every_recorded_event_has_run():
    state = TransferState(post_call=None)
    assert not state.drained()  # not closed
    events = [_Event(True), _Event(False)]
    state.close_after(events)
    assert not state.drained()
    events[1].done = True
    assert state.drained()


def test_the_state_holds_only_its_documented_fields():
    state = TransferState(post_call=None)
    with pytest.raises(AttributeError):
        state.async_error = None  # slots: no field can be added beside the documented ones by mistake
