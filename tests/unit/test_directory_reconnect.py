"""A fleet member whose directory was lost connects again: the heartbeat at most once per half liveness bound,
never waiting; a directory call (which may take up to its bound) also right after a failed attempt, or takes the
outcome of the attempt under way. The decision alone, with the connection stood in for (the real directory
restarts and etcd outages run in tests/multiproc/test_fleet.py and test_fleet_etcd.py)."""

from __future__ import annotations

import threading
import time

from tensorwire.meeting.fleet import Fleet


def _member(attempts: list, connects: bool = True, attempt_s: float = 0.0) -> Fleet:
    member = object.__new__(Fleet)  # only the fields _reconnected reads
    member._owns_store, member.liveness_s = True, 2.0
    member._reconnecting, member._lost = threading.Lock(), "lost the directory (stood in)"
    member._next_reconnect = time.monotonic() + 60.0  # an attempt failed just now

    def connect_again(now: float) -> bool:
        attempts.append(threading.current_thread().name)
        time.sleep(attempt_s)
        member._next_reconnect = now + member.liveness_s / 2
        if connects:
            member._lost = None
        return connects

    member._connect_again = connect_again
    return member


def test_a_directory_call_right_after_a_failed_attempt_tries_again():
    """The directory came back just after the heartbeat's last attempt failed (an etcd cluster electing its
    leader): a call must connect, not fail on that attempt's memory (a member's close() failed so in CI)."""
    attempts: list = []
    member = _member(attempts)
    assert member._reconnected() is True and member._lost is None
    assert len(attempts) == 1


def test_the_heartbeat_keeps_to_its_rate():
    attempts: list = []
    member = _member(attempts)
    assert member._reconnected(waiting=False) is False and attempts == []
    member._next_reconnect = 0.0
    assert member._reconnected(waiting=False) is True and len(attempts) == 1


def test_a_call_takes_the_outcome_of_the_attempt_under_way():
    """One attempt at a time: a call that finds the heartbeat connecting waits for it (within the bound) and
    reports its outcome instead of making a second one."""
    attempts: list = []
    member = _member(attempts, attempt_s=0.3)
    member._next_reconnect = 0.0
    heartbeat = threading.Thread(target=member._reconnected, kwargs={"waiting": False}, name="heartbeat")
    heartbeat.start()
    while not attempts:
        time.sleep(0.001)
    assert member._reconnected() is True
    heartbeat.join(5)
    assert attempts == ["heartbeat"]


def test_a_directory_still_down_fails_the_call():
    attempts: list = []
    member = _member(attempts, connects=False)
    assert member._reconnected() is False and member._lost is not None and len(attempts) == 1
