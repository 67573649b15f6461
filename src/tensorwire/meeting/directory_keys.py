"""What the embedded directory (``directory.py``) holds: keys, who owns each, and the fleet's rank counter.

Every key belongs to the session (an authenticated connection, ``Session``) that wrote it and goes with it, counters
included: nothing a member writes outlives it, and a session holds at most ``Limits.keys_per_session`` keys and one
rank claim (``rank/<r>``), and the sessions of one host at most ``Limits.names_per_host`` names (``name/<name>``: a
session holding one is a member, ``directory.py`` bounds the others), so no member fills the directory for the
others, and what it filled goes with it.

The rank counter (``RANK_COUNTER``) is the directory's own, the one key no member writes: it moves by one per join
(``add(RANK_COUNTER, 1)``; a read is ``add(..., 0)``), never past the largest rank a member can hold
(``RANK_LIMIT``), and is raised (``raise_to``) only by a member that holds the claim of the rank it raises past, and
only where the directory cannot know where its previous run stopped (no state file). Set, compared, deleted or
moved any other way, it is refused with the reason. So no member can stop the joins of others.

Never handed out twice, across restarts too: ranks are int32 on every wire, so no clock fine enough to outrun any
join rate fits (2**31 ms is 25 days); instead the directory keeps a *high-water mark* in its state file: before
it hands out a rank at or past the mark it writes a mark ``_BLOCK`` ranks further (written to a new file, flushed
to disk, renamed over the old one), and a restarted directory starts at the mark it finds. A kill -9 at any moment
loses at most a block of numbers, never repeats one. Without a state file the counter starts at the seconds since
2026-01-01 (above every rank of an earlier run that gave fewer than one a second), and members put theirs back
(``raise_to``), as they do into a directory whose state file is new.
"""

from __future__ import annotations

import calendar
import time
from collections import Counter
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError
from .directory_state import StateFile
from .directory_wire import MAX_VALUE

__all__ = ["Limits", "Session", "Keys", "RankCounter", "RANK_COUNTER", "RANK_LIMIT"]

RANK_COUNTER = "fleet/next_rank"
RANK_LIMIT = 2**31 - 1  # ranks are 0 .. RANK_LIMIT - 1 (int32 on the wire; environment.OPEN_WORLD is this value)
_EPOCH = calendar.timegm((2026, 1, 1, 0, 0, 0))
_BLOCK = 4096  # ranks reserved per write of the state file
_RAISE_WINDOW = 1 << 20  # how far past its own start a directory without state lets members put a rank back


@dataclass(frozen=True)
class Limits:
    """What one directory holds and serves at most."""

    connections: int = 1024  # sessions at once; over it a session of the host holding the most goes (directory.py)
    unnamed_per_host: int = 256  # sessions of one host that hold no name: over it, that host's oldest such goes
    names_per_host: int = 256  # names (``name/<name>`` claims) the sessions of one host hold at once
    pending_handshakes: int = 64
    pending_per_host: int = 16
    handshake_s: float = 5.0
    keys: int = 200_000
    keys_per_session: int = 4096
    bytes_held: int = 1 << 30
    value_bytes: int = MAX_VALUE
    lease_s: tuple[float, float] = (1.0, 600.0)  # a member's lease is clamped to this range
    counter_digits: int = 18  # a counter stays an int64


@dataclass(eq=False)
class Session:
    """One authenticated connection and the keys it wrote."""

    peer: str
    lease_s: float
    keys: set[str] = field(default_factory=set)
    rank_claims: int = 0
    name_claims: int = 0  # a session that holds a name is a member (name and host); one without is not yet one


class Keys:
    """The values, who owns each, and the totals the limits bound."""

    def __init__(self, limits: Limits) -> None:
        self.values: dict[str, bytes] = {}
        self.owner: dict[str, Session] = {}
        self.bytes_held = 0
        self.names_per_host: Counter[str] = Counter()
        self._limits = limits

    def refusal(self, key: str, value: bytes, session: Session | None) -> str | None:
        """Why ``key`` may not take ``value`` from ``session``, or None."""
        limits = self._limits
        if len(value) > limits.value_bytes:
            return f"a value of {len(value)} bytes for {key!r} is over the directory's {limits.value_bytes}"
        new = key not in self.values or self.owner.get(key) is not session
        if key not in self.values and len(self.values) >= limits.keys:
            return f"the directory holds {len(self.values)} keys, its limit"
        if session is not None and new and len(session.keys) >= limits.keys_per_session:
            return (f"this member holds {len(session.keys)} keys, the directory's limit per member; delete keys it "
                    "no longer needs")
        if session is not None and new and key.startswith("rank/") and session.rank_claims >= 1:
            return f"this member holds a rank claim already; it may not claim {key!r} too"
        if session is not None and new and key.startswith("name/") and \
                self.names_per_host[session.peer] >= limits.names_per_host:
            return (f"members at {session.peer} hold {self.names_per_host[session.peer]} names, the directory's limit "
                    "per host; close members there that are no longer needed")
        if self.bytes_held + len(value) - len(self.values.get(key, b"")) > limits.bytes_held:
            return f"the directory holds {self.bytes_held} bytes, its limit is {limits.bytes_held}"
        return None

    def put(self, key: str, value: bytes, session: Session | None) -> None:
        self.bytes_held += len(key) + len(value) - (len(key) + len(self.values[key]) if key in self.values else 0)
        self.values[key] = value
        self._disown(key)
        if session is not None:
            self.owner[key] = session
            session.keys.add(key)
            session.rank_claims += key.startswith("rank/")
            if key.startswith("name/"):
                session.name_claims += 1
                self.names_per_host[session.peer] += 1

    def _disown(self, key: str) -> None:
        before = self.owner.pop(key, None)
        if before is not None:
            before.keys.discard(key)
            before.rank_claims -= key.startswith("rank/")
            if key.startswith("name/"):
                before.name_claims -= 1
                self.names_per_host[before.peer] -= 1
                if not self.names_per_host[before.peer]:
                    del self.names_per_host[before.peer]

    def delete(self, key: str) -> bool:
        value = self.values.pop(key, None)
        if value is None:
            return False
        self.bytes_held -= len(key) + len(value)
        self._disown(key)
        return True

    def end(self, session: Session) -> None:
        """The session is over: its keys go."""
        for key in list(session.keys):
            if self.owner.get(key) is session:
                self.delete(key)
        session.keys.clear()


class RankCounter:
    """The fleet's rank counter: the next rank to propose, its bound, and its high-water mark on disk.

    ``state``: the file that keeps the mark across restarts (None: none; the counter then starts at the seconds
    since 2026-01-01). Raises ``InvalidArgumentError`` from the constructor when the file cannot be read or written
    (``directory_state.StateFile``: the path, what is in the way, the fix); ``close()`` lets the file go."""

    def __init__(self, state: str | None) -> None:
        self.state = state
        self._file = StateFile(state) if state is not None else None
        self.known = self._file is not None and self._file.mark is not None  # nothing of an earlier run is above
        earlier = self._file.mark if self._file is not None and self._file.mark is not None else 0
        self.start = max(int(time.time()) - _EPOCH, earlier)
        self.value = self.start
        self.reserved = self.start
        if self._file is not None:
            try:
                self._reserve(self.start + _BLOCK)
            except OSError as e:
                self.close()
                raise InvalidArgumentError(f"directory: cannot write the rank counter's mark to {self._file.path} "
                                           f"({e}); free space there, make its folder writable by this user, or pass "
                                           "--state another file") from e

    def _reserve(self, mark: int) -> None:
        """Write ``mark`` durably before a rank below it is handed out; ``OSError`` leaves ``reserved`` as it was."""
        self._file.write(mark)
        self.reserved = mark

    def close(self) -> None:
        """Let the state file go (idempotent)."""
        if self._file is not None:
            self._file.close()

    def add(self, amount: int) -> tuple[int | None, str]:
        """The counter after a join (``amount`` 1) or a read (0): (value, "") or (None, why it is refused)."""
        if amount not in (0, 1):
            return None, (f"the fleet's rank counter moves only by one per join (add {amount} refused: it is the "
                          "directory's own; members do not set it)")
        if self.value + amount > RANK_LIMIT:
            return None, (f"the fleet's ranks are spent: the counter is at {self.value}, and a rank must stay below "
                          f"{RANK_LIMIT}; start the directory with a new state file")
        if amount and self.state is not None and self.value + amount > self.reserved:
            why = self._reserve_or_why(self.value + amount + _BLOCK)
            if why:
                return None, why
        self.value += amount
        return self.value, ""

    def _reserve_or_why(self, mark: int) -> str:
        """Nothing ("") once ``mark`` is on disk, else why no rank past the mark on disk is handed out (the disk
        refused: full, made read-only): the join is refused, never given a rank the file does not cover; the next
        one tries again."""
        try:
            self._reserve(mark)
        except OSError as e:
            return (f"the directory cannot write its rank counter's mark to {self._file.path} ({e}), so it hands out "
                    f"no rank past {self.reserved}; free space there or make its folder writable (joins go on once "
                    "it can)")
        return ""

    def raise_to(self, floor: int, proves: bool) -> tuple[int | None, str]:
        """Put back a rank a member holds: the counter raised to ``floor`` (never lowered). Only where the start
        is unknown (no state file, or a new one), by a member that holds the claim of rank ``floor - 1``
        (``proves``), and at most ``_RAISE_WINDOW`` past this run's start: no member moves the counter further than
        a rank it holds."""
        if floor <= self.value:
            return self.value, ""
        if self.known:
            return None, (f"the rank counter is at {self.value} and this directory keeps its high-water mark in "
                          f"{self.state}: no rank of an earlier run is above it, so raising it to {floor} is refused")
        if not proves:
            return None, (f"raising the rank counter to {floor} needs the claim of rank {floor - 1} (rank/"
                          f"{floor - 1}) held by this member first")
        if floor > min(self.start + _RAISE_WINDOW, RANK_LIMIT):
            return None, (f"raising the rank counter to {floor} is refused: it started at {self.start} and no earlier "
                          f"run could have handed out ranks past {self.start + _RAISE_WINDOW}")
        if self.state is not None and floor > self.reserved:
            why = self._reserve_or_why(floor + _BLOCK)
            if why:
                return None, why
        self.value = floor
        return self.value, ""
