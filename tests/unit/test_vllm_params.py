"""The checks of a client's ``kv_transfer_params`` at the connector's scheduler hooks, without vLLM: every hostile
value is refused where vLLM first hands it over (never raised out of a hook), naming the field, and a sealed
handoff is believed only for the prompt, producer and blocks it was sealed for, once, before it expires."""

from __future__ import annotations

import copy
import logging
import time
from types import SimpleNamespace

import pytest

from tensorwire import kv
from tensorwire.integrations.vllm.scheduler import SchedulerSide
from tensorwire.integrations.vllm.settings import Settings
from tensorwire.integrations.vllm.worker import WorkerSide
from tensorwire.kv import HandoffRefused, check_params

LAYOUT = "LlamaForCausalLM layers=2 kv_heads=2 head_dim=64 kv_dtype=float32 block_size=96"
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


def test_a_sealed_handoff_is_planned_with_a_claim_of_its_own_each_time():
    """Single use is the producer's to enforce (it grants a handoff to one claim, test_kv_producer.py): each load
    the scheduler plans carries a new claim, so a replay here, at another consumer or after a restart differs."""
    params = _handed_off()
    side = _side("decode-0", "kv_consumer")
    answer, plan = _judged(copy.deepcopy(params), side)
    assert answer == (250, True)
    (load,) = plan.loads
    assert load.handoff.block_ids == (4, 5, 6) and load.remote_block_ids() == (4, 5, 6) and not load.refusal
    assert load.handoff.producer_tp == 1 and len(load.claim) == 32
    answer, plan = _judged(copy.deepcopy(params), side)  # the same handoff again: a replay, with another claim
    (replay,) = plan.loads
    assert answer == (250, True) and replay.claim != load.claim


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
    "remote_tp_size": [0, -1, "2", True, 2.0, 2**63, None],
    # 7, 100: neither divides 96; 96 * 128: 128 times it (each ratio is a prepared READ per source)
    "remote_block_size": [None, 0, -1, "96", True, 96.0, 2**63, 7, 100, 96 * 128],
    "remote_issued_at": ["soon", True, None, float("inf")],
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
        ("altered", {**params, "remote_tp_size": 2}),  # would read other heads
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
    opened = check_params(unsealed, PROMPT, BLOCK, LAYOUT, sealed=False, now=time.time())
    assert opened.issued_at == unsealed["remote_issued_at"] > 0  # what the producer's hold is keyed by
    with pytest.raises(HandoffRefused) as refused:  # a sealing consumer believes no unsealed handoff
        check_params(unsealed, PROMPT, BLOCK, LAYOUT, sealed=True, now=time.time())
    assert refused.value.reason == "forged"


def test_a_handoff_sealed_in_another_job_does_not_open(monkeypatch):
    params = _handed_off()
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", "another-job-token-0000")
    with pytest.raises(HandoffRefused) as refused:
        check_params(params, PROMPT, BLOCK, LAYOUT, sealed=True, now=time.time())
    assert refused.value.reason == "forged"


def test_a_consumer_handoff_sent_to_a_producer_is_computed_there_whatever_the_policy():
    """A misrouted request is served, not failed: under "fail" vLLM would answer it with HTTP 500, and no connector
    hook runs in vLLM's API server where a 4xx could be answered."""
    params = _handed_off()
    for policy in ("fail", "recompute"):
        producer = _side("prefill-1", "kv_producer", policy=policy)
        answer, plan = _judged(copy.deepcopy(params), producer)
        assert answer == (0, False) and plan.refused == ["role"] and plan.loads == []
    worker = WorkerSide(producer._settings, "kv_producer", LAYOUT, 0, kv.Sharding(1, 2), 16)
    worker.start(plan)  # nothing to load, nothing failed
    assert worker.finished() == (set(), set()) and worker.load_errors() == set()
    assert worker.stats.take()["refused_handoffs"] == ["role"]
    assert producer.request_finished(_request({"do_remote_prefill": True, "remote_block_ids": "x"}), [1]) == (
        False, None)


def test_hooks_never_raise():
    side = _side("decode-0", "kv_consumer")
    broken = SimpleNamespace(request_id="b", kv_transfer_params={"do_remote_prefill": True}, prompt_token_ids=5,
                             num_computed_tokens="x", status=None)
    assert side.num_new_matched_tokens(broken, 0) == (0, False)
    side.after_alloc(broken, None, 3)
    assert side.request_finished(broken, [1]) == (False, None)


@pytest.mark.parametrize("status", ["FINISHED_ABORTED", "FINISHED_STOPPED"])
def test_a_request_ended_before_its_params_were_judged_releases_the_producers_blocks(status):
    """vLLM may abort a decode request before it ever asked the connector about it: its handoff is still released
    (a load of no blocks), so the producer frees the blocks now, not at expiry."""
    side = _side("decode-0", "kv_consumer")
    request = _request(_handed_off(), request_id="c1", status=status)
    assert side.request_finished(request, []) == (False, None)
    (release,) = side.build_plan().loads
    assert release.local_block_ids == () and release.handoff.block_ids == (4, 5, 6) and release.claim
    forged = {**_handed_off(), "remote_seal": "AAAA"}  # what does not open is released nowhere, quietly
    assert side.request_finished(_request(forged, request_id="c2", status=status), []) == (False, None)
    assert side.build_plan().loads == []
