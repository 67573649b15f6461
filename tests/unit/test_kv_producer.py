"""``kv.Producer``'s holds without a fleet: claims and dones pushed into its channel as consumer ranks would send
them, grants read back. A handoff is granted to one claim, freed after the reads the head map expects, refused as
spent afterwards, and freed unread at its expiry. The real thing runs in tests/multiproc/test_kv_handoff.py."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import tensorwire as tw
from tensorwire import kv
from tensorwire.kv import producer as producer_module
from tensorwire.kv.messages import TO_PRODUCER, Claim, Done, Grant, parse
from tensorwire.testing.suite import scaled


class _Runtime:
    def __init__(self) -> None:
        self.inbox: list[tuple[int, bytes]] = []
        self.replies: list[tuple[int, Grant]] = []
        self.gone: set[int] = set()  # ranks the liveness view says left

    def peer_lost(self, rank: int, fresh: bool = False) -> str | None:
        return "its process closed the connection" if rank in self.gone else None

    def channel(self, prefix: bytes):
        def take_all():
            taken, self.inbox = self.inbox, []
            return taken

        return SimpleNamespace(take_all=take_all, send=lambda rank, m: self.replies.append((rank, parse(m))))


def _producer(tp_size: int = 1, tp_rank: int = 0, heads: int = 8, hold_s: float = 60.0):
    runtime = _Runtime()
    member = SimpleNamespace(comm=SimpleNamespace(runtime=runtime), name="prefill", tp_rank=tp_rank,
                             sharding=kv.Sharding(tp_size, heads), shape=kv.BlockShape(96, 1))
    return kv.Producer(member, hold_s=hold_s), runtime


def _handoff(request: str = "r1", issued_at: float = 100.0, hold_s: float = 60.0) -> kv.Handoff:
    now = time.time()
    return kv.Handoff("prefill", (1, 2), request, 192, "L", "", issued_at, now + hold_s, block_size=96)


def _claim(runtime, sender: int, claim: str, *, request="r1", issued_at=100.0, read=True, tp=1, rank=0,
           lease_s=60.0) -> Grant:
    runtime.inbox.append((sender, Claim("t" + claim, ((request, issued_at, claim),), read, tp, rank,
                                        lease_s).encode()))
    return _reply(runtime, sender)


def _reply(runtime, sender: int, timeout_s: float = 5.0) -> Grant:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, (rank, _) in enumerate(runtime.replies):
            if rank == sender:
                return runtime.replies.pop(i)[1]
        time.sleep(0.005)
    raise AssertionError("no grant")


def _released(producer, request: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if request in producer.released():
            return True
        time.sleep(0.005)
    return False


def test_a_handoff_is_granted_to_one_claim_and_spent_after_its_read():
    producer, runtime = _producer()
    producer.hold(_handoff())
    assert _claim(runtime, 5, "A").verdicts == {"r1": "granted"}
    assert _claim(runtime, 5, "A").verdicts == {"r1": "granted"}  # the same consumer asking again
    assert _claim(runtime, 6, "B").verdicts == {"r1": "taken"}  # a second consumer, or a restarted one
    assert producer.released() == set()
    runtime.inbox.append((6, Done((("r1", "B"),), 0).encode()))  # a done under another claim counts for nothing
    time.sleep(0.05)
    assert producer.released() == set()
    runtime.inbox.append((5, Done((("r1", "A"),), 0).encode()))
    assert _released(producer, "r1")
    assert _claim(runtime, 6, "C").verdicts == {"r1": "spent"}  # after reuse: refused before any byte moves
    assert _claim(runtime, 5, "A").verdicts == {"r1": "spent"}
    assert producer.refused == {"taken": 1, "spent": 2}
    producer.close()


def test_a_claim_before_the_engine_handed_off_is_held_and_reported_once_handed_off():
    producer, runtime = _producer()
    issued_at = time.time()
    assert _claim(runtime, 5, "A", issued_at=issued_at).verdicts == {"r1": "granted"}
    runtime.inbox.append((5, Done((("r1", "A"),), 0).encode()))
    time.sleep(0.05)
    assert producer.released() == set()  # read, but the engine has not handed it off yet: not reported
    producer.hold(_handoff(issued_at=issued_at))
    assert _released(producer, "r1")
    producer.close()


def test_a_claim_for_a_handoff_this_producer_cannot_have_issued_is_unknown():
    """A producer started again remembers nothing spent: a handoff issued before it started, or long ago, or in
    the future, is refused rather than granted on a hold it never made."""
    producer, runtime = _producer(hold_s=60.0)
    for issued_at in (time.time() - 3.0, time.time() - 86400, time.time() + 3600):
        assert _claim(runtime, 5, "A", issued_at=issued_at).verdicts == {"r1": "unknown"}, issued_at
    producer.close()


def test_a_release_for_another_handoff_of_an_id_does_not_free_the_real_one():
    producer, runtime = _producer()
    issued_at = time.time()
    bogus = _claim(runtime, 9, "X", issued_at=issued_at + 0.25, read=False)  # frees its own hold only
    assert bogus.verdicts == {"r1": "granted"}
    producer.hold(_handoff(issued_at=issued_at))
    time.sleep(0.05)
    assert producer.released() == set()  # the engine's handoff is still held
    assert _claim(runtime, 5, "A", issued_at=issued_at).verdicts == {"r1": "granted"}
    runtime.inbox.append((5, Done((("r1", "A"),), 0).encode()))
    assert _released(producer, "r1")
    producer.close()


def test_a_done_from_a_rank_the_head_map_does_not_send_here_counts_for_nothing():
    producer, runtime = _producer()
    producer.hold(_handoff())
    assert _claim(runtime, 5, "A").verdicts == {"r1": "granted"}
    runtime.inbox.append((5, Done((("r1", "A"),), 7).encode()))  # consumer TP 1 has only rank 0
    time.sleep(0.05)
    assert producer.released() == set()
    producer.close()


def test_the_engines_hold_keeps_a_grants_lease():
    producer, runtime = _producer()
    issued_at = time.time()
    assert _claim(runtime, 5, "A", issued_at=issued_at).verdicts == {"r1": "granted"}
    producer.hold(_handoff(issued_at=issued_at, hold_s=0.2))  # expires before the READ is done
    time.sleep(0.5)
    assert producer.released() == set() and producer.expired == 0
    producer.close()


def test_a_request_id_of_another_handoff_is_unknown():
    producer, runtime = _producer()
    producer.hold(_handoff(issued_at=100.0))
    assert _claim(runtime, 5, "A", issued_at=99.0).verdicts == {"r1": "unknown"}
    producer.close()


def test_every_consumer_rank_the_head_map_names_must_report():
    # Producer rank 1 of TP 2 (heads 4..7) read by a consumer at TP 4: consumer ranks 2 and 3 read from it.
    producer, runtime = _producer(tp_size=2, tp_rank=1)
    producer.hold(_handoff())
    assert _claim(runtime, 12, "A", tp=4, rank=2).verdicts == {"r1": "granted"}
    assert _claim(runtime, 13, "A", tp=4, rank=3).verdicts == {"r1": "granted"}  # one consumer, all its ranks
    runtime.inbox.append((12, Done((("r1", "A"),), 2).encode()))
    runtime.inbox.append((12, Done((("r1", "A"),), 2).encode()))  # the same rank twice counts once
    time.sleep(0.05)
    assert producer.released() == set()
    runtime.inbox.append((13, Done((("r1", "A"),), 3).encode()))
    assert _released(producer, "r1")
    producer.close()


def test_a_release_counts_as_done_at_once():
    # MLA at producer TP 2, consumer TP 1: the consumer reads rank 0 and releases rank 1.
    runtime = _Runtime()
    member = SimpleNamespace(comm=SimpleNamespace(runtime=runtime), name="prefill-tp1", tp_rank=1,
                             sharding=kv.Sharding(2, 1, replicated=True), shape=kv.BlockShape(96, 1))
    producer = kv.Producer(member, hold_s=60.0)
    producer.hold(_handoff())
    assert _claim(runtime, 9, "A", read=False).verdicts == {"r1": "granted"}
    assert _released(producer, "r1")
    producer.close()


def test_an_unread_hold_expires_and_malformed_messages_are_ignored():
    producer, runtime = _producer()
    producer.hold(_handoff(hold_s=0.2))
    runtime.inbox += [(5, b"twkv1p {"), (5, b"twkv1p " + b"[" * 100000), (5, b"twkv1p {\"kind\":\"claim\"}"),
                      (5, b'twkv1p {"kind":["claim"]}'), (5, b'twkv1p {"kind":{"a":1}}'),
                      (5, Claim("t", (("r1", float("nan"), "A"),), True, 1, 0).encode())]
    assert _released(producer, "r1") and producer.expired == 1
    assert runtime.replies == []  # nothing malformed was answered
    producer.close()


def test_a_granted_hold_outlives_its_expiry_until_read():
    producer, runtime = _producer()
    producer.hold(_handoff(hold_s=0.2))
    assert _claim(runtime, 5, "A").verdicts == {"r1": "granted"}  # just before expiry: the READ comes after
    time.sleep(0.5)
    assert producer.released() == set() and producer.expired == 0  # never freed under a READ
    runtime.inbox.append((5, Done((("r1", "A"),), 0).encode()))
    assert _released(producer, "r1")
    producer.close()


def test_a_producer_leaving_waits_until_its_handoffs_are_read():
    producer, runtime = _producer()
    producer.hold(_handoff())
    _claim(runtime, 5, "A")
    runtime.inbox.append((5, Done((("r1", "A"),), 0).encode()))
    started = time.monotonic()
    producer.drain(5.0)
    assert producer.pending() == 0 and time.monotonic() - started < 5.0
    producer.close()


# --- token holders inside the fleet -----------------------------------------------------------------------------
def _held(producer, request: str, seconds: float) -> bool:
    """Whether ``request`` is still held after ``seconds`` (released() asked all along)."""
    return not _released(producer, request, timeout_s=seconds)


def test_claiming_again_never_keeps_a_hold_past_its_expiry_plus_the_first_grants_read_bound():
    producer, runtime = _producer()
    issued_at = time.time()
    producer.hold(_handoff(issued_at=issued_at, hold_s=0.3))
    assert _claim(runtime, 5, "A", issued_at=issued_at, lease_s=0.3).verdicts == {"r1": "granted"}
    started = time.monotonic()
    for _ in range(6):  # the same claim again, asking for the longest lease each time
        _claim(runtime, 5, "A", issued_at=issued_at, lease_s=600.0)
        if "r1" in producer.released():
            break
        time.sleep(0.1)
    assert _released(producer, "r1", timeout_s=2.0)
    assert time.monotonic() - started < 2.0 and producer.expired == 1
    producer.close()


def test_a_grant_still_keeps_its_read_bound_when_claimed_just_before_expiry():
    producer, runtime = _producer()
    issued_at = time.time()
    producer.hold(_handoff(issued_at=issued_at, hold_s=0.1))
    assert _claim(runtime, 5, "A", issued_at=issued_at, lease_s=1.0).verdicts == {"r1": "granted"}
    assert _held(producer, "r1", 0.5)  # past the expiry, inside the READ bound
    assert _released(producer, "r1", timeout_s=3.0)
    producer.close()


def test_the_hold_of_a_claimant_gone_from_the_fleet_ends_soon(monkeypatch):
    monkeypatch.setattr(producer_module, "_PRESENCE_SCAN_S", 0.05)
    monkeypatch.setattr(producer_module, "_GONE_GRACE_S", 0.2)
    producer, runtime = _producer()
    issued_at = time.time()
    producer.hold(_handoff(issued_at=issued_at, hold_s=0.1))
    assert _claim(runtime, 5, "A", issued_at=issued_at, lease_s=600.0).verdicts == {"r1": "granted"}
    assert _claim(runtime, 6, "A", issued_at=issued_at, lease_s=600.0).verdicts == {"r1": "granted"}  # its 2nd rank
    runtime.gone.add(5)
    assert _held(producer, "r1", 0.6)  # one claimant of the two is still there
    runtime.gone.add(6)
    assert _released(producer, "r1", timeout_s=2.0)
    producer.close()


def test_claims_before_the_engines_hold_are_bounded_per_claiming_rank(monkeypatch):
    monkeypatch.setattr(producer_module, "_MAX_CLAIMED_FIRST", 8)
    producer, runtime = _producer()
    issued_at = time.time()
    made_up = tuple((f"made-up-{i}", issued_at, "X") for i in range(20))
    runtime.inbox.append((9, Claim("tX", made_up, True, 1, 0).encode()))
    verdicts = _reply(runtime, 9).verdicts
    assert sum(v == "granted" for v in verdicts.values()) == 8 and sum(v == "unknown" for v in verdicts.values()) == 12
    assert _claim(runtime, 5, "A", request="real", issued_at=issued_at).verdicts == {"real": "granted"}
    for i in range(8):  # the engine hands its own off: they no longer count against rank 9
        producer.hold(_handoff(request=f"made-up-{i}", issued_at=issued_at))
    runtime.inbox.append((9, Claim("tY", (("again", issued_at, "X"),), True, 1, 0).encode()))
    assert _reply(runtime, 9).verdicts == {"again": "granted"}
    producer.close()


def test_claims_before_the_engines_hold_end_with_their_claimant(monkeypatch):
    monkeypatch.setattr(producer_module, "_PRESENCE_SCAN_S", 0.05)
    monkeypatch.setattr(producer_module, "_GONE_GRACE_S", 0.1)
    producer, runtime = _producer()
    issued_at = time.time()
    runtime.inbox.append((9, Claim("tX", (("made-up", issued_at, "X"),), True, 1, 0, 600.0).encode()))
    assert _reply(runtime, 9).verdicts == {"made-up": "granted"}
    runtime.gone.add(9)
    deadline = time.monotonic() + 2.0
    while producer._holds and time.monotonic() < deadline:
        producer.released()
        time.sleep(0.01)
    assert not producer._holds
    producer.hold(_handoff(request="made-up", issued_at=issued_at))  # the engine hands it off later: freed at once
    assert _released(producer, "made-up", timeout_s=1.0)
    producer.close()


def test_a_consumer_tp_without_a_head_map_is_unknown_and_any_tp_costs_the_same():
    producer, runtime = _producer(heads=8)
    producer.hold(_handoff())
    assert _claim(runtime, 5, "A", tp=3).verdicts == {"r1": "unknown"}  # 8 heads do not split over 3 ranks
    assert _claim(runtime, 5, "A", tp=12).verdicts == {"r1": "unknown"}  # nor replicate evenly over 12
    started = time.perf_counter()
    for tp in range(8, 4097, 8):
        producer_module._readers(kv.Sharding(1, 8), 0, tp)
    per_claim = (time.perf_counter() - started) / 512
    assert per_claim < scaled(1e-3), f"{per_claim * 1e6:.0f} us per consumer TP"
    assert _claim(runtime, 5, "A", tp=4096, rank=4095).verdicts == {"r1": "granted"}
    producer.close()


def _tp_sizes(heads: int) -> list[int]:
    return [t for t in range(1, 4 * heads + 1) if heads % t == 0 or t % heads == 0]


def test_the_readers_of_a_producer_rank_are_the_head_maps():
    for heads in (1, 2, 3, 4, 6, 8):
        for mla in (False, True):
            if mla and heads != 1:
                continue
            sizes = range(1, 13) if mla else _tp_sizes(heads)
            for producer_tp in sizes:
                for consumer_tp in sizes:
                    own, other = kv.Sharding(producer_tp, heads, mla), kv.Sharding(consumer_tp, heads, mla)
                    try:
                        head_map = kv.HeadMap(own, other)
                    except tw.InvalidArgumentError:
                        head_map = None
                    for rank in range(producer_tp):
                        got = producer_module._readers(own, rank, consumer_tp)
                        case = (heads, mla, producer_tp, consumer_tp, rank)
                        if head_map is None:
                            assert got is None, case
                            continue
                        want = head_map.readers_of(rank) or [rank % consumer_tp]
                        assert got is not None and list(got) == want, (case, got, want)


def test_malformed_messages_are_warned_about_once_per_sender_then_counted(caplog):
    producer, runtime = _producer()
    with caplog.at_level(logging.WARNING, logger="tensorwire.kv.producer"):
        for sender in (5, 6):
            runtime.inbox += [(sender, TO_PRODUCER + b" {")] * 500
        _claim(runtime, 7, "A", request="unheld", issued_at=1.0)  # answered after them: they were all handled
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 2, [r.getMessage() for r in lines]  # one per sender; the rest counted later
    producer.close()


def test_made_up_claims_released_at_once_still_count_against_their_rank_until_they_expire(monkeypatch):
    """Claiming and releasing made-up handoffs in one message would otherwise fill the spent handoffs (which are
    never forgotten early) for everyone."""
    monkeypatch.setattr(producer_module, "_MAX_CLAIMED_FIRST", 8)
    producer, runtime = _producer()
    issued_at = time.time()
    for batch in range(3):
        made_up = tuple((f"made-up-{batch}-{i}", issued_at, "X") for i in range(8))
        runtime.inbox.append((9, Claim(f"t{batch}", made_up, False, 1, 0).encode()))  # claimed and released
        verdicts = _reply(runtime, 9).verdicts
        assert set(verdicts.values()) == ({"granted"} if batch == 0 else {"unknown"}), (batch, verdicts)
    assert _claim(runtime, 5, "A", request="real", issued_at=issued_at).verdicts == {"real": "granted"}
    producer.hold(_handoff(request="made-up-0-0", issued_at=issued_at))  # the engine's own: no longer rank 9's
    assert _released(producer, "made-up-0-0")
    runtime.inbox.append((9, Claim("tZ", (("again", issued_at, "X"),), True, 1, 0).encode()))
    assert _reply(runtime, 9).verdicts == {"again": "granted"}
    producer.close()
