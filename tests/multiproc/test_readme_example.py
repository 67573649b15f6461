"""The README's examples run as written: the first under torchrun with 2 ranks (on this machine's memory: the
CPU without a GPU), the one without a launcher as two plain processes given their rank on the command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tensorwire as tw

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README's ``## <section>``, in order."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end != -1 else None], flags=re.DOTALL)


def _token_env() -> dict[str, str]:
    return {**os.environ, "TENSORWIRE_JOB_TOKEN": "readme-example-token-0123456789"}


def test_first_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_python_blocks("Example")[0])
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(tw.testing.free_port()), str(script)],
        capture_output=True, text=True, timeout=180, env=_token_env(),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert output.count("transport:") == 2, output[-3000:]


def test_example_without_a_launcher_runs_as_two_processes(tmp_path):
    code = _python_blocks("Example")[1]
    assert 'master_addr="10.0.0.1"' in code and "master_port=29500" in code, code
    script = tmp_path / "job.py"
    script.write_text(code.replace("10.0.0.1", "127.0.0.1").replace("29500", str(tw.testing.free_port())))
    env = _token_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # nothing but what the example passes
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for rank in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    for rank, (process, output) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0, output[-3000:]
        assert f"rank {rank} of 2" in output, output[-3000:]
