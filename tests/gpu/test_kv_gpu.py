"""A prefill engine and a decode engine as vLLM lays their caches out on GPUs, every rank a process on one GPU:
producer TP 2 -> consumer TP 1 and TP 1 -> 2 (three processes each), bf16 caches (head_dim 8: codes exact in 16
bits) of K/V-first ``[2, num_blocks, block_size, heads, head_dim]`` tensors in ``HND`` (the stride-permuted view
vLLM hands over) or ``NHD`` memory, read over ``cuda_ipc`` and over NIXL; one pair of another order and block size
on each side (an engine that could not honour the HND layout). Every row of every loaded block is checked by its
(layer, K/V, token, head, element) code, and nothing else written (``tensorwire.testing.kv_pools``).
"""

from __future__ import annotations

import pytest

from tensorwire.testing.kv_pools import PairSpec, check_report, run_pair

pytestmark = pytest.mark.gpu

_BLOCKS_16 = (3, 9, 1, 14, 6)  # five blocks of 16 tokens: 70 tokens


def _need(transport: str) -> None:
    if transport == "nixl":
        pytest.importorskip("nixl", reason="NIXL is not installed (pip install nixl)")


@pytest.mark.parametrize("transport", ["cuda_ipc", "nixl"])
@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["tp2-to-1", "tp1-to-2"])
def test_a_vllm_shaped_gpu_pair_reads_every_row_once(tp, order, transport, kv_fleet):
    _need(transport)
    spec = PairSpec(tp[0], tp[1], 8, cuda=True, dtype="bfloat16", tokens=16, dim=8, producer_order=order,
                    consumer_order=order, remote_ids=_BLOCKS_16, local_ids=(5, 11, 0, 2, 8), num_tokens=70,
                    transport="nixl" if transport == "nixl" else None)
    check_report(run_pair(spec, *kv_fleet), spec, transport)


@pytest.mark.parametrize("transport", ["cuda_ipc", "nixl"])
def test_an_nhd_consumer_of_larger_blocks_reads_an_hnd_producer(transport, kv_fleet):
    _need(transport)
    spec = PairSpec(2, 1, 8, cuda=True, dtype="bfloat16", dim=8, producer_block=16, consumer_block=32,
                    consumer_order="NHD", remote_ids=_BLOCKS_16, local_ids=(5, 11, 0), num_tokens=70,
                    transport="nixl" if transport == "nixl" else None)
    check_report(run_pair(spec, *kv_fleet), spec, transport)
