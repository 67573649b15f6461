"""The checks of a client's ``kv_transfer_params`` at the connector's scheduler hooks, without vLLM: every hostile
value is refused where vLLM first hands it over (never raised out of a hook), naming the field, and a sealed
handoff is believed only for the prompt, producer and blocks it was sealed for, once, before it expires."""

from __future__ import annotations

import copy
import logging
import time
from types import SimpleNamespace

import pytest

from tensorwire.integrations.vllm.handoff import Handoff, Load
from tensorwire.integrations.vllm.loader import Loader
from tensorwire.integrations.vllm.params import HandoffRefused, check_params
from tensorwire.integrations.vllm.scheduler import SchedulerSide
from tensorwire.integrations.vllm.settings import Settings
from tensorwire.integrations.vllm.worker import StatsLog, WorkerSide

LAYOUT = "LlamaForCausalLM layers=2 kv_heads=2 head_dim=64 kv_dtype=float32 block_size=96 tp=1"
BLOCK = 96
PROMPT = [(7 * i) % 997 + 3 for i in range(250)]  # 3 blocks of 96


@pytest.fixture(autouse=True)
def job_token(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", "0123456789abcdef0123")


def _side(name: str, role: str, policy: str = "recompute", sealed: bool = True) -> SchedulerSide:
    settings = Settings.from_extra_config({"directory": "tcp://127.0.0.1:1", "name": name, "hold_s": 60}, "e")
    return SchedulerSide(settings, LAYOUT, role=role, block_size=BLOCK, policy=policy, sealed=sealed)


def _request(params, prompt=PROMPT, request_id="r1", status="FINISHED_LENGTH_CAPPED"):
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=list(prompt),
                           num_computed_tokens=len(prompt), status=SimpleNamespace(name=status))


def _handed_off(prompt=PROMPT, request_id="p1", sealed=True) -> dict:
    producer = _side("prefill-0", "kv_producer", sealed=sealed)
    delay, params = producer.request_finished(_request({"do_remote_decode": True}, prompt, request_id), [4, 5, 6, 7])
    assert delay and params["remote_block_ids"] == [4, 5, 6]
    return params


def _judged(params, side=None, prompt=PROMPT):
    """(what num_new_matched_tokens answered, the loads planned after alloc) for a consumer request."""
    side = side or _side("decode-0", "kv_consumer")
    request = _request(params, prompt, request_id="c1")
    answer = side.num_new_matched_tokens(request, 0)
    side.after_alloc(request, SimpleNamespace(get_unhashed_block_ids=lambda: [11, 12, 13]), answer[0])
    return answer, side.build_plan()


def test_a_sealed_handoff_is_loaded_once():
    params = _handed_off()
    side = _side("decode-0", "kv_consumer")
    answer, plan = _judged(copy.deepcopy(params), side)
    assert answer == (250, True)
    (load,) = plan.loads
    assert load.handoff.block_ids == (4, 5, 6) and load.remote_block_ids() == (4, 5, 6) and not load.refusal
    answer, plan = _judged(copy.deepcopy(params), side)  # the same handoff again: a replay
    assert answer == (0, False) and plan.loads == [] and plan.refused == ["replayed"]


HOSTILE = {  # field -> value a client may send instead of the producer's
    "remote_block_ids": ["4", None, [[4], [5], [6]], [4, 5, 2**63], [4, 5, -1], [4, 5, True], [4, 5, 6.0], [4, 5],
                         [4, 4, 5], "4,5,6", {"a": 1}],
    "remote_num_tokens": [1e400, float("nan"), "250", None, 2**63, -1, 0, 249, 251, 250.0, True],
    "remote_member": [None, "", 7, ["prefill-0"], "x" * 300, "prefill\n0"],
    "remote_request_id": [None, 3, "", "\x00"],
    "remote_layout": [None, LAYOUT.replace("block_size=96", "block_size=32"), 1],
    "remote_expires_at": [1e400, "soon", None, True],
    "remote_seal": [None, "", "AAAA", "not base64 !", 5, "x" * (2 << 20)],
    "do_remote_prefill": ["yes", 1, [True]],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, values in HOSTILE.items() for v in values])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_hostile_field_is_refused_before_async_naming_it(field, value, policy, caplog):
    params = _handed_off()
    params[field] = value
    with caplog.at_level(logging.WARNING):
        answer, plan = _judged(params, _side("decode-0", "kv_consumer", policy))
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and field in refused[0], caplog.text
    if policy == "recompute":
        assert answer == (0, False) and plan.loads == []
    else:  # failed at once by the worker: vLLM is told "async", and the load it waits for fails
        assert answer == (250, True)
        (load,) = plan.loads
        assert load.refusal and load.handoff is None and load.local_block_ids == (11, 12, 13)


def test_missing_fields_and_non_objects_are_refused():
    for params in ({"do_remote_prefill": True}, {"do_remote_prefill": True, "remote_block_ids": [1]}):
        assert _judged(params)[0] == (0, False)
    with pytest.raises(HandoffRefused, match="kv_transfer_params"):
        check_params([1, 2], PROMPT, BLOCK, LAYOUT, sealed=True, now=time.time())
    for params in (["do_remote_prefill"], "x", 5):  # not a dict: nothing to load, nothing raised
        assert _side("decode-0", "kv_consumer").num_new_matched_tokens(_request(params), 0) == (0, False)


def test_forged_altered_other_prompt_and_expired_handoffs_are_refused():
    params = _handed_off()
    cases = [
        ("altered", {**params, "remote_block_ids": [1, 2, 3]}),  # another user's blocks
        ("altered", {**params, "remote_member": "prefill-1"}),
        ("altered", {**params, "remote_request_id": "someone-else"}),  # would free another request's blocks
        ("forged", {**params, "remote_seal": params["remote_seal"][:-8] + "AAAAAAAA"}),
        ("forged", {**params, "remote_seal": _handed_off(request_id="p1")["remote_seal"][::-1]}),
        ("prompt", _handed_off(prompt=PROMPT[::-1])),  # sealed for another prompt of the same length
    ]
    for reason, bad in cases:
        answer, plan = _judged(copy.deepcopy(bad))
        assert answer == (0, False) and plan.refused == [reason], (reason, plan)
    for now in (time.time() + 3600, params["remote_expires_at"] - 3.0):  # expired, or too close to it to read
        with pytest.raises(HandoffRefused) as refused:
            check_params(params, PROMPT, BLOCK, LAYOUT, sealed=True, now=now)
        assert refused.value.reason == "expired"
    unsealed = _handed_off(sealed=False)
    assert "remote_seal" not in unsealed
    with pytest.raises(HandoffRefused) as refused:  # a sealing consumer believes no unsealed handoff
        check_params(unsealed, PROMPT, BLOCK, LAYOUT, sealed=True, now=time.time())
    assert refused.value.reason == "forged"


def test_a_handoff_sealed_in_another_job_does_not_open(monkeypatch):
    params = _handed_off()
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", "another-job-token-0000")
    with pytest.raises(HandoffRefused) as refused:
        check_params(params, PROMPT, BLOCK, LAYOUT, sealed=True, now=time.time())
    assert refused.value.reason == "forged"


def test_a_consumer_handoff_sent_to_a_producer_is_refused_and_never_reaches_its_worker():
    params = _handed_off()
    producer = _side("prefill-1", "kv_producer", policy="fail")
    answer, plan = _judged(params, producer)
    assert answer == (250, True) and plan.refused == ["role"] and plan.loads[0].refusal == "role"
    worker = WorkerSide(producer._settings, "kv_producer", LAYOUT, 0, 1)
    worker.start(plan)  # a producer loads nothing: the load fails at once instead of raising
    sending, recving = worker.finished()
    assert recving == {"c1"} and worker.load_errors() == {11, 12, 13}
    stats = worker.stats.take()
    assert stats["failure_reasons"] == ["refused:role"] and stats["refused_handoffs"] == ["role"]
    assert producer.request_finished(_request({"do_remote_prefill": True, "remote_block_ids": "x"}), [1]) == (
        False, None)


def test_hooks_never_raise():
    side = _side("decode-0", "kv_consumer")
    broken = SimpleNamespace(request_id="b", kv_transfer_params={"do_remote_prefill": True}, prompt_token_ids=5,
                             num_computed_tokens="x", status=None)
    assert side.num_new_matched_tokens(broken, 0) == (0, False)
    side.after_alloc(broken, None, 3)
    assert side.request_finished(broken, [1]) == (False, None)


def test_a_lane_survives_any_exception_and_one_producer_does_not_stall_another():
    class Comm:  # "slow" is never found; "odd" raises something that is no TensorwireError
        def rank_of(self, name, timeout):
            if name == "odd":
                raise OverflowError("Python int too large to convert to C long")
            time.sleep(timeout)
            from tensorwire import WaitTimeoutError
            raise WaitTimeoutError(f"no {name}")

    loader = Loader(Comm(), None, LAYOUT, 0, 1, timeout_s=30, contact_s=2.0)
    handoff = Handoff("slow", (1,), "p", 96, LAYOUT)
    started = time.monotonic()
    loader.submit("slow", [Load("a", (1,), handoff)])
    loader.submit("odd", [Load("b", (1,), Handoff("odd", (1,), "q", 96, LAYOUT))])
    results = _wait_results(loader, 1)
    assert [r.reason for r in results] == ["internal"] and time.monotonic() - started < 1.5
    results = _wait_results(loader, 1)
    assert [r.reason for r in results] == ["unreachable"]
    again = time.monotonic()  # remembered: the next load naming it fails within the short presence check
    loader.submit("slow", [Load("c", (2,), handoff)])
    assert [r.reason for r in _wait_results(loader, 1)] == ["unreachable"] and time.monotonic() - again < 1.0
    loader.submit("odd", [Load("d", (1,), Handoff("odd", (1,), "q2", 96, LAYOUT))])
    assert [r.reason for r in _wait_results(loader, 1)] == ["internal"]  # its lane still runs
    loader.close(5)
    log = StatsLog()
    for result in results:
        log.record(result)
    assert log.take()["failure_reasons"] == ["unreachable"]


def _wait_results(loader, count, timeout_s=10.0):
    deadline, results = time.monotonic() + timeout_s, []
    while len(results) < count and time.monotonic() < deadline:
        results += loader.take_results()
        time.sleep(0.01)
    assert len(results) == count, results
    return results


def test_first_contact_is_asked_again_while_the_producer_is_listed():
    """Under a 2-core box's load a producer's first answer can miss its bound: the lane asks again (only it
    waits); a producer no longer listed fails at once."""
    import tensorwire as tw

    class Transfer:
        bytes_per_block, transport = 16, "fake"

        def post(self, local, remote, notify):
            self.posted = (list(local), list(remote))

        def wait(self, timeout):
            pass

        def close(self):
            pass

    class Comm:
        def __init__(self):
            self.misses, self.listed = 1, True

        def rank_of(self, name, timeout):
            if not self.listed:
                raise tw.WaitTimeoutError("gone")
            return 3

        def lookup_blocks(self, key, rank, timeout):
            if self.misses:
                self.misses -= 1
                raise tw.WaitTimeoutError("not answered after 10s")
            return "desc"

        def prepare_blocks(self, op, pool, remote):
            return Transfer()

    comm = Comm()
    loader = Loader(comm, None, LAYOUT, 0, 1, timeout_s=30, contact_s=2.0)
    loader.submit("prefill-0", [Load("a", (1, 2), Handoff("prefill-0", (7, 8), "p", 192, LAYOUT))])
    (result,) = _wait_results(loader, 1)
    assert result.error is None and result.num_blocks == 2 and result.num_bytes == 32
    comm2 = Comm()
    comm2.misses = 10**6
    loader2 = Loader(comm2, None, LAYOUT, 0, 1, timeout_s=30, contact_s=2.0)
    loader2.submit("prefill-0", [Load("a", (1,), Handoff("prefill-0", (7,), "p", 96, LAYOUT))])
    time.sleep(0.3)
    comm2.listed = False
    started = time.monotonic()
    (result,) = _wait_results(loader2, 1)
    assert result.reason == "timeout" and time.monotonic() - started < 2.0
    loader.close(5)
    loader2.close(5)


def test_a_producer_leaving_waits_until_its_handoffs_are_read():
    from tensorwire.integrations.vllm.handoff import Plan, read_message

    class Comm:
        def __init__(self):
            self.started, self.closed = time.monotonic(), False

        def poll_notifications(self):
            return [(1, read_message(["r1"]))] if time.monotonic() - self.started > 0.3 else []

        def close(self):
            self.closed = True

    worker = WorkerSide(_side("prefill-0", "kv_producer")._settings, "kv_producer", LAYOUT, 0, 1)
    worker._comm = comm = Comm()
    worker.start(Plan(holds={"r1": 60.0}))
    started = time.monotonic()
    worker.close()
    assert comm.closed and 0.25 < time.monotonic() - started < 5.0


def test_a_read_that_comes_before_its_hold_frees_it_at_once_and_stale_ones_are_forgotten(monkeypatch):
    from tensorwire.integrations.vllm import worker as worker_module
    from tensorwire.integrations.vllm.handoff import Plan, read_message

    monkeypatch.setattr(worker_module, "_READ_EARLY_S", 0.0)  # every early read is stale at once

    class Comm:
        messages = [(1, read_message([f"stale-{i}" for i in range(2000)] + ["r1"]))]

        def poll_notifications(self):
            taken, self.messages = self.messages, []
            return taken

    worker = WorkerSide(_side("prefill-0", "kv_producer")._settings, "kv_producer", LAYOUT, 0, 1)
    worker._comm = Comm()
    worker.start(Plan(holds={"r0": 60.0}))  # a hold not read yet: the producer polls
    assert worker.finished()[0] == set()
    worker.start(Plan(holds={"r1": 60.0}))
    assert worker.finished()[0] == {"r1"}
    assert len(worker._read_early) < 1024


def test_a_producer_lost_at_first_contact_is_remembered_as_departed():
    import tensorwire as tw

    class Comm:  # the directory still lists rank 5, which refuses every contact (killed)
        def rank_of(self, name, timeout):
            return 5

        def lookup_blocks(self, key, rank, timeout):
            raise tw.PeerLostError("rank 5: connection refused")

    loader = Loader(Comm(), None, LAYOUT, 0, 1, timeout_s=1.0, contact_s=1.0)
    handoff = Handoff("prefill-0", (7,), "p", 96, LAYOUT)
    loader.submit("prefill-0", [Load("a", (1,), handoff)])
    assert [r.reason for r in _wait_results(loader, 1)] == ["lost"]
    started = time.monotonic()
    loader.submit("prefill-0", [Load("b", (2,), handoff)])
    assert [r.reason for r in _wait_results(loader, 1)] == ["departed"] and time.monotonic() - started < 0.5
    loader.close(5)


def test_a_first_read_that_fails_is_made_once_more_on_a_fresh_transfer():
    import tensorwire as tw

    class Transfer:
        bytes_per_block, transport, made = 16, "fake", 0

        def __init__(self):
            Transfer.made += 1
            self.fails = Transfer.made == 1  # the first transfer's READ fails (its connection missed its bound)

        def post(self, local, remote, notify):
            if self.fails:
                raise tw.TransferError("nixl: connection setup timed out")

        def wait(self, timeout):
            pass

        def close(self):
            pass

    class Comm:
        def rank_of(self, name, timeout):
            return 3

        def lookup_blocks(self, key, rank, timeout):
            return "desc"

        def prepare_blocks(self, op, pool, remote):
            return Transfer()

    loader = Loader(Comm(), None, LAYOUT, 0, 1, timeout_s=30, contact_s=2.0)
    loader.submit("prefill-0", [Load("a", (1,), Handoff("prefill-0", (7,), "p", 96, LAYOUT))])
    (result,) = _wait_results(loader, 1)
    assert result.error is None and Transfer.made == 2
    loader.close(5)
