"""Fleets in etcd: the parties of ``test_fleet.py`` meet through a 3-node etcd cluster on loopback (started by the
test, killed when it ends) instead of ``tensorwire directory``; a dead member's keys leave etcd by themselves (its
lease), the fleet does not notice losing one etcd node, and without a quorum directory calls fail typed within the
liveness bound while transfers go on, and work again once the nodes are back.

Skipped, with the reason, where no ``etcd`` binary (Debian: ``etcd-server``) or no ``etcd3gw`` is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_fleet import LIVENESS_S, TOKEN, WAIT, _await, _finish, _Fleet, _touch, _value, check_decode_saw

import tensorwire as tw
from tensorwire.meeting.etcd_store import fleet_prefix

if shutil.which("etcd") is None:
    pytest.skip("no etcd binary (apt-get install etcd-server): etcd fleets not tested", allow_module_level=True)
etcd3gw = pytest.importorskip("etcd3gw", reason="no etcd client (pip install etcd3gw): etcd fleets not tested")


class _Cluster:
    """Three etcd nodes on loopback, each its own process and data directory; killed (all) when the test ends."""

    def __init__(self, root: str) -> None:
        self.root = root
        ports = [tw.testing.free_port() for _ in range(6)]
        self.client_ports, self.peer_ports = ports[:3], ports[3:]
        self.initial = ",".join(f"n{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer_ports))
        self.processes: list[subprocess.Popen | None] = [None] * 3
        self.directory = "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def start(self, i: int) -> None:
        client, peer = f"http://127.0.0.1:{self.client_ports[i]}", f"http://127.0.0.1:{self.peer_ports[i]}"
        with open(os.path.join(self.root, f"etcd-{i}.log"), "a") as log:
            self.processes[i] = subprocess.Popen(
                ["etcd", "--name", f"n{i}", "--data-dir", os.path.join(self.root, f"etcd-{i}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer, "--initial-cluster", self.initial,
                 "--initial-cluster-token", os.path.basename(self.root), "--initial-cluster-state", "new",
                 "--unsafe-no-fsync"], stdout=log, stderr=subprocess.STDOUT)

    def kill(self, i: int) -> None:
        self.processes[i].send_signal(signal.SIGKILL)
        self.processes[i].wait(timeout=30)

    def client(self, i: int = 0):
        return etcd3gw.Etcd3Client("127.0.0.1", self.client_ports[i], api_path="/v3/", timeout=2)

    def keys(self, token: str = TOKEN) -> list[str]:
        """The keys of the fleet of ``token``, read from the first node that answers, without the fleet's own part
        of the prefix (``tensorwire/member/3`` for ``tensorwire/<fleet>/member/3``)."""
        fleet = f"tensorwire/{fleet_prefix(token.encode())}/"
        for i, process in enumerate(self.processes):
            if process is not None and process.poll() is None:
                found = self.client(i).get_prefix(fleet)  # (value, metadata) pairs
                return sorted("tensorwire/" + meta["key"].decode()[len(fleet):] for _, meta in found)
        raise RuntimeError("no etcd node runs")

    def await_quorum(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client(next(i for i, p in enumerate(self.processes) if p is not None and p.poll() is None)).put(
                    "probe", "1")
                return
            except etcd3gw.exceptions.Etcd3Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def close(self) -> None:
        for process in self.processes:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=30)


@pytest.fixture
def etcd(tmp_path):
    cluster = _Cluster(str(tmp_path))
    try:
        for i in range(3):
            cluster.start(i)
        cluster.await_quorum()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def fleet(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    f = _Fleet(str(work))
    yield f
    f.close()


@pytest.mark.slow
def test_members_meet_in_etcd_fail_alone_and_their_keys_expire(fleet, etcd):
    """Cases 1-3 of test_fleet over etcd: two prefill members, a decode member started afterwards reading blocks by
    name; prefill-1 killed (its transfers fail typed, prefill-0's go on, members() drops it, its keys leave etcd
    within twice the liveness period); started again under its name: a new rank, read correctly."""
    work, directory = fleet.work, etcd.directory
    prefill = [fleet.start(f"_prefill({directory!r}, 'prefill-{i}', {work!r}, 0, 'nixl')") for i in range(2)]
    for i in range(2):
        _await(os.path.join(work, f"prefill-{i}.0.ready"))
    with open(os.path.join(work, "prefill-1.0.ready")) as f:
        killed_rank = int(f.read())
    decode = fleet.start(f"_decode({directory!r}, {work!r}, 'nixl')")
    _await(os.path.join(work, "decode.looping"), timeout=120)
    mine = [key for key in etcd.keys() if key.endswith(f"/{killed_rank}") or f"/{killed_rank}/" in key]
    assert {f"tensorwire/member/{killed_rank}", f"tensorwire/alive/{killed_rank}",
            f"tensorwire/blocks/{killed_rank}/kv"} <= set(mine), mine
    time.sleep(0.3)
    with open(os.path.join(work, "killed.tmp"), "w") as f:
        f.write(str(time.time()))
    prefill[1].send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    os.rename(os.path.join(work, "killed.tmp"), os.path.join(work, "killed"))
    prefill[1].wait(timeout=30)
    while any(key in mine for key in etcd.keys()) and time.monotonic() - t_kill < 4 * LIVENESS_S + 5:
        time.sleep(0.05)
    expired_after_s = time.monotonic() - t_kill
    left = [key for key in etcd.keys() if key in mine and not key.startswith("tensorwire/name/")]
    _await(os.path.join(work, "restart"), timeout=120)
    fleet.start(f"_prefill({directory!r}, 'prefill-1', {work!r}, 1, 'nixl')")
    _finish(decode, "decode")
    _touch(os.path.join(work, "prefill-0.stop"))
    _touch(os.path.join(work, "prefill-1.stop"))
    _finish(prefill[0], "prefill-0")
    with open(os.path.join(work, "decode.json")) as f:
        seen = json.load(f)
    print(f"\netcd: {seen}; the killed member's {len(mine)} keys left etcd after {expired_after_s:.2f}s")
    assert not left, f"the killed member's keys are still in etcd after {expired_after_s:.1f}s: {left}"
    assert expired_after_s < 2 * LIVENESS_S + 2.0, expired_after_s
    check_decode_saw(seen)


def _decode_through_etcd_loss(directory: str, work: str) -> None:
    """Reads from prefill-0 while etcd loses one node (a member joins and is read from), then two (no quorum:
    directory calls fail typed, reads go on), then gets them back."""
    comm = tw.init(directory=directory, name="decode-0", timeout=WAIT)
    out = torch.zeros(1000, 64, dtype=torch.int32)
    pool = comm.register_blocks(out)
    ids = list(range(1000))
    seen: dict = {}

    def reader(name: str):
        rank = comm.rank_of(name, timeout=WAIT)
        return comm.prepare_blocks(tw.READ, pool, comm.lookup_blocks("kv", rank, timeout=WAIT))

    def read(transfer, member: int) -> bool:
        out.zero_()
        transfer.post(ids, ids)
        transfer.wait(timeout=WAIT)
        return bool(torch.equal(out, _value(member)))

    first = reader("prefill-0")
    assert read(first, 0)
    _touch(os.path.join(work, "kill-one"))
    _await(os.path.join(work, "one-killed"))
    second = reader("prefill-1")  # joined after the node was killed
    seen["one_down_read"] = read(second, 1) and read(first, 0)
    seen["one_down_members"] = sorted(m.name for m in comm.members().values())
    _touch(os.path.join(work, "kill-two"))
    _await(os.path.join(work, "two-killed"))
    calls = []
    for call in (comm.members, lambda: comm.lookup_blocks("kv", comm.rank_of("prefill-0", timeout=1), timeout=1)):
        t0 = time.monotonic()
        try:
            call()
            calls.append(["answered", time.monotonic() - t0])
        except tw.TensorwireError as e:
            calls.append([f"{type(e).__name__}: {e}", time.monotonic() - t0])
    seen["no_quorum_calls"] = calls
    reads, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 1.0:  # the data plane does not need the directory
        assert read(first, 0) and read(second, 1), "a read without an etcd quorum returned wrong bytes"
        reads += 1
    seen["reads_without_quorum"] = reads
    _touch(os.path.join(work, "restart-two"))
    _await(os.path.join(work, "two-restarted"))
    t0, listed = time.monotonic(), []
    while time.monotonic() - t0 < LIVENESS_S + 20:
        try:
            listed = sorted(m.name for m in comm.members().values())
        except tw.TensorwireError:
            listed = []
        if listed == ["decode-0", "prefill-0", "prefill-1"]:
            break
        time.sleep(0.05)
    seen["recovered_after_s"] = time.monotonic() - t0
    seen["members_after"] = listed
    again = reader("prefill-1")
    seen["read_after"] = read(again, 1) and read(first, 0)
    with open(os.path.join(work, "decode.json"), "w") as f:
        json.dump(seen, f)
    for transfer in (again, second, first):
        transfer.close()
    pool.close()
    comm.close()


@pytest.mark.slow
def test_losing_one_etcd_node_changes_nothing_and_losing_two_fails_directory_calls_typed(fleet, etcd):
    work, directory = fleet.work, etcd.directory
    prefill = [fleet.start(f"_prefill({directory!r}, 'prefill-0', {work!r}, 0, 'nixl')")]
    _await(os.path.join(work, "prefill-0.0.ready"))
    code = f"import test_fleet_etcd; test_fleet_etcd._decode_through_etcd_loss({directory!r}, {work!r})"
    decode = subprocess.Popen([sys.executable, "-c", code], env=fleet.env())
    fleet.processes.append(decode)
    _await(os.path.join(work, "kill-one"), timeout=120)
    etcd.kill(0)
    prefill.append(fleet.start(f"_prefill({directory!r}, 'prefill-1', {work!r}, 0, 'nixl')"))  # joins meanwhile
    _touch(os.path.join(work, "one-killed"))
    _await(os.path.join(work, "kill-two"), timeout=120)
    etcd.kill(1)
    _touch(os.path.join(work, "two-killed"))
    _await(os.path.join(work, "restart-two"), timeout=120)
    restarted = time.monotonic()
    etcd.start(0)
    etcd.start(1)
    _touch(os.path.join(work, "two-restarted"))
    _finish(decode, "decode")
    for i in range(2):
        _touch(os.path.join(work, f"prefill-{i}.stop"))
    for i, process in enumerate(prefill):
        _finish(process, f"prefill-{i}")
    with open(os.path.join(work, "decode.json")) as f:
        seen = json.load(f)
    print(f"\n{seen}; restart to recovered: {seen['recovered_after_s']:.2f}s of {time.monotonic() - restarted:.1f}s")
    assert seen["one_down_read"] is True and seen["one_down_members"] == ["decode-0", "prefill-0", "prefill-1"]
    for what, took in seen["no_quorum_calls"]:
        assert what.startswith("PeerLostError") and "etcd" in what and "quorum" in what, what
        assert took < LIVENESS_S + 1.0, f"a directory call without quorum took {took:.2f}s"
    assert seen["reads_without_quorum"] > 0
    assert seen["members_after"] == ["decode-0", "prefill-0", "prefill-1"], seen
    assert seen["recovered_after_s"] < LIVENESS_S + 15.0, seen
    assert seen["read_after"] is True


# A member of the fleet of its TENSORWIRE_JOB_TOKEN: joins, says its rank and what members() lists (names), and
# leaves when "<out>.stop" exists; a refused init is written out as the error instead.
_NAMED_MEMBER = """
import json, os, sys, time
import tensorwire as tw
out = sys.argv[3]
try:
    comm = tw.init(directory=sys.argv[1], name=sys.argv[2], timeout=60)
except tw.TensorwireError as e:
    with open(out, "w") as f:
        json.dump({"error": type(e).__name__, "message": str(e)}, f)
    raise SystemExit(0)
with open(out + ".tmp", "w") as f:
    json.dump({"rank": comm.rank, "names": sorted(m.name for m in comm.members().values())}, f)
os.replace(out + ".tmp", out)
while not os.path.exists(out + ".stop"):
    time.sleep(0.05)
comm.close()
"""


def _named(fleet, etcd, name: str, out: str, token: str) -> tuple[subprocess.Popen, dict]:
    process = subprocess.Popen([sys.executable, "-c", _NAMED_MEMBER, etcd.directory, name, out], env=fleet.env(token))
    fleet.processes.append(process)
    _await(out, timeout=120)
    with open(out) as f:
        return process, json.load(f)


def test_fleets_with_different_tokens_share_no_name_in_one_etcd(fleet, etcd):
    """Two fleets (two tokens) in one etcd: each holds its own "decode-0", under a prefix of its own; a name claim
    this fleet's token cannot open (forged into its prefix) is refused, not taken over."""
    work, other = fleet.work, "another-fleet-token-0123456789"
    first, mine = _named(fleet, etcd, "decode-0", os.path.join(work, "a.json"), TOKEN)
    second, theirs = _named(fleet, etcd, "decode-0", os.path.join(work, "b.json"), other)
    assert "error" not in mine and "error" not in theirs, (mine, theirs)
    assert "tensorwire/name/decode-0" in etcd.keys(TOKEN) and "tensorwire/name/decode-0" in etcd.keys(other)
    # The first fleet's name is still its own member's: a newcomer of the first fleet under that name is refused.
    _, again = _named(fleet, etcd, "decode-0", os.path.join(work, "c.json"), TOKEN)
    assert again.get("error") == "InvalidArgumentError" and "is present" in again["message"], again
    client = etcd.client()
    lease = client.lease(ttl=60)
    client.put(f"tensorwire/{fleet_prefix(TOKEN.encode())}/name/decode-1", "forged", lease=lease)
    _, forged = _named(fleet, etcd, "decode-1", os.path.join(work, "d.json"), TOKEN)
    assert forged.get("error") == "InvalidArgumentError" and "cannot open" in forged["message"], forged
    for out in ("a.json", "b.json"):
        _touch(os.path.join(work, out + ".stop"))
    _finish(first, "the first fleet's member")
    _finish(second, "the second fleet's member")


# A member that asks members() when "<out>.ask" appears and writes the outcome to "<out>.answer".
_ASKED_MEMBER = """
import json, os, sys, time
import tensorwire as tw
out = sys.argv[3]
comm = tw.init(directory=sys.argv[1], name=sys.argv[2], timeout=60)
with open(out + ".tmp", "w") as f:
    json.dump({"rank": comm.rank}, f)
os.replace(out + ".tmp", out)
while not os.path.exists(out + ".stop"):
    if os.path.exists(out + ".ask"):
        os.remove(out + ".ask")
        try:
            said = {"members": sorted(comm.members())}
        except tw.TensorwireError as e:
            said = {"error": type(e).__name__, "message": str(e)}
        with open(out + ".answer.tmp", "w") as f:
            json.dump(said, f)
        os.replace(out + ".answer.tmp", out + ".answer")
    time.sleep(0.05)
comm.close()
"""


def test_a_member_stopped_past_its_etcd_lease_comes_back_superseded_not_as_a_twin(fleet, etcd):
    work = fleet.work
    old_out, new_out = os.path.join(work, "old.json"), os.path.join(work, "new.json")
    old = subprocess.Popen([sys.executable, "-c", _ASKED_MEMBER, etcd.directory, "decode-0", old_out], env=fleet.env())
    fleet.processes.append(old)
    _await(old_out, timeout=120)
    with open(old_out) as f:
        old_rank = json.load(f)["rank"]
    old.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while f"tensorwire/member/{old_rank}" in etcd.keys():  # its lease expires
            assert time.monotonic() < deadline, "a stopped member's keys outlived its etcd lease"
            time.sleep(0.1)
        new = subprocess.Popen([sys.executable, "-c", _ASKED_MEMBER, etcd.directory, "decode-0", new_out],
                               env=fleet.env())
        fleet.processes.append(new)
        _await(new_out, timeout=120)
    finally:
        old.send_signal(signal.SIGCONT)
    with open(new_out) as f:
        new_rank = json.load(f)["rank"]
    deadline = time.monotonic() + 4 * LIVENESS_S
    while time.monotonic() < deadline:  # its heartbeats find the name taken: nothing written back
        records = [key for key in etcd.keys() if key.startswith("tensorwire/member/")]
        assert records == [f"tensorwire/member/{new_rank}"], records
        time.sleep(0.1)
    _touch(old_out + ".ask")
    _await(old_out + ".answer", timeout=120)
    with open(old_out + ".answer") as f:
        said = json.load(f)
    assert said.get("error") == "PeerLostError" and "superseded" in said["message"], said
    for out in (old_out, new_out):
        _touch(out + ".stop")
    _finish(old, "the superseded member")
    _finish(new, "the member that holds the name")
