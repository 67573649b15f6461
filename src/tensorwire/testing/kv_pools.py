"""A producer and a consumer engine of any tensor parallelism, each rank a process of one fleet, over KV caches whose
values encode (layer, K/V, token, head, element): the multi-process KV tests and ``bench kv --tp`` run it.

Each rank's cache is one tensor per layer laid out as vLLM lays its caches out on GPUs: K/V first
(FlashAttention, ``[2, num_blocks, block_size, heads, dim]``) or blocks first (FlashInfer, ``[num_blocks, 2, ...]``),
in memory either heads outermost (``HND``: the logical shape is a stride-permuted view, as vLLM hands it over) or
tokens outermost (``NHD``); MLA: ``[num_blocks, block_size, dim]`` (every rank holds it whole). The pool's views are
the K and V halves (``cache[0]``, ``cache[:, 0]``...), ``[num_blocks, block_size, heads, dim]`` each. The two engines
may differ in order and block size. Producer ranks fill every block with ``code``s of the prompt's tokens (its
handoff blocks, in token order) or of a token outside the prompt (negative: any other block); consumer ranks start
from zeros and check, after their load, that each of their rows of each loaded block holds the producer's code of
that token and head, and that nothing else was written.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import torch

import tensorwire as tw
from tensorwire import kv

__all__ = ["PairSpec", "run_pair", "check_report"]

LAYERS = 2
_WAIT_S = 120.0


@dataclass(frozen=True)
class PairSpec:
    """Producer TP, consumer TP, the model's KV heads (1 with ``mla``), host memory in shared files (``shm``: the
    ``shm`` transport between ranks of one host) or not (NIXL), GPU memory (``cuda``: one GPU shared by every rank,
    ``cuda_ipc``), the producer's blocks of the prompt and the consumer's blocks it loads into (in token order), each
    side's tokens per block (``tokens`` unless ``producer_block``/``consumer_block`` say otherwise) and order, the
    cache's shape (``kv_first``), dtype (``"float32"``, or ``"bfloat16"`` whose bits are int16 codes), the prompt's
    tokens (all of the producer's blocks unless ``num_tokens``) and how many requests (each its own handoff of the
    same blocks) are loaded one after the other."""

    producer_tp: int
    consumer_tp: int
    total_heads: int
    mla: bool = False
    shm: bool = False
    num_blocks: int = 16
    remote_ids: tuple[int, ...] = (7, 3, 12, 0, 9)
    local_ids: tuple[int, ...] = (1, 2, 15, 4, 10)
    tokens: int = 4
    dim: int = 8
    requests: int = 1
    cuda: bool = False  # GPU memory (one GPU shared by every rank: cuda_ipc)
    producer_block: int | None = None
    consumer_block: int | None = None
    producer_order: str = "HND"
    consumer_order: str = "HND"
    kv_first: bool = True
    dtype: str = "float32"
    num_tokens: int | None = None
    transport: str | None = None  # the consumer's READs' (None: the fastest)

    @property
    def layout(self) -> str:
        return f"testing-kv layers={LAYERS} dim={self.dim} {self.dtype}"

    @property
    def prompt_tokens(self) -> int:
        return self.num_tokens or len(self.remote_ids) * self.block_size("producer")

    def block_size(self, side: str) -> int:
        return (self.producer_block if side == "producer" else self.consumer_block) or self.tokens

    def sharding(self, tp_size: int) -> kv.Sharding:
        return kv.Sharding(tp_size, 1 if self.mla else self.total_heads, replicated=self.mla)


def _codes(spec: PairSpec, side: str, start: int, heads: int, block_token) -> torch.Tensor:
    """int64 ``[LAYERS, 2, num_blocks, block_size, heads, dim]``: the code of (layer, K/V, token, head, element) for
    ``block_token(block)``, the prompt token of a block's first row (None: not a prompt block, a negative code)."""
    size = spec.block_size(side)
    layer, half, block, token, head, element = torch.meshgrid(
        torch.arange(LAYERS), torch.arange(2), torch.arange(spec.num_blocks), torch.arange(size),
        torch.arange(heads), torch.arange(spec.dim), indexing="ij")
    firsts = [block_token(b) for b in range(spec.num_blocks)]
    first = torch.tensor([-1 if f is None else f for f in firsts]).view(1, 1, -1, 1, 1, 1)
    prompt = first >= 0
    global_token = torch.where(prompt, first + token, block * size + token)
    total = 1 if spec.mla else spec.total_heads
    value = (((layer * 2 + half) * spec.prompt_tokens + global_token) * total + head + start) * spec.dim + element
    limit = 32000 if spec.dtype == "bfloat16" else 1 << 24  # exact in int16 bits / in float32
    if LAYERS * 2 * spec.prompt_tokens * total * spec.dim >= limit:
        raise ValueError(f"PairSpec: {spec.prompt_tokens} tokens x {total} heads x {spec.dim} do not fit unique "
                         f"{spec.dtype} codes; use fewer")
    return torch.where(prompt, value + 1, -(value % limit) - 1)  # other blocks' codes need only be negative


def _views(spec: PairSpec, side: str, tp_rank: int, tp_size: int,
           fill: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(the storage, the pool views, the halves): per layer one cache as vLLM lays it out (its flat storage: a
    ``shm`` file lives as long as that tensor); its K and V halves as views (the CPU backend's ``HKND`` cache: the
    whole cache, one view); the halves, per layer K then V as logical ``[num_blocks, block_size, heads, dim]`` (MLA:
    the cache), what the codes are written into and checked in."""
    start, stop = spec.sharding(tp_size).heads(tp_rank)
    size, heads = spec.block_size(side), stop - start
    order = spec.producer_order if side == "producer" else spec.consumer_order
    storage = torch.int16 if spec.dtype == "bfloat16" else torch.float32
    device = "cuda" if spec.cuda else "cpu"
    storages, views, halves = [], [], []
    for _ in range(LAYERS):
        if spec.mla:
            physical = (spec.num_blocks, size, spec.dim)
        elif order == "HKND":
            physical = (spec.num_blocks, heads, 2, size, spec.dim)
        else:
            inner = (heads, size, spec.dim) if order == "HND" else (size, heads, spec.dim)
            physical = (2, spec.num_blocks, *inner) if spec.kv_first else (spec.num_blocks, 2, *inner)
        numel = math.prod(physical)
        flat = tw.shared_empty((numel,), dtype=storage) if spec.shm else torch.empty(numel, dtype=storage,
                                                                                      device=device)
        flat.zero_()
        storages.append(flat)
        cache = flat.view(physical)
        if not spec.mla and order == "HND":
            cache = cache.transpose(-3, -2)  # the logical [..., block_size, heads, dim] over heads-outermost memory
        if spec.dtype == "bfloat16":
            cache = cache.view(torch.bfloat16)
        if spec.mla:
            views.append(cache)
            halves.append(cache)
        elif order == "HKND":
            views.append(cache)
            halves.extend((cache[:, :, 0].transpose(1, 2), cache[:, :, 1].transpose(1, 2)))
        else:
            layer_views = (cache[0], cache[1]) if spec.kv_first else (cache[:, 0], cache[:, 1])
            views.extend(layer_views)
            halves.extend(layer_views)
    if fill:
        ids = spec.remote_ids
        codes = _codes(spec, side, start, 1 if spec.mla else heads,
                       lambda b: ids.index(b) * size if b in ids else None)
        for layer in range(LAYERS):
            for half in range(1 if spec.mla else 2):
                target = halves[layer if spec.mla else 2 * layer + half]
                value = codes[layer, half, :, :, 0] if spec.mla else codes[layer, half]
                _bits(target).copy_(value.to(_bits(target).dtype).to(target.device))
    return storages, views, halves


def _bits(view: torch.Tensor) -> torch.Tensor:
    """The view as the type its codes are written in (bfloat16 caches hold int16 codes)."""
    return view.view(torch.int16) if view.dtype == torch.bfloat16 else view


def _problems(spec: PairSpec, halves: list[torch.Tensor], tp_rank: int, loaded: bool) -> list[str]:
    """What differs from the producer's codes in the loaded blocks' rows of the prompt (a consumer block's rows past
    the prompt: zero or the producer's code of that token, never another block's), or from zero elsewhere."""
    start, stop = spec.sharding(spec.consumer_tp).heads(tp_rank)
    size = spec.block_size("consumer")
    ids = spec.local_ids
    codes = _codes(spec, "consumer", start, 1 if spec.mla else stop - start,
                   lambda b: ids.index(b) * size if b in ids else None)
    tokens = torch.arange(spec.num_blocks).view(-1, 1) * 0 + torch.arange(size).view(1, -1)
    problems = []
    for index, view in enumerate(halves):
        layer, half = (index, 0) if spec.mla else divmod(index, 2)
        got = _bits(view).cpu().to(torch.int64)
        want = codes[layer, half, :, :, 0] if spec.mla else codes[layer, half]
        for block in range(spec.num_blocks):
            if loaded and block in ids:
                first = ids.index(block) * size
                in_prompt = (first + tokens[block]) < spec.prompt_tokens
                rows_ok = (got[block] == want[block]).flatten(1).all(1)
                tail_ok = rows_ok | (got[block] == 0).flatten(1).all(1)
                if not bool(torch.where(in_prompt, rows_ok, tail_ok).all()):
                    bad = int(torch.nonzero(~torch.where(in_prompt, rows_ok, tail_ok))[0])
                    problems.append(f"layer {layer} {'KV'[half]} block {block} token {bad}: "
                                    f"{got[block][bad].flatten()[:4].tolist()}... expected "
                                    f"{want[block][bad].flatten()[:4].tolist()}...")
            elif got[block].abs().sum() != 0:
                problems.append(f"layer {layer} {'KV'[half]} block {block} was written")
    return problems


def _member(spec: PairSpec, side: str, address: str, token: str, instance: str, tp_rank: int, tp_size: int,
            fill: bool) -> tuple[kv.KVMember, list[torch.Tensor], list[torch.Tensor]]:
    """(the member, its cache's K and V halves, their storage: keep it while the member lives)."""
    os.environ["TENSORWIRE_JOB_TOKEN"] = token  # this spawned process's own environment
    storages, views, halves = _views(spec, side, tp_rank, tp_size, fill)
    order = spec.producer_order if side == "producer" else spec.consumer_order
    member = kv.KVMember(views, instance=instance, tp_rank=tp_rank, sharding=spec.sharding(tp_size),
                         layout=spec.layout, block_size=spec.block_size(side), order=order, directory=address,
                         timeout_s=30.0)
    return member, halves, storages


def handoff_of(spec: PairSpec, issued_at: float, request: int = 0) -> kv.Handoff:
    return kv.Handoff("prefill", spec.remote_ids, f"p-{request}", spec.prompt_tokens, spec.layout, "", issued_at,
                      issued_at + _WAIT_S * 2, spec.producer_tp, block_size=spec.block_size("producer"))


def producer_rank(spec: PairSpec, address: str, token: str, tp_rank: int, issued_at: float, out: mp.Queue,
                  stop: mp.Event) -> None:
    """A producer rank: hold the requests' blocks, say when they were all released, stay until ``stop``."""
    member, _, storages = _member(spec, "producer", address, token, "prefill", tp_rank, spec.producer_tp, fill=True)
    producer = kv.Producer(member, hold_s=_WAIT_S * 2)
    for request in range(spec.requests):
        producer.hold(handoff_of(spec, issued_at, request))
    out.put(("ready", tp_rank))
    held, deadline = {f"p-{r}" for r in range(spec.requests)}, time.monotonic() + _WAIT_S
    while held and time.monotonic() < deadline:
        held -= producer.released()
        time.sleep(0.01)
    out.put(("held" if held else "released", tp_rank, producer.refused))
    stop.wait(_WAIT_S)
    out.put(("refused", tp_rank, producer.refused))
    producer.close()
    member.close()
    del storages  # the cache's memory outlived the member that registered it


def consumer_rank(spec: PairSpec, address: str, token: str, instance: str, tp_rank: int, tp_size: int,
                  issued_at: float, claim: str, out: mp.Queue) -> None:
    """A consumer rank: load the requests one after the other (claim ``<claim>-<request>``, the same at every
    rank), check every byte, report (rank, first error reason, transport, problems, claim, transfer and load seconds of
    each load)."""
    consumer_spec = PairSpec(**{**spec.__dict__, "consumer_tp": tp_size})
    member, views, storages = _member(consumer_spec, "consumer", address, token, instance, tp_rank, tp_size, fill=False)
    consumer = kv.Consumer(member, timeout_s=30.0, transport=spec.transport)
    results = []
    for request in range(spec.requests):
        load = kv.Load(f"c-{request}", spec.local_ids, handoff_of(spec, issued_at, request), claim=f"{claim}-{request}")
        results += consumer.load([load])
    failed = next((r for r in results if r.error), None)
    problems = _problems(consumer_spec, views, tp_rank, loaded=failed is None)
    out.put(("loaded", tp_rank, failed.reason if failed else "", results[0].transport, problems,
             [r.claim_s for r in results], [r.transfer_s for r in results], [r.load_s for r in results]))
    consumer.close()
    member.close()
    del storages  # the cache's memory outlived the member that registered it


def run_pair(spec: PairSpec, address: str, token: str, *, replay_tp: int | None = None) -> dict:
    """Start the producer ranks, then the consumer ranks (and, with ``replay_tp``, a second consumer instance of
    that TP replaying the same handoff after the first one's read); collect what each reported. Blocks (bounded)."""
    context = mp.get_context("spawn")
    out, stop = context.Queue(), context.Event()
    issued_at = time.time()
    processes = [context.Process(target=producer_rank, args=(spec, address, token, r, issued_at, out, stop),
                                 daemon=True) for r in range(spec.producer_tp)]
    report: dict = {"ready": set(), "released": set(), "held": set(), "loaded": {}, "replayed": {}, "refused": {}}
    try:
        for process in processes:
            process.start()
        _collect(out, report, lambda: len(report["ready"]) == spec.producer_tp)
        _consumers(context, spec, address, token, "decode", spec.consumer_tp, issued_at, kv.new_claim(), out,
                   processes)
        _collect(out, report, lambda: len(report["loaded"]) == spec.consumer_tp
                 and len(report["released"] | report["held"]) == spec.producer_tp)
        if replay_tp is not None:
            report["replayed"], report["loaded"] = report["loaded"], {}
            _consumers(context, spec, address, token, "replayer", replay_tp, issued_at, kv.new_claim(), out,
                       processes)
            _collect(out, report, lambda: len(report["loaded"]) == replay_tp)
            report["replayed"], report["loaded"] = report["loaded"], report["replayed"]
        stop.set()
        _collect(out, report, lambda: len(report["refused"]) == spec.producer_tp)
    finally:
        stop.set()
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    return report


def _consumers(context, spec: PairSpec, address: str, token: str, instance: str, tp_size: int, issued_at: float,
               claim: str, out: mp.Queue, processes: list) -> None:
    for r in range(tp_size):
        process = context.Process(target=consumer_rank, args=(spec, address, token, instance, r, tp_size, issued_at,
                                                              claim, out), daemon=True)
        process.start()
        processes.append(process)


def _collect(out: mp.Queue, report: dict, done) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the KV pair did not report within {_WAIT_S:g}s: {report}")
        item = out.get(timeout=left)
        kind, rank = item[0], item[1]
        if kind == "ready":
            report["ready"].add(rank)
        elif kind in ("released", "held"):
            report[kind].add(rank)
        elif kind == "loaded":
            report["loaded"][rank] = item[2:]
        elif kind == "refused":
            report["refused"][rank] = item[2]


def check_report(report: dict, spec: PairSpec, transport: str) -> None:
    """``AssertionError`` unless every consumer rank of ``run_pair``'s report loaded without a failure or a wrong
    byte over ``transport``, and every producer rank heard all it expected."""
    for rank, (reason, used, problems, *_) in sorted(report["loaded"].items()):
        assert reason == "" and not problems, (rank, reason, problems[:4])
        assert used == transport, (rank, used)
    assert report["released"] == set(range(spec.producer_tp)), report
