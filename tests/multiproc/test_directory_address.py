"""A member given a wrong directory address hears so early: a host name that does not resolve fails ``init`` at
once, and a port where nothing listens is said (where, and what to check) after a few seconds, long before
``init``'s timeout ends the wait. Each member is a real process.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

from tensorwire.testing import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")

# Joins with init's timeout given; prints each warning as it comes (flushed), then the error's type and text.
MEMBER = """
import sys, warnings
import tensorwire as tw
warnings.showwarning = lambda message, *rest: print("warning:", message, flush=True)
try:
    tw.init(directory=sys.argv[1], name="lost", timeout=float(sys.argv[2]))
except tw.TensorwireError as e:
    print(type(e).__name__ + ":", e, flush=True)
    raise SystemExit(0)
raise SystemExit("joined")
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update({"PYTHONPATH": os.pathsep.join([SRC, env.get("PYTHONPATH", "")]),
                "TENSORWIRE_JOB_TOKEN": "address-token-0123456789abcdef"})
    return env


def test_a_directory_host_that_does_not_resolve_fails_init_at_once():
    # init's timeout is far longer than the test waits: only failing at once passes.
    done = subprocess.run([sys.executable, "-c", MEMBER, "tcp://no-such-directory.invalid:29700", "3600"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "InvalidArgumentError:" in done.stdout and "does not resolve" in done.stdout, done.stdout
    assert "no-such-directory.invalid" in done.stdout


def test_a_directory_port_where_nothing_listens_is_said_early(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    member = subprocess.Popen([sys.executable, "-c", MEMBER, address, "3600"], env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        # The first thing it says, while init still waits (bounded far past "a few seconds", far below init's 3600).
        assert select.select([member.stdout], [], [], 300)[0], "a member said nothing in 300s of waiting"
        line = member.stdout.readline()
        assert line.startswith("warning:") and "still no directory at " + address in line, line
        assert "tensorwire directory" in line and "TENSORWIRE_DIRECTORY" in line
    finally:
        member.kill()
        member.wait(timeout=30)
