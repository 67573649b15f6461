"""``TensorDesc``: packs to versioned bytes and back, narrows inside its range, and refuses corrupt bytes."""

from __future__ import annotations

import dataclasses
import struct

import pytest

import tensorwire as tw
from tensorwire.descriptors import MemoryKind, TensorDesc

CPU, CUDA = MemoryKind.CPU, MemoryKind.CUDA


def desc(rank=1, addr=0x1000, nbytes=256, kind=CPU, device_index=-1, epoch=3) -> TensorDesc:
    return TensorDesc(rank, addr, nbytes, kind, device_index, epoch)



# --- TensorDesc ---------------------------------------------------------------------------------
def test_pack_unpack_round_trip():
    """Descriptors of both memory kinds, extreme addresses and sizes survive pack/unpack unchanged."""
    descs = [
        desc(),
        desc(rank=7, addr=2**64 - 4096, nbytes=4096, kind=CUDA, device_index=3, epoch=2**32 - 1),
        desc(rank=0, addr=0, nbytes=0, epoch=0),
        desc(rank=2**31 - 1, addr=12345, nbytes=2**40),
    ]
    data = TensorDesc.pack(descs)
    assert isinstance(data, bytes)
    assert len(data) == 8 + 28 * len(descs)
    assert TensorDesc.unpack(data) == descs
    assert TensorDesc.unpack(bytearray(data)) == descs
    assert TensorDesc.unpack(memoryview(data)) == descs


def test_pack_single_desc_and_empty_list():
    """pack accepts one TensorDesc (a list of one comes back) and an empty list."""
    d = desc(kind=CUDA, device_index=1)
    assert TensorDesc.unpack(TensorDesc.pack(d)) == [d]
    assert TensorDesc.unpack(TensorDesc.pack([])) == []


def test_pack_rejects_non_descriptors():
    """pack of something that is not a TensorDesc raises InvalidArgumentError naming the type."""
    with pytest.raises(tw.InvalidArgumentError, match="got int"):
        TensorDesc.pack([desc(), 5])


def test_desc_properties():
    """device/end/kind properties describe the range."""
    assert desc().device == "cpu"
    assert desc(kind=CUDA, device_index=2).device == "cuda:2"
    assert desc(addr=100, nbytes=28).end == 128
    assert CUDA.device_type == "cuda" and CPU.device_type == "cpu"


def test_narrow_inside():
    """narrow returns the sub-range and keeps rank, kind, device and epoch."""
    d = desc(addr=0x1000, nbytes=256, kind=CUDA, device_index=1, epoch=9)
    n = d.narrow(16, 32)
    assert (n.addr, n.nbytes, n.end) == (0x1010, 32, 0x1030)
    assert (n.rank, n.kind, n.device_index, n.epoch) == (d.rank, d.kind, d.device_index, d.epoch)
    assert d.narrow(0, 256) == d
    assert d.narrow(256, 0).nbytes == 0  # empty range at the very end is inside
    assert d.contains(n) and not n.contains(d)


@pytest.mark.parametrize("offset,nbytes", [(250, 8), (0, 257), (257, 0), (-1, 8), (8, -1)])
def test_narrow_outside(offset, nbytes):
    """narrow past either end (or with a negative offset/size) raises InvalidArgumentError naming the range."""
    with pytest.raises(tw.InvalidArgumentError, match=r"outside the 256 bytes"):
        desc(nbytes=256).narrow(offset, nbytes)


def test_contains_requires_same_rank_and_device():
    """contains is false for the same addresses on another rank, kind or device."""
    d = desc(nbytes=256, kind=CUDA, device_index=1)
    inner = d.narrow(8, 8)
    assert d.contains(inner)
    assert not d.contains(dataclasses.replace(inner, rank=d.rank + 1))
    assert not d.contains(dataclasses.replace(inner, kind=CPU, device_index=-1))
    assert not d.contains(dataclasses.replace(inner, device_index=0))
    assert not d.contains(dataclasses.replace(inner, addr=d.end - 4))  # straddles the end


def _corrupt(kind: str) -> bytes:
    good = TensorDesc.pack([desc(), desc(rank=2)])
    if kind == "bad-magic":
        return b"XYZ" + good[3:]
    if kind == "wrong-version":
        return good[:3] + bytes([99]) + good[4:]
    if kind == "truncated-header":
        return good[:5]
    if kind == "truncated-record":
        return good[:-1]
    if kind == "trailing-bytes":
        return good + b"\0"
    if kind == "count-too-large":
        return good[:4] + struct.pack("<I", 3) + good[8:]
    if kind == "bad-memory-kind":
        return good[:8] + struct.pack("<i", 1) + bytes([7]) + good[13:]
    if kind == "negative-rank":
        return good[:8] + struct.pack("<i", -5) + good[12:]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind,text",
    [
        ("bad-magic", "bad magic"),
        ("wrong-version", "format version 99"),
        ("truncated-header", "shorter than the 8-byte header"),
        ("truncated-record", "for 2 records, expected 64"),
        ("trailing-bytes", "for 2 records, expected 64"),
        ("count-too-large", "for 3 records, expected 92"),
        ("bad-memory-kind", "memory kind 7"),
        ("negative-rank", "rank -5"),
    ],
)
def test_unpack_corrupt_bytes(kind, text):
    """unpack of corrupt or foreign bytes raises InvalidArgumentError that names what is wrong."""
    with pytest.raises(tw.InvalidArgumentError) as info:
        TensorDesc.unpack(_corrupt(kind))
    assert text in str(info.value)


def test_unpack_rejects_non_bytes():
    """unpack of a str (not bytes) raises InvalidArgumentError naming the type."""
    with pytest.raises(tw.InvalidArgumentError, match="got str"):
        TensorDesc.unpack("TWD")
