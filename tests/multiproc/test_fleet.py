"""Fleets: members launched apart meet in a directory (``tensorwire directory``, its own process), find each other
by name, move KV blocks, and fail alone: a killed member costs only its transfers, a member started again under
its name is a new rank, a process without the token cannot join.

Every party is a separate process: the directory, two "prefill" members, a "decode" member started after them.
They coordinate through files in a temporary directory (``<name>.ready``, ``stop``), never through tensorwire.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tensorwire as tw

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
TOKEN = "fleet-token-0123456789abcdef"
LIVENESS_S = 2.0
BLOCKS, WIDTH = 1000, 64  # int32 values per block: 256-byte blocks
WAIT = 30.0


def _value(member: int, incarnation: int = 0) -> torch.Tensor:
    """What member ``member`` (its index in its name) holds: block b, element e = (member, incarnation, b, e)."""
    base = (member + 1) * 100_000_000 + incarnation * 10_000_000
    return torch.arange(BLOCKS * WIDTH, dtype=torch.int32).view(BLOCKS, WIDTH) + base


def _await(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)


def _shm_prefix(work: str) -> str:
    return f"tw-fleet-{os.path.basename(work)}"


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


# --- the parties (run as `python -c "import test_fleet; test_fleet._<party>(...)"`) -------------------------
def _prefill(directory: str, name: str, work: str, incarnation: int, memory: str) -> None:
    comm = tw.init(directory=directory, name=name, timeout=WAIT)
    member = int(name.rsplit("-", 1)[1])
    if memory == "shm":  # the harness removes the file, also after a kill -9
        path = os.path.join("/dev/shm", f"{_shm_prefix(work)}-{name}-{incarnation}")
        blocks = torch.from_file(path, shared=True, size=BLOCKS * WIDTH, dtype=torch.int32).view(BLOCKS, WIDTH)
        blocks.copy_(_value(member, incarnation))
    else:
        blocks = _value(member, incarnation).clone()
    pool = comm.register_blocks(blocks)
    comm.publish_blocks("kv", pool)
    with open(os.path.join(work, f"{name}.{incarnation}.ready"), "w") as f:
        f.write(str(comm.rank))
    _await(os.path.join(work, f"{name}.stop"), timeout=300)
    pool.close()
    comm.close()


def _decode(directory: str, work: str, memory: str) -> None:
    """Reads every block of both prefill members by name, then loops over both while prefill-1 is killed and
    started again; writes what it saw to ``decode.json``."""
    comm = tw.init(directory=directory, name="decode-0", timeout=WAIT)
    seen: dict = {"rank": comm.rank}
    out = torch.zeros(BLOCKS, WIDTH, dtype=torch.int32)
    pool = comm.register_blocks(out)
    ids = torch.randperm(BLOCKS).tolist()
    transport = "shm" if memory == "shm" else "nixl"

    def reader(name: str):
        rank = comm.rank_of(name, timeout=WAIT)
        remote = comm.lookup_blocks("kv", rank, timeout=WAIT)
        return rank, comm.prepare_blocks(tw.READ, pool, remote, transport=transport)

    def read(transfer, incarnation: int, member: int) -> bool:
        out.zero_()
        transfer.post(ids, ids)
        transfer.wait(timeout=WAIT)
        return bool(torch.equal(out[ids], _value(member, incarnation)[ids]))

    readers = {name: reader(name) for name in ("prefill-0", "prefill-1")}
    seen["first"] = {name: read(x, 0, int(name[-1])) for name, (_, x) in readers.items()}
    seen["ranks"] = {name: rank for name, (rank, _) in readers.items()}
    seen["members_before"] = sorted(m.name for m in comm.members().values())
    _touch(os.path.join(work, "decode.looping"))
    # Read from both until prefill-1 is gone: its transfer fails typed, prefill-0's keeps going.
    errors, good_after, t_kill = [], 0, None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not errors or good_after < 20):
        if os.path.exists(os.path.join(work, "killed")) and t_kill is None:
            with open(os.path.join(work, "killed")) as f:
                t_kill = float(f.read())
        assert read(readers["prefill-0"][1], 0, 0), "a read from the live member was wrong"
        if errors:
            good_after += 1
            continue
        try:
            read(readers["prefill-1"][1], 0, 1)
        except tw.TensorwireError as e:
            errors.append((type(e).__name__, time.time() - (t_kill or time.time())))
    seen["errors"] = errors
    seen["good_after"] = good_after
    gone_at = time.monotonic()
    while "prefill-1" in {m.name for m in comm.members().values()} and time.monotonic() - gone_at < 30:
        time.sleep(0.05)
    seen["dropped_after_s"] = time.monotonic() - gone_at
    seen["members_after_kill"] = sorted(m.name for m in comm.members().values())
    # The old handle stays refused; a new prefill-1 is a new rank with its own bytes.
    try:
        read(readers["prefill-1"][1], 0, 1)
        seen["old_handle"] = "worked"
    except tw.TensorwireError as e:
        seen["old_handle"] = type(e).__name__
    _touch(os.path.join(work, "restart"))
    _await(os.path.join(work, "prefill-1.1.ready"))
    rank, again = reader("prefill-1")
    seen["new_rank"] = rank
    seen["again"] = read(again, 1, 1)
    seen["members_end"] = sorted(m.name for m in comm.members().values())
    with open(os.path.join(work, "decode.json"), "w") as f:
        json.dump(seen, f)
    again.close()
    for _, x in readers.values():
        x.close()
    pool.close()
    comm.close()


def _decode_through_a_restart(directory: str, work: str) -> None:
    """Reads from prefill-0 while the directory is killed and started again empty; then reads from a member
    that joined after the restart."""
    comm = tw.init(directory=directory, name="decode-0", timeout=WAIT)
    out = torch.zeros(BLOCKS, WIDTH, dtype=torch.int32)
    pool = comm.register_blocks(out)
    ids = list(range(BLOCKS))
    seen: dict = {}

    def reader(name: str):
        rank = comm.rank_of(name, timeout=WAIT)
        return rank, comm.prepare_blocks(tw.READ, pool, comm.lookup_blocks("kv", rank, timeout=WAIT))

    def read(transfer, member: int) -> bool:
        out.zero_()
        transfer.post(ids, ids)
        transfer.wait(timeout=WAIT)
        return bool(torch.equal(out, _value(member)))

    rank0, first = reader("prefill-0")
    assert read(first, 0)
    _touch(os.path.join(work, "kill-directory"))
    _await(os.path.join(work, "directory-killed"))
    reads, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 1.0:  # the data plane does not need the directory
        assert read(first, 0), "a read while the directory was down returned wrong bytes"
        reads += 1
    seen["reads_while_down"] = reads
    try:
        comm.members()
        seen["members_while_down"] = "answered"
    except tw.TensorwireError as e:
        seen["members_while_down"] = f"{type(e).__name__}: {e}"
    _touch(os.path.join(work, "restart-directory"))
    _await(os.path.join(work, "directory-restarted"))
    t0, listed = time.monotonic(), []
    while time.monotonic() - t0 < LIVENESS_S + 10:
        try:
            listed = sorted(m.name for m in comm.members().values())
        except tw.TensorwireError:
            listed = []
        if listed == ["decode-0", "prefill-0"]:
            break
        time.sleep(0.05)
    seen["repopulated_after_s"] = time.monotonic() - t0
    seen["members_after_restart"] = listed
    _touch(os.path.join(work, "start-late-member"))
    late_rank, late = reader("prefill-2")
    seen["late_rank_is_new"] = late_rank not in (comm.rank, rank0)
    seen["late_read"] = read(late, 2)
    seen["old_read"] = read(first, 0)
    with open(os.path.join(work, "decode.json"), "w") as f:
        json.dump(seen, f)
    late.close()
    first.close()
    pool.close()
    comm.close()


def _stranger(directory: str, token: str | None, work: str) -> None:
    """Tries to join with another token (or none) and to read prefill-0's blocks."""
    result = {}
    try:
        comm = tw.init(directory=directory, name="stranger", timeout=10)
    except tw.TensorwireError as e:
        result["join"] = type(e).__name__
    else:
        try:
            rank = comm.rank_of("prefill-0", timeout=5)
            comm.lookup_blocks("kv", rank, timeout=5)
            result["join"] = "joined and looked up"
        except tw.TensorwireError as e:
            result["join"] = f"joined; then {type(e).__name__}"
        comm.close()
    with open(os.path.join(work, f"stranger-{token is not None}.json"), "w") as f:
        json.dump(result, f)


# --- the harness ------------------------------------------------------------------------------------------------
class _Fleet:
    """The processes of one test, killed (all of them) when it ends."""

    def __init__(self, work: str) -> None:
        self.work = work
        self.processes: list[subprocess.Popen] = []

    def env(self, token: str | None = TOKEN) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
        env.update({"PYTHONPATH": os.pathsep.join([SRC, HERE, env.get("PYTHONPATH", "")]),
                    "TENSORWIRE_LIVENESS_S": str(LIVENESS_S)})
        if token is not None:
            env["TENSORWIRE_JOB_TOKEN"] = token
        return env

    def directory(self, port: int = 0) -> str:
        """A ``tensorwire directory``: a new one lets members join at once; started again on its ``port``, it
        gives the members it had its default grace period to put their ranks back first."""
        grace = [] if port else ["--grace", "0"]
        process = subprocess.Popen([sys.executable, "-m", "tensorwire", "directory", "--port", str(port), *grace],
                                   env=self.env(), stdout=subprocess.PIPE, text=True)
        self.processes.append(process)
        self.directory_process = process
        line = process.stdout.readline()
        if "tcp://" not in line:
            raise RuntimeError(f"tensorwire directory said {line!r}")
        return line.split()[3]

    def start(self, call: str, token: str | None = TOKEN) -> subprocess.Popen:
        code = f"import test_fleet; test_fleet.{call}"
        process = subprocess.Popen([sys.executable, "-c", code], env=self.env(token))
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
        if os.path.isdir("/dev/shm"):
            for name in os.listdir("/dev/shm"):
                if name.startswith(_shm_prefix(self.work)):
                    os.unlink(os.path.join("/dev/shm", name))


@pytest.fixture
def fleet(tmp_path):
    f = _Fleet(str(tmp_path))
    yield f
    f.close()


def _finish(process: subprocess.Popen, what: str, timeout: float = 120) -> None:
    code = process.wait(timeout=timeout)
    assert code == 0, f"{what} exited with {code}"


def check_decode_saw(seen: dict) -> None:
    """What ``_decode`` must have seen: both members read by name, the killed one failing alone and typed, dropped
    from ``members()``, its old handle refused, its new incarnation a new rank read correctly."""
    assert seen["first"] == {"prefill-0": True, "prefill-1": True}, seen
    assert seen["members_before"] == ["decode-0", "prefill-0", "prefill-1"]
    assert seen["errors"] and seen["errors"][0][0] == "PeerLostError", seen["errors"]
    assert seen["errors"][0][1] < LIVENESS_S + 5.0, "the killed member's transfer failed too late"
    assert seen["good_after"] >= 20, "reads from the live member stopped with the other's death"
    assert seen["members_after_kill"] == ["decode-0", "prefill-0"]
    assert seen["dropped_after_s"] < LIVENESS_S + 5.0
    assert seen["old_handle"] in ("PeerLostError", "RevokedError"), seen["old_handle"]
    assert seen["new_rank"] not in seen["ranks"].values() and seen["new_rank"] > seen["rank"]
    assert seen["again"] is True
    assert seen["members_end"] == ["decode-0", "prefill-0", "prefill-1"]


@pytest.mark.parametrize("memory", ["nixl", "shm"])
@pytest.mark.slow
def test_members_launched_apart_meet_by_name_and_fail_alone(fleet, memory):
    if memory == "shm" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    work = fleet.work
    directory = fleet.directory()
    prefill = [fleet.start(f"_prefill({directory!r}, 'prefill-{i}', {work!r}, 0, {memory!r})") for i in range(2)]
    for i in range(2):
        _await(os.path.join(work, f"prefill-{i}.0.ready"))
    decode = fleet.start(f"_decode({directory!r}, {work!r}, {memory!r})")  # launched after them
    _await(os.path.join(work, "decode.looping"), timeout=120)
    time.sleep(0.3)
    with open(os.path.join(work, "killed.tmp"), "w") as f:
        f.write(str(time.time()))
    prefill[1].send_signal(signal.SIGKILL)
    os.rename(os.path.join(work, "killed.tmp"), os.path.join(work, "killed"))
    prefill[1].wait(timeout=30)
    _await(os.path.join(work, "restart"), timeout=120)
    fleet.start(f"_prefill({directory!r}, 'prefill-1', {work!r}, 1, {memory!r})")
    _finish(decode, "decode")
    _touch(os.path.join(work, "prefill-0.stop"))
    _touch(os.path.join(work, "prefill-1.stop"))
    _finish(prefill[0], "prefill-0")
    with open(os.path.join(work, "decode.json")) as f:
        seen = json.load(f)
    print(f"\n{memory}: {seen}")
    check_decode_saw(seen)


@pytest.mark.slow
def test_a_process_with_another_token_or_none_cannot_join(fleet):
    work = fleet.work
    directory = fleet.directory()
    prefill = fleet.start(f"_prefill({directory!r}, 'prefill-0', {work!r}, 0, 'nixl')")
    _await(os.path.join(work, "prefill-0.0.ready"))
    for token in ("another-token-0123456789", None):
        _finish(fleet.start(f"_stranger({directory!r}, {token!r}, {work!r})", token=token), "stranger")
    _touch(os.path.join(work, "prefill-0.stop"))
    _finish(prefill, "prefill-0")
    for token in (True, False):
        with open(os.path.join(work, f"stranger-{token}.json")) as f:
            result = json.load(f)
        assert result["join"] in ("AuthenticationError", "joined; then AuthenticationError",
                                  "joined; then WaitTimeoutError"), (token, result)


def test_launcher_only_calls_are_refused_in_a_fleet_and_names_are_unique(fleet):
    directory = fleet.directory()
    env = fleet.env()
    code = f"""
import tensorwire as tw
comm = tw.init(directory={directory!r}, name="solo", timeout=30)
for call in (lambda: comm.world_size, lambda: comm.barrier()):
    try:
        call()
        raise SystemExit("a launcher-world call worked in a fleet")
    except tw.InvalidArgumentError as e:
        assert "fleet" in str(e), e
try:
    tw.init(directory={directory!r}, name="solo", timeout=30)
    raise SystemExit("a second live member took the name 'solo'")
except tw.InvalidArgumentError as e:
    assert "present" in str(e), e
assert comm.rank_of("solo") == comm.rank and list(comm.members()) == [comm.rank]
comm.close()
again = tw.init(directory={directory!r}, name="solo", timeout=30)  # the name is free again, the rank is new
assert again.rank > comm.rank, (again.rank, comm.rank)
again.close()
"""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_directory_killed_and_started_again_costs_no_transfer(fleet):
    """While the directory is down, prepared transfers keep flowing and directory calls fail typed, naming it;
    started again empty, it is repopulated by the live members within the liveness bound, and a member that
    joins afterwards gets a new rank and is read from."""
    work = fleet.work
    directory = fleet.directory()
    port = int(directory.rsplit(":", 1)[1])
    prefill = fleet.start(f"_prefill({directory!r}, 'prefill-0', {work!r}, 0, 'nixl')")
    _await(os.path.join(work, "prefill-0.0.ready"))
    decode = fleet.start(f"_decode_through_a_restart({directory!r}, {work!r})")
    _await(os.path.join(work, "kill-directory"), timeout=120)
    fleet.directory_process.kill()
    fleet.directory_process.wait(timeout=30)
    _touch(os.path.join(work, "directory-killed"))
    _await(os.path.join(work, "restart-directory"), timeout=120)
    assert fleet.directory(port) == directory
    _touch(os.path.join(work, "directory-restarted"))
    _await(os.path.join(work, "start-late-member"), timeout=120)
    late = fleet.start(f"_prefill({directory!r}, 'prefill-2', {work!r}, 0, 'nixl')")
    _finish(decode, "decode")
    for name in ("prefill-0", "prefill-2"):
        _touch(os.path.join(work, f"{name}.stop"))
    _finish(prefill, "prefill-0")
    _finish(late, "prefill-2")
    with open(os.path.join(work, "decode.json")) as f:
        seen = json.load(f)
    print(f"\n{seen}")
    assert seen["reads_while_down"] > 0
    assert seen["members_while_down"].startswith("PeerLostError") and directory.split("//")[1] in \
        seen["members_while_down"], seen["members_while_down"]
    assert seen["members_after_restart"] == ["decode-0", "prefill-0"], seen
    assert seen["repopulated_after_s"] < LIVENESS_S + 5.0, seen
    assert seen["late_rank_is_new"] and seen["late_read"] and seen["old_read"], seen


TORCHRUN_MEMBER = """
import os, time, torch
import tensorwire as tw
import test_fleet

with tw.init(timeout=30) as comm:  # TENSORWIRE_DIRECTORY and TENSORWIRE_NAME=prefill-{rank}: no code for fleets
    member = int(comm.name.rsplit("-", 1)[1])
    pool = comm.register_blocks(test_fleet._value(member).clone())
    comm.publish_blocks("kv", pool)
    test_fleet._touch(os.path.join(os.environ["WORK"], comm.name + ".0.ready"))
    test_fleet._await(os.path.join(os.environ["WORK"], "stop"), timeout=120)
    pool.close()
"""


def _read_both(directory: str, work: str) -> None:
    comm = tw.init(directory=directory, name="decode-0", timeout=WAIT)
    out = torch.zeros(BLOCKS, WIDTH, dtype=torch.int32)
    pool = comm.register_blocks(out)
    ok = {}
    for member in (0, 1):
        rank = comm.rank_of(f"prefill-{member}", timeout=WAIT)
        comm.read_blocks(pool, list(range(BLOCKS)), comm.lookup_blocks("kv", rank, timeout=WAIT),
                         list(range(BLOCKS)), timeout=WAIT)
        ok[member] = bool(torch.equal(out, _value(member)))
    with open(os.path.join(work, "decode.json"), "w") as f:
        json.dump(ok, f)
    pool.close()
    comm.close()


@pytest.mark.slow
def test_a_torchrun_job_joins_a_fleet_and_is_read_from_by_a_member_launched_apart(fleet):
    work = fleet.work
    directory = fleet.directory()
    script = os.path.join(work, "member.py")
    with open(script, "w") as f:
        f.write(TORCHRUN_MEMBER)
    env = fleet.env()
    env.update({"TENSORWIRE_DIRECTORY": directory, "TENSORWIRE_NAME": "prefill-{rank}", "WORK": work})
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-addr", "127.0.0.1", "--master-port", str(tw.testing.free_port()), script],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fleet.processes.append(job)
    for member in (0, 1):
        _await(os.path.join(work, f"prefill-{member}.0.ready"), timeout=120)
    _finish(fleet.start(f"_read_both({directory!r}, {work!r})"), "decode")
    _touch(os.path.join(work, "stop"))
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 0, output[-3000:]
    with open(os.path.join(work, "decode.json")) as f:
        assert json.load(f) == {"0": True, "1": True}
