"""A ``tensorwire`` command run as a user runs it, for the tests that interrupt or kill it: a subprocess with SIGINT
at its default (a shell's background job would ignore it) in a process group of its own, as a terminal's
foreground job is (``signal_group`` sends a signal to it and every process it started, as Ctrl-C does), its
stderr read line by line on a thread."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

__all__ = ["CommandRun"]


class CommandRun:
    """``python -m tensorwire *args``, after ``prefix`` (a wrapper command such as ``timeout 120``); ``wait_s`` bounds
    every wait (for a loaded machine: nothing is asserted about durations)."""

    def __init__(self, *args: str, wait_s: float = 120.0, prefix: tuple[str, ...] = ()) -> None:
        self.wait_s = wait_s
        self.process = subprocess.Popen([*prefix, sys.executable, "-m", "tensorwire", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line)

    def signal_group(self, number: int) -> None:
        """Send signal ``number`` to the command's process group: the command and the processes it started (Ctrl-C
        in a terminal is SIGINT to the group)."""
        os.killpg(self.process.pid, number)

    def wait_for(self, text: str) -> str:
        """The first stderr line that contains ``text``; AssertionError (with the stderr so far) if the command
        ends first or none comes within ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.process.poll() is None, f"the command ended first: {''.join(self.stderr)[-3000:]}"
                continue
            self.stderr.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} on stderr within {self.wait_s}s: {''.join(self.stderr)[-3000:]}")

    def finish(self) -> tuple[str, str]:
        """Its stdout and whole stderr, once it ended (bounded by ``wait_s``)."""
        self.process.wait(timeout=self.wait_s)
        stdout = self.process.stdout.read()
        self._reader.join(timeout=self.wait_s)
        while not self.lines.empty():
            self.stderr.append(self.lines.get_nowait())
        return stdout, "".join(self.stderr)
