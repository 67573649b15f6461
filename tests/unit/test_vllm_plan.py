"""The vLLM connector's plain parts, without vLLM: settings, the handoff between instances, the scheduler's
plan, the KV cache as pool views, the refusal of a producer of another layout. The hooks themselves run under
real vLLM in tests/vllm."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import tensorwire as tw
from tensorwire.integrations.vllm.layout import block_order, pool_views
from tensorwire.integrations.vllm.scheduler import SchedulerSide
from tensorwire.integrations.vllm.settings import Settings
from tensorwire.kv import Handoff, check_params

LAYOUT = "LlamaForCausalLM layers=2 kv_heads=2 head_dim=64 kv_dtype=float32"


def _settings(**extra) -> Settings:
    return Settings.from_extra_config({"directory": "tcp://127.0.0.1:29700", **extra}, "engine-1", None)


def test_settings_defaults_and_refusals():
    s = _settings()
    assert (s.name, s.timeout_s, s.hold_s, s.contact_s) == ("vllm-engine-1", 30.0, 120.0, 5.0)
    from_env = Settings.from_extra_config({}, "e", ("tcp://127.0.0.1:1", "prefill-7"))
    assert (from_env.directory, from_env.name) == ("tcp://127.0.0.1:1", "prefill-7")
    assert _settings(name="prefill").member_name(1, 2) == "prefill-tp1"
    for bad in ({"directory": "127.0.0.1:1"}, {"timeout_s": 0}, {"hold_s": "1"}, {"directory_": "x"}):
        with pytest.raises(tw.InvalidArgumentError):
            Settings.from_extra_config(bad, "e", None)


def _request(params, prompt_len=250, status="FINISHED_LENGTH_CAPPED"):
    return SimpleNamespace(request_id="r1", kv_transfer_params=params, prompt_token_ids=list(range(prompt_len)),
                           num_computed_tokens=prompt_len, status=SimpleNamespace(name=status))


def test_producer_holds_the_blocks_and_hands_them_off():
    side = SchedulerSide(_settings(name="prefill-0", hold_s=7), LAYOUT, role="kv_producer", block_size=96)
    delay, params = side.request_finished(_request({"do_remote_decode": True}), [3, 4, 5, 6])
    handoff = check_params(params, list(range(250)), 96, LAYOUT, sealed=False, now=time.time())
    assert delay and (handoff.member, handoff.block_ids, handoff.request_id, handoff.num_tokens) == (
        "prefill-0", (3, 4, 5), "r1", 250)  # the blocks of the prompt's 250 tokens, not the sampled one's
    (hold,) = side.build_plan().holds
    assert hold.request_id == "r1" and hold.expires_at - hold.issued_at == 7 and hold.producer_tp == 1
    assert side.request_finished(_request({"do_remote_decode": True}, status="FINISHED_ABORTED"), [3]) == (False,
                                                                                                           None)


def test_consumer_plans_one_load_per_request_into_its_new_blocks():
    side = SchedulerSide(_settings(name="decode"), LAYOUT, role="kv_consumer", block_size=96)
    params = Handoff("prefill-0", (3, 4, 5), "p-1", 250, LAYOUT, block_size=96).to_params(sealed=False)
    request = _request(params)
    assert side.num_new_matched_tokens(request, 96) == (154, True)
    side.after_alloc(request, SimpleNamespace(get_unhashed_block_ids=lambda: [8, 9]), 154)
    (load,) = side.build_plan().loads
    assert load.local_block_ids == (8, 9) and load.remote_block_ids() == (4, 5)  # the first block was cached here
    assert side.num_new_matched_tokens(request, 0) == (0, False)  # planned once
    assert side.build_plan().loads == []


def test_pool_views_of_both_cache_layouts():
    blocks_first = {f"layer{i}": torch.zeros(10, 2, 32, 128) for i in range(2)}
    assert [v.shape[0] for v in pool_views(blocks_first, 10)] == [10, 10]
    kv_first = {"layer0": torch.zeros(2, 10, 32, 2, 64)}
    views = pool_views(kv_first, 10)
    assert len(views) == 2 and views[1].data_ptr() == kv_first["layer0"][1].data_ptr()
    shared = torch.zeros(10, 4)
    assert len(pool_views({"a": shared, "b": shared}, 10)) == 1
    with pytest.raises(tw.InvalidArgumentError, match="layer0"):
        pool_views({"layer0": torch.zeros(3, 7, 4)}, 10)


def test_the_order_of_a_blocks_rows_is_read_from_the_strides():
    assert block_order(pool_views({"a": torch.zeros(10, 2, 32, 128)}, 10), 32, 2) == "HKND"  # CPU: per head K, V
    flash = torch.zeros(2, 10, 32, 2, 64)  # FlashAttention NHD: [2, blocks, block, heads, dim]
    assert block_order(pool_views({"a": flash}, 10), 32, 2) == "NHD"
    hnd = torch.zeros(2, 10, 2, 32, 64).transpose(2, 3)  # the HND view vLLM hands over: heads outermost in memory
    assert hnd.shape == flash.shape and block_order(pool_views({"a": hnd}, 10), 32, 2) == "HND"
    flashinfer_hnd = torch.zeros(10, 2, 2, 32, 64).transpose(2, 3)  # [blocks, K/V, block, heads, dim] as HND
    views = pool_views({"a": flashinfer_hnd}, 10)
    assert len(views) == 2 and block_order(views, 32, 2) == "HND"
    assert block_order(pool_views({"a": torch.zeros(10, 32, 576)}, 10), 32, 1) == "NHD"  # MLA: one head
    with pytest.raises(tw.InvalidArgumentError, match="not supported"):
        block_order(pool_views({"a": flash}, 10), 16, 2)  # not blocks of 16 tokens
    with pytest.raises(tw.InvalidArgumentError, match="one order"):
        block_order(pool_views({"a": flash, "b": hnd}, 10), 32, 2)

