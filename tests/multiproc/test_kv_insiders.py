"""A token holder inside the fleet (an insider: a member that sends whatever claims it likes) against a real
``kv.Producer``, each a process of one fleet: it cannot pin the producer's blocks, fill its claim-first table for
everyone, or stall its thread, and an honest consumer's claim is answered meanwhile.

One producer rank and two clients (``insider``, ``honest``) serve the whole module; a test that kills a client
starts its own. Every request id is the test's own, so the tests share the producer without meeting. Clients send
raw ``CLAIM`` messages on the producer's channel, as ``kv.Consumer`` does, and time the ``GRANT``s.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import time

import pytest

from tensorwire.testing.suite import scaled

HEADS = 8
_START_S = 120.0  # spawning a process that imports torch and joins the fleet, on a loaded 2-core box


# --- the processes --------------------------------------------------------------------------------------------
def _producer(address: str, token: str, commands: mp.Queue, out: mp.Queue) -> None:
    """The producer rank: ``hold`` handoffs when told, report each release (monotonic time) and its state."""
    os.environ["TENSORWIRE_JOB_TOKEN"] = token  # this spawned process's own environment
    import torch

    from tensorwire import kv

    views = [torch.zeros(8, 16, HEADS, 4) for _ in range(2)]  # NHD: [blocks, tokens, heads, dim]
    member = kv.KVMember(views, instance="prefill", tp_rank=0, sharding=kv.Sharding(1, HEADS), layout="L",
                         block_size=16, order="NHD", directory=address, timeout_s=60.0)
    producer = kv.Producer(member, hold_s=60.0)
    out.put(("ready", member.comm.rank))
    while True:
        try:
            command = commands.get(timeout=0.005)
        except queue.Empty:
            command = None
        if command is not None and command[0] == "stop":
            break
        if command is not None and command[0] == "hold":
            _, request_id, issued_at, expires_in = command
            producer.hold(kv.Handoff("prefill", (1, 2), request_id, 32, "L", "", issued_at, time.time() + expires_in,
                                     block_size=16))
        elif command is not None and command[0] == "state":
            cpu = time.clock_gettime(time.pthread_getcpuclockid(producer._thread.ident))
            out.put(("state", len(producer._holds), cpu, dict(producer.refused)))
        for request_id in producer.released():
            out.put(("released", request_id, time.monotonic()))
    producer.close()
    member.close()


def _client(address: str, token: str, name: str, commands: mp.Queue, out: mp.Queue) -> None:
    """A member that sends claims as told and reports the grants' verdicts with each claim's round trip."""
    os.environ["TENSORWIRE_JOB_TOKEN"] = token
    import tensorwire as tw
    from tensorwire.kv.messages import TO_CONSUMER, TO_PRODUCER, parse

    comm = tw.init(directory=address, name=name, timeout=60.0)
    producer = comm.rank_of("prefill", timeout=60.0)
    to_producer, grants = comm.runtime.channel(TO_PRODUCER), comm.runtime.channel(TO_CONSUMER)
    out.put(("ready", comm.rank))
    while True:
        command = commands.get()
        if command[0] == "die":
            os._exit(0)  # as a crash: nothing closed, nothing said
        if command[0] == "stop":
            break
        _, claims, wait_s = command
        sent = {}
        for claim in claims:
            sent[claim.ticket] = time.monotonic()
            to_producer.send(producer, claim.encode())
        out.put(("sent", len(sent)))
        answers: dict[str, tuple[dict, float]] = {}
        deadline = time.monotonic() + wait_s
        while len(answers) < len(sent) and time.monotonic() < deadline:
            for _, message in grants.take_all():
                grant = parse(message)
                if grant is not None and grant.ticket in sent:
                    answers[grant.ticket] = (grant.verdicts, time.monotonic() - sent[grant.ticket])
            time.sleep(0.0005)
        out.put(("grants", answers))
    comm.close()


# --- the harness ----------------------------------------------------------------------------------------------
class _Party:
    def __init__(self, context, target, *args) -> None:
        self.commands, self.out = context.Queue(), context.Queue()
        self.process = context.Process(target=target, args=(*args, self.commands, self.out), daemon=True)
        self.process.start()

    def ready(self) -> int:
        kind, rank = self.out.get(timeout=scaled(_START_S))
        assert kind == "ready", kind
        return rank

    def close(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(scaled(10))
        if self.process.is_alive():
            self.process.kill()


class _Fleet:
    def __init__(self, address: str, token: str) -> None:
        self.context, self.address, self.token = mp.get_context("spawn"), address, token
        self.producer = _Party(self.context, _producer, address, token)
        self.producer.ready()  # the clients look it up by name
        self.insider, self.honest = (self.client(name) for name in ("insider", "honest"))
        self.released: dict[str, float] = {}
        self._states: list = []

    def client(self, name: str) -> _Party:
        party = _Party(self.context, _client, self.address, self.token, name)
        party.ready()
        return party

    def send(self, client: _Party, claims: list, wait_s: float) -> None:
        """Have ``client`` send ``claims`` (returns once all are sent); ``answers`` collects their grants."""
        client.commands.put(("claims", claims, wait_s))
        assert client.out.get(timeout=scaled(60)) == ("sent", len(claims))

    def answers(self, client: _Party, wait_s: float) -> dict[str, tuple[dict, float]]:
        """The grants of what ``client`` sent last: ticket -> (verdicts, seconds from its claim's send)."""
        kind, answers = client.out.get(timeout=wait_s + scaled(30))
        assert kind == "grants"
        return answers

    def claim(self, client: _Party, claims: list, wait_s: float) -> dict[str, tuple[dict, float]]:
        self.send(client, claims, wait_s)
        return self.answers(client, wait_s)

    def hold(self, request_id: str, issued_at: float, expires_in: float) -> None:
        self.producer.commands.put(("hold", request_id, issued_at, expires_in))

    def _drain(self, timeout_s: float) -> None:
        item = self.producer.out.get(timeout=timeout_s)
        if item[0] == "released":
            self.released[item[1]] = item[2]
        else:
            self._states.append(item)

    def released_by(self, request_id: str, deadline: float) -> float | None:
        """When the producer released ``request_id`` (monotonic), waiting until ``deadline``; None if it did not."""
        while request_id not in self.released:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                self._drain(left)
            except queue.Empty:
                return None
        return self.released[request_id]

    def state(self) -> tuple:
        self.producer.commands.put(("state",))
        while not self._states:
            self._drain(scaled(30))
        return self._states.pop(0)

    def close(self) -> None:
        for party in (self.insider, self.honest, self.producer):
            party.close()


@pytest.fixture(scope="module")
def fleet():
    from tensorwire.bench.vllm_parties import start_directory

    token = secrets.token_hex(16)
    directory, address = start_directory(token)
    parties = None
    try:
        parties = _Fleet(address, token)
        yield parties
    finally:
        if parties is not None:
            parties.close()
        directory.close()


def _claim(request_id: str, issued_at: float, value: str, *, lease_s: float = 5.0, consumer_tp: int = 1):
    from tensorwire.kv.messages import Claim

    return Claim(secrets.token_hex(8), ((request_id, issued_at, value),), True, consumer_tp, 0, lease_s)


# --- the tests ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_renewed_claims_cannot_keep_a_hold_past_its_expiry_plus_the_read_bound(fleet):
    """The insider claims a handoff (a 1 s READ bound) and keeps claiming it again with the longest lease: the hold
    still ends at its expiry plus the first grant's READ bound."""
    issued_at, expires_in, lease_s = time.time(), 1.0, 1.0
    fleet.hold("renewed", issued_at, expires_in)
    expiry = time.monotonic() + expires_in
    first = fleet.claim(fleet.insider, [_claim("renewed", issued_at, "I", lease_s=lease_s)], scaled(10))
    assert [v for v, _ in first.values()] == [{"renewed": "granted"}]
    renew_until = expiry + lease_s + scaled(3)  # well past where the hold must have ended
    while time.monotonic() < renew_until and "renewed" not in fleet.released:
        fleet.claim(fleet.insider, [_claim("renewed", issued_at, "I", lease_s=600.0)], scaled(10))
        fleet.released_by("renewed", time.monotonic() + 0.3)
    released = fleet.released_by("renewed", time.monotonic() + scaled(2))
    assert released is not None, "a renewed claim kept the hold past its expiry plus the READ bound"
    assert released <= expiry + lease_s + scaled(1.5)


@pytest.mark.slow
def test_a_claimant_that_died_does_not_keep_its_hold(fleet):
    """A member claims a handoff with the longest lease (600 s) and dies: its hold ends soon after the producer
    finds it gone, not 10 minutes later."""
    doomed = fleet.client("doomed")
    issued_at = time.time()
    fleet.hold("orphan", issued_at, 1.0)
    grants = fleet.claim(doomed, [_claim("orphan", issued_at, "D", lease_s=600.0)], scaled(10))
    assert [v for v, _ in grants.values()] == [{"orphan": "granted"}]
    doomed.commands.put(("die",))
    doomed.process.join(scaled(10))
    assert fleet.released_by("orphan", time.monotonic() + scaled(15)) is not None, (
        "the hold of a claimant that died outlived it")


@pytest.mark.slow
def test_made_up_claims_of_one_member_do_not_starve_another_members_claim(fleet):
    """The insider claims 8192 made-up handoffs before any engine hold (what fills a shared claim-first table);
    an honest consumer's claim that also comes before the engine's hold is still granted, not ``unknown``."""
    issued_at = time.time()
    made_up = [(f"made-up-{i}", issued_at, "I") for i in range(8192)]
    from tensorwire.kv.messages import MAX_REQUESTS, Claim

    claims = [Claim(secrets.token_hex(8), tuple(made_up[i:i + MAX_REQUESTS]), True, 1, 0, 5.0)
              for i in range(0, len(made_up), MAX_REQUESTS)]
    fleet.claim(fleet.insider, claims, scaled(30))
    honest = fleet.claim(fleet.honest, [_claim("honest-first", time.time(), "H")], scaled(10))
    assert [v for v, _ in honest.values()] == [{"honest-first": "granted"}]
    holds = fleet.state()[1]
    assert holds <= 2048, f"{holds} holds: one member's made-up claims are not bounded"


@pytest.mark.slow
def test_claims_naming_many_consumer_tp_sizes_do_not_stall_an_honest_grant(fleet):
    """The insider sends 400 claims, each naming another consumer TP (every multiple of the 8 heads up to 4096, the
    costliest head maps); an honest claim sent right after them is granted within a second, not seconds later."""
    issued_at = time.time()
    fleet.hold("honest-tp", issued_at, 30.0)
    costly = [_claim(f"tp-{i}", issued_at, "I", consumer_tp=4096 - 8 * i) for i in range(400)]
    fleet.send(fleet.insider, costly, 0.0)  # the producer's inbox holds them all before the honest claim
    honest = fleet.claim(fleet.honest, [_claim("honest-tp", issued_at, "H")], scaled(30))
    fleet.answers(fleet.insider, 0.0)
    [(verdicts, seconds)] = honest.values()
    assert verdicts == {"honest-tp": "granted"}
    assert seconds < scaled(1.0), f"the honest grant took {seconds:.2f}s behind the insider's claims"
