"""``Liveness.watch`` connects at once, whatever a check just found: a rank that prepares a transfer to a peer must
be among that peer's callers, or the peer's revocations skip it and a revoked buffer still takes its writes."""

from __future__ import annotations

import time

from tensorwire.meeting.liveness import Liveness

TOKEN = b"0123456789abcdef0123456789abcdef"


def test_watch_connects_right_after_a_check_found_no_address():
    owner = Liveness(1, 2, 5.0, "127.0.0.1", TOKEN, lambda peer: None)
    published: dict[int, tuple[str, int]] = {}
    holder = Liveness(0, 2, 5.0, "127.0.0.1", TOKEN, published.get)
    try:
        assert holder.lost(1, fresh=True) is None  # a wait's check: rank 1 has published no address yet
        published[1] = owner.address  # it publishes; this rank prepares a transfer to it at once
        holder.watch(1)
        deadline = time.monotonic() + 5.0
        while 0 not in owner.callers() and time.monotonic() < deadline:
            holder.serve(0.005)  # the holder's revocation thread: it answers the owner's challenge
        assert owner.callers() == [0], "a rank that watched the owner is missing from its callers"
    finally:
        holder.close()
        owner.close()
