"""What a KV member says at start-up when no transport can carry its cache to a peer (no NIXL, host memory outside
a shared file): one reason with the fix, instead of every load failing later behind successful answers."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import tensorwire as tw
from tensorwire import kv


def _without_nixl(monkeypatch) -> None:
    real = tw.backends()
    gone = tw.BackendInfo("nixl", False, "the nixl package is not installed", "pip install nixl", "")
    monkeypatch.setattr(tw, "backends", lambda: {**real, "nixl": gone})


def _member(view: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(pool=SimpleNamespace(views=[view]))


def test_host_memory_without_nixl_outside_a_shared_file_is_unreachable(monkeypatch):
    _without_nixl(monkeypatch)
    reason = kv.KVMember.unreachable(_member(torch.zeros(4, 8)))
    assert "not installed" in reason and "pip install nixl" in reason


def test_a_shared_file_or_nixl_reaches_it(monkeypatch):
    shared = tw.shared_empty((4, 8))
    assert tw.in_shared_file(shared) and not tw.in_shared_file(torch.zeros(4, 8))
    if tw.backends()["nixl"].available:
        assert kv.KVMember.unreachable(_member(torch.zeros(4, 8))) is None
    _without_nixl(monkeypatch)
    assert kv.KVMember.unreachable(_member(shared)) is None
