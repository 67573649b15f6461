"""What the embedded directory does with a member's request (``directory.py`` admits the sessions): the key-value
operations over ``directory_keys.Keys`` and the rank counter, each checked and answered with one frame, and the
refusals' log.

An operation trusts nothing of the request but the session it came on (authenticated by the handshake): keys and
values are bounded and owned (``Keys``), the rank counter is the directory's own (moved by joins only, not during
the grace period after a start, raised only by the member that holds the rank below the floor), and a request no
member sends (an unknown operation, a wrong field count, a key that is no UTF-8) ends the session. Every answer is
computed on the event loop's thread; nothing here blocks.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from . import directory_wire as wire
from .directory_keys import RANK_COUNTER, Keys, Limits, RankCounter
from .directory_keys import Session as _Session

__all__ = ["Operations", "Refusals"]

log = logging.getLogger("tensorwire.directory")


class Refusals:
    """Logs each kind of refusal at most once a second, with how many there were."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._last: dict[str, float] = {}

    def __call__(self, kind: str, detail: str) -> None:
        self._counts[kind] += 1
        now = time.monotonic()
        if now - self._last.get(kind, 0.0) >= 1.0:
            self._last[kind] = now
            log.warning("tensorwire directory refused %s (%d so far): %s", kind, self._counts[kind], detail)


class Operations:
    """The operations of one directory: ``answer(request, session)``. ``grace_s``: how long after now the rank
    counter hands nothing out (members of a restarted directory put their ranks back first)."""

    def __init__(self, limits: Limits, keys: Keys, ranks: RankCounter, grace_s: float, refused: Refusals) -> None:
        self.limits, self.keys, self.ranks, self.refused = limits, keys, ranks, refused
        self.grace_until = time.monotonic() + grace_s  # counters do not move before: live members restore first

    def answer(self, request: tuple[int, list[bytes]], session: _Session) -> bytes | None:
        """The answer frame to one request; None for a request no member sends (the session ends)."""
        op, fields = request
        try:
            keys = [f.decode() for f in fields] if op in (wire.Op.CHECK, wire.Op.LIST) else None
            key = fields[0].decode() if fields and keys is None else ""
        except UnicodeDecodeError:
            return None
        if any(len(f) > wire.MAX_KEY for f in (fields if keys is not None else fields[:1])):
            return wire.encode(wire.Status.REFUSED, f"a key is over {wire.MAX_KEY} bytes".encode())
        handler = _HANDLERS.get((op, len(fields)))
        if handler is None:
            return None
        return handler(self, session, key, keys or [], fields)


    def _refuse(self, session, kind: str, why: str) -> bytes:
        self.refused(kind, f"from {session.peer}: {why}")
        return wire.encode(wire.Status.REFUSED, why.encode())

    def _own_counter(self, session, key: str) -> bytes:
        return self._refuse(session, "a write", f"{key!r} is the directory's rank counter: members move it only by "
                                                "joining (add 1), never set, compare, delete or add to it otherwise")

    def _set(self, session, key, _keys, fields) -> bytes:
        if key == RANK_COUNTER:
            return self._own_counter(session, key)
        refusal = self.keys.refusal(key, fields[1], session)
        if refusal is not None:
            return self._refuse(session, "a value", refusal)
        self.keys.put(key, fields[1], session)
        return wire.encode(wire.Status.OK)

    def _get(self, _session, key, _keys, _fields) -> bytes:
        if key == RANK_COUNTER:
            return wire.encode(wire.Status.OK, str(self.ranks.value).encode())
        value = self.keys.values.get(key)
        return wire.encode(wire.Status.MISSING) if value is None else wire.encode(wire.Status.OK, value)

    def _check(self, _session, _key, keys, _fields) -> bytes:
        held = all(k == RANK_COUNTER or k in self.keys.values for k in keys)
        return wire.encode(wire.Status.OK, b"1" if held else b"0")

    def _amount(self, field_: bytes) -> int | None:
        digits = self.limits.counter_digits
        try:
            return int(field_) if len(field_) <= digits + 1 else None
        except ValueError:
            return None

    def _add(self, session, key, _keys, fields) -> bytes:
        amount, digits = self._amount(fields[1]), self.limits.counter_digits
        wait_s = self.grace_until - time.monotonic()
        if amount and key == RANK_COUNTER and wait_s > 0:  # a rank handed out now could be one a member puts back
            return wire.encode(wire.Status.WAIT, f"{wait_s:.3f}".encode())
        if amount is not None and key == RANK_COUNTER:
            value, why = self.ranks.add(amount)
            return self._refuse(session, "a join", why) if value is None else \
                wire.encode(wire.Status.OK, str(value).encode())
        try:
            value = int(self.keys.values.get(key, b"0")) + amount if amount is not None else None
        except ValueError:
            value = None
        if value is None or len(str(abs(value))) > digits:
            return self._refuse(session, "a counter", f"{key!r} is not a counter, or the amount or the sum is no "
                                                      f"integer of at most {digits} digits")
        if amount or key not in self.keys.values:
            refusal = self.keys.refusal(key, str(value).encode(), session)
            if refusal is not None:
                return self._refuse(session, "a counter", refusal)
            self.keys.put(key, str(value).encode(), session)  # the counter goes with the member that moved it last
        return wire.encode(wire.Status.OK, str(value).encode())

    def _raise(self, session, key, _keys, fields) -> bytes:
        """The rank counter raised to a floor (never lowered) by a member that holds the rank below the floor:
        it hands nothing out, it puts back what a member holds, so it is allowed in the grace period."""
        floor = self._amount(fields[1])
        if key != RANK_COUNTER or floor is None:
            return self._refuse(session, "a counter", f"only the rank counter is raised, to an integer (not {key!r} "
                                                      f"to {fields[1][:24]!r})")
        value, why = self.ranks.raise_to(floor, self.keys.owner.get(f"rank/{floor - 1}") is session)
        return self._refuse(session, "a raise", why) if value is None else \
            wire.encode(wire.Status.OK, str(value).encode())

    def _compare_set(self, session, key, _keys, fields) -> bytes:
        """As ``TCPStore``'s: ``desired`` stored (and returned) where ``key`` holds ``expected`` (or is missing and
        ``expected`` is empty), else what it holds (``expected`` when it is missing). An empty ``desired`` deletes:
        to every caller an empty claim and a missing one are alike (free)."""
        if key == RANK_COUNTER:
            return self._own_counter(session, key)
        expected, desired = fields[1], fields[2]
        current = self.keys.values.get(key)
        if (current is None and expected) or (current is not None and current != expected):
            return wire.encode(wire.Status.OK, expected if current is None else current)
        if not desired:  # given back (a name or rank released): gone, so it counts for nobody's bounds
            self.keys.delete(key)
            return wire.encode(wire.Status.OK, desired)
        refused = self._set(session, key, [], [fields[0], desired])
        return refused if refused != wire.encode(wire.Status.OK) else wire.encode(wire.Status.OK, desired)

    def _delete(self, session, key, _keys, _fields) -> bytes:
        if key == RANK_COUNTER:
            return self._own_counter(session, key)
        return wire.encode(wire.Status.OK, b"1" if self.keys.delete(key) else b"0")

    def _list(self, _session, _key, keys, _fields) -> bytes:
        """Every key under the prefix with its value, in one answer (members() costs one round trip)."""
        prefix = keys[0]
        found = [part for k, v in self.keys.values.items() if k.startswith(prefix) for part in (k.encode(), v)]
        if sum(len(part) + 4 for part in found) > wire.MAX_FRAME:
            return wire.encode(wire.Status.REFUSED, f"the keys under {prefix!r} exceed one answer".encode())
        return wire.encode(wire.Status.OK, *found)

    def _ping(self, _session, _key, _keys, _fields) -> bytes:
        return wire.encode(wire.Status.OK)


_HANDLERS = {  # (op, number of fields) -> (operations, session, key, keys, fields) -> frame
    (wire.Op.SET, 2): Operations._set, (wire.Op.GET, 1): Operations._get, (wire.Op.ADD, 2): Operations._add,
    (wire.Op.COMPARE_SET, 3): Operations._compare_set, (wire.Op.DELETE, 1): Operations._delete,
    (wire.Op.LIST, 1): Operations._list, (wire.Op.PING, 0): Operations._ping, (wire.Op.RAISE, 2): Operations._raise,
    **{(wire.Op.CHECK, n): Operations._check for n in range(1, 257)},
}
