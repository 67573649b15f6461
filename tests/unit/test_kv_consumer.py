"""``kv.Consumer``'s lanes without a fleet: a stand-in member whose communicator finds, refuses, stalls or raises as
each case needs, and whose producers grant every claim. The real thing runs in tests/multiproc/test_kv_handoff.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import tensorwire as tw
from tensorwire import kv
from tensorwire.kv.messages import TO_CONSUMER, Claim, Done, Grant, parse

LAYOUT = "LlamaForCausalLM layers=2 kv_heads=2 head_dim=64 kv_dtype=float32"


class _Channels:
    """The member's runtime: claims sent to a producer rank are answered at once (``verdict``) on the grant
    channel; what was sent is kept."""

    def __init__(self, verdict: str = "granted", per_request: dict | None = None, order: str = "HND") -> None:
        self.verdict, self.per_request, self.sent, self.grants = verdict, per_request or {}, [], {}
        self.order = order  # the producer's order of rows, as its grants say
        self.lost: dict[int, str] = {}  # rank -> why it is gone

    def channel(self, prefix: bytes):
        return SimpleNamespace(send=self._send, take_all=self._take_all)

    def _take_all(self) -> list[tuple[int, bytes]]:
        taken = [(rank, m) for rank, messages in self.grants.items() for m in messages]
        self.grants = {}
        return taken

    def peer_lost(self, rank: int, fresh: bool = False) -> str | None:
        return self.lost.get(rank)

    def _send(self, rank: int, message: bytes) -> None:
        self.sent.append((rank, parse(message)))
        claim = parse(message)
        if isinstance(claim, Claim):
            verdicts = {r: self.per_request.get(r, self.verdict) for r, _, _ in claim.requests}
            grant = Grant(claim.ticket, verdicts, self.order)
            self.grants.setdefault(rank, []).append(grant.encode())


def _member(comm) -> SimpleNamespace:
    comm.runtime = getattr(comm, "runtime", None) or _Channels()
    return SimpleNamespace(comm=comm, tp_rank=0, sharding=kv.Sharding(1, 2), heads=(0, 2), layout=LAYOUT,
                           shape=kv.BlockShape(96, 2), pool=None)


def _load(request: str, local=(1,), producer: str = "prefill-0", remote=(7,), layout: str = LAYOUT) -> kv.Load:
    handoff = kv.Handoff(producer, tuple(remote), f"p-{request}", 96 * len(remote), layout, "", 1.0, 2.0,
                         block_size=96)
    return kv.Load(request, tuple(local), handoff, claim=kv.new_claim())


def _results(consumer: kv.Consumer, count: int, timeout_s: float = 10.0) -> list[kv.LoadResult]:
    deadline, results = time.monotonic() + timeout_s, []
    while len(results) < count and time.monotonic() < deadline:
        results += consumer.take_results()
        time.sleep(0.01)
    assert len(results) == count, results
    return results


class _Transfer:
    bytes_per_block, transport = 16, "fake"

    def __init__(self, fail_first_post: bool = False) -> None:
        self.fails, self.posted = fail_first_post, []

    def post(self, local, remote):
        self.posted.append((list(local), list(remote)))

    def wait(self, timeout):
        if self.fails:
            self.fails = False
            raise tw.TransferError("nixl: connection setup timed out")

    def close(self):
        pass


class _Comm:
    """Finds every producer at rank 3 and prepares ``_Transfer``s."""

    def __init__(self) -> None:
        self.transfers: list[_Transfer] = []

    gone = False  # the directory no longer lists the producer

    def rank_of(self, name, timeout):
        if self.gone:
            raise tw.WaitTimeoutError(f"no {name}")
        return 3

    def lookup_blocks(self, key, rank, timeout):
        return "desc"

    def prepare_blocks(self, op, pool, remote, transport=None):
        self.transfers.append(_Transfer(fail_first_post=not self.transfers and getattr(self, "flaky", False)))
        return self.transfers[-1]


def test_a_load_claims_then_reads_then_says_done():
    comm = _Comm()
    consumer = kv.Consumer(_member(comm), timeout_s=30)
    consumer.submit([_load("a", (1, 2), remote=(7, 8))])
    (result,) = _results(consumer, 1)
    assert result.error is None and result.num_blocks == 2 and result.num_bytes == 32
    claim, done = [m for _, m in comm.runtime.sent]
    assert isinstance(claim, Claim) and claim.read and claim.requests[0][0] == "p-a" and claim.lease_s >= 60
    (local, remote), = comm.transfers[0].posted
    assert (local, remote) == ([1, 2], [7, 8]) and done.requests == (("p-a", claim.requests[0][2]),)
    consumer.close(5)


def test_a_refused_claim_reads_nothing():
    comm = _Comm()
    comm.runtime = _Channels(verdict="spent")
    consumer = kv.Consumer(_member(comm), timeout_s=30)
    consumer.submit([_load("a")])
    (result,) = _results(consumer, 1)
    assert result.reason == "replayed" and "once, by one consumer" in result.error
    assert all(not t.posted for t in comm.transfers)  # nothing moved
    consumer.close(5)


def test_in_one_job_a_refused_load_fails_alone():
    comm = _Comm()
    comm.runtime = _Channels(per_request={"p-b": "taken"})
    consumer = kv.Consumer(_member(comm), timeout_s=30)
    consumer.submit([_load("a", (1,), remote=(7,)), _load("b", (2,), remote=(8,))])
    results = {r.loads[0].request_id: r for r in _results(consumer, 2)}
    assert results["a"].error is None and results["a"].num_blocks == 1
    assert results["b"].reason == "replayed"
    (local, remote), = comm.transfers[0].posted
    assert (local, remote) == ([1], [7])  # only the granted load's blocks moved
    releases = [m for _, m in comm.runtime.sent if isinstance(m, Claim) and not m.read]
    assert [r.requests[0][0] for r in releases] == ["p-b"]  # the refused load is released where it was granted
    consumer.close(5)


def test_a_producer_of_another_layout_is_refused_naming_both():
    consumer = kv.Consumer(_member(_Comm()), timeout_s=5)  # refused before any communication
    other = LAYOUT.replace("kv_dtype=float32", "kv_dtype=bfloat16")
    consumer.submit([_load("r1", producer="prefill-9", layout=other)])
    (result,) = _results(consumer, 1)
    consumer.close(5)
    assert "bfloat16" in result.error and "float32" in result.error and "prefill-9" in result.error
    assert result.reason == "layout"


def test_block_sizes_that_do_not_divide_are_refused_naming_both():
    consumer = kv.Consumer(_member(_Comm()), timeout_s=5)
    load = _load("r1")
    load = kv.Load(load.request_id, load.local_block_ids, kv.Handoff(**{**load.handoff.__dict__, "block_size": 64}),
                   claim=load.claim)
    consumer.submit([load])
    (result,) = _results(consumer, 1)
    consumer.close(5)
    assert "96 tokens" in result.error and "64" in result.error and result.reason == "layout", result.error


def test_a_producer_tp_that_does_not_divide_is_refused_naming_both():
    consumer = kv.Consumer(_member(_Comm()), timeout_s=5)
    load = _load("r1")
    load = kv.Load(load.request_id, load.local_block_ids, kv.Handoff(**{**load.handoff.__dict__, "producer_tp": 3}),
                   claim=load.claim)
    consumer.submit([load])
    (result,) = _results(consumer, 1)
    consumer.close(5)
    assert result.reason == "tp" and "3" in result.error


def test_a_lane_survives_any_exception_and_one_producer_does_not_stall_another():
    class Comm(_Comm):  # "slow" is never found; "odd" raises something that is no TensorwireError
        def rank_of(self, name, timeout):
            if name == "odd":
                raise OverflowError("Python int too large to convert to C long")
            time.sleep(timeout)
            raise tw.WaitTimeoutError(f"no {name}")

    consumer = kv.Consumer(_member(Comm()), timeout_s=30, contact_s=2.0)
    started = time.monotonic()
    consumer.submit([_load("a", producer="slow"), _load("b", producer="odd")])
    assert [r.reason for r in _results(consumer, 1)] == ["internal"] and time.monotonic() - started < 1.5
    assert [r.reason for r in _results(consumer, 1)] == ["unreachable"]
    again = time.monotonic()  # remembered: the next load naming it fails within the short presence check
    consumer.submit([_load("c", producer="slow")])
    assert [r.reason for r in _results(consumer, 1)] == ["unreachable"] and time.monotonic() - again < 1.0
    consumer.submit([_load("d", producer="odd")])
    assert [r.reason for r in _results(consumer, 1)] == ["internal"]  # its lane still runs
    consumer.close(5)


def test_first_contact_is_asked_again_while_the_producer_is_listed():
    """Under a 2-core box's load a producer's first answer can miss its bound: the lane asks again (only it
    waits); a producer no longer listed fails at once."""

    class Comm(_Comm):
        def __init__(self, misses):
            super().__init__()
            self.misses, self.listed = misses, True

        def rank_of(self, name, timeout):
            if not self.listed:
                raise tw.WaitTimeoutError("gone")
            return 3

        def lookup_blocks(self, key, rank, timeout):
            if self.misses:
                self.misses -= 1
                raise tw.WaitTimeoutError("not answered after 10s")
            return "desc"

    consumer = kv.Consumer(_member(Comm(1)), timeout_s=30, contact_s=2.0)
    consumer.submit([_load("a", (1, 2), remote=(7, 8))])
    (result,) = _results(consumer, 1)
    assert result.error is None and result.num_blocks == 2
    comm = Comm(10**6)
    stalled = kv.Consumer(_member(comm), timeout_s=30, contact_s=2.0)
    stalled.submit([_load("a")])
    time.sleep(0.3)
    comm.listed = False
    started = time.monotonic()
    (result,) = _results(stalled, 1)
    assert result.reason == "timeout" and time.monotonic() - started < 2.0
    consumer.close(5)
    stalled.close(5)


def test_a_producer_lost_at_first_contact_is_remembered_as_departed_once_the_directory_forgot_it():
    class Comm(_Comm):  # rank 5 refuses every contact (killed); the directory lists it until ``forgotten``
        forgotten = False

        def rank_of(self, name, timeout):
            if self.forgotten:
                raise tw.WaitTimeoutError(f"no {name}")
            return 5

        def lookup_blocks(self, key, rank, timeout):
            raise tw.PeerLostError("rank 5: connection refused")

    comm = Comm()
    consumer = kv.Consumer(_member(comm), timeout_s=1.0, contact_s=1.0)
    consumer.submit([_load("a")])
    assert [r.reason for r in _results(consumer, 1)] == ["lost"]
    consumer.submit([_load("b")])  # still listed: perhaps a false alarm under load, so contacted again
    assert [r.reason for r in _results(consumer, 1)] == ["lost"]
    consumer.close(5)

    class Forgetting(Comm):  # the directory forgets rank 5 as its contact fails: it is gone
        def lookup_blocks(self, key, rank, timeout):
            self.forgotten = True
            raise tw.PeerLostError("rank 5: connection refused")

    comm = Forgetting()
    consumer = kv.Consumer(_member(comm), timeout_s=1.0, contact_s=1.0)
    consumer.submit([_load("a")])
    assert [r.reason for r in _results(consumer, 1)] == ["lost"]
    comm.forgotten = False  # listed under that rank again (a stale record), within _DEPARTED_S: still gone
    started = time.monotonic()
    consumer.submit([_load("b")])
    assert [r.reason for r in _results(consumer, 1)] == ["departed"] and time.monotonic() - started < 1.0
    consumer.close(5)


def test_a_first_read_that_fails_is_made_once_more_on_a_fresh_transfer():
    comm = _Comm()
    comm.flaky = True
    consumer = kv.Consumer(_member(comm), timeout_s=30, contact_s=2.0)
    consumer.submit([_load("a")])
    (result,) = _results(consumer, 1)
    assert result.error is None and len(comm.transfers) == 2 and comm.transfers[1].posted
    consumer.close(5)


def _split_load(request: str, block_bytes: tuple[int, ...]) -> tuple[_Comm, kv.Load]:
    """A consumer at TP 1 of a producer at TP 2 (each producer rank: one of the two heads): head ranges, so the
    pools are reduced to rows; the producer's pool has ``block_bytes`` per view."""

    class Comm(_Comm):
        def lookup_blocks(self, key, rank, timeout):
            return SimpleNamespace(block_bytes=block_bytes, select=lambda ranges: ranges)

    comm = Comm()
    load = _load(request)
    load = kv.Load(load.request_id, load.local_block_ids, kv.Handoff(**{**load.handoff.__dict__, "producer_tp": 2}),
                   claim=load.claim)
    return comm, load


def _split_member(comm, views: int, order: str = "HND") -> SimpleNamespace:
    comm.runtime = _Channels(order=order)
    member = _member(comm)
    member.pool = SimpleNamespace(block_bytes=(96 * 2 * 128,) * views, select=lambda ranges: ranges)
    return member


def test_producer_rows_of_another_size_are_refused_naming_both():
    comm, load = _split_load("r1", (96 * 64,) * 2)  # 64 bytes per row there, 128 here: another dtype or dim
    consumer = kv.Consumer(_split_member(comm, 2), timeout_s=5)
    consumer.submit([load])
    (result,) = _results(consumer, 1)
    consumer.close(5)
    assert result.reason == "layout" and "bytes per row" in result.error and "[128, 128]" in result.error
    assert "[64, 64]" in result.error and not comm.transfers  # refused before anything was prepared


def test_orders_that_differ_past_the_descriptor_limit_are_refused_with_the_fix():
    views = 400  # x 192 rows (96 tokens x 2 heads) paired one by one (the orders differ): 76,800 ranges per block

    class Comm(_Comm):
        def lookup_blocks(self, key, rank, timeout):
            return SimpleNamespace(block_bytes=(96 * 2 * 128,) * views, select=lambda ranges: ranges)

    comm = Comm()
    consumer = kv.Consumer(_split_member(comm, views, order="NHD"), timeout_s=5)
    consumer.submit([_load("r1")])
    (result,) = _results(consumer, 1)
    consumer.close(5)
    assert result.reason == "layout" and "76800 in all" in result.error and "HND" in result.error, result.error
    assert not comm.transfers


class _HeldChannels(_Channels):
    """Grants kept until ``release()``: what went out before a producer answered can be seen."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.held = False
        self._kept: list[tuple[int, bytes]] = []

    def _send(self, rank: int, message: bytes) -> None:
        super()._send(rank, message)
        if self.held and isinstance(parse(message), Claim):
            self._kept.append((rank, self.grants[rank].pop()))

    def release(self) -> None:
        for rank, grant in self._kept:
            self.grants.setdefault(rank, []).append(grant)
        self._kept.clear()


def _second_load(channels: _HeldChannels) -> tuple[_Comm, kv.Consumer]:
    """A consumer that loaded once from prefill-0 (its order of rows known), its grants now held."""
    comm = _Comm()
    comm.runtime = channels
    consumer = kv.Consumer(_member(comm), timeout_s=30)
    consumer.submit([_load("a", (1,), remote=(7,))])
    assert _results(consumer, 1)[0].error is None
    channels.held = True
    return comm, consumer


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_once_the_order_is_known_the_read_goes_out_with_the_claim():
    channels = _HeldChannels()
    comm, consumer = _second_load(channels)
    consumer.submit([_load("b", (2, 3), remote=(8, 9))])
    _wait_for(lambda: len(comm.transfers[0].posted) == 2, "the READ waited for the grant")
    assert not consumer.take_results()  # not done before the grant
    assert not [m for _, m in channels.sent if isinstance(m, Done) and m.requests[0][0] == "p-b"]
    channels.release()
    (result,) = _results(consumer, 1)
    assert result.error is None and comm.transfers[0].posted[1] == ([2, 3], [8, 9])
    assert [m for _, m in channels.sent if isinstance(m, Done) and m.requests[0][0] == "p-b"]  # DONE after both
    consumer.close(5)


def test_a_load_refused_after_its_early_read_fails_and_frees_nothing_it_was_not_granted():
    channels = _HeldChannels(per_request={"p-b": "spent"})
    comm, consumer = _second_load(channels)
    consumer.submit([_load("b", (2,), remote=(8,)), _load("c", (4,), remote=(6,))])
    _wait_for(lambda: len(comm.transfers[0].posted) == 2, "the READ waited for the grant")
    channels.release()
    results = {r.loads[0].request_id: r for r in _results(consumer, 2)}
    assert results["b"].reason == "replayed" and results["c"].error is None
    dones = [m for _, m in channels.sent if isinstance(m, Done)]
    assert [r[0] for m in dones for r in m.requests] == ["p-a", "p-c"]  # no DONE for what was refused
    consumer.close(5)


def test_a_producer_whose_order_changed_under_an_early_read_fails_it_and_releases_the_grants():
    channels = _HeldChannels()
    comm, consumer = _second_load(channels)
    channels.order = "NHD"  # its engine restarted with another cache layout
    consumer.submit([_load("b", (2,), remote=(8,))])
    _wait_for(lambda: len(comm.transfers[0].posted) == 2, "the READ waited for the grant")
    channels.release()
    (result,) = _results(consumer, 1)
    assert result.reason == "layout" and "NHD" in result.error
    releases = [m for _, m in channels.sent if isinstance(m, Claim) and not m.read]
    assert [r.requests[0][0] for r in releases] == ["p-b"]
    consumer.close(5)


def test_the_grant_channel_keeps_nothing_no_lane_waits_for():
    channels = _HeldChannels()
    comm, consumer = _second_load(channels)
    stranger = Grant("f" * 16, {"p-x": "granted"}, "HND").encode()
    for _ in range(1000):  # from a rank that is no producer of ours, and garbage from a producer
        channels.grants.setdefault(9, []).append(stranger)
        channels.grants.setdefault(3, []).append(TO_CONSUMER + b" {not json")
    consumer.submit([_load("b", (2,), remote=(8,))])
    _wait_for(lambda: len(comm.transfers[0].posted) == 2, "the READ waited for the grant")
    channels.release()
    (result,) = _results(consumer, 1)
    assert result.error is None
    assert consumer.grants.dropped == 2000 and not channels.grants  # taken from the channel and dropped
    assert not consumer.grants._expected and not consumer.grants._arrived
    consumer.close(5)


def test_a_producer_gone_with_a_claim_unanswered_fails_within_the_liveness_bound():
    channels = _HeldChannels()
    comm, consumer = _second_load(channels)
    started = time.monotonic()
    consumer.submit([_load("b", (2,), remote=(8,))])
    _wait_for(lambda: len(comm.transfers[0].posted) == 2, "the READ waited for the grant")
    channels.lost[3] = "connection reset"  # its grant never comes
    time.sleep(0.5)
    assert not consumer.take_results()  # the directory still lists it: a false alarm is not taken for a loss
    comm.gone = True  # the directory forgot it
    (result,) = _results(consumer, 1)
    assert result.reason == "lost" and "connection reset" in result.error
    assert time.monotonic() - started < consumer.timeout_s / 2  # not the whole timeout_s
    assert not consumer.grants._expected  # the unanswered claim is forgotten
    consumer.close(5)


def test_a_producer_missed_once_is_looked_for_in_full_again_after_the_window(monkeypatch):
    """On a loaded box one contact can miss its bound: loads naming the producer then fail fast for
    ``_DEPARTED_S``, and after it the full contact is tried again (not a short look for good)."""
    from tensorwire.kv import sources

    class Comm(_Comm):  # answers only with a bound longer than the short look (a slow directory)
        def rank_of(self, name, timeout):
            if timeout < 1.0:
                time.sleep(timeout)
                raise tw.WaitTimeoutError(f"no {name} within {timeout}")
            return 3

    monkeypatch.setattr(sources, "_DEPARTED_S", 0.5)
    comm = Comm()
    consumer = kv.Consumer(_member(comm), timeout_s=30, contact_s=0.5)  # the first contact misses too
    consumer.submit([_load("a")])
    assert [r.reason for r in _results(consumer, 1)] == ["unreachable"]
    consumer.submit([_load("b")])
    assert [r.reason for r in _results(consumer, 1)] == ["unreachable"]  # within the window: the short look
    time.sleep(0.6)
    consumer.contact_s = 2.0
    for lane in consumer._lanes.values():
        for source in lane.sources.values():
            source.contact_s = 2.0  # the directory answers within the full bound now
    consumer.submit([_load("c")])
    (result,) = _results(consumer, 1)
    assert result.error is None, result.error
    consumer.close(5)
