"""The README's vLLM section, run as printed: its commands after the install (which ``.ci/run`` makes the same way,
into ``.venv-vllm``) in a scratch directory beside that venv and ``examples/``, in a process group of their own. They
make the tiny model, start the directory, both servers and the router, wait for the servers and send one
completion with token ids through the router: its answer has the decode instance's tokens, and that instance's log
shows vLLM's ``KV Transfer metrics:`` line, where the README says the transfer figures appear.

Skipped, saying why, where ``.venv-vllm`` has no vLLM, or where a port the README names is taken.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PORTS = (29700, 8100, 8200, 8000)  # as printed: the directory, the two servers, the router
RUN_S = 900.0  # both servers start in 15-60 s on a quiet 2-core box; minutes on a busy one
METRICS_S = 120.0  # vLLM logs its KV transfer metrics every few seconds once a load happened


def _readme_commands() -> str:
    """The vLLM section's commands after its install lines (``.venv-vllm`` exists), as one bash script."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it from vLLM"):]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    install, serve = blocks[0], blocks[1]
    activate = ". .venv-vllm/bin/activate\n"
    assert activate in install, "the README's vLLM install no longer activates .venv-vllm"
    return activate + install.split(activate, 1)[1] + serve


def _skip_reason() -> str | None:
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        return f"no {python}: install vLLM's CPU build there as .ci/run does"
    probe = subprocess.run([str(python), "-c", "import vllm, tensorwire.integrations.vllm"], capture_output=True,
                           text=True, timeout=300, check=False)
    if probe.returncode != 0:
        return f"{python} cannot import vllm and tensorwire: {probe.stderr.strip()[-300:]}"
    for port in PORTS:
        with socket.socket() as probe_socket:
            if probe_socket.connect_ex(("127.0.0.1", port)) == 0:
                return f"port {port}, which the README's commands use, is taken here"
    return None


def test_the_readme_vllm_commands_run_as_printed(tmp_path):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    (tmp_path / ".venv-vllm").symlink_to(ROOT / ".venv-vllm")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    log = tmp_path / "commands.log"
    script = "set -e\n" + _readme_commands() + "\necho\necho README-COMMANDS-DONE\nsleep 3600\n"
    with open(log, "w") as out:
        group = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={k: v for k, v in os.environ.items()
                                                              if not k.startswith(("TENSORWIRE_", "VIRTUAL_ENV"))})
    try:
        shown = _wait_for(log, group, "README-COMMANDS-DONE", RUN_S)
        answer = shown.split("README-COMMANDS-DONE")[0]
        assert '"token_ids"' in answer and '"error"' not in answer, answer[-3000:]
        _wait_for(log, group, "KV Transfer metrics:", METRICS_S)
    finally:
        os.killpg(group.pid, signal.SIGTERM)
        try:
            group.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(group.pid, signal.SIGKILL)
            group.wait(timeout=60)


def _wait_for(log: Path, group: subprocess.Popen, text: str, seconds: float) -> str:
    """The log once it contains ``text``; AssertionError with its tail when the commands end first or time runs
    out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        shown = log.read_text(errors="replace")
        if text in shown:
            return shown
        assert group.poll() is None, f"the commands ended ({group.returncode}) before {text!r}:\n{shown[-4000:]}"
        time.sleep(2.0)
    raise AssertionError(f"no {text!r} within {seconds:.0f}s:\n{log.read_text(errors='replace')[-4000:]}")
