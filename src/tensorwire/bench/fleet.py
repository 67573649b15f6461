"""``tensorwire bench fleet``: members launched apart (a *fleet*, ``tw.init(directory=, name=)``): what joining
costs, what the first READ from a member never contacted costs (handshake included), and whether the steady
state READ between members of two launches matches the same READ inside one launcher world.

This process runs the directory (``tensorwire.meeting.directory.Directory``) and starts every other party as a fresh
process (``fleet_parties``; multiprocessing ``spawn``). For each fleet size N of ``--members``, ascending:

- **join**: the first launch's members (``member-0`` ... ``member-<N-2>``, started together, imported and
  idle) join one after another, each timing its own ``tw.init(directory=, name=)`` in a process that has not
  called it before (what a starting member pays). The fleet grows from one size to the next, so the record
  of N holds the joins of all N members, the reader's included. ``params["phases_ms"]`` splits the median
  join: the directory connection with the rank claim and liveness listener, starting the NIXL agent (made on
  its own thread meanwhile), the name claim and member record, and the rest. ``serving_ms``: joined and the
  first pool registered, which waits for that agent: when the member can serve a READ.
- **first contact**: a reader (``reader-<N>``), a second launch started after the first's members are up,
  joins and reaches the members that joined since the last reader, which nobody has contacted (at most
  ``--first-contacts``): ``rank_of`` + ``lookup_blocks`` + ``prepare_blocks`` + the first READ of
  ``FIRST_READ_BLOCKS`` random blocks of a small pool over NIXL, each step timed; the median over those
  members is the record, the same READ repeated (``again_us``) beside it. Held against raw NIXL's first
  contact (``fleet_raw``: metadata load + the same READ between two fresh bare agents), measured at the end.
- **steady state**: the reader READs ``--blocks`` random ids of ``member-0``'s pool (``--block-bytes`` each,
  in a ``/dev/shm`` file), one request per post, per ``--transports``; the two ranks of one launcher world
  (``tensorwire.testing.launch``, started once at the beginning, pools of the same shape) do the same READ.
  Both are timed in alternating rounds (``--rounds``, ``--time`` seconds per path in all), so a drift of this
  machine weighs on both alike; the fleet's record is held against the world's (``ratio``). Bytes checked.
- **descriptors**: ``/proc/self/fd`` of the reader after joining, after its first contacts and after the
  steady state, and of every first-launch member after joining and at the end of the stage, split into the
  members some reader contacted and those nobody did (``params["fds"]``): joining opens no connection to
  anyone, a member holds connections only to the peers it used.

Host memory only: the fleet's figures concern the control plane and the handshake, not a device; CUDA memory
between members is ``bench kv``'s with a fleet in place of a world. Non-goals: cross-host figures, etcd.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import WaitTimeoutError
from .command import announce, at_least, check_plot, finish, header, header_lines, parse_size, positive, require_nixl
from .fleet_report import FLEET, RAW_NIXL, TABLE, WORLD, plot_fleet, tail_lines
from .partial import PartialRecords, measured_records
from .record import Record
from .timing import Budget, quantile, summarize

__all__ = ["HELP", "FleetBenchConfig", "run", "add_arguments", "main", "plot_fleet"]

HELP = "fleet members launched apart: join, first READ from a never-seen member, steady READ beside one world"



@dataclass(frozen=True)
class FleetBenchConfig:
    members: tuple[int, ...] = (2, 8)  # about a minute on 2 cores; --members 2,8,32 for the scaling figures
    blocks: int = 10_000
    block_bytes: int = 16384
    transports: tuple[str, ...] = ("nixl", "shm")
    time_s: float = 1.0  # a 160 MiB READ over NIXL takes 60-75 ms here, its p90 up to 2x that: ~15 calls a path
    rounds: int = 8
    first_contacts: int = 3  # also raw NIXL's fresh process pairs, the longest part of a default run
    timeout_s: float = 600.0
    quiet: bool = False
    partial: PartialRecords | None = None  # where each fleet size's records go as they are measured


class _Party:
    """A process of the benchmark and the pipe it takes requests on; ``ask`` is bounded by the run's deadline."""

    def __init__(self, name: str, conn: Any, deadline: float, alive: Callable[[], bool],
                 why_gone: Callable[[], str]) -> None:
        self.name, self.conn, self.deadline = name, conn, deadline
        self._alive, self._why_gone = alive, why_gone

    def reply(self) -> Any:
        while not self.conn.poll(0.05):
            if not self._alive():
                if self.conn.poll(0):
                    break  # its last words arrived as it exited
                raise _failed(f"bench fleet: {self.name} exited without answering ({self._why_gone()})")
            if time.monotonic() > self.deadline:
                raise WaitTimeoutError(f"bench fleet: {self.name} did not answer within --timeout; raise "
                                       "--timeout or measure fewer --members")
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            raise _failed(f"bench fleet: {self.name} closed its pipe ({self._why_gone()})") from None
        if kind == "error":
            raise _failed(f"bench fleet: {self.name} failed:\n{payload}")
        return payload

    def ask(self, *request: Any) -> Any:
        self.conn.send(request)
        return self.reply()


def _failed(message: str) -> Exception:
    from ..testing import RankFailedError

    return RankFailedError(message)


class _Run:
    """The parties of one run; ``close`` ends every one still running and removes their ``/dev/shm`` files."""

    def __init__(self, config: FleetBenchConfig) -> None:
        from ..meeting.directory import Directory

        self.config = config
        self.deadline = time.monotonic() + config.timeout_s
        self.context = mp.get_context("spawn")
        token = secrets.token_hex(16)
        self.env = {"TENSORWIRE_JOB_TOKEN": token}  # the fleet's; the world gets its own
        self.directory = Directory(token=token.encode())
        self.processes: list[Any] = []
        self._world_conns: list[Any] = []

    def say(self, line: str) -> None:
        if not self.config.quiet:
            print(f"bench fleet: {line}", file=sys.stderr, flush=True)

    def start(self, name: str, target: Callable, *args: Any) -> _Party:
        """Start a party process (it imports tensorwire, then waits for requests); not yet waited for."""
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=target, args=(theirs, self.env, self.directory.address, name, *args),
                                       name=f"tensorwire-bench-{name}", daemon=True)
        process.start()
        theirs.close()
        self.processes.append(process)
        return _Party(name, ours, self.deadline, process.is_alive, lambda: f"exit code {process.exitcode}")

    def start_world(self) -> tuple[_Party, _Party]:
        """The launcher world of 2 ranks, run by ``launch`` on a thread of this process: its ranks' parties."""
        from ..testing import launch
        from .fleet_parties import world_rank

        pipes = [self.context.Pipe() for _ in range(2)]
        self._world_conns = [ours for ours, _ in pipes]
        failure: list[BaseException] = []
        c = self.config

        def run_world() -> None:
            try:
                launch(world_rank, 2, tuple(theirs for _, theirs in pipes), c.blocks, c.block_bytes, c.transports,
                       c.timeout_s, timeout=c.timeout_s)
            except BaseException as e:  # noqa: BLE001 - reported by the parties' next answer
                failure.append(e)

        thread = threading.Thread(target=run_world, name="tensorwire-bench-world", daemon=True)
        thread.start()
        return tuple(_Party(f"rank {rank} of the launcher world", ours, self.deadline, thread.is_alive,
                            lambda: str(failure[0]) if failure else "no error") for rank, ours in enumerate(
                                self._world_conns))

    def close(self) -> None:
        for conn in self._world_conns:
            conn.close()  # a rank's next recv fails: launch stops both
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        self.directory.close()
        from ..shared_memory import remove_orphans  # here, not atop: the command's --help needs no torch

        remove_orphans()  # the /dev/shm files of parties that were killed


# --- one fleet size --------------------------------------------------------------------------------------------
def _stage(run: _Run, size: int, holders: list[_Party], joined: list[dict[str, Any]], contacted: set[int],
           world: _Party) -> list[Record]:
    """Grow the fleet to ``size`` members (``size - 1`` holders and a new reader), then measure; the records."""
    from .fleet_parties import reader

    c = run.config
    first_new = len(joined)
    for member in range(first_new, size - 1):
        joined.append(holders[member].ask("join", c.block_bytes))
    run.say(f"{size - 1} member(s) joined (median {quantile([j['join_ms'] for j in joined], 0.5):.1f} ms); "
            f"starting reader-{size}")
    party = run.start(f"reader-{size}", reader, c.timeout_s)
    party.reply()
    reader_join = party.ask("join", c.block_bytes)
    fds = {"reader after join": _fds(reader_join)}
    targets = list(range(first_new, size - 1))[-c.first_contacts:]
    firsts = party.ask("first", [(f"member-{m}", m) for m in targets], c.block_bytes)
    contacted.update(targets)
    fds["reader after first contacts"] = party.ask("fds")
    run.say(f"first READ from {len(targets)} never-seen member(s): median "
            f"{quantile([f['total_ms'] for f in firsts], 0.5):.1f} ms; steady state")
    party.ask("steady", "member-0", c.blocks, c.block_bytes, c.transports)
    contacted.add(0)
    steady = _steady(run, party, world, size)
    fds["reader after steady state"] = party.ask("fds")
    ends = [h.ask("fds") for h in holders[:size - 1]]
    fds["members after join"] = _spread([_fds(j) for j in joined])
    fds["contacted members now"] = _spread([e for m, e in enumerate(ends) if m in contacted])
    fds["untouched members now"] = _spread([e for m, e in enumerate(ends) if m not in contacted])
    party.ask("stop")
    joins = [*joined, reader_join]
    return [_join_record(size, joins, fds), _first_record(size, firsts, c.block_bytes), *steady]


def _steady(run: _Run, party: _Party, world: _Party, size: int) -> list[Record]:
    """Each transport: the fleet's READ and the world's, warmed, then timed in alternating rounds."""
    c = run.config
    nbytes = c.blocks * c.block_bytes
    out = []
    for transport in c.transports:
        per_call = max(party.ask("warm", transport), world.ask("warm", transport))
        reps = math.ceil(Budget(time_s=c.time_s, min_reps=10).reps_for(per_call) / c.rounds)
        samples: dict[str, list[float]] = {FLEET: [], WORLD: []}
        for _ in range(c.rounds):
            samples[FLEET] += party.ask("round", transport, reps)
            samples[WORLD] += world.ask("round", transport, reps)
        party.ask("check", transport)
        world.ask("check", transport)
        params = {"members": size, "blocks": c.blocks, "block_bytes": c.block_bytes, "ids": "random"}
        world_record = Record.measured("fleet", "cpu", "READ", WORLD, transport, nbytes, summarize(samples[WORLD]),
                                       **params)
        fleet_record = Record.measured("fleet", "cpu", "READ", FLEET, transport, nbytes, summarize(samples[FLEET]),
                                       **params).against(world_record)
        run.say(f"{size} members, {transport}: fleet {fleet_record.gbps:.2f} GB/s, one world "
                f"{world_record.gbps:.2f} GB/s ({fleet_record.ratio_text()})")
        out += [fleet_record, world_record]
    return out


def _fds(counts: dict[str, Any]) -> dict[str, int]:
    return {"fds": counts["fds"], "sockets": counts["sockets"]}


def _spread(counts: list[dict[str, int]]) -> dict[str, Any] | None:
    """Median and max of descriptor counts over members, and how many members; None for none."""
    if not counts:
        return None
    return {key: {"median": quantile([float(c[key]) for c in counts], 0.5), "max": max(c[key] for c in counts)}
            for key in ("fds", "sockets")} | {"members": len(counts)}


def _join_record(size: int, joins: list[dict[str, Any]], fds: dict[str, Any]) -> Record:
    """Join latency over the fleet's ``size`` members, the phases of each averaged by their median."""
    timing = summarize([j["join_ms"] * 1e-3 for j in joins])
    phases = {name: quantile([j["phases"].get(name, 0.0) for j in joins], 0.5) for name in joins[0]["phases"]}
    return Record.measured("fleet", "cpu", "join", FLEET, "directory", 0, timing, members=size,
                           max_ms=max(j["join_ms"] for j in joins), join_ms=[round(j["join_ms"], 2) for j in joins],
                           reader_join_ms=joins[-1]["join_ms"], phases_ms=phases, fds=fds,
                           serving_ms=quantile([j["serving_ms"] for j in joins], 0.5),
                           serving_max_ms=max(j["serving_ms"] for j in joins))


def _first_record(size: int, firsts: list[dict[str, float]], block_bytes: int) -> Record:
    """The first READ from never-seen members, handshake included: median over them, each step's median."""
    from .fleet_parties import FIRST_READ_BLOCKS

    steps = {key: quantile([f[key] for f in firsts], 0.5) for key in firsts[0] if key != "total_ms"}
    return Record.measured("fleet", "cpu", "first READ", FLEET, "nixl", FIRST_READ_BLOCKS * block_bytes,
                           summarize([f["total_ms"] * 1e-3 for f in firsts]), members=size, targets=len(firsts),
                           max_ms=max(f["total_ms"] for f in firsts), **steps)


def run(config: FleetBenchConfig) -> list[Record]:
    """Measure every fleet size of ``config``; the records. Blocks for the whole run (bounded by
    ``config.timeout_s``); raises ``RankFailedError`` when a party fails (wrong bytes: ``TransferError`` in its
    message) and ``WaitTimeoutError`` past the timeout. Every process it started is gone when it returns."""
    from ..backends.nixl import quiet_nixl_logging
    from .fleet_parties import holder

    quiet_nixl_logging()
    bench_run = _Run(config)
    try:
        largest = max(config.members)
        bench_run.say(f"directory at {bench_run.directory.address}; starting {largest - 1} member(s) and a "
                      "2-rank launcher world")
        world, world_source = bench_run.start_world()
        holders = [bench_run.start(f"member-{m}", holder, m, (config.blocks, config.block_bytes) if m == 0 else None,
                                   config.timeout_s) for m in range(largest - 1)]
        for party in holders:
            party.reply()
        world.reply()
        world_source.reply()
        records: list[Record] = []
        joined: list[dict[str, Any]] = []
        contacted: set[int] = set()
        for size in sorted(config.members):
            measured = _stage(bench_run, size, holders, joined, contacted, world)
            if config.partial is not None:
                config.partial.add(measured)
            records += measured
        world_source.ask("stop")
        world.ask("stop")
        for party in holders:
            party.ask("stop")
        return _against_raw_nixl(bench_run, records)
    finally:
        bench_run.close()


def _against_raw_nixl(run: _Run, records: list[Record]) -> list[Record]:
    """The first READs held against raw NIXL's first contact (``fleet_raw``), measured now; its record added."""
    from .fleet_parties import FIRST_POOL_BLOCKS, FIRST_READ_BLOCKS
    from .fleet_raw import raw_first_contacts

    c = run.config
    run.say(f"raw NIXL's first contact, {c.first_contacts} fresh pair(s) of processes")
    seconds = raw_first_contacts(FIRST_POOL_BLOCKS, FIRST_READ_BLOCKS, c.block_bytes, c.first_contacts, c.timeout_s)
    raw = Record.measured("fleet", "cpu", "first READ", RAW_NIXL, "nixl", FIRST_READ_BLOCKS * c.block_bytes,
                          summarize(seconds), max_ms=max(seconds) * 1e3, contacts=len(seconds))
    held = [r.against(raw) if r.op == "first READ" else r for r in records]
    return [*held, raw]


# --- the command -----------------------------------------------------------------------------------------------
def _members(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give fleet sizes of 2 or more members, e.g. 2,8,32")
    return sizes


def _transports(text: str) -> tuple[str, ...]:
    transports = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not transports or set(transports) - {"nixl", "shm"}:
        raise argparse.ArgumentTypeError(f"{text!r}: give nixl, shm or nixl,shm")
    return transports



def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FleetBenchConfig()
    parser.epilog = ("Needs: the nixl package (raw NIXL's first contact is the reference) and room in /dev/shm for the"
                     " members' pools. Starts its own directory on 127.0.0.1 and every member as a local process; "
                     "TENSORWIRE_DIRECTORY is not read.")
    parser.description = (HELP + ". Host memory only. The defaults take about a minute on a 2-core machine.")
    parser.add_argument("--members", type=_members, default=defaults.members, metavar="N,N",
                        help="fleet sizes, members in all (default 2,8)")
    parser.add_argument("--blocks", type=at_least(int, 1), default=defaults.blocks, metavar="N",
                        help="blocks of the steady READ, one request per post (default 10000)")
    parser.add_argument("--block-bytes", type=parse_size, default=defaults.block_bytes, metavar="SIZE",
                        help="bytes per block, a multiple of 4 (default 16K)")
    parser.add_argument("--transports", type=_transports, default=defaults.transports, metavar="LIST",
                        help="steady READ transports: nixl, shm or nixl,shm (default nixl,shm)")
    parser.add_argument("--time", type=positive, default=defaults.time_s, metavar="S",
                        help="seconds of timed steady READs per path, transport and fleet size (default 1)")
    parser.add_argument("--rounds", type=at_least(int, 1), default=defaults.rounds, metavar="N",
                        help="alternating rounds of fleet and world READs (default 8)")
    parser.add_argument("--first-contacts", type=at_least(int, 1), default=defaults.first_contacts, metavar="N",
                        help="never-seen members a reader reaches at most, and raw NIXL's first contacts (default 3)")
    parser.add_argument("--timeout", type=positive, default=defaults.timeout_s, metavar="S",
                        help="give up (and stop every process) after this many seconds (default 600)")
    parser.add_argument("--memory", choices=["cpu", "cuda"], default="cpu",
                        help="host memory only (cpu, the default); cuda is refused")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every record to PATH")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="plot to PNG (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def config_from(args: argparse.Namespace) -> FleetBenchConfig:
    if args.memory != "cpu":
        args.parser.error("--memory cuda: bench fleet measures host memory only (joins, handshakes and the READ "
                          "between members launched apart); use bench kv --memory cuda for GPU block transfers")
    if args.block_bytes % 4:
        args.parser.error(f"--block-bytes {args.block_bytes}: give a multiple of 4")
    return replace(FleetBenchConfig(), members=args.members, blocks=args.blocks, block_bytes=args.block_bytes,
                   transports=args.transports, time_s=args.time, rounds=args.rounds,
                   first_contacts=args.first_contacts, timeout_s=args.timeout, quiet=args.quiet)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark: the header on stdout, each fleet size's block as soon as it is measured (progress on
    stderr), then raw NIXL's reference; write ``--json`` / ``--plot``. Ctrl-C stops every party: the fleet sizes
    measured stay the report (exit 130)."""
    config = config_from(args)
    require_nixl(args, "bench fleet (raw NIXL's first contact is its reference)")
    check_plot(args)
    head = header(args.argv)
    announce(header_lines("tensorwire bench fleet: members launched apart, meeting in a directory", head,
                          method_rows(config)))
    records, interrupted = measured_records(lambda partial: run(replace(config, partial=partial)), "fleet", TABLE)
    return finish(args, head, records, tail_lines(records),
                  lambda records, path: plot_fleet(records, path, title=" ".join(["tensorwire", *args.argv])),
                  interrupted, config=replace(config, partial=None))


def method_rows(config: FleetBenchConfig) -> list[tuple[str, str]]:
    """How ``bench fleet`` measures (the header's method rows)."""
    return [
        ("fleet", f"sizes {','.join(map(str, config.members))}: members of one launch join a directory in this "
                  "process one after another (each times its own tw.init); a reader launched later reaches up to "
                  f"{config.first_contacts} never-seen members (rank_of + lookup + prepare + first READ), held "
                  "against raw NIXL's first contact"),
        ("steady", f"READ {config.blocks} x {config.block_bytes // 1024} KiB random blocks of member-0 over "
                   f"{','.join(config.transports)}, beside the same READ between 2 ranks of one launcher world, "
                   f"{config.rounds} alternating rounds, {config.time_s:g} s per path"),
    ]
