"""``tensorwire.kv`` between real processes: a producer engine and a consumer engine of any tensor parallelism, each
rank a fleet member (a ``tensorwire directory`` process), over real NIXL (private host memory) and ``shm`` (host
memory in shared files), with caches whose values encode (layer, block, head, token, element).

Every consumer rank reads its heads of every block from the producer ranks that hold them (head ranges inside each
block when the TP sizes differ, GQA replication on either side, MLA: one replica read, the others released); every
byte is checked and nothing else written; every producer rank frees the request once the consumer ranks it expects
reported. A second consumer replaying the same handoff after the read is refused before any byte moves.
"""

from __future__ import annotations

import pytest

from tensorwire.testing.kv_pools import PairSpec, check_report, run_pair

CASES = {  # id -> (producer TP, consumer TP, KV heads, MLA)
    "tp1-to-2": (1, 2, 8, False),
    "tp2-to-1": (2, 1, 8, False),
    "tp2-to-4": (2, 4, 8, False),
    "tp4-to-2": (4, 2, 8, False),
    "gqa-consumer-replicates": (1, 4, 2, False),  # 4 consumer ranks, 2 heads: each head read by two ranks
    "gqa-producer-replicates": (4, 1, 2, False),  # 4 producer ranks hold 2 heads: one replica each read
    "mla-2-to-1": (2, 1, 1, True),
    "mla-1-to-2": (1, 2, 1, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["nixl", "shm", pytest.param("cuda_ipc", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", list(CASES))
def test_a_consumer_of_any_tp_reads_exactly_its_heads_once(case, memory, kv_fleet):
    producer_tp, consumer_tp, heads, mla = CASES[case]
    spec = PairSpec(producer_tp, consumer_tp, heads, mla=mla, shm=memory == "shm", cuda=memory == "cuda_ipc")
    report = run_pair(spec, *kv_fleet)
    check_report(report, spec, memory)


# As vLLM lays caches out on GPUs (and its CPU backend: HKND), and block sizes that differ: id -> (PairSpec fields,
# transport). The arithmetic of every order x block-size x TP combination is in tests/unit/test_kv_shapes.py; these
# run each kind of plan between real processes (one descriptor per block, rows per token, a row per head and token,
# several parts per request).
_IDS_16 = (3, 9, 1, 14, 6)  # five blocks of 16 tokens: 70 tokens
LAYOUTS = {
    "nhd-tp2-to-1": (dict(producer_tp=2, consumer_tp=1, total_heads=8, producer_order="NHD", consumer_order="NHD"),
                     "nixl"),
    "nhd-flashinfer-tp1-to-2": (dict(producer_tp=1, consumer_tp=2, total_heads=8, producer_order="NHD",
                                     consumer_order="NHD", kv_first=False), "shm"),
    "hnd-flashinfer-tp2-to-4": (dict(producer_tp=2, consumer_tp=4, total_heads=8, kv_first=False), "nixl"),
    "hnd-to-nhd-tp4-to-2": (dict(producer_tp=4, consumer_tp=2, total_heads=8, consumer_order="NHD"), "nixl"),
    "nhd-gqa-consumer-replicates": (dict(producer_tp=1, consumer_tp=4, total_heads=2, producer_order="NHD",
                                         consumer_order="NHD"), "shm"),
    "blocks-16-to-32-tp2-to-1": (dict(producer_tp=2, consumer_tp=1, total_heads=4, producer_block=16,
                                      consumer_block=32, remote_ids=_IDS_16, local_ids=(5, 11, 0), num_tokens=70),
                                 "nixl"),
    "blocks-32-to-16-nhd-tp1-to-2": (dict(producer_tp=1, consumer_tp=2, total_heads=4, producer_block=32,
                                          consumer_block=16, producer_order="NHD", consumer_order="NHD",
                                          remote_ids=(5, 11, 0), local_ids=_IDS_16, num_tokens=70), "shm"),
    "blocks-16-to-64-mla": (dict(producer_tp=2, consumer_tp=1, total_heads=1, mla=True, producer_block=16,
                                 consumer_block=64, remote_ids=_IDS_16, local_ids=(8, 2), num_tokens=70), "nixl"),
    "cpu-cache-tp2-to-1": (dict(producer_tp=2, consumer_tp=1, total_heads=4, producer_order="HKND",
                                consumer_order="HKND"), "nixl"),
    "blocks-64-to-16-hnd-to-nhd": (dict(producer_tp=1, consumer_tp=2, total_heads=4, producer_block=64,
                                        consumer_block=16, consumer_order="NHD", remote_ids=(8, 2), local_ids=_IDS_16,
                                        num_tokens=70), "nixl"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_gpu_cache_layouts_and_block_sizes_read_every_row_once(case, kv_fleet):
    fields, transport = LAYOUTS[case]
    spec = PairSpec(**{"dim": 4, **fields, "shm": transport == "shm"})
    report = run_pair(spec, *kv_fleet)
    check_report(report, spec, transport)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2-to-1", "mla-2-to-1"])
def test_a_replayed_handoff_is_refused_before_any_byte_moves(case, kv_fleet):
    producer_tp, consumer_tp, heads, mla = CASES[case]
    spec = PairSpec(producer_tp, consumer_tp, heads, mla=mla)
    report = run_pair(spec, *kv_fleet, replay_tp=1)
    check_report(report, spec, "nixl")
    for rank, (reason, _, problems, *_) in report["replayed"].items():
        assert reason == "replayed" and not problems, (rank, reason, problems)  # its cache still all zeros
    assert sum(r.get("spent", 0) for r in report["refused"].values()) >= 1, report["refused"]


@pytest.mark.slow
def test_the_plain_pytorch_example_runs_as_printed():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "kv_handoff.py"
    done = subprocess.run([sys.executable, str(example), "--prefill-tp", "1", "--decode-tp", "2"], capture_output=True,
                          text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert output.count("every byte as prefill computed") == 2 and output.count("load refused (replayed)") == 2, (
        output[-3000:])
