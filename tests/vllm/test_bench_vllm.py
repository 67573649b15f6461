"""``tensorwire bench vllm`` run as a user runs it: the header first, a progress line per rep, and Ctrl-C after the
first rep ends the run at once with that rep reported (exit 130), no vLLM instance left behind.

Skipped, saying why, where no interpreter with vLLM exists (as ``test_vllm_connector.py``)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tensorwire.bench.vllm_parties import vllm_python
from tensorwire.testing.cli_run import CommandRun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WAIT_S = 600.0  # two vLLM instances start in ~1 min on 2 cores; bounds for a loaded machine


def _instances_of_bench_vllm() -> list[int]:
    """Processes whose command line names a ``bench vllm`` model directory (its vLLM instances)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tw-bench-vllm-" in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_ctrl_c_after_a_rep_reports_it_and_leaves_no_instance(tmp_path):
    python, why = vllm_python()
    if python is None:
        pytest.skip(f"vLLM is not installed: {why}")
    out = tmp_path / "vllm.json"
    bench = CommandRun("bench", "vllm", "--lengths", "200", "--concurrency", "1", "--reps", "50", "--connectors",
                       "tensorwire", "--json", str(out), wait_s=WAIT_S)
    bench.wait_for("bench vllm: tensorwire: rep 1/50")
    bench.process.send_signal(signal.SIGINT)
    stdout, stderr = bench.finish()
    assert bench.process.returncode == 130, stderr[-3000:]
    assert "interrupted; reporting" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "200 tokens x1" in stdout and "tensorwire" in stdout, stdout
    # The header once, on stdout, before the report (it was printed before anything started)
    assert stdout.count("  machine ") == 1 and stdout.index("  machine ") < stdout.index("200 tokens x1"), stdout
    document = json.loads(out.read_text())
    assert document["interrupted"] is True, document
    [record] = document["records"]
    assert record["path"] == "tensorwire" and 1 <= record["reps"] < 50 and record["nbytes"] > 0, record
    assert _instances_of_bench_vllm() == [], "a vLLM instance outlived the interrupted bench"
