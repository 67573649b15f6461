"""The fleet's control plane tried as an attacker would: a process on the job's network without the token (a raw
TCP client, a ``TCPStore`` client, a client with another token), a flood of idle connections, a squatter on a dead
member's liveness port, a member over the directory's bounds, a restarted directory. Each test asserts what honest
members observe afterwards. Members are real processes (``tw.init(directory=, name=)``) where a member's own
behaviour is under test; the directory's client (``DirectoryStore``) stands in for them where only the directory's
answer is.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import tensorwire as tw
from tensorwire.meeting import directory_wire as wire
from tensorwire.meeting.directory import Directory, Limits
from tensorwire.meeting.directory_store import DirectoryStore
from tensorwire.meeting.listener_queries import answering

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
TOKEN = b"directory-token-0123456789abcdef"
LIVENESS_S = 2.0


def _client(directory: Directory, token: bytes | None = TOKEN, lease_s: float = 10.0) -> DirectoryStore:
    return DirectoryStore(directory.host, directory.port, token=token, lease_s=lease_s, connect_s=5.0, request_s=5.0)


def _env(token: bytes | None = TOKEN) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update({"PYTHONPATH": os.pathsep.join([SRC, env.get("PYTHONPATH", "")]),
                "TENSORWIRE_LIVENESS_S": str(LIVENESS_S)})
    if token is not None:
        env["TENSORWIRE_JOB_TOKEN"] = token.decode()
    return env


MEMBER = """
import json, os, sys, time
import tensorwire as tw
comm = tw.init(directory=sys.argv[1], name=sys.argv[2], timeout=30)
with open(sys.argv[3] + ".tmp", "w") as f:
    json.dump({"rank": comm.rank, "liveness": list(comm.runtime.liveness.address)}, f)
os.rename(sys.argv[3] + ".tmp", sys.argv[3])
while not os.path.exists(sys.argv[3] + ".stop"):
    time.sleep(0.05)
comm.close()
"""


def _start_member(directory: str, name: str, out: str, token: bytes | None = TOKEN) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", MEMBER, directory, name, out], env=_env(token))


def _joined(out: str, process: subprocess.Popen, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(out):
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the member did not join (exit code {process.poll()})")
        time.sleep(0.02)
    with open(out) as f:
        return json.load(f)


def test_a_stranger_without_the_token_learns_nothing_and_changes_nothing():
    with Directory(token=TOKEN) as directory:
        member = _client(directory)
        member.set("member/7", b"sealed record")
        # A raw TCP client: the greeting is a fresh nonce and a mode byte; a wrong proof ends the connection.
        with socket.create_connection((directory.host, directory.port), timeout=5) as raw:
            greeting = raw.recv(64)
            assert greeting.startswith(wire.MAGIC) and b"member" not in greeting
            raw.sendall(bytes(wire.NONCE_BYTES) + wire.LEASE.pack(1000) + bytes(wire.MAC_BYTES))
            assert raw.recv(64).startswith(b"\x00")
            assert raw.recv(64) == b""  # closed
        # A request frame sent before any handshake is not a proof either.
        with socket.create_connection((directory.host, directory.port), timeout=5) as raw:
            raw.recv(64)
            raw.sendall(wire.encode(wire.Op.LIST, b"") * 8)  # as long as a hello
            assert raw.recv(64).startswith(b"\x00") and raw.recv(64) == b""
        # torch's TCPStore client, as anyone would try first, gets nowhere.
        with pytest.raises(Exception):  # noqa: B017 - torch's own error types; any of them is a refusal
            dist.TCPStore(directory.host, directory.port, None, False, datetime.timedelta(seconds=3)).add("x", 1)
        # Another token, or none: refused before anything is read, typed, saying the token differs.
        with pytest.raises(tw.AuthenticationError, match="differs"):
            _client(directory, token=b"another-token-0123456789abcdef")
        with pytest.raises(tw.AuthenticationError, match="has none"):
            _client(directory, token=None)
        assert member.list_prefix("") == {"member/7": b"sealed record"}, "a stranger changed what members see"
        assert _client(directory).get("member/7") == b"sealed record"


def test_the_directory_logs_a_member_without_a_token_as_well_as_one_with_another(caplog):
    """Each refusal is logged once, a missing token as well as a wrong one, each saying which it was."""
    with caplog.at_level("WARNING", logger="tensorwire.directory"), Directory(token=TOKEN) as directory:
        for token in (None, b"another-token-0123456789abcdef"):
            with pytest.raises(tw.AuthenticationError):
                _client(directory, token=token)
        deadline = time.monotonic() + 30
        while len(caplog.records) < 2 and time.monotonic() < deadline:  # the directory logs on its own thread
            time.sleep(0.05)
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2, refusals
    assert "without a job token" in refusals[0] and "TENSORWIRE_JOB_TOKEN is not set" in refusals[0], refusals
    assert "another job token" in refusals[1], refusals


def test_a_directory_on_a_busy_port_names_its_own_flags():
    """``tensorwire directory --port N`` on a port in use says to choose another --port (not MASTER_PORT, which the
    user never typed), on a line of its own."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        done = subprocess.run([sys.executable, "-m", "tensorwire", "directory", "--port", str(busy.getsockname()[1])],
                              capture_output=True, text=True, timeout=120, env=_env(), check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "--port" in done.stderr and "MASTER" not in done.stderr and done.stderr.endswith("\n"), done.stderr


def test_a_member_with_the_token_meeting_an_open_directory_is_refused():
    with Directory(token=None) as directory:
        with pytest.raises(tw.AuthenticationError, match="without a job token"):
            _client(directory)
        assert _client(directory, token=None).add("n", 1) > 0  # an unauthenticated fleet still works


def test_a_flood_of_idle_connections_does_not_keep_members_out():
    """200 connections that never complete a handshake (held open for longer than the handshake bound would
    allow): members keep joining, because the oldest pending handshake is dropped, not the newest."""
    with Directory(token=TOKEN, limits=Limits(handshake_s=60.0)) as directory:
        flood = [socket.create_connection((directory.host, directory.port), timeout=5) for _ in range(200)]
        try:
            for i in range(5):
                member = _client(directory)
                member.set(f"member/{i}", b"x")
                member.close()
            dropped = 0
            for sock in flood:
                sock.settimeout(2)
                try:
                    sock.recv(64)
                    dropped += sock.recv(64) == b""
                except OSError:
                    dropped += 1
            assert dropped >= 200 - Limits().pending_per_host, "the flood's handshakes were kept over the bound"
        finally:
            for sock in flood:
                sock.close()


def test_the_directory_refuses_over_its_bounds_typed_and_keeps_serving():
    with Directory(token=TOKEN, limits=Limits(value_bytes=1024, keys=10)) as directory:
        member = _client(directory)
        with pytest.raises(tw.InvalidArgumentError, match="over the directory's 1024"):
            member.set("big", bytes(2048))
        for i in range(10):
            member.set(f"k{i}", b"v")
        with pytest.raises(tw.InvalidArgumentError, match="10 keys, its limit"):
            member.set("k10", b"v")
        member.delete_key("k0")
        member.set("k10", b"v")  # room again
        assert len(member.list_prefix("k")) == 10


def test_a_members_keys_live_as_long_as_its_lease():
    """Keys belong to the connection that wrote them: gone when it closes (a process that died) or falls silent
    past its lease (a host that went); counters stay and only grow."""
    with Directory(token=TOKEN) as directory:
        watcher = _client(directory)
        closed, silent = _client(directory), _client(directory, lease_s=1.0)
        closed.set("member/1", b"a")
        silent.set("member/2", b"b")
        first = closed.add("fleet/next_rank", 1)
        closed.close()
        time.sleep(0.2)
        assert set(watcher.list_prefix("member/")) == {"member/2"}
        time.sleep(1.5)
        assert watcher.list_prefix("member/") == {}
        with pytest.raises(tw.PeerLostError):
            silent.ping()
        assert watcher.add("fleet/next_rank", 1) == first + 1


def test_a_restarted_directory_hands_a_newcomer_no_live_members_rank(tmp_path, processes):
    """The directory restarts empty; a newcomer joins before the live member has put its records back: it gets a
    rank of its own, above every rank the earlier directory gave, and both are listed once the member restored."""
    port = tw.testing.free_port()
    directory = Directory(port=port, token=TOKEN)
    old = str(tmp_path / "old.json")
    processes.append(_start_member(directory.address, "old", old))
    old_rank = _joined(old, processes[-1])["rank"]
    directory.close()
    with Directory(port=port, token=TOKEN, grace_s=2 * LIVENESS_S) as again:  # as `tensorwire directory` gives
        new = str(tmp_path / "new.json")
        processes.append(_start_member(again.address, "new", new))
        new_rank = _joined(new, processes[-1])["rank"]
        assert new_rank > old_rank
        watcher = _client(again)
        deadline = time.monotonic() + 2 * LIVENESS_S + 5
        while {"member/" + str(r) for r in (old_rank, new_rank)} - set(watcher.list_prefix("member/")):
            assert time.monotonic() < deadline, "the live member did not restore its record"
            time.sleep(0.05)
        for out in (old, new):
            open(out + ".stop", "w").close()
        for process in processes:
            assert process.wait(timeout=60) == 0


def test_a_squatter_on_a_dead_members_port_is_not_that_member(tmp_path, processes):
    with Directory(token=TOKEN) as directory:
        gone, stays = str(tmp_path / "gone.json"), str(tmp_path / "stays.json")
        processes.append(_start_member(directory.address, "gone", gone))
        victim = _joined(gone, processes[-1])
        processes.append(_start_member(directory.address, "stays", stays))
        live = _joined(stays, processes[-1])
        assert answering({live["rank"]: tuple(live["liveness"])}, TOKEN, 5.0) == {live["rank"]}
        processes[0].send_signal(signal.SIGKILL)
        processes[0].wait(timeout=30)
        squatter = socket.create_server(tuple(victim["liveness"]))  # takes the port, accepts, says nothing valid
        try:
            address = {victim["rank"]: tuple(victim["liveness"])}
            assert answering(address, TOKEN, 2.0) == set(), "a squatter passed for the dead member"
            assert "name/gone" not in _client(directory).list_prefix("name/"), "a dead member's name stayed taken"
            again = str(tmp_path / "again.json")
            processes.append(_start_member(directory.address, "gone", again))  # its name back at once
            assert _joined(again, processes[-1])["rank"] > victim["rank"]
            for out in (stays, again):
                open(out + ".stop", "w").close()
            for process in processes[1:]:
                assert process.wait(timeout=60) == 0
        finally:
            squatter.close()


def test_a_member_with_another_token_fails_at_init_typed(tmp_path, processes):
    with Directory(token=TOKEN) as directory:
        code = ("import tensorwire as tw, sys\n"
                "try:\n    tw.init(directory=sys.argv[1], name='intruder', timeout=30)\n"
                "except tw.AuthenticationError as e:\n    print('refused:', e); raise SystemExit(0)\n"
                "raise SystemExit('joined')\n")
        for token in (b"another-token-0123456789abcdef", None):
            done = subprocess.run([sys.executable, "-c", code, directory.address], env=_env(token),
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr[-2000:]
            assert "TENSORWIRE_JOB_TOKEN" in done.stdout and directory.address in done.stdout
            assert TOKEN.decode() not in done.stdout  # never which token is right
            assert "unauthenticated" not in done.stderr, done.stderr  # no warning the error then contradicts


def test_counters_wait_out_a_fresh_directorys_grace_but_a_member_puts_its_rank_back_at_once():
    """A rank can only be handed out once the members of a restarted directory had their heartbeat's time to put
    theirs back; putting one back (raising the counter past the rank whose claim it holds) is allowed at once and
    never lowers it."""
    from tensorwire.meeting.directory_store import NotYet

    with Directory(token=TOKEN, grace_s=1.0) as directory:
        member = _client(directory)
        epoch = member.add("fleet/next_rank", 0)
        with pytest.raises(NotYet) as waited:
            member.add("fleet/next_rank", 1)
        assert 0 < waited.value.seconds <= 1.0
        member.compare_set(f"rank/{epoch + 99}", b"", b"its sealed claim")  # what it puts back first: its rank
        assert member.raise_to("fleet/next_rank", epoch + 100) == epoch + 100
        assert member.raise_to("fleet/next_rank", epoch + 5) == epoch + 100
        time.sleep(waited.value.seconds + 0.05)
        assert member.add("fleet/next_rank", 1) == epoch + 101
        with pytest.raises(tw.InvalidArgumentError, match="digits"):
            member.add("fleet/next_rank", 10**30)
