"""Trust: the job token seals every value tensorwire puts in the store, forged and corrupt values are refused
with typed errors (and do not cut a peer off), a rank is claimed once, the store listens on MASTER_ADDR only,
and a peer's shm export cannot make this process write into an arbitrary file.

The forger is what anyone who reaches the store port can run: a plain ``torch.distributed.TCPStore`` client,
in a process of its own, without ``TENSORWIRE_JOB_TOKEN``.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import tensorwire as tw
from tensorwire import config
from tensorwire.backends.base import Op, Segment
from tensorwire.backends.shm import _EXPORT, ShmBackend
from tensorwire.descriptors import MemoryKind, TensorDesc
from tensorwire.meeting.liveness import Liveness
from tensorwire.meeting.store_sockets import listen_socket
from tensorwire.memory_map import MemoryMap, host_identity, typed_decoding
from tensorwire.sealing import seal, unseal
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch

TOKEN = b"0123456789abcdef0123456789abcdef"
HERE = os.path.dirname(os.path.abspath(__file__))


# --- helpers ---------------------------------------------------------------------------------------
def _signal(directory: str, name: str) -> None:
    with open(os.path.join(directory, name), "w"):
        pass


def _await(directory: str, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(directory, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name!r} signal within {timeout}s")
        time.sleep(0.01)


def _raw_store(port: int) -> dist.Store:
    """What any process that reaches the port gets: a plain client of the job's store, under tensorwire's prefix."""
    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    return dist.PrefixStore("tensorwire/", client)


def _forge(port: int, generation: int) -> None:
    """Run in a process without the token: write forged values under every kind of key tensorwire reads."""
    if "TENSORWIRE_JOB_TOKEN" in os.environ:
        raise RuntimeError("the forger must run without the job token")
    store = _raw_store(port)
    real_map = store.get("memmap/1")
    everything = TensorDesc(1, 0x1000, 1 << 40, MemoryKind.CPU, -1, 1)
    export = _EXPORT.pack(0x1000, 1 << 40, 0, 0, 0, len(b"/etc/passwd")) + b"/etc/passwd"
    forged_map = MemoryMap(1 << 20, {"host": host_identity().encode(), "shm": export}, [everything]).pack()
    forged = {
        "memmap/1": forged_map,  # rank 1's memory map: all of its address space, an shm export
        "user/1/kv": TensorDesc.pack(everything),  # a published descriptor
        "user/1/replayed": real_map,  # a real, sealed value copied under another key
        "user/1/macked": b"TWA\x01" + os.urandom(32) + TensorDesc.pack(everything),  # a guessed MAC
        f"barrier/{generation}/1": b"1",  # rank 1 arrived (it has not)
        f"barrier/{generation}/done": b"1",  # everybody arrived
        "departed/1": b"1",  # rank 1 has closed (it has not)
    }
    for key, value in forged.items():
        store.set(key, value)
    store.add(f"barrier/{generation}", 100)  # the counters a barrier and a departure used to trust
    store.add("departed", 1)
    print(json.dumps(sorted(forged)))


def _run_forger(port: int, generation: int) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TENSORWIRE_JOB_TOKEN"}
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_trust; test_trust._forge({port}, {generation})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"the forger failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _refused(fn) -> str:
    """The name of the typed error ``fn`` raised; fails when it returned (a forged value was accepted)."""
    try:
        fn()
    except tw.AuthenticationError as e:
        assert "TENSORWIRE_JOB_TOKEN" in str(e), str(e)
        return type(e).__name__
    except tw.TensorwireError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("a forged value was accepted")


# --- sealed values ---------------------------------------------------------------------------------
def test_a_sealed_value_opens_only_under_its_key_with_its_token():
    secret = b"0x7f3a2c000000 tw1-nixl-metadata /dev/shm/kv"
    sealed = seal(TOKEN, "memmap/1", secret)
    assert unseal(TOKEN, "memmap/1", sealed) == secret
    # Encrypted, not only authenticated: no run of the plaintext shows, and two seals of one value differ.
    assert all(secret[i:i + 4] not in sealed for i in range(len(secret) - 3))
    assert seal(TOKEN, "memmap/1", secret) != sealed
    with pytest.raises(tw.AuthenticationError, match="'user/1/kv'.*does not open"):
        unseal(TOKEN, "user/1/kv", sealed)  # replayed under another key
    with pytest.raises(tw.AuthenticationError, match="does not open"):
        unseal(b"another job's token, same length", "memmap/1", sealed)
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(tw.AuthenticationError, match="does not open"):
        unseal(TOKEN, "memmap/1", tampered)
    with pytest.raises(tw.AuthenticationError, match="is not sealed"):
        unseal(TOKEN, "memmap/1", b"value")
    with pytest.raises(tw.AuthenticationError, match="this process has no TENSORWIRE_JOB_TOKEN"):
        unseal(None, "memmap/1", sealed)
    assert unseal(None, "memmap/1", b"value") == b"value"  # an unauthenticated job reads values as they are
    assert issubclass(tw.AuthenticationError, PermissionError)


def test_the_job_token_is_read_by_config_and_never_shown(monkeypatch):
    monkeypatch.delenv("TENSORWIRE_JOB_TOKEN", raising=False)
    assert config.load().job_token is None
    authenticated, reason = config.job_token_status()
    assert not authenticated and "not set" in reason and "secrets.token_hex" in reason
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", "short")
    with pytest.raises(tw.InvalidArgumentError, match="5 characters, fewer than 16"):
        config.load()
    assert config.job_token_status()[0] is False
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", TOKEN.decode())
    loaded = config.load()
    assert loaded.job_token == TOKEN and TOKEN.decode() not in repr(loaded)
    assert config.job_token_status()[0] is True


@pytest.mark.slow
def test_launch_gives_each_job_a_fresh_token_without_touching_this_process():
    before = os.environ.get("TENSORWIRE_JOB_TOKEN")
    first, second = launch(_token_of_rank, 2), launch(_token_of_rank, 2)
    assert first[0] == first[1] and second[0] == second[1], "the ranks of one job must share the token"
    assert first[0] != second[0] and len(first[0]) >= 16
    assert os.environ.get("TENSORWIRE_JOB_TOKEN") == before
    assert launch(_token_of_rank, 1, env={"TENSORWIRE_JOB_TOKEN": ""}) == [""]


def _token_of_rank():
    return os.environ.get("TENSORWIRE_JOB_TOKEN")


# --- corrupt values: typed errors only --------------------------------------------------------------
def _real_map() -> bytes:
    export = _EXPORT.pack(0x7000, 4096, 0, 1, 2, len(b"/dev/shm/kv")) + b"/dev/shm/kv"
    regions = [TensorDesc(1, 0x7000 + 8192 * i, 4096, MemoryKind.CPU, -1, 3) for i in range(3)]
    return MemoryMap(7, {"host": b"node/boot", "nixl": os.urandom(64), "shm": export}, regions).pack()


def _decoders(source: str):
    return {
        "MemoryMap.unpack": lambda blob: MemoryMap.unpack(blob, source),
        "MemoryMap.epoch_of": lambda blob: MemoryMap.epoch_of(blob, source),
        "TensorDesc.unpack": lambda blob: TensorDesc.unpack(blob, source=source),
        "ShmBackend.load_peer": lambda blob: ShmBackend().load_peer(1, blob),
    }


def test_corrupt_store_values_raise_only_typed_errors():
    """Random bytes, truncations and bit flips of real packed values: every decoder of a store value raises
    InvalidArgumentError naming where the value came from, nothing else."""
    rng = random.Random(18)
    source = "the memory map of rank 1 (store key 'memmap/1')"
    real = {"MemoryMap": _real_map(), "TensorDesc": TensorDesc.pack(MemoryMap.unpack(_real_map()).regions),
            "shm": _EXPORT.pack(1, 2, 3, 4, 5, 11) + b"/dev/shm/kv"}
    samples = [rng.randbytes(rng.randrange(0, 200)) for _ in range(300)]
    for blob in real.values():
        samples += [blob[:n] for n in range(len(blob))]
        for _ in range(200):
            flipped = bytearray(blob)
            flipped[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
            samples.append(bytes(flipped))
    refused = 0
    for name, decode in _decoders(source).items():
        for blob in samples:
            try:
                decode(blob)
            except tw.InvalidArgumentError as e:
                refused += 1
                assert name == "ShmBackend.load_peer" or source in str(e), f"{name}: {e}"
            except Exception as e:  # noqa: BLE001 - the point of the test
                raise AssertionError(f"{name} raised {type(e).__name__}: {e} for {blob!r}") from e
    assert refused > len(samples)  # most samples are refused by several decoders


def test_forged_counts_and_lengths_are_refused_before_allocating():
    import tracemalloc

    huge_desc = struct.pack("<3sBI", b"TWD", 1, 0xFFFFFFFF)  # four billion records announced, none there
    huge_section = struct.pack("<IH", 1, 1) + struct.pack("<HI", 4, 0xFFFFFFFF) + b"host"
    many_sections = struct.pack("<IH", 1, 0xFFFF)
    tracemalloc.start()
    try:
        for blob, problem in ((huge_desc, "for 4294967295 records"), (huge_section, "claims 4 \\+ 4294967295"),
                              (many_sections, "section 0 of 65535")):
            with pytest.raises(tw.InvalidArgumentError, match=problem):
                MemoryMap.unpack(blob, "memmap/1") if blob is not huge_desc else TensorDesc.unpack(blob)
        with pytest.raises(tw.InvalidArgumentError, match="a path of 65535 bytes"):
            ShmBackend().load_peer(1, _EXPORT.pack(0, 1 << 40, 0, 0, 0, 0xFFFF))
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_a_map_without_its_host_or_with_a_foreign_section_is_refused():
    with pytest.raises(tw.InvalidArgumentError, match="no 'host' section"):
        MemoryMap.unpack(MemoryMap(1, {"nixl": b"x"}, []).pack(), "memmap/1")
    with pytest.raises(tw.InvalidArgumentError, match="'host' section is not UTF-8"):
        MemoryMap.unpack(MemoryMap(1, {"host": b"\xff\xfe"}, []).pack(), "memmap/1")
    with pytest.raises(tw.InvalidArgumentError, match="appears twice"):
        MemoryMap.unpack(struct.pack("<IH", 1, 2) + 2 * (struct.pack("<HI", 4, 1) + b"host1")
                         + TensorDesc.pack([]), "memmap/1")
    with pytest.raises(tw.InvalidArgumentError, match="memmap/1, section 'cuda_ipc': decoding failed"):
        with typed_decoding("memmap/1, section 'cuda_ipc'"):
            struct.unpack_from("<Q", b"abc")


# --- shm files -------------------------------------------------------------------------------------
@pytest.fixture
def shm_file():
    """A 64 KiB file directly in /dev/shm, mapped here; removed afterwards."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = f"/dev/shm/tensorwire-trust-{os.getpid()}-{random.randrange(1 << 30)}"
    tensor = torch.from_file(path, shared=True, size=1 << 16, dtype=torch.uint8)
    yield path, tensor
    os.unlink(path)


def _export_of(path: str, nbytes: int, addr: int = 0x10000, offset: int = 0, identity: str | None = None) -> bytes:
    found = os.stat(identity or path)
    encoded = path.encode()
    return _EXPORT.pack(addr, nbytes, offset, found.st_dev, found.st_ino, len(encoded)) + encoded


def _shm_write(backend: ShmBackend, export: bytes, nbytes: int = 8):
    """rank 1 exported ``export``; WRITE ``nbytes`` of 0xAB from here into its start."""
    backend.load_peer(1, export)
    remote = Segment(0x10000, nbytes, MemoryKind.CPU, -1)
    source = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    local = Segment(source.data_ptr(), nbytes, MemoryKind.CPU, -1)
    reached = backend.reaches(1, [remote])
    try:
        request = backend.prepare(Op.WRITE, [local], [remote], 1, None)
    except tw.TransferError as e:
        return reached, str(e)
    backend.post(request, None)
    return reached, "written"


@pytest.mark.parametrize("authenticated", [False, True])
def test_an_shm_export_of_an_own_file_in_dev_shm_is_mapped(shm_file, authenticated):
    path, tensor = shm_file
    backend = ShmBackend(authenticated=authenticated)
    try:
        assert _shm_write(backend, _export_of(path, 4096)) == (True, "written")
        assert tensor[:8].tolist() == [0xAB] * 8 and tensor[8] == 0
    finally:
        backend.close()


@pytest.mark.parametrize("authenticated", [False, True])
def test_a_forged_shm_export_never_writes_into_another_file(tmp_path, shm_file, authenticated):
    """A symlink planted in /dev/shm, a file elsewhere (in an unauthenticated job), another file under the
    exported name, a range past the file's end, a FIFO: refused with TransferError, nothing written, no
    SIGBUS, no hang."""
    path, _ = shm_file
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(4096))
    link = f"{path}-link"
    os.symlink(victim, link)
    fifo = f"{path}-fifo"
    os.mkfifo(fifo)
    backend = ShmBackend(authenticated=authenticated)
    try:
        cases = {
            "symlink": (_export_of(link, 4096, identity=str(victim)), "is a symbolic link"),
            "past the end": (_export_of(path, 1 << 20), "has 65536 bytes, the export reaches byte 1048576"),
            "another file": (_export_of(path, 4096, identity=str(victim)), "is not the file the peer mapped"),
            "fifo": (_export_of(fifo, 4096), "is not a regular file"),
        }
        if not authenticated:
            cases["file outside /dev/shm"] = (_export_of(str(victim), 4096), "is not directly in /dev/shm")
            cases["/etc/passwd"] = (_export_of("/etc/passwd", 8), "is not directly in /dev/shm")
        for name, (export, reason) in cases.items():
            reached, outcome = _shm_write(backend, export)
            assert not reached and "shm: refusing rank 1's shared file" in outcome and reason in outcome, \
                (name, outcome)
        assert victim.read_bytes() == bytes(4096)
    finally:
        backend.close()
        os.unlink(link)
        os.unlink(fifo)


def test_a_malformed_shm_path_is_refused_at_load():
    for path in (b"relative/name", b"/dev/shm/../../etc/passwd", b"//dev/shm/x", b"/dev/shm/a\x00b", b"/"):
        with pytest.raises(tw.InvalidArgumentError, match="not a plain absolute path"):
            ShmBackend().load_peer(1, _EXPORT.pack(0, 8, 0, 0, 0, len(path)) + path)


# --- the store's socket ----------------------------------------------------------------------------
def test_the_store_socket_is_bound_to_master_addr():
    listener, why_not = listen_socket("127.0.0.1", 0)
    try:
        assert why_not == "" and listener.getsockname()[0] == "127.0.0.1"
        with pytest.raises(tw.InvalidArgumentError, match="EADDRINUSE"):
            listen_socket("127.0.0.1", listener.getsockname()[1])
    finally:
        listener.close()


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* shows them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


# --- real processes --------------------------------------------------------------------------------
def _forged_values_are_refused(directory: str):
    """A job with the token; a process without it forges a memory map, descriptors, a replayed value, barrier
    entries and a departure. Every forged value is refused with a typed error, the real values published
    again are used, and rank 0's store waits for rank 1's real departure."""
    comm = tw.init(timeout=INIT_TIMEOUT)
    peer, n = 1 - comm.rank, 1024
    buf, out = rank_values(comm.rank, n), sentinel(n)
    reg = comm.register([buf, out])
    comm.publish("kv", reg.descs[:1])
    remote = comm.lookup("kv", peer, timeout=WAIT)[0]
    comm.read(out, remote, timeout=WAIT)
    assert_equal(out, rank_values(peer, n), "READ before the forgery")
    comm.barrier(timeout=WAIT)  # generation 1
    refusals = {}
    if comm.rank == 0:
        port = int(os.environ["MASTER_PORT"])
        forged_keys = _run_forger(port, generation=2)
        assert len(forged_keys) == 7, forged_keys
        refusals["lookup kv"] = _refused(lambda: comm.lookup("kv", 1, timeout=WAIT))
        refusals["lookup replayed"] = _refused(lambda: comm.lookup("replayed", 1, timeout=WAIT))
        refusals["lookup macked"] = _refused(lambda: comm.lookup("macked", 1, timeout=WAIT))
        refusals["prepare"] = _refused(lambda: comm.prepare(tw.READ, out, remote))
        refusals["read forged desc"] = _refused(
            lambda: comm.read(out, TensorDesc(1, remote.addr, 4 * n, MemoryKind.CPU, -1, 1 << 20), timeout=WAIT))
        refusals["barrier arrival"] = _refused(lambda: comm.barrier(timeout=WAIT))
        assert_equal(buf, rank_values(0, n), "rank 0's memory after the forgery")
        _signal(directory, "rank0-checked")
        _await(directory, "rank1-republished")
        out.fill_(-1)
        comm.read(out, comm.lookup("kv", 1, timeout=WAIT)[0], timeout=WAIT)  # the real values are back
        assert_equal(out, rank_values(1, n, offset=7), "READ after rank 1 published again")
        comm.read(out, remote, timeout=WAIT)  # the descriptor looked up before the forgery still works
    else:
        _await(directory, "rank0-checked")
        refusals["barrier done"] = _refused(lambda: comm.barrier(timeout=WAIT))
        buf.copy_(rank_values(1, n, offset=7))
        extra = comm.register(torch.zeros(16))  # publishes rank 1's memory map again
        comm.publish("kv", reg.descs[:1])
        _signal(directory, "rank1-republished")
    comm.barrier(timeout=WAIT)  # generation 3: nothing forged there
    t0 = time.perf_counter()
    if comm.rank == 1:
        time.sleep(1.5)  # rank 0 is closing: its store must stay up for us despite the forged departure
        assert comm.lookup("kv", 1, timeout=WAIT)[0] == reg.descs[0]
        extra.close()
    comm.close()
    return refusals, time.perf_counter() - t0


@pytest.mark.slow
def test_forged_values_from_outside_the_job_are_refused(tmp_path):
    (rank0, close0), (rank1, _) = launch(_forged_values_are_refused, 2, str(tmp_path))
    assert rank0 == {k: "AuthenticationError" for k in ("lookup kv", "lookup replayed", "lookup macked", "prepare",
                                                          "read forged desc", "barrier arrival")}, rank0
    assert rank1 == {"barrier done": "AuthenticationError"}, rank1
    assert close0 > 1.0, f"rank 0 closed its store after {close0:.2f}s, trusting the forged departure of rank 1"


def _corrupt_maps_are_typed_and_do_not_poison():
    """An unauthenticated job (no token): one warning says so, on the host's first rank only; corrupt memory maps
    of rank 1 make prepare raise InvalidArgumentError naming rank 1, and once the real map is back, prepare works
    again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = tw.init(timeout=INIT_TIMEOUT)
    unauthenticated = [str(w.message) for w in caught if "unauthenticated" in str(w.message)]
    assert len(unauthenticated) == (1 if comm.rank == 0 else 0), [str(w.message) for w in caught]
    assert all(w.category is tw.TensorwireWarning for w in caught if "unauthenticated" in str(w.message))
    n = 256
    buf, out = rank_values(comm.rank, n), sentinel(n)
    reg = comm.register([buf, out])
    comm.publish("kv", reg.descs[:1])
    remote = comm.lookup("kv", 1 - comm.rank, timeout=WAIT)[0]
    comm.barrier(timeout=WAIT)
    errors = []
    if comm.rank == 0:
        store = _raw_store(int(os.environ["MASTER_PORT"]))
        real = store.get("memmap/1")
        shm_garbage = MemoryMap(MemoryMap.epoch_of(real) + 1, {"host": host_identity().encode(), "shm": b"\x01" * 50},
                                []).pack()
        noise = random.Random(5).randbytes(300)
        for corrupt in (real[:5], real[:-3], real[:6] + b"\xff" * 6 + real[12:], shm_garbage, noise):
            store.set("memmap/1", corrupt)
            try:
                comm.prepare(tw.READ, out, remote)
            except tw.InvalidArgumentError as e:
                errors.append(str(e))
        store.set("memmap/1", real)
        comm.read(out, remote, timeout=WAIT)
        assert_equal(out, rank_values(1, n), "READ after the real map is back")
        assert all("memory map of rank 1" in e or "rank 1's memory map" in e for e in errors), errors
    comm.barrier(timeout=WAIT)
    comm.close()
    return len(errors)


def test_corrupt_memory_maps_raise_typed_errors_and_do_not_cut_the_peer_off():
    assert launch(_corrupt_maps_are_typed_and_do_not_poison, 2, env={"TENSORWIRE_JOB_TOKEN": ""}) == [5, 0]


def _duplicate_rank(directory: str):
    rank = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"])
    if rank == 1:
        _await(directory, "claim-forged")
    comm = tw.init(timeout=INIT_TIMEOUT)
    result = None
    if rank == 0:
        listening = _listening_addresses(port)
        _raw_store(port).set("rank/1", b"a claim from outside the job")
        _signal(directory, "claim-forged")
        result = listening
    else:
        code = ("import tensorwire as tw\n"
                "try:\n"
                f"    tw.init(rank=1, world_size=2, master_addr='127.0.0.1', master_port={port}, timeout=10)\n"
                "except tw.TensorwireError as e:\n"
                "    print(type(e).__name__, e)\n"
                "else:\n"
                "    print('joined')\n")
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        result = done.stdout.strip(), time.perf_counter() - t0
    comm.barrier(timeout=WAIT + 60)  # rank 1 runs a whole process's init (at most 60 s) meanwhile
    comm.close()
    return result


def test_a_second_process_claiming_a_joined_rank_is_refused(tmp_path):
    """Rank 1 joins although a process outside the job wrote a claim for it first; a second process of the
    job claiming rank 1 is refused with a typed error. The store listens on MASTER_ADDR (127.0.0.1) only."""
    listening, (duplicate, _) = launch(_duplicate_rank, 2, str(tmp_path))
    assert listening == ["0100007F"], f"the store listens on {listening}, not only on 127.0.0.1"
    assert duplicate.startswith("InvalidArgumentError init: rank 1 of 2 is already taken"), duplicate
    assert "start each rank once" in duplicate, duplicate


# --- liveness handshakes ---------------------------------------------------------------------------
class _RecordingProxy:
    """Forwards TCP to ``target`` and keeps every byte each way: what anyone on the path sees."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.to_target, self.from_target = bytearray(), bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = target
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(self._target)
        for source, sink, seen in ((client, upstream, self.to_target), (upstream, client, self.from_target)):
            threading.Thread(target=self._pump, args=(source, sink, seen), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, seen: bytearray) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                seen += data
                sink.sendall(data)
            except OSError:
                return


def _liveness(rank: int, token: bytes, address: tuple[str, int] | None = None) -> Liveness:
    """Rank ``rank`` of 2 on loopback; it finds its peer at ``address`` (None: not published)."""
    return Liveness(rank, 2, 2.0, "127.0.0.1", token, lambda peer: address)


def _poll(checks, until, seconds: float = 10.0) -> bool:
    """Run each ``(liveness, rank)`` check, as waits do, until ``until()`` (True) or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for liveness, rank in checks:
            liveness.lost(rank, fresh=True)
        if until():
            return True
        time.sleep(0.005)
    return False


def _offer(listener: Liveness, data: bytes) -> bytes:
    """Connect to ``listener`` as an outsider, send ``data`` and return all it sends back until it closes the
    connection (it polls meanwhile); fails if it keeps the connection open."""
    received = bytearray()
    with socket.create_connection(listener.address) as sock:
        sock.sendall(data)
        sock.setblocking(False)

        def closed() -> bool:
            try:
                chunk = sock.recv(4096)
            except BlockingIOError:
                return False
            except ConnectionResetError:
                return True
            received.extend(chunk)
            return chunk == b""

        assert _poll([(listener, 1)], closed), f"the listener kept the connection open (it sent {bytes(received)!r})"
    return bytes(received)


def test_a_replayed_liveness_handshake_is_refused():
    """Someone on the path records a genuine handshake of rank 1 with rank 0 and replays it on a connection of
    its own: rank 0 must not count that connection for rank 1, or closing it would make rank 1 look gone."""
    listener = _liveness(0, TOKEN)
    proxy = _RecordingProxy(listener.address)
    genuine = _liveness(1, TOKEN, ("127.0.0.1", proxy.port))
    try:
        genuine.watch(0)
        _poll([(genuine, 0), (listener, 1)], lambda: proxy.from_target[-1:] == b"K")  # rank 0 accepted rank 1
        recorded = bytes(proxy.to_target)
        answered = _offer(listener, recorded)  # replayed: hello and answer as rank 1 sent them
        assert answered[-1:] != b"K", "the replayed answer was accepted"
        assert listener.lost(1, fresh=True) is None, "rank 0 counted the replayed connection for rank 1"
        assert 1 in listener.callers() and genuine.lost(0, fresh=True) is None
    finally:
        genuine.close()
        listener.close()


def test_a_liveness_handshake_without_the_job_token_is_refused():
    """A process with another token (or none) connects as rank 1: it is never counted, so closing its
    connection does not make rank 1 look gone, and it does not take rank 0 for gone either."""
    listener = _liveness(0, TOKEN)
    outsider = _liveness(1, b"another job's token, 32 bytes..", listener.address)
    try:
        outsider.watch(0)
        _poll([(outsider, 0), (listener, 1)], lambda: False, seconds=1.0)  # several refused handshakes
        assert outsider.lost(0, fresh=True) is None, "a refused handshake made the listener look gone"
        outsider.close()
        assert listener.lost(1, fresh=True) is None, "rank 0 counted the outsider's connection for rank 1"
        assert _offer(listener, b"TWL\x01\x00\x00\x00" + bytes(32))[-1:] != b"K", "a guessed answer was accepted"
    finally:
        outsider.close()
        listener.close()


def test_a_rank_busy_during_the_liveness_handshake_reconnects_and_a_gone_one_is_lost():
    """Rank 1 connects and then does not call into tensorwire for longer than the liveness bound: rank 0 closes
    the unanswered connection, and rank 1's next check reconnects instead of taking rank 0 for gone. Once rank 0
    has really closed, rank 1's next handshake is refused by the kernel and rank 0 is gone."""
    listener = _liveness(0, TOKEN)
    connector = _liveness(1, TOKEN, listener.address)
    try:
        connector.watch(0)
        first = connector._sockets[0][0]
        _poll([(listener, 1)], lambda: False, seconds=2.0 + 0.5)  # rank 1 is busy: only rank 0 polls
        assert _poll([(connector, 0), (listener, 1)], lambda: not connector._outgoing), "no handshake after"
        assert connector.lost(0, fresh=True) is None, "a rank busy elsewhere took a peer for gone"
        assert connector._sockets[0] and connector._sockets[0][0] is not first, "rank 0 kept the unanswered one"
        listener.close()
        assert _poll([(connector, 0)], lambda: connector.lost(0) is not None), "rank 0's close went unnoticed"
    finally:
        connector.close()
        listener.close()
