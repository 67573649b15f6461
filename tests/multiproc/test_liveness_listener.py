"""A rank's liveness listener and revocation thread under a stranger and at rest, with real processes: a hello that
claims a rank but never proves the token makes no caller to wait for (close() is not held by it), and an idle
rank's revocation thread sleeps instead of waking 100 times a second, while a revocation still reaches it at once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import torch

import tensorwire as tw
from tensorwire.meeting.directory import Directory
from tensorwire.meeting.listener_queries import HELLO
from tensorwire.testing.suite import launch

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
TOKEN = "listener-token-0123456789abcdef"
LIVENESS_S = 2.0

OWNER = """
import json, os, sys, time, torch
import tensorwire as tw
comm = tw.init(directory=sys.argv[1], name="owner", timeout=30)
pool = comm.register_blocks(torch.zeros(64, 16))
comm.publish_blocks("kv", pool)
out = sys.argv[2]
with open(out + ".tmp", "w") as f:
    json.dump(list(comm.runtime.liveness.address), f)
os.rename(out + ".tmp", out)
while not os.path.exists(out + ".go"):
    time.sleep(0.02)
try:
    pool.close()
    outcome = "closed"
except tw.TensorwireError as e:
    outcome = f"{type(e).__name__}: {e}"
with open(out + ".result", "w") as f:
    f.write(outcome)
comm.close()
"""


def test_a_strangers_hello_claiming_a_rank_makes_no_caller_to_wait_for(tmp_path):
    """Before, a 7-byte hello claiming a rank nobody has made every later close() of that member wait for the
    claimed rank's answer until the bound, raise, and keep the memory quarantined."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update({"PYTHONPATH": os.pathsep.join([SRC, env.get("PYTHONPATH", "")]), "TENSORWIRE_JOB_TOKEN": TOKEN,
                "TENSORWIRE_LIVENESS_S": str(LIVENESS_S)})
    out = str(tmp_path / "owner")
    with Directory(token=TOKEN.encode()) as directory:
        owner = subprocess.Popen([sys.executable, "-c", OWNER, directory.address, out], env=env)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(out):
                assert owner.poll() is None and time.monotonic() < deadline, "the owner did not start"
                time.sleep(0.02)
            with open(out) as f:
                address = tuple(json.load(f))
            strangers = []
            for claimed in (12345, 1 << 30):
                sock = socket.create_connection(address, timeout=5)
                sock.sendall(HELLO.pack(b"TWL", claimed))  # and never answers the challenge
                strangers.append(sock)
            open(out + ".go", "w").close()
            assert owner.wait(timeout=60) == 0
            with open(out + ".result") as f:
                assert f.read() == "closed"
        finally:
            if owner.poll() is None:
                owner.kill()
            for sock in locals().get("strangers", []):
                sock.close()


def _revocation_thread() -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name.startswith("tensorwire-revocations"))


def _wakes(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def _unproven_wakes(address, rank: int, stop: threading.Event) -> None:
    while not stop.wait(0.9):
        with socket.create_connection(tuple(address), timeout=5) as sock:
            sock.sendall(HELLO.pack(b"TWW", rank) + bytes(40))


def _idle_then_revoked() -> dict:
    with tw.init(timeout=60) as comm:
        return _idle_then_revoked_in(comm)


def _idle_then_revoked_in(comm) -> dict:
    peer = 1 - comm.rank
    data = torch.full((4096,), float(comm.rank))
    reg = comm.register([data])
    comm.publish("data", reg.descs)
    remote = comm.lookup("data", peer)
    inbox = torch.zeros(4096)
    with comm.register([inbox]) as mine, comm.prepare(tw.READ, inbox, remote) as transfer:
        transfer.post()
        transfer.wait(timeout=30)
        comm.barrier()
        time.sleep(1.5)  # past the revocation thread's busy time after the last wake
        thread = _revocation_thread()
        before = _wakes(thread)
        stop = threading.Event()
        stranger = threading.Thread(target=_unproven_wakes, args=(comm.runtime.liveness.address, comm.rank, stop))
        stranger.start()  # wakes without the token's proof: served, but no reason to poll
        time.sleep(4.0)
        stop.set()
        stranger.join()
        idle_wakes = _wakes(thread) - before
        comm.barrier()
        del mine
        if comm.rank == 0:
            began = time.monotonic()
            reg.close()  # rank 1 holds a READ of it, its revocation thread asleep: answered at once when poked
            close_s = time.monotonic() - began
        else:
            close_s = 0.0
        comm.barrier()
        if comm.rank == 1:
            reg.close()
    return {"idle_wakes": idle_wakes, "close_s": close_s}


def test_an_idle_ranks_revocation_thread_sleeps_and_still_answers_at_once():
    results = launch(_idle_then_revoked, 2, env={"TENSORWIRE_LIVENESS_S": str(LIVENESS_S)})
    for result in results:
        # One wake per liveness period and one per stranger's wake (2 + 4 in 4 s), against 400 polling at 10 ms.
        assert result["idle_wakes"] <= 16, results
    # Answered within the bound of close(): the owner did not wait for the holder's next idle wake-up to time out.
    assert results[0]["close_s"] < 2 * LIVENESS_S, results
