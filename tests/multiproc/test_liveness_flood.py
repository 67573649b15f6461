"""A member's liveness listener under a stranger's attention: a flood of connections to its port (another process
opening idle connections as fast as it can) never makes the member look gone to those who ask it questions with
the token, and a stranger's question is closed unanswered (no host, no pid).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

from tensorwire.meeting.directory import Directory
from tensorwire.meeting.listener_queries import HELLO, MAP_EPOCH, PROBE, ask

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
TOKEN = b"flood-token-0123456789abcdef0123"

MEMBER = """
import json, os, sys, time
import tensorwire as tw
comm = tw.init(directory=sys.argv[1], name="flooded", timeout=60)
with open(sys.argv[2] + ".tmp", "w") as f:
    json.dump({"rank": comm.rank, "liveness": list(comm.runtime.liveness.address), "pid": os.getpid()}, f)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
while not os.path.exists(sys.argv[2] + ".stop"):
    time.sleep(0.05)
comm.close()
"""

# Opens connections to the port without a word, keeping the newest 600 open, until "<stop>" exists.
FLOOD = """
import collections, os, socket, sys
host, port, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
held = collections.deque()
opened = 0
while not os.path.exists(stop):
    try:
        held.append(socket.create_connection((host, port), timeout=1))
        opened += 1
    except OSError:
        pass
    while len(held) > 600:
        held.popleft().close()
print(opened, flush=True)
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update({"PYTHONPATH": os.pathsep.join([SRC, env.get("PYTHONPATH", "")]), "TENSORWIRE_LIVENESS_S": "2",
                "TENSORWIRE_JOB_TOKEN": TOKEN.decode()})
    return env


@pytest.fixture
def member(tmp_path):
    with Directory(token=TOKEN) as directory:
        out = str(tmp_path / "member.json")
        process = subprocess.Popen([sys.executable, "-c", MEMBER, directory.address, out], env=_env())
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(out):
                assert process.poll() is None and time.monotonic() < deadline, "the member did not join"
                time.sleep(0.05)
            with open(out) as f:
                yield json.load(f)
            open(out + ".stop", "w").close()
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


def test_a_flood_of_the_liveness_port_never_makes_a_live_member_look_gone(member, tmp_path):
    address, rank = tuple(member["liveness"]), member["rank"]
    stop = str(tmp_path / "flood.stop")
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, address[0], str(address[1]), stop],
                             stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(2.0)  # the flood under way
        unanswered = 0
        for _ in range(60):
            try:
                unanswered += ask(address, MAP_EPOCH, rank, TOKEN, 10.0) is None
            except TimeoutError:
                unanswered += 1
        open(stop, "w").close()
        opened = int(flood.communicate(timeout=60)[0].strip() or 0)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait(timeout=30)
    assert opened > 600, f"the flood opened only {opened} connections"
    assert unanswered == 0, f"{unanswered} of 60 questions went unanswered under a flood of {opened} connections"


def test_a_strangers_probe_is_closed_unanswered(member):
    address, rank = tuple(member["liveness"]), member["rank"]
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(HELLO.pack(PROBE, rank) + secrets.token_bytes(16) + bytes(32))  # a question with no proof
        sock.settimeout(10)
        reply = sock.recv(4096)
    assert reply == b"", f"a stranger's probe was answered: {reply!r}"
    assert ask(address, PROBE, rank, TOKEN, 10.0) is not None  # a member is answered
    assert ask(address, PROBE, rank, b"another-token-0123456789abcdef01", 10.0) is None
