"""``tw.init`` and ``tensorwire directory`` refuse a wrong argument before any import of torch (seconds on a busy
machine): checked in a fresh interpreter, which must not have torch loaded when the refusal comes."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys, tensorwire as tw
try:
    tw.init({arguments})
except tw.InvalidArgumentError as e:
    print("refused:", e)
print("torch loaded:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("arguments,said", [
    ("directory='tcp://127.0.0.1', name='x'", "tcp://HOST:PORT"),  # no port
    ("directory='tcp://127.0.0.1:99999', name='x'", "tcp://HOST:PORT"),  # no such port
    ("directory='tcp://127.0.0.1:1'", "needs both directory= and name="),
    ("timeout=-1", "timeout=-1"),
    ("rank=0, world_size=2, directory='tcp://127.0.0.1:1', name='x'", "belong to a launcher's world"),
])
def test_a_wrong_argument_is_refused_before_torch_is_imported(arguments, said):
    done = subprocess.run([sys.executable, "-c", _PROBE.format(arguments=arguments)], capture_output=True, text=True,
                          timeout=120)
    assert "refused: init: " in done.stdout and said in done.stdout, done.stdout + done.stderr
    assert "torch loaded: False" in done.stdout, done.stdout


def test_the_directory_refuses_a_busy_port_without_torch():
    """``tensorwire directory`` needs no torch: a port in use is said at once (it took 7-45 s of imports)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tensorwire", "directory", "--port",
                               str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "in use" in done.stderr, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    assert "tensorwire.meeting.directory" in imported and "torch" not in imported, imported[-20:]
