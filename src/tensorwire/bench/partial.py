"""The records of a run that may not end well: the measuring rank appends each case's records to a file as soon as
they are measured, so that the command, interrupted (Ctrl-C) or stopped by a failing rank, still reports what it
measured instead of nothing.

The file is one JSON record per line (``Record.to_dict``) in a directory of the command's own; ``PartialRecords``
is the handle both sides share (it pickles to the ranks as its path). Non-goals: resuming a run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import TypeVar

from .record import Record

__all__ = ["PartialRecords", "measure_until_interrupted", "measured_records"]

T = TypeVar("T")


class PartialRecords:
    """A file of records, appended to by the rank that measures and read back by the command."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            handle, path = tempfile.mkstemp(prefix="tensorwire-bench-", suffix=".jsonl")
            os.close(handle)
        self.path = path

    def add(self, records: Iterable[Record]) -> None:
        """Append ``records`` (a case's) and flush them to the file. Blocks on the file write only."""
        with open(self.path, "a") as file:
            file.writelines(json.dumps(r.to_dict()) + "\n" for r in records)

    def read(self) -> list[Record]:
        """Every record added so far; a line cut short by a killed writer is left out."""
        records = []
        try:
            with open(self.path) as file:
                for line in file:
                    try:
                        records.append(Record.from_dict(json.loads(line)))
                    except (ValueError, TypeError):
                        continue
        except FileNotFoundError:
            pass
        return records

    def remove(self) -> None:
        """Delete the file. Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def measure_until_interrupted(run: Callable[[PartialRecords], T], benchmark: str) -> tuple[T | None, list[Record]]:
    """``(run(partial), [])``; on Ctrl-C, which ``tensorwire.testing.launch`` turns into stopping every rank at once
    (they ignore SIGINT themselves), ``(None, the records measured so far)``. Blocks while ``run`` does."""
    partial = PartialRecords()
    try:
        return run(partial), []
    except KeyboardInterrupt:
        records = partial.read()
        print(f"bench {benchmark}: interrupted; reporting the {len(records)} record(s) measured so far",
              file=sys.stderr, flush=True)
        return None, records
    finally:
        partial.remove()


def measured_records(run: Callable[[PartialRecords], list[Record]], benchmark: str) -> tuple[list[Record], bool]:
    """``(records, interrupted)``: ``run``'s records, or on Ctrl-C those measured so far
    (``measure_until_interrupted``). Blocks while ``run`` does."""
    records, so_far = measure_until_interrupted(run, benchmark)
    return (so_far, True) if records is None else (records, False)
