"""A process outside the job gets no bytes through the data plane: store values tell it nothing it can use to
reach memory (encrypted), NIXL notifications from agents that prove no rank are dropped without costing a member's
messages, agent names are not the rank's, and UCX listens on the job's interface only.

The stranger is a separate process without ``TENSORWIRE_JOB_TOKEN`` (as user ``nobody`` where this runs as root
and ``nobody`` can run this interpreter), reaching the job's store port like any process on the host can.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import struct
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import tensorwire as tw
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch, scaled

HERE = os.path.dirname(os.path.abspath(__file__))
N = 16384  # float32 values: 64 KiB
STRANGER_WAIT = scaled(150.0)  # a barrier behind the stranger process (it starts Python, torch and NIXL)


# --- the stranger ------------------------------------------------------------------------------------
def _stranger_steals(port: int, address: int) -> None:
    """Without the token: read rank 0's memory map from the store and try every way to use it."""
    if os.environ.get("TENSORWIRE_JOB_TOKEN"):
        raise RuntimeError("the stranger must run without the job token")
    from tensorwire.backends.nixl_setup import import_nixl
    from tensorwire.memory_map import MemoryMap

    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    blob = dist.PrefixStore("tensorwire/", client).get("memmap/0")
    found = {"map_bytes": len(blob), "address_visible": struct.pack("<Q", address)[:5] in blob,
             "agent_name_visible": b"tw0-" in blob or b"tensorwire-rank0" in blob}
    try:
        MemoryMap.unpack(blob, "stolen")
        found["map_decoded"] = True
    except Exception:  # noqa: BLE001 - the point
        found["map_decoded"] = False
    api, _ = import_nixl()
    agent = api.nixl_agent("tensorwire-rank1", api.nixl_agent_config(backends=["UCX"]))
    loaded = []
    for start in range(0, min(len(blob), 64)):  # wherever the agent metadata might start
        try:
            loaded.append(agent.add_remote_agent(blob[start:]))
        except Exception:  # noqa: BLE001
            continue
    found["agents_loaded"] = len(loaded)
    print(json.dumps(found))


def _stranger_notifies(metadata_path: str) -> None:
    """With rank 0's NIXL metadata in hand (as if leaked): send it notifications as agents claiming rank 1."""
    from tensorwire.backends.nixl_setup import import_nixl

    with open(metadata_path, "rb") as f:
        metadata = f.read()
    api, _ = import_nixl()
    sent = 0
    for name in ("tensorwire-rank1", "tw1-0123456789abcdef-" + "0" * 32, "tw1-0123456789abcdef"):
        agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        target = agent.add_remote_agent(metadata)
        for i in range(3):
            agent.send_notif(target, f"forged {i}".encode())
            sent += 1
        time.sleep(0.2)  # let UCX deliver before the agent goes
    print(json.dumps({"sent": sent}))


def _stranger_user() -> str | None:
    """``"nobody"`` where this process is root and ``nobody`` can run this interpreter, else None."""
    if os.geteuid() != 0:
        return None
    try:
        probe = subprocess.run([sys.executable, "-c", "import tensorwire"], user="nobody", capture_output=True,
                               timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return "nobody" if probe.returncode == 0 else None


def _run_stranger(call: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TENSORWIRE_JOB_TOKEN"}
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_stranger; test_stranger.{call}"
    user = _stranger_user()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=scaled(90),
                          **({"user": user} if user else {}))
    if done.returncode != 0:
        raise RuntimeError(f"the stranger failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["uid"] = user or "same"
    return result


# --- store values ------------------------------------------------------------------------------------
def _victim_of_a_store_reader():
    comm = tw.init(timeout=INIT_TIMEOUT)
    buf, out = rank_values(comm.rank, N), sentinel(N)
    reg = comm.register([buf, out])
    comm.publish("kv", reg.descs[:1])
    comm.barrier(timeout=WAIT)
    stolen = None
    if comm.rank == 0:
        stolen = _run_stranger(f"_stranger_steals({int(os.environ['MASTER_PORT'])}, {buf.data_ptr()})")
        assert_equal(buf, rank_values(0, N), "rank 0's memory after the stranger")
    comm.barrier(timeout=STRANGER_WAIT)
    comm.read(out, comm.lookup("kv", 1 - comm.rank, timeout=WAIT)[0], timeout=WAIT)  # members still can
    assert_equal(out, rank_values(1 - comm.rank, N), "a member's READ")
    comm.barrier(timeout=WAIT)
    comm.close()
    return stolen


def test_a_stranger_reads_nothing_usable_from_the_store():
    stolen, _ = launch(_victim_of_a_store_reader, 2)
    assert stolen["map_bytes"] > 0, stolen
    assert stolen == {**stolen, "address_visible": False, "agent_name_visible": False, "map_decoded": False,
                      "agents_loaded": 0}, stolen
    print(f"stranger ran as uid: {stolen['uid']}")


# --- notifications -----------------------------------------------------------------------------------
def _receiver_of_forged_notifications(tmp: str):
    comm = tw.init(timeout=INIT_TIMEOUT)
    buf = rank_values(comm.rank, N)
    reg = comm.register([buf])
    comm.publish("kv", reg.descs)
    comm.barrier(timeout=WAIT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if comm.rank == 0:
            assert not comm.runtime.transports["nixl"].agent_name.startswith("tensorwire-rank")
            path = os.path.join(tmp, "leaked-metadata")
            with open(path, "wb") as f:
                f.write(comm.runtime.transports["nixl"].metadata())
            sent = _run_stranger(f"_stranger_notifies({path!r})")["sent"]
        comm.barrier(timeout=STRANGER_WAIT)
        if comm.rank == 1:
            remote = comm.lookup("kv", 0, timeout=WAIT)[0]
            for i in range(3):
                comm.write(buf, remote, notify=f"genuine {i}".encode(), timeout=WAIT)
            comm.barrier(timeout=WAIT)
            comm.barrier(timeout=WAIT)  # rank 0 looks for anything more meanwhile
            comm.close()
            return None
        received = [comm.wait_notification(1, timeout=WAIT) for _ in range(3)]
        comm.barrier(timeout=WAIT)
        try:
            extra = comm.wait_notification(1, timeout=0.5)
        except tw.WaitTimeoutError:
            extra = None
        comm.barrier(timeout=WAIT)
    comm.close()
    dropped = [str(w.message) for w in caught if "not a member of this job" in str(w.message)]
    return {"sent": sent, "received": [m.decode() for m in received], "extra": extra, "dropped": dropped}


@pytest.mark.slow
def test_notifications_from_agents_outside_the_job_are_dropped_and_members_lose_none(tmp_path):
    result, _ = launch(_receiver_of_forged_notifications, 2, str(tmp_path))
    assert result["sent"] == 9
    assert result["received"] == ["genuine 0", "genuine 1", "genuine 2"], result
    assert result["extra"] is None, result
    assert len(result["dropped"]) == 3 and all("tensorwire-rank1" in w or "tw1-" in w for w in result["dropped"]), \
        result["dropped"]


# --- listening sockets ---------------------------------------------------------------------------------
def _listening_addresses() -> set[str]:
    """IPv4 addresses this process listens on (from /proc: no tool needed)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    with open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                found.add(socket.inet_ntoa(struct.pack("<I", int(local.split(":")[0], 16))))
    return found


def _listening_after_a_transfer():
    comm = tw.init(timeout=INIT_TIMEOUT)
    buf, out = rank_values(comm.rank, N), sentinel(N)
    reg = comm.register([buf, out])
    comm.publish("kv", reg.descs[:1])
    comm.read(out, comm.lookup("kv", 1 - comm.rank, timeout=WAIT)[0], timeout=WAIT)
    addresses = _listening_addresses()
    devices = comm.runtime.transports["nixl"].net_devices
    comm.barrier(timeout=WAIT)
    comm.close()
    return sorted(addresses), devices


def _external_ipv4() -> str | None:
    from tensorwire.network import interface_of

    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                import fcntl

                answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            address = socket.inet_ntoa(answer[20:24])
        except OSError:
            continue
        if interface_of(address) == name:
            return address
    return None


def test_ucx_and_every_listener_are_bound_to_the_jobs_interface():
    external = _external_ipv4()
    if external is None:
        pytest.skip("this machine has no IPv4 interface besides loopback: nothing to keep UCX off")
    for addresses, devices in launch(_listening_after_a_transfer, 2):
        assert devices is not None and devices.split(",")[0] == "lo", devices
        assert addresses and set(addresses) <= {"127.0.0.1"}, \
            f"a rank of a job on 127.0.0.1 listens on {addresses} (this host also has {external})"


# --- replay of an old sealed memory map -------------------------------------------------------------------
def _stranger_replays(port: int, path: str, mode: str) -> None:
    """``save``: copy rank 1's sealed memory map out of the store; ``restore``: write that old copy back."""
    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    store = dist.PrefixStore("tensorwire/", client)
    if mode == "save":
        with open(path, "wb") as f:
            f.write(store.get("memmap/1"))
    else:
        with open(path, "rb") as f:
            store.set("memmap/1", f.read())
    print(json.dumps({"done": mode}))


def _published_target(comm, n: int):
    """Rank 1's buffer of ``n`` floats (-7.0), registered and published under ``"target"``."""
    target = torch.full((n,), -7.0)
    reg = comm.register(target)
    comm.publish("target", reg.descs)
    return target, reg


def _victim_of_a_replay(tmp: str):
    comm = tw.init(timeout=INIT_TIMEOUT)
    n = 4096
    if comm.rank == 1:
        target, reg = _published_target(comm, n)
        comm.barrier(timeout=STRANGER_WAIT)  # rank 0 prepared a WRITE, the stranger saved this map
        reg.close()  # returns once rank 0 acknowledged: the memory may be reused at once
        again = comm.register(target)  # reused: the same bytes, a new registration
        target.fill_(-7.0)
        comm.barrier(timeout=STRANGER_WAIT)  # the stranger wrote the old map back; rank 0 tried again
        untouched = bool((target == -7.0).all())
        again.close()
        comm.close()
        return untouched
    src = rank_values(0, n)
    comm.register(src)
    old = comm.lookup("target", 1, timeout=WAIT)
    x = comm.prepare(tw.WRITE, src, old)
    x.post()
    x.wait(timeout=WAIT)
    path, port = os.path.join(tmp, "old-map"), int(os.environ["MASTER_PORT"])
    _run_stranger(f"_stranger_replays({port}, {path!r}, 'save')")
    comm.barrier(timeout=STRANGER_WAIT)
    _run_stranger(f"_stranger_replays({port}, {path!r}, 'restore')")
    outcome = {}
    for what, call in (("post", lambda: (x.post(), x.wait(timeout=WAIT))),
                       ("prepare", lambda: comm.prepare(tw.WRITE, src, old)),
                       ("write", lambda: comm.write(src, old, timeout=WAIT))):
        try:
            call()
            outcome[what] = "accepted"
        except tw.TensorwireError as e:
            outcome[what] = type(e).__name__
    x.close()
    comm.barrier(timeout=STRANGER_WAIT)
    comm.close()
    return outcome


@pytest.mark.slow
def test_an_old_memory_map_written_back_by_a_stranger_is_refused(tmp_path):
    """Before: rank 0's prepare accepted the replayed map and its WRITE overwrote rank 1's reused buffer."""
    liveness = {"TENSORWIRE_LIVENESS_S": f"{scaled(2.0):.2f}"}  # the store's bound, at this machine's pace
    outcome, untouched = launch(_victim_of_a_replay, 2, str(tmp_path), env=liveness)
    print(f"\nafter the replay: {outcome}")
    assert outcome["post"] == "RevokedError", outcome
    assert outcome["prepare"] in ("AuthenticationError", "RevokedError"), outcome
    assert outcome["write"] in ("AuthenticationError", "RevokedError"), outcome
    assert untouched, "a WRITE landed in rank 1's reused buffer"


def _victim_of_a_first_contact_replay(tmp: str):
    """As above, but the victim (rank 2) never touched rank 1 before the replay (its descriptor came from rank 0),
    so no revocation told it anything (rank 0 watches every rank in barriers: it is not the victim here)."""
    comm = tw.init(timeout=INIT_TIMEOUT)
    n = 4096
    if comm.rank == 1:
        target, reg = _published_target(comm, n)
        comm.barrier(timeout=STRANGER_WAIT)  # rank 2 looked the descriptor up, the stranger saved this map
        reg.close()
        again = comm.register(target)  # the same bytes reused under a new registration
        target.fill_(-7.0)
        comm.barrier(timeout=STRANGER_WAIT)  # the old map is back in the store; rank 2 tries to write
        comm.barrier(timeout=STRANGER_WAIT)
        untouched = bool((target == -7.0).all())
        callers = comm._rendezvous.liveness.callers()
        again.close()
        comm.close()
        return untouched, callers
    if comm.rank == 0:  # hands rank 1's descriptor on (descriptors are values: they travel any way the user likes)
        comm.publish("relayed", comm.lookup("target", 1, timeout=WAIT))
        for _ in range(3):
            comm.barrier(timeout=STRANGER_WAIT)
        comm.close()
        return None
    src = rank_values(2, n)
    comm.register(src)
    old = comm.lookup("relayed", 0, timeout=WAIT)  # rank 2 has not contacted rank 1
    path, port = os.path.join(tmp, "old-map"), int(os.environ["MASTER_PORT"])
    _run_stranger(f"_stranger_replays({port}, {path!r}, 'save')")
    comm.barrier(timeout=STRANGER_WAIT)
    comm.barrier(timeout=STRANGER_WAIT)
    _run_stranger(f"_stranger_replays({port}, {path!r}, 'restore')")
    try:
        comm.write(src, old, timeout=WAIT)
        outcome = "accepted"
    except tw.TensorwireError as e:
        outcome = f"{type(e).__name__}: {e}"
    comm.barrier(timeout=STRANGER_WAIT)
    comm.close()
    return outcome


def test_an_old_memory_map_is_refused_at_first_contact_too(tmp_path):
    """Before: a rank that had never touched rank 1 used the replayed map, and its WRITE landed in the reused
    buffer; now prepare asks rank 1 which map is current (freshness.py)."""
    _, (untouched, callers), outcome = launch(_victim_of_a_first_contact_replay, 3, str(tmp_path),
                                              env={"TENSORWIRE_LIVENESS_S": f"{scaled(2.0):.2f}"})
    print(f"\nafter the replay: {outcome}")
    assert 2 in callers  # connected when it prepared, after the replay: no revocation could have reached it
    assert outcome.startswith("AuthenticationError") and "older than epoch" in outcome, outcome
    assert untouched, "a WRITE landed in rank 1's reused buffer"
