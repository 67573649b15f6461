"""The consumer's grant box: GRANTs routed by ticket to the lane that waits for them, nothing else kept.

Every lane of a consumer reads one channel (``TO_CONSUMER``). Taking only the messages of the ranks a lane waits for
would leave the rest queued for ever: a grant that came after its lane gave up, a message from a rank that is no
producer of ours (an insider, a bug), garbage. Here each look at the channel takes everything: grants whose ticket
a lane is waiting for, from the rank its claim went to, are kept for that lane; the rest is dropped and counted.
Thread-safe (every lane looks); nothing blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .messages import Grant, parse

__all__ = ["GrantBox"]

log = logging.getLogger(__name__)

_LOG_EVERY_S = 60.0  # at most one line per this many seconds about dropped messages


class GrantBox:
    """Grants for the tickets lanes ``expect``, from ``channel`` (a ``Runtime.channel``)."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._expected: dict[str, int] = {}  # ticket -> the producer's fleet rank
        self._arrived: dict[str, Grant] = {}
        self.dropped = 0  # messages taken from the channel that no lane waited for
        self._logged_at, self._logged_count = 0.0, 0

    def expect(self, tickets: dict[str, int]) -> None:
        """Keep the grants of ``tickets`` (ticket -> the fleet rank its claim went to) until taken or forgotten."""
        with self._lock:
            self._expected.update(tickets)

    def take(self, tickets: set[str]) -> list[Grant]:
        """The grants of ``tickets`` arrived so far (each once), after one look at the channel."""
        with self._lock:
            for sender, message in self._channel.take_all():
                grant = parse(message)
                if isinstance(grant, Grant) and self._expected.get(grant.ticket) == sender:
                    self._arrived[grant.ticket] = grant
                    del self._expected[grant.ticket]
                else:
                    self.dropped += 1
            taken = [self._arrived.pop(t) for t in tickets if t in self._arrived]
        self._log_dropped()
        return taken

    def forget(self, tickets: set[str]) -> None:
        """No lane waits for ``tickets`` any more: their grants, now or later, are dropped."""
        with self._lock:
            for ticket in tickets:
                self._expected.pop(ticket, None)
                self._arrived.pop(ticket, None)

    def _log_dropped(self) -> None:
        now = time.monotonic()
        if self.dropped > self._logged_count and now - self._logged_at >= _LOG_EVERY_S:
            log.info("KV consumer: %d message(s) on the grant channel dropped so far (late grants, or from ranks "
                     "that are no producer of ours)", self.dropped)
            self._logged_at, self._logged_count = now, self.dropped
