"""A prefill engine and a decode engine of different tensor parallelism hand a prompt's KV over with tensorwire.kv,
in plain PyTorch: every rank a process, meeting in a `tensorwire directory`.

    python examples/kv_handoff.py                        # prefill at TP 2, decode at TP 1
    python examples/kv_handoff.py --prefill-tp 1 --decode-tp 2

Each prefill rank holds its share of the model's KV heads ([num_blocks, its heads, block_size, head_dim] per layer,
heads outermost, as vLLM's CPU backend), computes the prompt's KV into its blocks and holds them; its rank 0 gives
the client the sealed handoff (``Handoff.to_params``). The client passes it to the decode engine, which checks it
against the prompt, makes one claim for the load and gives it to every decode rank: each reads its heads of every
block from the prefill ranks that hold them, and the prefill ranks free the blocks once all reads are in. The
same handoff presented again (a replay) is refused before any byte moves.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import time

import torch

from tensorwire import kv

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 64, 16, 8, 32
LAYOUT = f"example layers={LAYERS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} float32"
PROMPT = list(range(3, 3 + 200))  # 13 blocks of 16 tokens


def kv_of(layer: int, blocks: torch.Tensor, heads: range) -> torch.Tensor:
    """What prefill computes: [len(blocks), len(heads), BLOCK_SIZE, HEAD_DIM] float32, distinct per (layer, block,
    head, position)."""
    head = torch.tensor(list(heads)).view(1, -1, 1, 1)
    position = torch.arange(BLOCK_SIZE * HEAD_DIM).view(1, 1, BLOCK_SIZE, HEAD_DIM)
    return ((layer * 1000 + blocks.view(-1, 1, 1, 1)) * 100 + head + position * 1e-4).to(torch.float32)


def engine_rank(role: str, tp: int, rank: int, directory: str, client: mp.Queue, out: mp.Queue) -> None:
    sharding = kv.Sharding(tp, KV_HEADS)
    start, stop = sharding.heads(rank)
    caches = [torch.zeros(NUM_BLOCKS, stop - start, BLOCK_SIZE, HEAD_DIM) for _ in range(LAYERS)]
    member = kv.KVMember(caches, instance=role, tp_rank=rank, sharding=sharding, layout=LAYOUT, block_size=BLOCK_SIZE,
                         order="HND", directory=directory)
    if role == "prefill":
        blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))[:-(-len(PROMPT) // BLOCK_SIZE)]
        for layer, cache in enumerate(caches):
            cache[blocks] = kv_of(layer, blocks, range(start, stop))
        producer = kv.Producer(member, hold_s=300)
        issued_at = client.get()  # every prefill rank holds the same handoff: the engine's scheduler made it
        handoff = kv.Handoff("prefill", tuple(blocks.tolist()), "request-1", len(PROMPT), LAYOUT,
                             kv.prompt_hash(PROMPT), issued_at, issued_at + 300, producer_tp=tp,
                             block_size=BLOCK_SIZE)
        producer.hold(handoff)
        if rank == 0:
            out.put(handoff.to_params(sealed=True))  # to the client
        deadline = time.monotonic() + 300
        while "request-1" not in producer.released() and time.monotonic() < deadline:
            time.sleep(0.01)
        out.put(f"prefill rank {rank}: heads {start}..{stop - 1} read, blocks freed")
        client.get()  # stay until the replay was tried
        producer.close()
    else:
        params, claim = client.get()
        handoff = kv.check_params(params, PROMPT, BLOCK_SIZE, LAYOUT, sealed=True, now=time.time())
        local = torch.randperm(NUM_BLOCKS)[:len(handoff.block_ids)]
        consumer = kv.Consumer(member, timeout_s=30)
        (result,) = consumer.load([kv.Load("decode-1", tuple(local.tolist()), handoff, claim=claim)])
        if result.error:
            out.put(f"decode rank {rank}: load refused ({result.reason})")
        else:
            remote = torch.tensor(handoff.block_ids)
            ok = all(torch.equal(c[local], kv_of(layer, remote, range(start, stop))) for layer, c in enumerate(caches))
            out.put(f"decode rank {rank}: heads {start}..{stop - 1} of {len(local)} blocks read over "
                    f"{result.transport}, {'every byte as prefill computed' if ok else 'WRONG BYTES'}")
        consumer.close()
    member.close()


def start_directory() -> tuple[subprocess.Popen, str]:
    directory = subprocess.Popen([sys.executable, "-m", "tensorwire", "directory", "--host", "127.0.0.1", "--port",
                                  "0", "--grace", "0"], stdout=subprocess.PIPE, text=True)
    line = directory.stdout.readline()
    return directory, next(w for w in line.split() if w.startswith("tcp://")).rstrip(")")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("TENSORWIRE_JOB_TOKEN", secrets.token_hex(16))  # the job's: children inherit it
    directory, address = start_directory()
    context = mp.get_context("spawn")
    to_prefill, to_decode, out = context.Queue(), context.Queue(), context.Queue()

    def engine(role: str, tp: int, queue: mp.Queue) -> list:
        ranks = [context.Process(target=engine_rank, args=(role, tp, r, address, queue, out)) for r in range(tp)]
        for process in ranks:
            process.start()
        return ranks

    processes = engine("prefill", args.prefill_tp, to_prefill)
    try:
        issued_at = time.time()
        for _ in range(args.prefill_tp):
            to_prefill.put(issued_at)
        params = out.get(timeout=120)  # the client holds the handoff
        for attempt in ("decode", "replay"):
            claim = kv.new_claim()  # the decode engine's scheduler: one claim per load, for all its ranks
            for _ in range(args.decode_tp):
                to_decode.put((params, claim))
            processes += engine("decode", args.decode_tp, to_decode)
            reports = args.decode_tp + (args.prefill_tp if attempt == "decode" else 0)  # prefill frees once
            print(f"{attempt}:", *sorted(out.get(timeout=120) for _ in range(reports)), sep="\n  ")
        for _ in range(args.prefill_tp):
            to_prefill.put("done")
        for process in processes:
            process.join(60)
        return 0 if all(p.exitcode == 0 for p in processes) else 1
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        directory.terminate()
        directory.wait(30)


if __name__ == "__main__":
    sys.exit(main())
