"""tensorwire without the ``nixl`` extra, as a user who left it out has it: every process of these tests starts with
``nixl`` hidden (a ``sitecustomize`` that puts None in ``sys.modules``, so importing it fails as if it were not
installed). The ranks of one host still meet: ``shm`` carries the bytes, the ``socket`` channel the notifications and
revocations; a transfer nothing can carry says why, naming the extra; the tools say what is missing and how to add
it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here: shm needs it")

_HIDE_NIXL = 'import sys; sys.modules["nixl"] = None  # as if the nixl package were not installed\n'
_JOB = textwrap.dedent('''
    import torch
    import tensorwire as tw
    from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch

    def job():
        with tw.init(timeout=INIT_TIMEOUT) as comm:
            peer = 1 - comm.rank
            mine, inbox = tw.shared_empty(1024, dtype=torch.uint8), tw.shared_empty(1024, dtype=torch.uint8)
            mine.fill_(comm.rank + 1)
            plain = torch.zeros(1024, dtype=torch.uint8)
            with comm.register([mine, plain]) as own, comm.register(inbox) as box:
                comm.publish("box", box.descs + own.descs)
                theirs = comm.lookup("box", peer, timeout=WAIT)
                comm.write(mine, theirs[0], notify=b"written", timeout=WAIT)
                assert comm.wait_notification(peer, timeout=WAIT) == b"written"
                assert bool((inbox == peer + 1).all()), inbox[:8]
                try:
                    comm.prepare(tw.READ, plain, theirs[2])
                    refused = "prepared"
                except tw.InvalidArgumentError as e:
                    refused = str(e)
                held = comm.prepare(tw.WRITE, mine, theirs[0])  # then rank 1 takes its inbox back
                comm.barrier(timeout=WAIT)
                if comm.rank == 1:
                    box.close()  # returns once rank 0 answered the revocation (over the socket channel)
                comm.barrier(timeout=WAIT)
                try:
                    held.post()
                    held.wait(timeout=WAIT)
                    revoked = "posted"
                except tw.RevokedError:
                    revoked = "RevokedError"
                held.close()
                return refused, revoked, comm.runtime.transports.messenger.name

    if __name__ == "__main__":
        import job_module
        print(repr(launch(job_module.job, 2)))
''')


@pytest.fixture
def without_nixl(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes cannot import nixl (children inherit it)."""
    (tmp_path / "sitecustomize.py").write_text(_HIDE_NIXL)
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), src])}


def test_two_ranks_of_a_host_meet_over_shm_and_sockets_and_a_transfer_nothing_carries_says_why(tmp_path,
                                                                                                without_nixl):
    (tmp_path / "job_module.py").write_text(_JOB)
    done = subprocess.run([sys.executable, str(tmp_path / "job_module.py")], capture_output=True, text=True,
                          env=without_nixl, cwd=tmp_path, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    for refused, _, messenger in results:
        assert messenger == "socket"
        assert "no transport reaches rank" in refused and "tensorwire[nixl]" in refused and \
            "tw.shared_empty" in refused, refused
    assert results[0][1] == "RevokedError", results  # rank 0's transfer into the inbox rank 1 took back


def test_the_tools_say_nixl_is_missing_and_how_to_add_it(without_nixl):
    bench = subprocess.run([sys.executable, "-m", "tensorwire", "bench"], capture_output=True, text=True,
                           env=without_nixl, timeout=120, check=False)
    assert bench.returncode == 2 and "pip install 'tensorwire[nixl]'" in bench.stderr, bench.stderr[-2000:]
    assert "Traceback" not in bench.stderr
    doctor = subprocess.run([sys.executable, "-m", "tensorwire", "doctor"], capture_output=True, text=True,
                            env=without_nixl, timeout=300, check=False)
    assert "WARN: nixl is not installed" in doctor.stdout and "FAIL: backend nixl" not in doctor.stdout, \
        doctor.stdout[-3000:]
    assert "pip install 'tensorwire[nixl]'" in doctor.stdout
