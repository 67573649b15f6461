"""The fleet's invariants through what a long-running fleet meets: a name belongs to one present member (through a
member stopped past its lease, and a name's claim deleted by another process), and a rank is never handed out
twice (through a burst of joins and a directory killed and started again). Members are real processes; the
directory's client (``DirectoryStore``) watches what the directory holds, as any member could.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tensorwire.meeting.directory import Directory
from tensorwire.meeting.directory_store import DirectoryStore
from tensorwire.sealing import unseal

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
TOKEN = b"invariants-token-0123456789abcdef"
LIVENESS_S = 1.0

# A member that writes its rank once joined, then asks members() whenever told to (a file "<out>.ask") and writes
# what happened (the ranks it saw, or the error) to "<out>.answer"; leaves on "<out>.stop".
MEMBER = """
import json, os, sys, time
import tensorwire as tw
out = sys.argv[3]
def write(path, value):
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)
comm = tw.init(directory=sys.argv[1], name=sys.argv[2], timeout=60)
write(out, {"rank": comm.rank})
while not os.path.exists(out + ".stop"):
    if os.path.exists(out + ".ask"):
        os.remove(out + ".ask")
        try:
            write(out + ".answer", {"members": sorted(comm.members())})
        except tw.TensorwireError as e:
            write(out + ".answer", {"error": type(e).__name__, "message": str(e)})
    time.sleep(0.05)
comm.close()
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update({"PYTHONPATH": os.pathsep.join([SRC, env.get("PYTHONPATH", "")]),
                "TENSORWIRE_LIVENESS_S": str(LIVENESS_S), "TENSORWIRE_JOB_TOKEN": TOKEN.decode()})
    return env


def _client(directory: Directory) -> DirectoryStore:
    return DirectoryStore(directory.host, directory.port, token=TOKEN, lease_s=60.0, connect_s=10.0, request_s=10.0)


def _wait_for(path: str, process: subprocess.Popen, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {os.path.basename(path)} from the member (exit code {process.poll()})")
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def _ask(out: str, process: subprocess.Popen) -> dict:
    if os.path.exists(out + ".answer"):
        os.remove(out + ".answer")
    open(out + ".ask", "w").close()
    return _wait_for(out + ".answer", process)


def _named(watcher: DirectoryStore, name: str) -> list[int]:
    """The ranks whose record in the directory says ``name``."""
    ranks = []
    for key, blob in watcher.list_prefix("member/").items():
        if unseal(TOKEN, key, blob).split(b"\n", 1)[0] == name.encode():
            ranks.append(int(key.rsplit("/", 1)[1]))
    return sorted(ranks)


def _start(directory: Directory, name: str, out: str, processes: list) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen([sys.executable, "-c", MEMBER, directory.address, name, out], env=_env())
    processes.append(process)
    return process, _wait_for(out, process)["rank"]


def _never_twins(watcher: DirectoryStore, name: str, seconds: float) -> list[int]:
    """Watch the directory for ``seconds``: never two records of ``name``; the ranks last seen."""
    deadline = time.monotonic() + seconds
    while True:
        ranks = _named(watcher, name)
        assert len(ranks) <= 1, f"two members are listed as {name!r}: ranks {ranks}"
        if time.monotonic() > deadline:
            return ranks
        time.sleep(0.05)


def test_a_member_stopped_past_its_lease_comes_back_superseded_not_as_a_twin(tmp_path, processes):
    with Directory(token=TOKEN) as directory:
        watcher = _client(directory)
        old_out, new_out = str(tmp_path / "old.json"), str(tmp_path / "new.json")
        old, old_rank = _start(directory, "decode-0", old_out, processes)
        os.kill(old.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while _named(watcher, "decode-0"):  # its lease (2 * liveness_s) runs out: its keys go
            assert time.monotonic() < deadline, "a stopped member's keys outlived its lease"
            time.sleep(0.05)
        new, new_rank = _start(directory, "decode-0", new_out, processes)
        os.kill(old.pid, signal.SIGCONT)
        # Its heartbeat (every half liveness period) finds the name taken: it writes nothing back.
        assert _never_twins(watcher, "decode-0", 6 * LIVENESS_S) == [new_rank]
        answer = _ask(old_out, old)
        assert answer.get("error") == "PeerLostError" and "superseded" in answer["message"], answer
        assert "decode-0" in answer["message"] and "init again" in answer["message"]
        assert old_rank not in _ask(new_out, new)["members"]
        for out in (old_out, new_out):
            open(out + ".stop", "w").close()
        for process in (old, new):
            assert process.wait(timeout=60) == 0


def test_a_deleted_name_claim_makes_no_twin_and_is_put_back(tmp_path, processes):
    with Directory(token=TOKEN) as directory:
        watcher = _client(directory)
        first_out, second_out = str(tmp_path / "first.json"), str(tmp_path / "second.json")
        first, first_rank = _start(directory, "decode-0", first_out, processes)
        assert watcher.delete_key("name/decode-0")  # another process of the fleet deletes the claim
        open(second_out + ".stop", "w").close()  # a second member that joined would leave at once (exit code 0)
        second = subprocess.run([sys.executable, "-c", MEMBER, directory.address, "decode-0", second_out],
                                env=_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode != 0 and "is present" in second.stderr, second.stderr[-2000:]
        deadline = time.monotonic() + 30
        while not watcher.check(["name/decode-0"]):  # the holder's heartbeat puts its claim back
            assert time.monotonic() < deadline, "the deleted name claim was not put back"
            time.sleep(0.05)
        assert _named(watcher, "decode-0") == [first_rank]
        watcher.set("name/decode-0", b"forged")  # a value that does not open is put back too
        deadline = time.monotonic() + 30
        while watcher.get("name/decode-0") == b"forged":
            assert time.monotonic() < deadline, "a forged name claim was not put back"
            time.sleep(0.05)
        assert unseal(TOKEN, "name/decode-0", watcher.get("name/decode-0")) == str(first_rank).encode()
        open(first_out + ".stop", "w").close()
        assert first.wait(timeout=60) == 0


def _directory_process(port: int, state: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "tensorwire", "directory", "--port", str(port), "--grace", "0",
                                "--state", state], env=_env(), stdout=subprocess.PIPE, text=True)
    assert "tensorwire directory at" in process.stdout.readline()
    return process


def test_ranks_are_never_handed_out_twice_across_a_restart_after_a_burst_of_joins(tmp_path, processes):
    """300 joins' worth of ranks in a few seconds (far more than one a second), kill -9, start again: the next
    member's rank is above every rank handed out before."""
    from tensorwire.testing import free_port

    port, state = free_port(), str(tmp_path / "directory.rank")
    first = _directory_process(port, state)
    processes.append(first)
    client = DirectoryStore("127.0.0.1", port, token=TOKEN, lease_s=60.0, connect_s=30.0, request_s=30.0)
    handed = [client.add("fleet/next_rank", 1) - 1 for _ in range(300)]  # the directory's half of 300 joins
    assert len(set(handed)) == 300
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    client.close()
    again = _directory_process(port, state)
    processes.append(again)
    out = str(tmp_path / "member.json")
    open(out + ".stop", "w").close()  # it leaves once joined
    member = subprocess.Popen([sys.executable, "-c", MEMBER, f"tcp://127.0.0.1:{port}", "newcomer", out], env=_env())
    processes.append(member)
    rank = _wait_for(out, member)["rank"]
    assert rank > max(handed), f"rank {rank} after a restart, while ranks up to {max(handed)} were handed out"
    assert member.wait(timeout=60) == 0


def test_no_member_can_stop_the_joins_of_others_through_the_rank_counter():
    """What a process with the token might write to the rank counter: each refused, typed, saying why, and joins
    (add 1) go on, below the largest rank a member can hold."""
    import tensorwire as tw
    from tensorwire.meeting.directory_keys import RANK_LIMIT

    with Directory(token=TOKEN, grace_s=0.5) as directory:
        insider = _client(directory)
        for floor in (10**19 - 1, 2**31, RANK_LIMIT):  # inside the grace period too
            with pytest.raises(tw.InvalidArgumentError, match="needs the claim of rank"):
                insider.raise_to("fleet/next_rank", floor)
        insider.compare_set("rank/2147483000", b"", b"mine")  # a claim far ahead does not prove the rank
        with pytest.raises(tw.InvalidArgumentError, match="no earlier run"):
            insider.raise_to("fleet/next_rank", 2147483001)
        time.sleep(0.6)
        for amount in (-10**6, -1, 2, 10**17):
            with pytest.raises(tw.InvalidArgumentError, match="only by one per join"):
                insider.add("fleet/next_rank", amount)
        with pytest.raises(tw.InvalidArgumentError, match="the directory's rank counter"):
            insider.set("fleet/next_rank", b"not a number")
        with pytest.raises(tw.InvalidArgumentError, match="the directory's rank counter"):
            insider.delete_key("fleet/next_rank")
        with pytest.raises(tw.InvalidArgumentError, match="the directory's rank counter"):
            insider.compare_set("fleet/next_rank", b"", b"0")
        member = _client(directory)
        before = member.add("fleet/next_rank", 0)
        assert member.add("fleet/next_rank", 1) == before + 1 < RANK_LIMIT


def test_what_a_member_creates_is_bounded_and_goes_with_it():
    """Counters and keys belong to the member that wrote them: a member holds at most its share (typed refusal
    past it), and all of it goes when its session ends, so a flood of counters does not outlive its writer."""
    import tensorwire as tw
    from tensorwire.meeting.directory import Limits

    with Directory(token=TOKEN, limits=Limits(keys_per_session=50)) as directory:
        flooder, watcher = _client(directory), _client(directory)
        for i in range(50):
            flooder.add(f"counter/{i}", 1)
        with pytest.raises(tw.InvalidArgumentError, match="limit per member"):
            flooder.add("counter/50", 1)
        with pytest.raises(tw.InvalidArgumentError, match="limit per member"):
            flooder.set("key/0", b"v")
        assert watcher.add("counter/mine", 1) == 1  # another member is not limited by it
        flooder.close()
        deadline = time.monotonic() + 30
        while watcher.list_prefix("counter/0") or watcher.check(["counter/49"]):
            assert time.monotonic() < deadline, "a closed member's counters stayed"
            time.sleep(0.05)


def test_a_member_stalled_mid_frame_keeps_its_keys_no_longer_than_its_lease():
    from tensorwire.meeting import directory_wire as wire

    with Directory(token=TOKEN) as directory:
        watcher = _client(directory)
        stalled = DirectoryStore(directory.host, directory.port, token=TOKEN, lease_s=1.0, connect_s=10.0,
                                 request_s=10.0)
        stalled.set("member/9", b"record")
        frame = wire.encode(wire.Op.SET, b"member/10", bytes(1000))
        stalled.socket.sendall(frame[:50])  # a frame begun and never finished
        deadline = time.monotonic() + 60
        while watcher.check(["member/9"]):
            assert time.monotonic() < deadline, "a member stalled mid-frame kept its keys past its lease"
            time.sleep(0.1)
        stalled.close()


def test_a_member_holds_one_rank_claim_and_one_it_gave_back_counts_for_nothing():
    import tensorwire as tw

    with Directory(token=TOKEN) as directory:
        member = _client(directory)
        assert member.compare_set("rank/5", b"", b"mine") == b"mine"
        with pytest.raises(tw.InvalidArgumentError, match="holds a rank claim already"):
            member.compare_set("rank/6", b"", b"mine")
        assert member.compare_set("rank/5", b"mine", b"") == b""  # given back (a rank whose holder still runs)
        assert not member.check(["rank/5"])
        assert member.compare_set("rank/6", b"", b"mine") == b"mine"  # so the next rank it is proposed is its own
