"""The error hierarchy (each also the matching builtin) and the public names of the package."""

from __future__ import annotations

import pytest

import tensorwire as tw
from tensorwire import errors


# --- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls,builtins",
    [
        (tw.InvalidArgumentError, (ValueError,)),
        (tw.ClosedError, (tw.InvalidArgumentError, ValueError)),
        (tw.BackendUnavailableError, (RuntimeError,)),
        (tw.TransferError, (RuntimeError,)),
        (tw.WaitTimeoutError, (TimeoutError,)),
        (tw.PeerLostError, (ConnectionError,)),
        (tw.testing.RankFailedError, (RuntimeError,)),
    ],
)
def test_error_hierarchy(cls, builtins):
    """Every tensorwire error is a TensorwireError and the builtin a caller would catch."""
    err = cls("boom")
    assert isinstance(err, tw.TensorwireError)
    for b in builtins:
        assert isinstance(err, b), f"{cls.__name__} is not a {b.__name__}"
    assert getattr(tw, cls.__name__, cls) is cls
    assert getattr(errors, cls.__name__, cls) is cls


def test_error_types_are_distinct():
    """A timeout is not a peer loss, a transfer error is not a value error, etc."""
    assert not issubclass(tw.WaitTimeoutError, ConnectionError)
    assert not issubclass(tw.PeerLostError, TimeoutError)
    assert not issubclass(tw.TransferError, ValueError)
    assert not issubclass(tw.InvalidArgumentError, RuntimeError)



# --- backends -------------------------------------------------------------------------------------
def test_backends_lists_nixl_available():
    """tw.backends() reports NIXL with its UCX plugin as available on this machine."""
    found = tw.backends()
    assert "nixl" in found
    info = found["nixl"]
    assert isinstance(info, tw.BackendInfo)
    assert info.name == "nixl"
    assert info.available is True, f"nixl unavailable: {info.reason} (fix: {info.fix})"
    assert info.version and info.version != "unknown"


def test_public_api_names():
    """The public names of the contract exist on the package."""
    for name in ["init", "Communicator", "Registration", "Transfer", "TensorDesc", "MemoryKind", "Status", "Op",
                 "READ", "WRITE", "backends", "BackendInfo", "testing"]:
        assert hasattr(tw, name), name
    assert tw.READ is tw.Op.READ and tw.WRITE is tw.Op.WRITE and tw.READ is not tw.WRITE
    assert {s.name for s in tw.Status} == {"DONE", "IN_PROGRESS", "ERROR"}
    assert callable(tw.testing.launch)
