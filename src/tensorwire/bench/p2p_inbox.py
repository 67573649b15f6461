"""The byte checks of ``tensorwire bench p2p``: every path must move the right bytes, before and after it is
timed, or the benchmark fails instead of reporting a fast number.

Each rank's buffer is ``[outbox | inbox]``. Rank 0 checks its own inbox after a READ path; after a WRITE path
it asks rank 1, through the store, to check its inbox (``InboxChecker``). A check syncs with the device and
clears the inbox for the next path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import Op
from ..descriptors import TensorDesc
from ..errors import TransferError
from ..testing.data import first_mismatch

__all__ = ["Side", "check_inbox", "check_path", "InboxChecker"]


@dataclass
class Side:
    """This rank's buffers for one memory kind."""

    memory: str
    buffer: torch.Tensor  # [outbox | inbox], registered with tensorwire and raw NIXL
    half: int  # bytes in each box
    own: torch.Tensor  # what this rank's outbox holds
    peer: torch.Tensor  # what the peer's outbox holds
    copy_dst: torch.Tensor | None  # rank 0: destination of the local copy
    registration: Any
    remote: TensorDesc | None = None  # the peer's buffer

    @property
    def outbox(self) -> torch.Tensor:
        return self.buffer[: self.half]

    @property
    def inbox(self) -> torch.Tensor:
        return self.buffer[self.half:]

    def sync(self) -> None:
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)


def check_inbox(side: Side, size: int, what: str, expected: torch.Tensor | None = None) -> None:
    """The first ``size`` bytes of this rank's inbox must be ``expected`` (default: the peer's outbox); then
    clear them for the next path. Raises ``TransferError`` naming ``what`` moved wrong bytes."""
    side.sync()
    expected = side.peer if expected is None else expected
    index = first_mismatch(side.inbox[:size], expected[:size])
    if index is not None:
        raise TransferError(
            f"bench: after the {what}s of {size} bytes ({side.memory}), byte {index} of an inbox is "
            f"{int(side.inbox[index])} but the source holds {int(expected[index])}: the transfer moved wrong "
            "bytes or none; run 'tensorwire doctor'"
        )
    side.inbox[:size].zero_()
    side.sync()


def check_path(side: Side, size: int, op: Op, path: str, checker: InboxChecker) -> None:
    """Rank 0 checks its own inbox after a READ path and asks rank 1 to check its inbox after a WRITE."""
    if op is Op.READ:
        check_inbox(side, size, f"{path} READ")
    else:
        checker.ask(side.memory, size, f"{path} WRITE")


class InboxChecker:
    """Rank 0 asks, through the store, and rank 1 checks (and clears) its inbox after each WRITE path."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._sequence = 0

    def ask(self, memory: str, size: int, what: str) -> None:
        """Rank 0: block until rank 1 checked; re-raise its finding here, where the path is known."""
        reply = self._call(f"check {memory} {size} {what}")
        if reply != "ok":
            raise TransferError(reply)

    def finish(self) -> None:
        self._call("done")

    def serve(self, sides: dict[str, Side]) -> None:
        """Rank 1: answer requests until rank 0 says ``done``."""
        while True:
            request = self._store.get(f"ask/{self._sequence}").decode()
            if request == "done":
                self._store.set(f"answer/{self._sequence}", b"ok")
                return
            _, memory, size, what = request.split(" ", 3)
            try:
                check_inbox(sides[memory], int(size), what)
                reply = "ok"
            except TransferError as e:
                reply = str(e)
            self._store.set(f"answer/{self._sequence}", reply.encode())
            self._sequence += 1

    def _call(self, request: str) -> str:
        self._store.set(f"ask/{self._sequence}", request.encode())
        reply = self._store.get(f"answer/{self._sequence}").decode()
        self._sequence += 1
        return reply
