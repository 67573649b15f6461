"""Unit tests: no ranks, no store, no transfers."""

from __future__ import annotations

import dataclasses
import struct
import sys

import pytest
import torch

import tensorwire as tw
from tensorwire import config, environment, errors
from tensorwire.backends.base import Segment
from tensorwire.descriptors import MemoryKind, TensorDesc
from tensorwire.progress import Inbox, wait_until
from tensorwire.registration import LocalMemoryMap

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


# --- environment ----------------------------------------------------------------------------------
_LAUNCHER_VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
    "TENSORWIRE_TIMEOUT", "TENSORWIRE_PROGRESS_WAKEUP_MS", "TENSORWIRE_SPIN_US", "TENSORWIRE_MAX_SLEEP_US",
]


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher or TENSORWIRE_* variables from the host leak into a test."""
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _env(rank, world, local_rank, local_world, addr, port, launcher):
    return environment.Environment(rank, world, local_rank, local_world, addr, port, launcher)


@pytest.mark.parametrize("variables, expected", [
    (dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"),
     _env(3, 8, 1, 2, "10.0.0.1", 29500, "torchrun")),
    (dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="6", OMPI_COMM_WORLD_LOCAL_RANK="2",
          OMPI_COMM_WORLD_LOCAL_SIZE="3", MASTER_ADDR="node0", MASTER_PORT="1234"),
     _env(5, 6, 2, 3, "node0", 1234, "mpirun")),
    # SLURM's '4(x2)' tasks-per-node syntax
    (dict(SLURM_PROCID="7", SLURM_NTASKS="8", SLURM_LOCALID="3", SLURM_NTASKS_PER_NODE="4(x2)",
          MASTER_ADDR="head", MASTER_PORT="4000"),
     _env(7, 8, 3, 4, "head", 4000, "slurm")),
], ids=["torchrun", "openmpi", "slurm"])
def test_environment_of_each_launcher(clean_env, variables, expected):
    """torchrun's RANK/..., mpirun's OMPI_COMM_WORLD_* and SLURM_* variables are read."""
    for k, v in variables.items():
        clean_env.setenv(k, v)
    assert environment.resolve_environment() == expected


def test_environment_torchrun_wins_over_openmpi(clean_env):
    """When several launchers' variables are set, torchrun's are used."""
    for k, v in dict(RANK="1", WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4",
                     MASTER_ADDR="a", MASTER_PORT="1").items():
        clean_env.setenv(k, v)
    env = environment.resolve_environment()
    assert (env.rank, env.world_size, env.launcher) == (1, 2, "torchrun")


def test_environment_local_rank_defaults(clean_env):
    """Without LOCAL_RANK/LOCAL_WORLD_SIZE the local values fall back to the global ones."""
    for k, v in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="a", MASTER_PORT="1").items():
        clean_env.setenv(k, v)
    env = environment.resolve_environment()
    assert (env.local_rank, env.local_world_size) == (1, 2)


def test_environment_default_is_single_rank(clean_env):
    """No launcher variables: a 1-rank world that needs no MASTER_ADDR."""
    env = environment.resolve_environment()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (0, 1, 0, 1, "none")


def test_environment_keywords_override(clean_env):
    """rank=, world_size=, master_addr=, master_port= override the environment."""
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="a", MASTER_PORT="1").items():
        clean_env.setenv(k, v)
    env = environment.resolve_environment(rank=3, world_size=4, master_addr="b", master_port=77)
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (3, 4, "b", 77)


def test_environment_missing_master_addr(clean_env):
    """A world of several ranks without MASTER_ADDR is an InvalidArgumentError that names MASTER_ADDR."""
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="29500").items():
        clean_env.setenv(k, v)
    with pytest.raises(tw.InvalidArgumentError, match="MASTER_ADDR"):
        environment.resolve_environment()


def test_environment_missing_master_port(clean_env):
    """A world of several ranks without MASTER_PORT is an InvalidArgumentError that names MASTER_PORT."""
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="x").items():
        clean_env.setenv(k, v)
    with pytest.raises(tw.InvalidArgumentError, match="MASTER_PORT"):
        environment.resolve_environment()


@pytest.mark.parametrize(
    "variables,text",
    [
        (dict(RANK="2", WORLD_SIZE="2"), "rank=2 is outside [0, 2)"),
        (dict(RANK="x", WORLD_SIZE="2"), "RANK='x' is not an integer"),
        (dict(RANK="0", WORLD_SIZE="0"), "world_size=0"),
        (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="http"), "MASTER_PORT='http' is not an integer"),
    ],
)
def test_environment_bad_values(clean_env, variables, text):
    """Out-of-range or non-integer launcher variables raise InvalidArgumentError naming the variable."""
    clean_env.setenv("MASTER_ADDR", "a")
    clean_env.setenv("MASTER_PORT", "1")
    for k, v in variables.items():
        clean_env.setenv(k, v)
    with pytest.raises(tw.InvalidArgumentError) as info:
        environment.resolve_environment()
    assert text in str(info.value)


def test_init_rejects_non_positive_timeout(clean_env):
    """tw.init(timeout=0) raises InvalidArgumentError before touching the network."""
    with pytest.raises(tw.InvalidArgumentError, match="positive"):
        tw.init(timeout=0)


def test_init_rejects_bad_config_env(clean_env):
    """tw.init with an unparsable TENSORWIRE_TIMEOUT raises InvalidArgumentError naming the variable."""
    clean_env.setenv("TENSORWIRE_TIMEOUT", "soon")
    with pytest.raises(tw.InvalidArgumentError, match="TENSORWIRE_TIMEOUT"):
        tw.init()


# --- config ---------------------------------------------------------------------------------------
def test_config_defaults(clean_env):
    """Without TENSORWIRE_* variables the documented defaults apply."""
    assert config.load() == config.Config(timeout_s=300.0, progress_wakeup_ms=10.0, spin_us=50.0, max_sleep_us=1000.0)


def test_config_reads_environment(clean_env):
    """TENSORWIRE_* variables are parsed as numbers; an empty value means the default."""
    clean_env.setenv("TENSORWIRE_TIMEOUT", "12.5")
    clean_env.setenv("TENSORWIRE_PROGRESS_WAKEUP_MS", "3")
    clean_env.setenv("TENSORWIRE_SPIN_US", "0")
    clean_env.setenv("TENSORWIRE_MAX_SLEEP_US", "")
    assert config.load() == config.Config(timeout_s=12.5, progress_wakeup_ms=3.0, spin_us=0.0, max_sleep_us=1000.0)


@pytest.mark.parametrize("name", ["TENSORWIRE_TIMEOUT", "TENSORWIRE_PROGRESS_WAKEUP_MS", "TENSORWIRE_SPIN_US",
                                  "TENSORWIRE_MAX_SLEEP_US"])
@pytest.mark.parametrize("value,text", [("abc", "is not a number"), ("-1", "is negative")])
def test_config_bad_value(clean_env, name, value, text):
    """A non-numeric or negative TENSORWIRE_* value raises InvalidArgumentError naming the variable."""
    clean_env.setenv(name, value)
    with pytest.raises(tw.InvalidArgumentError) as info:
        config.load()
    assert name in str(info.value) and text in str(info.value)


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


# --- progress helpers ----------------------------------------------------------------------------
def test_inbox_queues_per_sender_in_order():
    """The Inbox keeps one FIFO per sender; popping one sender never consumes another's messages."""
    batches = [[(2, b"2a"), (1, b"1a"), (2, b"2b")], [(1, b"1b")], []]

    def poll():
        return batches.pop(0) if batches else []

    inbox = Inbox(poll)
    assert inbox.try_pop(2) == b"2a"
    assert inbox.try_pop(2) == b"2b"
    assert inbox.try_pop(2) is None
    assert inbox.try_pop(1) == b"1a"
    assert inbox.try_pop(1) == b"1b"
    assert inbox.try_pop(1) is None
    assert inbox.try_pop(3) is None


def test_wait_until_times_out_with_description():
    """wait_until returns as soon as ready() holds and raises WaitTimeoutError with the description otherwise."""
    cfg = config.Config(timeout_s=1.0, progress_wakeup_ms=10.0, spin_us=50.0, max_sleep_us=1000.0)
    calls = []
    wait_until(lambda: calls.append(1) or len(calls) >= 3, 1.0, lambda: "never", cfg)
    assert len(calls) == 3
    with pytest.raises(tw.WaitTimeoutError, match="the thing I waited for"):
        wait_until(lambda: False, 0.05, lambda: "the thing I waited for", cfg)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux thread setting")
def test_a_sleeping_wait_tightens_the_thread_timer_slack_and_restores_it():
    """Past its spin, wait_until sleeps with 1 µs timer slack (the default 50 µs made each short sleep ~50 µs
    late); the caller's thread gets its own slack back afterwards, also when the wait times out."""
    from tensorwire import progress

    def slack() -> int:
        return progress._PRCTL(progress._PR_GET_TIMERSLACK, 0, 0, 0, 0)

    cfg = config.Config(timeout_s=1.0, progress_wakeup_ms=10.0, spin_us=0.0, max_sleep_us=1000.0)
    before, seen = slack(), []
    wait_until(lambda: seen.append(slack()) or len(seen) >= 3, 1.0, lambda: "x", cfg)
    assert seen[0] == before and seen[-1] == progress._FINE_SLACK_NS, seen  # the first poll runs before any sleep
    assert slack() == before
    with pytest.raises(tw.WaitTimeoutError):
        wait_until(lambda: False, 0.01, lambda: "x", cfg)
    assert slack() == before


def test_a_progress_thread_warning_never_raises():
    """Warnings the progress thread issues (a stream released by a timeout) must not raise where a filter turns
    warnings into errors: the raise would skip the release after it, or end the thread."""
    import warnings

    from tensorwire.progress import warn_from_progress_thread

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_from_progress_thread("released")
    assert [str(w.message) for w in caught] == ["released"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_from_progress_thread("released")  # does not raise


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_init_refuses_a_timeout_that_could_not_end(value):
    """A NaN or infinite timeout would make every wait unbounded: refused before anything starts."""
    with pytest.raises(tw.InvalidArgumentError, match="timeout="):
        tw.init(timeout=value)


def test_config_refuses_a_non_finite_timeout(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_TIMEOUT", "nan")
    with pytest.raises(tw.InvalidArgumentError, match="TENSORWIRE_TIMEOUT='nan' is not finite"):
        config.load()


def test_bench_budget_fills_the_time_but_caps_slow_calls():
    """Fast calls fill the time budget (at least min_reps, at most max_reps); a call of seconds gets a few."""
    from tensorwire.bench.timing import Budget

    budget = Budget(time_s=0.3, min_reps=20, max_reps=100_000)
    assert budget.reps_for(1e-3) == 300
    assert budget.reps_for(1e-7) == 100_000
    assert budget.reps_for(0.1) == 20  # min_reps still holds while 20 calls cost at most ten budgets
    assert budget.reps_for(0.5) == 6
    assert budget.reps_for(2.0) == 3
    assert Budget(iters=7).reps_for(2.0) == 7


def test_shared_file_of_finds_only_mappings_a_peer_can_open(tmp_path):
    """A range inside a MAP_SHARED file mapping is found with its file offset and identity; anonymous
    memory, and a mapping whose path now names another file (or none), are not."""
    import dataclasses
    import os

    from tensorwire.backends.shm import shared_file_of

    path = str(tmp_path / "shared")
    mapped = torch.from_file(path, shared=True, size=8192, dtype=torch.uint8)
    found = shared_file_of(mapped.data_ptr() + 100, 1000)
    assert (found.path, found.offset, found.inode) == (path, 100, os.stat(path).st_ino) and found.is_at_path()
    assert not dataclasses.replace(found, inode=found.inode + 1).is_at_path()  # same name, another file
    assert shared_file_of(mapped.data_ptr(), 8192 + 1) is None  # runs past the mapping
    assert shared_file_of(torch.zeros(4096, dtype=torch.uint8).data_ptr(), 4096) is None
    os.unlink(path)
    assert shared_file_of(mapped.data_ptr(), 10) is None and not found.is_at_path()
    torch.from_file(path, shared=True, size=8192, dtype=torch.uint8)  # a new file under the old name
    assert shared_file_of(mapped.data_ptr(), 10) is None and not found.is_at_path()


# --- bench report -------------------------------------------------------------------------------
def test_bench_summary_holds_wait_returns_against_their_goal():
    """Each measured wait(stream=) return becomes a summary line: ok only below 20 µs and with the transfer
    still in flight at every return; the JSON keeps the raw measurement."""
    from tensorwire.bench import p2p
    from tensorwire.bench import p2p_report as report
    from tensorwire.bench.timing import Budget

    def wait_return(transport, median_us, in_flight):
        return {"transport": transport, "op": "WRITE", "size": 1 << 30, "median_us": median_us, "p10_us": median_us,
                "p90_us": median_us, "first_us": 3 * median_us, "reps": 20, "in_flight": in_flight}

    returns = [wait_return("cuda_ipc", 6.0, 20), wait_return("nixl", 24.0, 20), wait_return("shm", 6.0, 19)]
    result = p2p.BenchResult(records=[], idle=[], raw_config="raw", progress_wakeup_ms=10, default_threads=1,
                             ucx_version=None, wait_returns=returns)
    lines = {line["name"]: line for line in report.summary(result)}
    assert [lines[f"wait(stream=) return, {t}"]["ok"] for t in ("cuda_ipc", "nixl", "shm")] == [True, False, False]
    assert "19/20 still moving" in lines["wait(stream=) return, shm"]["text"]
    head = {"versions": {}, "hostname": "h", "date": "2026-01-01"}
    assert report.to_json(result, head, p2p.BenchConfig(budget=Budget()))["wait_returns"] == returns


def test_bench_summary_holds_4k_gpu_graph_latency_against_its_goal():
    """A 4 KiB GPU row replayed from a graph becomes a summary line, ok only at <= 10 µs, naming the stream,
    copy and CPU-timed rows beside it; a GPU run without graph rows says why (no --graphs, or a transport
    that is not stream-ordered); a host-only run has no such line."""
    from tensorwire.bench import p2p
    from tensorwire.bench import p2p_report as report

    def record(op, path, median_us, transport="cuda_ipc"):
        gbps = 4096 / median_us / 1e3
        return p2p.Record("p2p", "cuda", op, path, transport, 4096, 20, median_us, median_us, median_us, gbps)

    def lines_of(records):
        result = p2p.BenchResult(records=records, idle=[], raw_config="raw", progress_wakeup_ms=10,
                                 default_threads=1, ucx_version=None)
        return {line["name"]: line for line in report.summary(result)}

    name = "4 KiB cuda {} GPU time, post to completion on the stream".format
    lines = lines_of([record("READ", p2p.TENSORWIRE_GRAPH, 6.5), record("READ", "copy", 3.0, "torch"),
                      record("READ", p2p.TENSORWIRE, 15.5), record("WRITE", p2p.TENSORWIRE_GRAPH, 10.5),
                      record("WRITE", p2p.TENSORWIRE_STREAM, 7.0)])
    read, write = lines[name("READ")], lines[name("WRITE")]
    assert (read["ok"], read["value"], write["ok"], write["value"]) == (True, 6.5, False, 10.5)
    assert "copy 3.0 µs" in read["text"] and "tensorwire (stream) 7.0 µs" in write["text"]
    assert "post() + wait(): 15.5 µs" in read["text"] and "post() + wait()" not in write["text"]
    unmeasured = lines_of([record("READ", p2p.TENSORWIRE_STREAM, 7.0)])[name("READ")]
    assert unmeasured["ok"] is None and "(add --graphs)" in unmeasured["text"]
    no_4k = lines_of([record("WRITE", p2p.TENSORWIRE_GRAPH, 3.0)])[name("READ")]
    assert no_4k["ok"] is None and "add 4K to --sizes, and --graphs" in no_4k["text"]
    over_nixl = lines_of([record("READ", p2p.TENSORWIRE, 40.0, "nixl")])[name("READ")]
    assert over_nixl["ok"] is None and "chose nixl, which is not stream-ordered" in over_nixl["text"]
    assert not any("cuda" in name for name in lines_of([]))


def test_deadlines_run_each_action_once_at_its_time_and_sleep_otherwise():
    """An armed action runs once, not before its deadline; arming an armed key keeps the earlier deadline and
    its action; disarming forgets it; an action that raises warns and spares the others; a deadline beyond
    what a thread can sleep does not end the thread; the thread does not wake while nothing is due, nor when a
    later deadline than the one it sleeps until is armed."""
    import threading
    import time

    from tensorwire.progress import Deadlines

    deadlines = Deadlines()
    ran: list[tuple[str, float]] = []
    done = threading.Event()

    def action(name: str):
        return lambda: ran.append((name, time.monotonic()))

    def boom():
        raise RuntimeError("boom")

    start = time.monotonic()
    try:
        deadlines.arm("huge", start + 1e10, action("huge"))  # beyond threading.TIMEOUT_MAX
        deadlines.arm("a", start + 0.10, action("a-later"))
        deadlines.arm("a", start + 0.05, action("a"))  # earlier: replaces
        deadlines.arm("b", start + 0.06, action("b"))
        deadlines.arm("b", start + 0.20, action("b-later"))  # later: the first stays
        deadlines.arm("c", start + 0.02, action("c"))
        deadlines.disarm("c")
        deadlines.arm("boom", start + 0.01, boom)
        deadlines.arm("last", start + 0.15, done.set)
        with pytest.warns(RuntimeWarning, match="a timeout action failed: RuntimeError: boom"):
            assert done.wait(5), "the last action never ran: the thread ended or overslept"
        assert [name for name, _ in ran] == ["a", "b"], ran
        assert ran[0][1] >= start + 0.05 and ran[1][1] >= start + 0.06, (start, ran)
        time.sleep(0.05)
        woken = deadlines.wakeups
        deadlines.arm("far", time.monotonic() + 100, action("far"))  # earlier than "huge": wakes it once
        time.sleep(0.05)
        woken_after_far = deadlines.wakeups
        deadlines.arm("farther", time.monotonic() + 200, action("farther"))  # later than "far": no wake
        time.sleep(0.1)
        assert woken_after_far == woken + 1 and deadlines.wakeups == woken_after_far, (woken, woken_after_far,
                                                                                      deadlines.wakeups)
    finally:
        deadlines.close()
    assert not deadlines._thread.is_alive() and [name for name, _ in ran] == ["a", "b"]
