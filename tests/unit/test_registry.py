"""The transport registry: one ordered table decides which transport carries a transfer, which names
``prepare(transport=)`` accepts, and what ``tw.backends()`` and the doctor report."""

from __future__ import annotations

import pytest

import tensorwire as tw
from tensorwire.backends import registry
from tensorwire.backends.base import Segment
from tensorwire.descriptors import MemoryKind

CPU, CUDA = MemoryKind.CPU, MemoryKind.CUDA


class _Stand:
    """A backend stand-in: the real class's capabilities, and a chosen answer to ``reaches``."""

    def __init__(self, name: str, reaches: bool = True) -> None:
        self.capabilities = registry.transport(name).capabilities
        self._reaches = reaches

    def reaches(self, peer: int, remote: list[Segment]) -> bool:
        return self._reaches


def _choose(to_self: bool, same_host: bool, local: MemoryKind, remote: MemoryKind, exported: bool = True,
            present=registry.NAMES) -> list[str]:
    backends = {name: _Stand(name, reaches=exported or name in ("local", "nixl")) for name in present}
    return registry.reachable(backends, to_self, same_host, local, remote, 1, [])


@pytest.mark.parametrize("to_self, same_host, local, remote, exported, expected", [
    (True, True, CUDA, CUDA, True, ["local"]),  # own memory: a copy, never NIXL's TCP emulation
    (True, True, CPU, CUDA, True, ["local"]),
    (False, True, CUDA, CUDA, True, ["cuda_ipc", "nixl"]),
    (False, True, CUDA, CUDA, False, ["nixl"]),  # the peer could not export (VMM memory)
    (False, True, CPU, CPU, True, ["shm", "nixl"]),
    (False, True, CPU, CPU, False, ["nixl"]),  # anonymous host memory: no shared file to map
    (False, True, CPU, CUDA, True, ["nixl"]),  # mixed kinds: only NIXL moves them
    (False, False, CUDA, CUDA, True, ["nixl"]),  # another host
    (False, False, CPU, CPU, True, ["nixl"]),
])
def test_the_first_transport_that_reaches_wins(to_self, same_host, local, remote, exported, expected):
    assert _choose(to_self, same_host, local, remote, exported) == expected


def test_a_transport_missing_here_is_skipped():
    assert _choose(False, True, CUDA, CUDA, present=("local", "shm", "nixl")) == ["nixl"]


def test_backends_lists_every_transport_in_preference_order_with_a_reason():
    found = tw.backends()
    assert tuple(found) == registry.NAMES == ("local", "cuda_ipc", "shm", "nixl", "socket")
    for name, info in found.items():
        assert info.name == name and info.reason, info
        # Unavailable: a fix, or nothing to fix because another transport does its job here (the doctor then
        # lists it as "not used"; the socket channel where NIXL carries the messages).
        replaced = name == "socket" and found["nixl"].available and info.reason.startswith("not needed")
        assert info.available or info.fix or replaced, f"{name} is unavailable without a fix: {info}"
    assert found["local"].available


def test_stream_ordered_transports_come_from_the_capabilities():
    assert registry.stream_ordered_names() == ("local", "cuda_ipc")
