"""A producer and a consumer engine of any tensor parallelism, each rank a process of one fleet, over KV caches whose
values encode (layer, block, head, token, element): the multi-process KV tests and ``bench kv --tp`` run it.

Each rank's cache is one view per layer, ``[num_blocks, its heads, tokens, dim]`` float32 (heads outermost in a
block, as vLLM's CPU backend), or ``[num_blocks, tokens, dim]`` for MLA (every rank holds it whole). Producer ranks
fill their blocks with ``code(...)`` (never 0); consumer ranks start from zeros and check, after their load, that each
of their heads of each loaded block holds the producer's code and nothing else was written.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import torch

import tensorwire as tw
from tensorwire import kv

__all__ = ["PairSpec", "code", "run_pair"]

LAYERS = 2
_WAIT_S = 120.0


@dataclass(frozen=True)
class PairSpec:
    """Producer TP, consumer TP, the model's KV heads (1 with ``mla``), host memory in shared files (``shm``: the
    ``shm`` transport between ranks of one host) or not (NIXL), the blocks a request moves, each head's
    ``tokens x dim`` floats per block, and how many requests (each its own handoff of the same blocks) are loaded
    one after the other."""

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

    @property
    def layout(self) -> str:
        return f"testing-kv layers={LAYERS} tokens={self.tokens} dim={self.dim} float32"

    def sharding(self, tp_size: int) -> kv.Sharding:
        return kv.Sharding(tp_size, 1 if self.mla else self.total_heads, replicated=self.mla)


def code(spec: PairSpec, layer: int, block: int, head: int, token: int, element: int) -> int:
    """The value at (layer, block, head, token, element) of the producer's cache: unique, exact in float32, > 0."""
    heads = 1 if spec.mla else spec.total_heads
    return ((((layer * spec.num_blocks + block) * heads + head) * spec.tokens + token) * spec.dim + element) + 1


def _views(spec: PairSpec, tp_rank: int, tp_size: int, fill: bool) -> list[torch.Tensor]:
    start, stop = spec.sharding(tp_size).heads(tp_rank)
    shape = ((spec.num_blocks, spec.tokens, spec.dim) if spec.mla
             else (spec.num_blocks, stop - start, spec.tokens, spec.dim))
    views = []
    for layer in range(LAYERS):
        view = tw.shared_empty(shape) if spec.shm else torch.empty(shape, device="cuda" if spec.cuda else "cpu")
        view.zero_()
        if fill:
            index = torch.cartesian_prod(*(torch.arange(n) for n in shape))
            heads = torch.zeros(len(index), dtype=torch.long) if spec.mla else index[:, 1] + start
            token, element = index[:, -2], index[:, -1]
            codes = ((((layer * spec.num_blocks + index[:, 0]) * (1 if spec.mla else spec.total_heads) + heads)
                      * spec.tokens + token) * spec.dim + element) + 1
            view.copy_(codes.to(torch.float32).view(shape).to(view.device))
        views.append(view)
    return views


def _problems(spec: PairSpec, views: list[torch.Tensor], tp_rank: int, loaded: bool) -> list[str]:
    """What differs from the producer's codes in the loaded blocks, or from zero elsewhere."""
    start, _ = spec.sharding(spec.consumer_tp).heads(tp_rank)
    host = PairSpec(**{**spec.__dict__, "shm": False, "cuda": False})
    expected = _views(host, 0, 1, fill=True) if spec.mla else None
    problems = []
    for layer, view in enumerate(views):
        view = view.cpu()
        for block in range(spec.num_blocks):
            got = view[block]
            if loaded and block in spec.local_ids:
                remote = spec.remote_ids[spec.local_ids.index(block)]
                if spec.mla:
                    want = expected[layer][remote]
                else:
                    heads = torch.arange(start, start + got.shape[0]).view(-1, 1, 1)
                    want = ((((layer * spec.num_blocks + remote) * spec.total_heads + heads) * spec.tokens
                             + torch.arange(spec.tokens).view(1, -1, 1)) * spec.dim
                            + torch.arange(spec.dim).view(1, 1, -1) + 1)
                if not torch.equal(got, want.to(torch.float32)):
                    problems.append(f"layer {layer} block {block}: {got.flatten()[:4].tolist()}... expected "
                                    f"{want.flatten()[:4].tolist()}...")
            elif got.abs().sum() != 0:
                problems.append(f"layer {layer} block {block} was written")
    return problems


def _member(spec: PairSpec, address: str, token: str, instance: str, tp_rank: int, tp_size: int,
            fill: bool) -> tuple[kv.KVMember, list[torch.Tensor]]:
    os.environ["TENSORWIRE_JOB_TOKEN"] = token  # this spawned process's own environment
    views = _views(spec, tp_rank, tp_size, fill)
    member = kv.KVMember(views, instance=instance, tp_rank=tp_rank, sharding=spec.sharding(tp_size),
                         layout=spec.layout, heads_outermost=True, directory=address, timeout_s=30.0)
    return member, views


def handoff_of(spec: PairSpec, issued_at: float, request: int = 0) -> kv.Handoff:
    return kv.Handoff("prefill", spec.remote_ids, f"p-{request}", len(spec.remote_ids) * spec.tokens, spec.layout, "",
                      issued_at, issued_at + _WAIT_S * 2, spec.producer_tp)


def producer_rank(spec: PairSpec, address: str, token: str, tp_rank: int, issued_at: float, out: mp.Queue,
                  stop: mp.Event) -> None:
    """A producer rank: hold the requests' blocks, say when they were all released, stay until ``stop``."""
    member, _ = _member(spec, address, token, "prefill", tp_rank, spec.producer_tp, fill=True)
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


def consumer_rank(spec: PairSpec, address: str, token: str, instance: str, tp_rank: int, tp_size: int,
                  issued_at: float, claim: str, out: mp.Queue) -> None:
    """A consumer rank: load the requests one after the other (claim ``<claim>-<request>``, the same at every
    rank), check every byte, report (rank, first error reason, transport, problems, claim and transfer seconds of
    each load)."""
    consumer_spec = PairSpec(**{**spec.__dict__, "consumer_tp": tp_size})
    member, views = _member(consumer_spec, address, token, instance, tp_rank, tp_size, fill=False)
    consumer = kv.Consumer(member, timeout_s=30.0)
    results = []
    for request in range(spec.requests):
        load = kv.Load(f"c-{request}", spec.local_ids, handoff_of(spec, issued_at, request), claim=f"{claim}-{request}")
        results += consumer.load([load])
    failed = next((r for r in results if r.error), None)
    problems = _problems(consumer_spec, views, tp_rank, loaded=failed is None)
    out.put(("loaded", tp_rank, failed.reason if failed else "", results[0].transport, problems,
             [r.claim_s for r in results], [r.transfer_s for r in results]))
    consumer.close()
    member.close()


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
