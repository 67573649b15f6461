"""The ``socket`` message channel (where NIXL is not installed): two channels of one process stand for two ranks of
one host. Messages arrive whole and in order; a frame made without the job token, or for another rank, or out of
its connection's order, is never delivered and closes its connection."""

from __future__ import annotations

import socket
import time

import pytest

from tensorwire.backends.socket_messages import _HEADER, SocketMessages
from tensorwire.errors import InvalidArgumentError, TransferError

TOKEN = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def pair():
    a, b = SocketMessages(0, TOKEN, 5.0), SocketMessages(1, TOKEN, 5.0)
    a.load_peer(1, b.metadata())
    b.load_peer(0, a.metadata())
    yield a, b
    a.close()
    b.close()


def _arrivals(channel: SocketMessages, count: int, within_s: float = 5.0) -> list[tuple[int, bytes]]:
    got, deadline = [], time.monotonic() + within_s
    while len(got) < count and time.monotonic() < deadline:
        got += channel.notifications()
        time.sleep(0.001)
    return got


def test_messages_arrive_whole_in_order_and_both_ways(pair):
    a, b = pair
    sent = [b"x" * n for n in (0, 1, 100, 4000)] + [bytes(range(256))]  # a notification is small
    for message in sent:
        a.send_notification(1, message)
    b.send_notification(0, b"back")
    assert _arrivals(b, len(sent)) == [(0, m) for m in sent]
    assert _arrivals(a, 1) == [(1, b"back")]
    assert a.loaded_peers() == {1} and b.loaded_peers() == {0}


def _stranger_sends(channel: SocketMessages, frame: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(channel.metadata())
    sock.sendall(frame)
    return sock


@pytest.mark.parametrize("what", ["no token", "another rank's frame", "out of order"])
def test_a_frame_not_made_for_this_rank_by_a_member_is_dropped_and_its_connection_closed(pair, what):
    a, b = pair
    forger = SocketMessages(0, b"another token, not this job's!!!" if what == "no token" else TOKEN, 5.0)
    receiver, sequence = {"another rank's frame": (7, 0), "out of order": (1, 5)}.get(what, (1, 0))
    header = _HEADER.pack(0, receiver, sequence, 5)
    sock = _stranger_sends(b, header + b"forge" + forger._mac(header, b"forge"))
    try:
        assert _arrivals(b, 1, within_s=0.5) == []
        sock.settimeout(5.0)
        assert sock.recv(1) == b"", "the connection of a bad frame stays open"
    finally:
        sock.close()
        forger.close()
    a.send_notification(1, b"still here")  # the members' own connection is untouched
    assert _arrivals(b, 1) == [(0, b"still here")]


def test_sending_to_a_rank_that_is_gone_or_unknown_raises_transfer_error(pair):
    a, b = pair
    b.close()
    with pytest.raises(TransferError, match="notifying rank 1"):
        a.send_notification(1, b"anyone?")
    with pytest.raises(TransferError, match="rank 2's memory map was not loaded"):
        a.send_notification(2, b"anyone?")


def test_it_never_carries_a_transfer_and_refuses_a_name_that_is_not_ours(pair):
    a, _ = pair
    assert not a.capabilities.memory_kinds and a.capabilities.message_channel and a.capabilities.same_host_only
    with pytest.raises(InvalidArgumentError, match="not one of ours"):
        a.load_peer(3, b"/tmp/some-socket")


def test_a_flood_of_connections_costs_a_bounded_number_of_descriptors(pair):
    from tensorwire.backends.socket_messages import _MAX_UNPROVEN

    a, b = pair
    a.send_notification(1, b"first")  # a member's connection, proven by its first frame
    assert _arrivals(b, 1) == [(0, b"first")]
    flood = [_stranger_sends(b, b"") for _ in range(_MAX_UNPROVEN + 20)]
    try:
        b.notifications()
        assert len(b._incoming) <= _MAX_UNPROVEN + 1
        a.send_notification(1, b"still heard")
        assert _arrivals(b, 1) == [(0, b"still heard")]
    finally:
        for sock in flood:
            sock.close()
