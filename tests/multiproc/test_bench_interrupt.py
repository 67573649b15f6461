"""A benchmark or a job interrupted as a user interrupts it, run as a user runs it (a subprocess in a process group of
its own, as a terminal's foreground job): Ctrl-C (SIGINT to the whole group, ranks included) stops ``tensorwire
bench kv`` mid-run, which reports the cases it measured and leaves nothing in ``/dev/shm``; so does SIGTERM to the
group, and Ctrl-C or SIGTERM of a 2-rank job of ``testing.launch`` in the middle of its transfers; a bench killed
with SIGKILL takes its ranks with it, and the files they leave are removed by the next tensorwire process on the
host. Each test prints the ``/dev/shm`` listing it judged."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tensorwire.shared_memory import SHM_DIRECTORY, orphans
from tensorwire.testing.cli_run import CommandRun

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir(SHM_DIRECTORY), reason="no /dev/shm here: nothing to leave")]

# Long enough that a signal lands mid-run: 5 s of timing per path, several paths per case.
KV_ARGS = ["bench", "kv", "--memory", "cpu", "--blocks", "2000", "--block-bytes", "16K", "--no-llama", "--no-raw",
           "--time", "5", "--patterns", "random,contiguous"]
# A case that takes long enough to be interrupted in (5 s per path), on pools of 2 MiB.
SMALL_KV_ARGS = ["bench", "kv", "--memory", "cpu", "--blocks", "500", "--block-bytes", "4K", "--no-llama", "--no-raw",
                 "--time", "5", "--patterns", "random"]
WAIT_S = 120.0  # bounds for a loaded machine; nothing is asserted about durations


class _Bench(CommandRun):
    def files_of_its_ranks(self) -> list[str]:
        """The ``/dev/shm`` files of this bench's ranks (processes whose parent is the bench)."""
        return _files_of_children_of(self.process.pid)


def _files_of_children_of(parent: int) -> list[str]:
    """The ``/dev/shm`` files of tensorwire processes whose parent is ``parent``."""
    found = []
    for name in os.listdir(SHM_DIRECTORY):
        parts = name.split("-")
        if len(parts) in (4, 5) and parts[0] == "tensorwire" and _parent_of(int(parts[2])) == parent:
            found.append(os.path.join(SHM_DIRECTORY, name))
    return found


def _listing(when: str, files: list[str]) -> list[str]:
    """Which of ``files`` are still in ``/dev/shm``, printed with ``when`` for the test's log."""
    left = [path for path in files if os.path.exists(path)]
    print(f"\n/dev/shm {when}: {[os.path.basename(path) for path in left] or 'none of them'}")
    return left


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_ctrl_c_stops_a_bench_which_reports_what_it_measured_and_leaves_nothing(tmp_path):
    out = tmp_path / "kv.json"
    bench = _Bench(*KV_ARGS, "--json", str(out), wait_s=WAIT_S)
    bench.wait_for("bench kv: cpu READ contiguous")  # the first case is done, its pools are in /dev/shm
    files = bench.files_of_its_ranks()
    assert files, "the ranks' pools were expected in /dev/shm files"
    _listing("before Ctrl-C", files)
    bench.signal_group(signal.SIGINT)  # as a terminal sends it: the bench and its ranks
    stdout, stderr = bench.finish()
    assert bench.process.returncode == 130, stderr[-3000:]
    assert "interrupted; reporting the" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "cpu READ random 2000x16KiB" in stdout, stdout  # the finished case's rows
    assert stdout.count("  software ") == 1 and stdout.count("post p50 us") == 1, stdout  # header, column names
    document = json.loads(out.read_text())
    assert document["interrupted"] is True and {r["params"]["pattern"] for r in document["records"]} == {"random"}
    assert _listing("after the group exited", files) == []


@pytest.mark.skipif(shutil.which("timeout") is None, reason="no timeout(1) here")
def test_ctrl_c_under_timeout_which_passes_it_on_to_the_group_leaves_nothing():
    """``setsid timeout 120 tensorwire bench kv``, then SIGINT to its group: timeout(1) passes the SIGINT it gets on
    to its whole group, so the bench sees Ctrl-C twice, the second while it stops its ranks. Every file of every
    process of the group is gone once they all are, and the run says it measured nothing (small pools: quick)."""
    bench = CommandRun(*SMALL_KV_ARGS, wait_s=WAIT_S, prefix=("timeout", str(int(WAIT_S))))
    bench.wait_for("bench kv: cpu READ random")  # the ranks made their pools
    group = _processes_of_group(bench.process.pid)
    files = [path for pid in group for path in _files_of(pid)]
    assert files, f"the ranks' pools were expected in /dev/shm files (group {group})"
    _listing("before Ctrl-C", files)
    bench.signal_group(signal.SIGINT)
    stdout, stderr = bench.finish()
    deadline = time.monotonic() + WAIT_S
    while any(_alive(pid) for pid in group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in group), "a process of the group outlived it"
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "interrupted before any case was measured" in stdout, stdout[-3000:]
    assert _listing("after every process of the group ended", files) == []


def _processes_of_group(group: int) -> list[int]:
    """The processes whose process group is ``group``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if entry.isdigit() and int(stat.read().rsplit(")", 1)[1].split()[2]) == group:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _files_of(pid: int) -> list[str]:
    return [os.path.join(SHM_DIRECTORY, name) for name in os.listdir(SHM_DIRECTORY)
            if name.startswith("tensorwire-") and name.split("-")[2] == str(pid)]


def test_sigterm_to_the_group_stops_a_bench_and_leaves_nothing():
    bench = _Bench(*KV_ARGS, wait_s=WAIT_S)
    bench.wait_for("bench kv: cpu READ random")  # the pools are in /dev/shm
    files = bench.files_of_its_ranks()
    assert files, "the ranks' pools were expected in /dev/shm files"
    _listing("before SIGTERM", files)
    bench.signal_group(signal.SIGTERM)
    _, stderr = bench.finish()
    assert bench.process.returncode == 143, stderr[-3000:]
    assert _listing("after the group exited", files) == []


_JOB = """
import time, torch, tensorwire as tw
from tensorwire.testing import launch

def rank():
    with tw.init(timeout=60) as comm:
        mine, inbox = tw.shared_empty(1 << 20, dtype=torch.uint8), tw.shared_empty(1 << 20, dtype=torch.uint8)
        with comm.register([mine, inbox]) as registration:
            comm.publish("b", registration.descs)
            theirs = comm.lookup("b", 1 - comm.rank, timeout=60)
            comm.barrier(timeout=60)
            print("transferring", flush=True)
            deadline = time.monotonic() + 120  # until the signal comes
            while time.monotonic() < deadline:
                comm.write(mine, theirs[1], timeout=60)
                comm.read(inbox, theirs[0], timeout=60)

if __name__ == "__main__":
    launch(rank, 2, timeout=180)
"""


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_job_stopped_by_a_signal_to_its_group_mid_transfer_leaves_nothing(tmp_path, number):
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    job = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "transferring" in job.stdout.readline(), job.stderr.read()[-3000:] if job.poll() else ""
        files = _files_of_children_of(job.pid)
        assert len(files) == 4, files  # two per rank
        _listing(f"before {signal.Signals(number).name}", files)
        os.killpg(job.pid, number)
        job.wait(timeout=WAIT_S)
        assert _listing("after the group exited", files) == []
    finally:
        job.kill()
        job.wait(timeout=WAIT_S)


def test_a_killed_bench_takes_its_ranks_along_and_the_next_process_removes_their_files():
    bench = _Bench(*KV_ARGS, wait_s=WAIT_S)
    bench.wait_for("bench kv: cpu READ random")  # the pools are in /dev/shm
    files = bench.files_of_its_ranks()
    ranks = {int(os.path.basename(path).split("-")[2]) for path in files}
    assert files, "the ranks' pools were expected in /dev/shm files"
    bench.process.kill()
    bench.process.wait(timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in ranks), "a rank outlived its killed launcher"
    assert set(files) <= set(orphans()), "nothing cleaned up after SIGKILL: the files are left for the next process"
    _listing("after kill -9", files)
    next_process = ("import tensorwire as tw\n"
                    "with tw.init(rank=0, world_size=1, master_addr='127.0.0.1', "
                    "master_port=tw.testing.free_port(), timeout=60):\n    pass\n")
    done = subprocess.run([sys.executable, "-c", next_process], capture_output=True, text=True, timeout=WAIT_S,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _listing("after the next process's tw.init", files) == []
