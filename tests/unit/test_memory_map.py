"""``LocalMemoryMap``: which registration owns an address range, overlaps refused, removal."""

from __future__ import annotations

import pytest

from tensorwire.backends.base import Segment
from tensorwire.descriptors import MemoryKind
from tensorwire.registration import LocalMemoryMap

CPU, CUDA = MemoryKind.CPU, MemoryKind.CUDA


# --- LocalMemoryMap ------------------------------------------------------------------------------
def _seg(addr, nbytes, kind=CPU, device=-1) -> Segment:
    return Segment(addr, nbytes, kind, device)


def _add(m: LocalMemoryMap, s: Segment, reg) -> None:
    """Add a fake range (no tensor behind it: these tests never call ``view``)."""
    m.add(s, reg, None)


@pytest.fixture
def memory_map():
    """Three CPU ranges [1000,1100) [2000,2100) [3000,3100) and one CUDA:0 range [1000,1100)."""
    m = LocalMemoryMap()
    regs = {name: object() for name in ("a", "b", "c", "gpu")}
    _add(m, _seg(2000, 100), regs["b"])  # out of order on purpose
    _add(m, _seg(1000, 100), regs["a"])
    _add(m, _seg(3000, 100), regs["c"])
    _add(m, _seg(1000, 100, CUDA, 0), regs["gpu"])
    return m, regs


@pytest.mark.parametrize(
    "segment,owner",
    [
        (_seg(1000, 100), "a"),
        (_seg(1050, 10), "a"),
        (_seg(1099, 1), "a"),
        (_seg(2000, 100), "b"),
        (_seg(3050, 50), "c"),
        (_seg(1000, 100, CUDA, 0), "gpu"),
        (_seg(1090, 20), None),  # straddles the end of a
        (_seg(999, 2), None),  # straddles the start of a
        (_seg(500, 10), None),  # before everything
        (_seg(1500, 10), None),  # in a gap
        (_seg(5000, 10), None),  # after everything
        (_seg(2050, 10, CUDA, 0), None),  # CPU range b's addresses, but on the GPU
        (_seg(1050, 10, CUDA, 1), None),  # another GPU
    ],
)
def test_memory_map_find(memory_map, segment, owner):
    """find returns the registration whose range contains the segment, and nothing for partial overlaps."""
    m, regs = memory_map
    found = m.find(segment)
    assert found is (regs[owner] if owner else None)


@pytest.mark.parametrize(
    "segment,clash",
    [
        (_seg(1050, 10), (1000, 100)),  # inside
        (_seg(950, 100), (1000, 100)),  # overlaps the start
        (_seg(1099, 10), (1000, 100)),  # overlaps the end by one byte
        (_seg(900, 300), (1000, 100)),  # encloses
        (_seg(1900, 1300), (3000, 100)),  # encloses b and overlaps c: any clash is reported
        (_seg(1100, 900), None),  # exactly fills the gap between a and b
        (_seg(900, 100), None),  # ends where a starts
        (_seg(3100, 10), None),  # starts where c ends
        (_seg(2000, 100, CUDA, 0), None),  # other memory kind
        (_seg(1000, 100, CUDA, 1), None),  # other GPU
    ],
)
def test_memory_map_overlapping(memory_map, segment, clash):
    """overlapping finds a registered range sharing at least one byte, on the same kind and device only."""
    m, _ = memory_map
    found = m.overlapping(segment)
    if clash is None:
        assert found is None
    else:
        assert found is not None and (found.addr, found.nbytes) in {(1000, 100), (2000, 100), (3000, 100)}
        assert found.addr < segment.addr + segment.nbytes and segment.addr < found.addr + found.nbytes


def test_memory_map_remove(memory_map):
    """remove forgets exactly one range; the others stay findable and segments() stays sorted."""
    m, regs = memory_map
    m.remove(_seg(2000, 100))
    assert m.find(_seg(2010, 10)) is None
    assert m.overlapping(_seg(2010, 10)) is None
    assert m.find(_seg(1010, 10)) is regs["a"] and m.find(_seg(3010, 10)) is regs["c"]
    assert [(s.kind, s.addr) for s in m.segments()] == [(CPU, 1000), (CPU, 3000), (CUDA, 1000)]
    m.remove(_seg(2000, 100))  # removing twice is harmless
    assert len(m.segments()) == 3
