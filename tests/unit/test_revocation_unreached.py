"""A revocation that cannot reach a rank that is alive does not release the memory under it: ``close()`` warns,
waits for that rank (its answer, its death or the bound) and keeps the memory quarantined. Stand-ins for the
runtime: one live peer whose messages all fail."""

from __future__ import annotations

import types
import weakref

import pytest

from tensorwire.errors import TensorwireWarning, TransferError, WaitTimeoutError
from tensorwire.revocation import Revocations


class _Unreachable:
    def loaded_peers(self) -> frozenset[int]:
        return frozenset({1})

    def send_notification(self, peer: int, message: bytes) -> None:
        raise TransferError(f"notifying rank {peer}: refused")


def _revocations(peer_alive: bool) -> Revocations:
    liveness = types.SimpleNamespace(callers=lambda settle_s=0.0: [1], poke=lambda rank: None,
                                     lost=lambda rank, fresh=False: None if peer_alive else "gone")
    runtime = types.SimpleNamespace(
        rank=0, closed=False, inbox=types.SimpleNamespace(pump=lambda: None), liveness=liveness,
        transports=types.SimpleNamespace(messenger=_Unreachable()), config=types.SimpleNamespace(liveness_s=0.1),
        transfers=weakref.WeakSet(), peer_lost=lambda rank, fresh=False: None if peer_alive else "gone")
    return Revocations(runtime, peers=None)


def test_a_live_rank_that_cannot_be_told_keeps_the_memory_quarantined():
    released = []
    revocations = _revocations(peer_alive=True)
    with pytest.warns(TensorwireWarning, match="could not tell rank 1"), pytest.raises(WaitTimeoutError):
        revocations.revoke([5], 7, lambda: released.append(True))
    assert released == [] and revocations.quarantined() == 1


def test_a_rank_that_is_gone_is_not_waited_for():
    released = []
    _revocations(peer_alive=False).revoke([5], 7, lambda: released.append(True))
    assert released == [True]
