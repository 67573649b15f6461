"""A benchmark interrupted as a user interrupts it, run as a user runs it (a subprocess): Ctrl-C (SIGINT) stops
``tensorwire bench kv`` mid-run, which reports the cases it measured and leaves nothing in ``/dev/shm``; a bench
killed with SIGKILL takes its ranks with it, and the files they leave are removed by the next tensorwire process
on the host."""

from __future__ import annotations

import json
import os
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
WAIT_S = 120.0  # bounds for a loaded machine; nothing is asserted about durations


class _Bench(CommandRun):
    def files_of_its_ranks(self) -> list[str]:
        """The ``/dev/shm`` files of this bench's ranks (processes whose parent is the bench)."""
        found = []
        for name in os.listdir(SHM_DIRECTORY):
            parts = name.split("-")
            if len(parts) in (4, 5) and parts[0] == "tensorwire" and _parent_of(int(parts[2])) == self.process.pid:
                found.append(os.path.join(SHM_DIRECTORY, name))
        return found


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
    bench.process.send_signal(signal.SIGINT)
    stdout, stderr = bench.finish()
    assert bench.process.returncode == 130, stderr[-3000:]
    assert "interrupted; reporting the" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "cpu READ random 2000x16KiB" in stdout, stdout  # the finished case's rows
    document = json.loads(out.read_text())
    assert document["interrupted"] is True and {r["params"]["pattern"] for r in document["records"]} == {"random"}
    assert [path for path in files if os.path.exists(path)] == []


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
    next_process = ("import tensorwire as tw\n"
                    "with tw.init(rank=0, world_size=1, master_addr='127.0.0.1', "
                    "master_port=tw.testing.free_port(), timeout=60):\n    pass\n")
    done = subprocess.run([sys.executable, "-c", next_process], capture_output=True, text=True, timeout=WAIT_S,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [path for path in files if os.path.exists(path)] == []
