"""TensorwireConnector's worker side without vLLM: a producer and a consumer ``WorkerSide`` in two processes of
one fleet (a ``tensorwire directory`` process), over KV caches shaped like vLLM's: the CPU backend's
blocks-first ``[num_blocks, kv_heads, block, 2 * head_dim]`` and FlashAttention's K/V-first ``[2, num_blocks,
block, kv_heads, head_dim]`` on a GPU (marker ``gpu``: one GPU shared by both processes, so ``cuda_ipc``).

Values encode (layer, block, element), so a block read from the wrong id or layer shows up. The consumer loads
a request, the producer frees it only once the consumer's READ told it so; then the producer is killed and the
next load fails into ``load_errors`` (what vLLM recomputes or fails) instead of raising.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time

import pytest
import torch

from tensorwire import kv
from tensorwire.bench.vllm_parties import start_directory
from tensorwire.integrations.vllm.plan import Plan
from tensorwire.integrations.vllm.settings import Settings
from tensorwire.integrations.vllm.worker import WorkerSide
from tensorwire.kv import Handoff, Load

LAYOUT = "LlamaForCausalLM layers=2 kv_heads=2 head_dim=64 kv_dtype=float32"
BLOCK = 32
SHARDING = kv.Sharding(1, 2)
NUM_BLOCKS, LAYERS = 40, 2
WAIT = 30.0
ISSUED = 1000.0  # the issue time of the producer's one handoff

def _caches(device: str, producer: bool) -> dict[str, torch.Tensor]:
    """cpu: the CPU backend's cache; cuda: FlashAttention's (NHD); cuda-hnd: the same logical shape over
    heads-outermost memory, the stride-permuted view vLLM hands over under the HND layout."""
    shape = (NUM_BLOCKS, 2, BLOCK, 128) if device == "cpu" else (2, NUM_BLOCKS, BLOCK, 2, 64)
    caches = {}
    for layer in range(LAYERS):
        values = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + layer * 1e7
        cache = (values if producer else torch.zeros(shape)).to(device.removesuffix("-hnd"))
        if device == "cuda-hnd":
            cache = cache.transpose(2, 3).contiguous().transpose(2, 3)  # [2, blocks, block, heads, dim] over HND
        caches[f"model.layers.{layer}.attn"] = cache
    return caches


def _block(caches: dict[str, torch.Tensor], layer: int, block: int, device: str) -> torch.Tensor:
    cache = caches[f"model.layers.{layer}.attn"]
    return cache[block] if device == "cpu" else cache[:, block]


def _worker(directory: str, name: str, role: str, token: str) -> WorkerSide:
    os.environ["TENSORWIRE_JOB_TOKEN"] = token  # this spawned process's own environment
    settings = Settings.from_extra_config({"directory": directory, "name": name, "timeout_s": 5, "hold_s": 60},
                                          None, None)
    return WorkerSide(settings, role, LAYOUT, 0, SHARDING, BLOCK)


def _producer(directory: str, token: str, device: str, done: mp.Queue) -> None:
    worker = _worker(directory, "prefill", "kv_producer", token)
    worker.register(_caches(device, producer=True), NUM_BLOCKS)
    now = time.time()
    worker.start(Plan(holds=[Handoff("prefill", (7, 3, 30, 12), "p-1", 100, LAYOUT, "", ISSUED, now + 60,
                                     block_size=BLOCK)]))
    done.put("ready")
    released, deadline = set(), time.monotonic() + WAIT
    while "p-1" not in released and time.monotonic() < deadline:
        released |= worker.finished()[0]
        time.sleep(0.01)
    done.put(sorted(released))
    time.sleep(WAIT * 4)  # killed by the test


def _finish(worker: WorkerSide, request_id: str) -> set[int]:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if request_id in worker.finished()[1]:
            return worker.load_errors()
        time.sleep(0.01)
    raise AssertionError(f"the load of {request_id} did not end within {WAIT}s")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu),
                                    pytest.param("cuda-hnd", marks=pytest.mark.gpu)])
def test_a_load_is_read_freed_and_a_dead_producer_becomes_load_errors(device, monkeypatch):
    token = secrets.token_hex(16)
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", token)  # the consumer runs here: undone after the test
    directory, address = start_directory(token)
    context = mp.get_context("spawn")
    done = context.Queue()
    producer = context.Process(target=_producer, args=(address, token, device, done), daemon=True)
    producer.start()
    consumer = None
    try:
        assert done.get(timeout=120) == "ready"
        settings = Settings.from_extra_config({"directory": address, "name": "decode", "timeout_s": 5,
                                               "hold_s": 60}, None, None)
        consumer = WorkerSide(settings, "kv_consumer", LAYOUT, 0, SHARDING, BLOCK)
        caches = _caches(device, producer=False)
        consumer.register(caches, NUM_BLOCKS)
        remote, local = [7, 3, 30, 12], [0, 1, 2, 39]
        handoff = Handoff("prefill", tuple(remote), "p-1", 100, LAYOUT, "", ISSUED, time.time() + 60,
                          block_size=BLOCK)
        consumer.start(Plan(loads=[Load("c-1", tuple(local), handoff, claim=kv.new_claim())]))
        assert _finish(consumer, "c-1") == set()
        expected = _caches(device, producer=True)
        for layer in range(LAYERS):
            for r, ll in zip(remote, local):
                assert torch.equal(_block(caches, layer, ll, device), _block(expected, layer, r, device))
        assert _block(caches, 0, 5, device).abs().sum() == 0  # nothing else was written
        assert done.get(timeout=WAIT) == ["p-1"]  # freed by the consumer's READ, long before hold_s
        assert consumer.transports == {"nixl" if device == "cpu" else "cuda_ipc"}
        assert consumer._member.shape.order == {"cpu": "HKND", "cuda": "NHD", "cuda-hnd": "HND"}[device]
        stats = consumer.stats.take()
        assert stats["num_blocks"] == [4] and stats["bytes_transferred"] == [4 * 2 * 32 * 128 * 4 * LAYERS]

        producer.kill()
        producer.join(30)
        handoff = Handoff("prefill", (1, 2), "p-2", 64, LAYOUT, "", ISSUED, time.time() + 60, block_size=BLOCK)
        consumer.start(Plan(loads=[Load("c-2", (4, 5), handoff, claim=kv.new_claim())]))
        assert _finish(consumer, "c-2") == {4, 5}
        assert consumer.stats.take()["num_failed_transfers"] == [1]
    finally:
        if consumer is not None:
            consumer.close()
        if producer.is_alive():
            producer.kill()
        directory.close()
