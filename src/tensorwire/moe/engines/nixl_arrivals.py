"""The ``"nixl"`` MoE engine's notifications: ``b"twmoe"`` + (kind, round), and the wait for them.

Each WRITE of the engine carries a notification naming what it delivered (a count row, rows, expert outputs)
and the round it belongs to. One that arrives ahead of the call waiting for it is remembered, so back-to-back
calls never mix; one that arrives twice is an error.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from ...backends.base import Status
from ...errors import PeerLostError, TransferError
from ...progress import wait_until

if TYPE_CHECKING:
    from ...communicator import Communicator

__all__ = ["MAGIC", "COUNTS", "ROWS", "RETURN", "message", "Arrivals"]

MAGIC = b"twmoe"
_MESSAGE = struct.Struct("<BQ")  # kind, round
COUNTS, ROWS, RETURN = 1, 2, 3
_KIND_NAMES = {COUNTS: "count row", ROWS: "rows", RETURN: "expert outputs"}


def message(kind: int, round_: int) -> bytes:
    return MAGIC + _MESSAGE.pack(kind, round_)


def _parse(message: bytes, sender: int, fn: str) -> tuple[int, int]:
    if len(message) != len(MAGIC) + _MESSAGE.size or not message.startswith(MAGIC):
        raise TransferError(
            f"{fn}: rank {sender} sent a malformed tensorwire.moe notification ({message[:24]!r}); "
            "messages starting with b'twmoe' are reserved for tensorwire.moe")
    kind, round_ = _MESSAGE.unpack_from(message, len(MAGIC))
    return kind, round_


class Arrivals:
    """One engine's view of the ``twmoe`` channel of the communicator's inbox."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._channel = comm.runtime.channel(MAGIC)  # MoE notifications never mix with the user's
        self._early: list[set[tuple[int, int]]] = [set() for _ in range(comm.world_size)]

    def wait(self, kind: int, round_: int, senders: list[int], transfers: list, fn: str) -> None:
        """Wait for one (kind, round) notification from each of ``senders`` (others that arrive are kept for
        their own call) and for ``transfers`` to complete. Blocks (sleeping), bounded by the communicator's
        timeout; ``PeerLostError`` once one of those ranks is gone (within ``TENSORWIRE_LIVENESS_S``). A posted
        NIXL WRITE only progresses while its status is polled, so both are polled in one loop: waiting for the
        peers alone would deadlock."""
        wanted = (kind, round_)
        pending = []
        for sender in senders:
            if wanted in self._early[sender]:
                self._early[sender].remove(wanted)
            else:
                pending.append(sender)
        in_flight = list(transfers)

        def ready() -> bool:
            for transfer in list(in_flight):
                state = transfer.status()
                if state is Status.ERROR:
                    self._raise_failed(transfer.peer, f"{fn}: the WRITE of {_KIND_NAMES[kind]} to rank "
                                                      f"{transfer.peer} failed")
                if state is Status.DONE:
                    in_flight.remove(transfer)
            for sender in list(pending):
                if self._arrived(sender, wanted, fn):
                    pending.remove(sender)
            return not pending and not in_flight

        def describe() -> str:
            if pending:
                return (f"{fn}: rank(s) {pending} did not deliver their {_KIND_NAMES[kind]} of round {round_}; "
                        "every rank must make the same MoE calls in the same order")
            return f"{fn}: WRITEs of {_KIND_NAMES[kind]} to rank(s) {[t.peer for t in in_flight]} did not complete"

        runtime = self._comm.runtime

        def alive() -> None:  # a sender or WRITE target that is gone ends the wait now, not at the timeout
            for rank in {*pending, *(transfer.peer for transfer in in_flight)}:
                runtime.liveness.check(rank, describe)
            runtime.between_polls()

        wait_until(ready, self._comm.timeout_s, describe, self._comm.config, alive)

    def _raise_failed(self, peer: int, what: str) -> None:
        """A WRITE to ``peer`` failed: ``PeerLostError`` if the peer is gone (NIXL may report its death before
        the liveness view has seen it: looked for up to the liveness period), else ``TransferError``."""
        runtime = self._comm.runtime
        gone = runtime.gone_among([peer], runtime.config.liveness_s)
        if gone is not None:
            raise PeerLostError(f"{what}: rank {peer} is gone ({gone[1]})")
        raise TransferError(f"{what}; the peer may have exited")

    def _arrived(self, sender: int, wanted: tuple[int, int], fn: str) -> bool:
        """Take ``sender``'s notifications until ``wanted``; keep the others for their own call."""
        while (message := self._channel.try_pop(sender)) is not None:
            got = _parse(message, sender, fn)
            if got == wanted:
                return True
            if got in self._early[sender]:
                raise TransferError(f"{fn}: rank {sender} delivered {_KIND_NAMES[got[0]]} of round {got[1]} twice")
            self._early[sender].add(got)
        return False
