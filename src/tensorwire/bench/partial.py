"""The records of a run as they come, and of a run that may not end well: the measuring rank appends each case's
records to a file as soon as they are measured; the command prints the case's rows from it at once (``Table``,
``RowPrinter``) and, interrupted (Ctrl-C) or stopped by a failing rank, still reports what was measured instead of
nothing.

The file has one line per case, the JSON list of its records (``Record.to_dict``), in a directory of the command's
own: a case is written with one ``write`` and read only once its line is whole, so the command never prints half a
case (a case's ratios need its reference). ``PartialRecords`` is the handle both sides share (it pickles to the
ranks as its path). Non-goals: resuming a run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from .record import Record

__all__ = ["PartialRecords", "Table", "RowPrinter", "measure_until_interrupted", "measured_records"]

T = TypeVar("T")
_POLL_S = 0.2  # how often the command looks for a new case: a row shows within this of its measurement


class PartialRecords:
    """A file of records, appended to by the rank that measures and read back by the command."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            handle, path = tempfile.mkstemp(prefix="tensorwire-bench-", suffix=".jsonl")
            os.close(handle)
        self.path = path
        self._offset = 0  # the command's side: where the cases not yet taken by ``new_cases`` start

    def __getstate__(self) -> dict[str, object]:
        return {"path": self.path, "_offset": 0}

    def add(self, records: Iterable[Record]) -> None:
        """Append ``records`` (a case's) as one line, in one write. Blocks on the file write only."""
        line = json.dumps([r.to_dict() for r in records]) + "\n"
        with open(self.path, "a") as file:
            file.write(line)

    def read(self) -> list[Record]:
        """Every record added so far; a line cut short by a killed writer is left out."""
        return [r for case in self._cases(0)[0] for r in case]

    def new_cases(self) -> list[list[Record]]:
        """The cases added since the last call (whole lines only), each a list of records, in the order added."""
        cases, self._offset = self._cases(self._offset)
        return cases

    def _cases(self, offset: int) -> tuple[list[list[Record]], int]:
        """The whole lines' cases from byte ``offset`` on, and the offset after the last whole line."""
        try:
            with open(self.path, "rb") as file:
                file.seek(offset)
                data = file.read()
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1
        cases = []
        for line in data[:end].splitlines():
            try:
                cases.append([Record.from_dict(r) for r in json.loads(line)])
            except (ValueError, TypeError, AttributeError):
                continue  # not a case: a line of another writer's making
        return cases, offset + end

    def remove(self) -> None:
        """Delete the file. Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class Table:
    """How a benchmark prints its records as they come: ``heading`` (the column names, printed once before the
    first case), ``rows(case)`` (a case's records -> its lines, in fixed-width columns so that rows printed apart
    line up) and ``legend`` (what the columns mean, printed after the last row)."""

    heading: list[str]
    rows: Callable[[list[Record]], list[str]]
    legend: list[str] = field(default_factory=list)


class RowPrinter:
    """A thread of the command that prints each case's rows on stdout as soon as the measuring rank added them to
    ``partial``. ``stop()`` prints what is left and returns how many cases were printed."""

    def __init__(self, partial: PartialRecords, table: Table) -> None:
        self.partial, self.table, self.printed = partial, table, 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="tensorwire-bench-rows", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stopping.wait(_POLL_S):
            self._print_new()

    def _print_new(self) -> None:
        for case in self.partial.new_cases():
            lines = self.table.rows(case)
            if not lines:
                continue
            if self.printed == 0:
                lines = [*self.table.heading, *lines]
            print("\n".join(lines), flush=True)
            self.printed += 1

    def stop(self) -> int:
        """Stop following, print the cases not printed yet; the number of cases printed. Blocks up to one poll."""
        self._stopping.set()
        self._thread.join()
        self._print_new()
        return self.printed


def measure_until_interrupted(run: Callable[[PartialRecords], T], benchmark: str,
                              table: Table | None = None) -> tuple[T | None, list[Record]]:
    """``(run(partial), [])``; on Ctrl-C, which ``tensorwire.testing.launch`` turns into stopping every rank at once
    (they ignore SIGINT themselves), ``(None, the records measured so far)``. With a ``table``, each case's rows
    are printed on stdout as they come, and an interrupted run that measured nothing says so in one line. Blocks
    while ``run`` does."""
    partial = PartialRecords()
    printer = RowPrinter(partial, table) if table is not None else None
    try:
        return run(partial), []
    except KeyboardInterrupt:
        if printer is not None:
            printer.stop()  # the rows of every case measured, before the line that says the run was cut
        records = partial.read()
        if records:
            print(f"bench {benchmark}: interrupted; reporting the {len(records)} record(s) measured so far",
                  file=sys.stderr, flush=True)
        else:
            print(f"bench {benchmark}: interrupted before any case was measured", flush=True)
        return None, records
    finally:
        if printer is not None:
            printer.stop()
        partial.remove()


def measured_records(run: Callable[[PartialRecords], list[Record]], benchmark: str,
                     table: Table | None = None) -> tuple[list[Record], bool]:
    """``(records, interrupted)``: ``run``'s records, or on Ctrl-C those measured so far
    (``measure_until_interrupted``, which prints the rows as they come with a ``table``). Blocks while ``run``
    does."""
    records, so_far = measure_until_interrupted(run, benchmark, table)
    return (so_far, True) if records is None else (records, False)
