"""``tensorwire doctor`` in a fleet's environment, run as a user runs it (a subprocess with ``TENSORWIRE_DIRECTORY``
exported): it checks the directory that variable names and says so; a directory that does not answer is a FAIL
that names the variable and the fix, never blamed on UCX; its own 2-process probe meets in a job of its own
either way, so the transports it reports are right."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

from tensorwire.meeting.directory import Directory
from tensorwire.testing import free_port


def _doctor(directory: str, token: str | None = None) -> str:
    env = {**os.environ, "TENSORWIRE_DIRECTORY": directory, "TENSORWIRE_JOB_TOKEN": token or secrets.token_hex(16)}
    env.pop("TENSORWIRE_NAME", None)
    done = subprocess.run([sys.executable, "-m", "tensorwire", "doctor", "--timeout", "60"], capture_output=True,
                          text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _problems(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if line.strip().startswith("!!! FAIL")]


def test_doctor_checks_a_live_directory_and_its_probe_still_passes():
    token = secrets.token_hex(16)
    directory = Directory("127.0.0.1", 0, token=token.encode())
    try:
        stdout = _doctor(directory.address, token)
    finally:
        directory.close()
    assert f"fleet: TENSORWIRE_DIRECTORY={directory.address}: the directory answers" in stdout, stdout[-3000:]
    assert _problems(stdout) == [], stdout[-3000:]
    assert "host -> host  rank 0 READ bytes: ok" in stdout, stdout[-3000:]


def test_doctor_names_a_dead_directory_and_blames_nothing_else():
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    stdout = _doctor(address)
    problems = _problems(stdout)
    assert len(problems) == 1 and f"TENSORWIRE_DIRECTORY={address}, and no directory answers there" in problems[0], \
        stdout[-3000:]
    assert "UCX" not in problems[0] and "unset TENSORWIRE_DIRECTORY" in stdout, stdout[-3000:]
    assert "host -> host  rank 0 READ bytes: ok" in stdout, stdout[-3000:]  # the probe's own job is unaffected


def test_doctor_says_when_the_directory_does_not_admit_this_token():
    directory = Directory("127.0.0.1", 0, token=secrets.token_hex(16).encode())
    try:
        stdout = _doctor(directory.address)  # another token
    finally:
        directory.close()
    problems = _problems(stdout)
    assert len(problems) == 1 and "does not admit this environment" in problems[0], stdout[-3000:]
    assert "TENSORWIRE_JOB_TOKEN" in stdout and "UCX" not in problems[0], stdout[-3000:]
