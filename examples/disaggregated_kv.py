"""Disaggregated inference in miniature: a prefill rank fills a paged KV cache, a decode rank READs the blocks of
one request by id, in one request per step, and checks them.

    python examples/disaggregated_kv.py            # two local ranks (host memory; GPU memory too if there is one)
    torchrun --nproc-per-node 2 examples/disaggregated_kv.py

Layout: vLLM's per-layer cache, ``[num_blocks, 2 (K/V), block_size, kv_heads, head_dim]`` per layer; a request
owns a list of block ids (its block table) on each side. The prefill rank publishes its pool once; per request,
the scheduler tells the decode rank the prefill rank's block table (here: both derive it from the request's seed);
the decode rank allocates blocks of its own, READs them all in one request, and continues decoding from them.
"""

from __future__ import annotations

import sys

import torch

import tensorwire as tw

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 256, 16, 8, 64
PROMPT_TOKENS = 1000  # 63 blocks of 16 tokens


def kv_value(layer: int, block: torch.Tensor) -> torch.Tensor:
    """What prefill writes into ``block`` of ``layer``: [len(block), 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM] bf16."""
    positions = torch.arange(2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM, device=block.device) % 251
    return ((block[:, None] * 7 + layer * 3 + positions[None, :]) % 256).to(torch.bfloat16).view(
        len(block), 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)


def run(device_type: str) -> str:
    with tw.init() as comm:
        device = torch.device("cpu") if device_type == "cpu" else comm.device
        caches = [torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
                  for _ in range(LAYERS)]
        num_request_blocks = -(-PROMPT_TOKENS // BLOCK_SIZE)
        with comm.register_blocks(caches) as pool:
            comm.publish_blocks(f"kv-{device_type}", pool)
            prefill_table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0))[:num_request_blocks]
            if comm.rank == 0:  # prefill: compute the prompt's KV into its blocks
                for layer, cache in enumerate(caches):
                    cache[prefill_table.to(device)] = kv_value(layer, prefill_table.to(device))
                comm.barrier()  # the KV is in place
                comm.barrier()  # decode has read it
                return "prefill done"
            remote = comm.lookup_blocks(f"kv-{device_type}", 0)
            comm.barrier()
            remote_ids = prefill_table
            local_ids = torch.randperm(NUM_BLOCKS)[:num_request_blocks]  # decode's own free blocks
            comm.read_blocks(pool, local_ids, remote, remote_ids, timeout=30)
            with comm.prepare_blocks(tw.READ, pool, remote) as x:
                transport = x.transport
            for layer, cache in enumerate(caches):
                expected = kv_value(layer, remote_ids.to(device))
                if not torch.equal(cache[local_ids.to(device)], expected):
                    raise RuntimeError(f"decode: layer {layer} differs from what prefill computed")
            comm.barrier()
            return f"decode read {num_request_blocks} blocks x {LAYERS} layers over {transport}"


def main() -> int:
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if "RANK" in __import__("os").environ:  # under torchrun
        for kind in kinds:
            print(run(kind))
        return 0
    for kind in kinds:
        print(kind, tw.testing.launch(run, 2, kind, timeout=120))
    return 0


if __name__ == "__main__":
    sys.exit(main())
