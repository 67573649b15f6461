"""``tensorwire bench kv --tp P:D,...``: a request's KV handoff from a producer engine at TP P to a consumer engine at
TP D (``tensorwire.kv``), every rank a local process of one fleet, beside the homogeneous pair (D:D) that reads
the same bytes into the same consumer ranks.

A request is one ``kv.Consumer.load`` of ``blocks`` random ids of a 2-layer cache of 8 KV heads (``tokens x dim``
float32 per head per block, K and V views laid out as vLLM lays them on GPUs, in the ``--orders`` asked), at every
consumer rank at once: the claims and, beside them, one READ per source rank (head ranges of every block when P
differs from D: one descriptor per block and view in ``HND``, one per token in ``NHD``, one per row where the orders
differ). Its time is the slowest consumer rank's load, claims to the last READ, per request, ``requests`` of them in
a row; the claim's round trip is reported beside it. Every byte is checked after the
last request. Host memory over NIXL (``--memory`` is ignored: the head split runs the same code on GPU memory).
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
from collections.abc import Callable
from typing import Any

from .command import announce, check_plot, finish, header, header_lines, progress
from .record import Record
from .timing import summarize

__all__ = ["main_tp", "run_pairs", "parse_pairs", "parse_orders", "KV_HEADS"]

ORDERS = ("HND", "NHD")

LAYERS, KV_HEADS, TOKENS, DIM, NUM_BLOCKS, BLOCKS, REQUESTS = 2, 8, 16, 64, 512, 256, 10
TITLE = "tensorwire bench kv --tp: KV handoffs between engines of different tensor parallelism, local processes"


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"2:1,1:2"`` as [(2, 1), (1, 2)]; ``ArgumentTypeError`` naming the fix."""
    pairs = []
    for item in text.split(","):
        try:
            producer, consumer = (int(x) for x in item.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: give PRODUCER_TP:CONSUMER_TP pairs, e.g. 2:1,1:2") from None
        if not (1 <= producer <= 8 and 1 <= consumer <= 8) or (max(producer, consumer) % min(producer, consumer)):
            raise argparse.ArgumentTypeError(f"{item!r}: TP sizes from 1 to 8, one dividing the other")
        pairs.append((producer, consumer))
    return pairs


def parse_orders(text: str) -> list[tuple[str, str]]:
    """``"HND,NHD,HND:NHD"`` as [(HND, HND), (NHD, NHD), (HND, NHD)] (producer, consumer); ``ArgumentTypeError``."""
    orders = []
    for item in text.split(","):
        sides = item.upper().split(":")
        if len(sides) == 1:
            sides *= 2
        if len(sides) != 2 or any(side not in ORDERS for side in sides):
            raise argparse.ArgumentTypeError(f"{item!r}: give HND, NHD or PRODUCER:CONSUMER of them, e.g. HND:NHD")
        orders.append((sides[0], sides[1]))
    return orders


def _spec(producer_tp: int, consumer_tp: int, orders: tuple[str, str], seed: int) -> Any:
    from ..testing.kv_pools import PairSpec  # torch: not for --help

    rng = random.Random(seed)
    return PairSpec(producer_tp, consumer_tp, KV_HEADS, num_blocks=NUM_BLOCKS,
                    remote_ids=tuple(rng.sample(range(NUM_BLOCKS), BLOCKS)),
                    local_ids=tuple(rng.sample(range(NUM_BLOCKS), BLOCKS)), tokens=TOKENS, dim=DIM, requests=REQUESTS,
                    producer_order=orders[0], consumer_order=orders[1])


def _record(producer_tp: int, consumer_tp: int, orders: tuple[str, str], report: dict) -> Record:
    loaded = report["loaded"]
    problems = [f"rank {r}: {reason or 'wrong bytes'}" for r, (reason, _, wrong, *_) in loaded.items()
                if reason or wrong]
    if problems:
        raise RuntimeError(f"bench kv --tp {producer_tp}:{consumer_tp}: {'; '.join(problems)}")
    claims = [max(values) for values in zip(*(row[3] for row in loaded.values()))]
    transfers = [max(values) for values in zip(*(row[4] for row in loaded.values()))]
    # A load's claim and READ overlap: its cost to the request is from the claims to the last READ's end.
    requests = [max(values) for values in zip(*(row[5] for row in loaded.values()))][1:]  # the first sets up
    nbytes = BLOCKS * LAYERS * 2 * KV_HEADS * TOKENS * DIM * 4  # K and V of every head of every block, all ranks
    transport = next(iter(loaded.values()))[1]
    path = f"handoff TP {producer_tp}->{consumer_tp}" + ("" if orders == ("HND", "HND") else " {}->{}".format(*orders))
    return Record.measured("kv", "cpu", "READ", path, transport, nbytes,
                           summarize(requests), blocks=BLOCKS, producer_tp=producer_tp, consumer_tp=consumer_tp,
                           producer_order=orders[0], consumer_order=orders[1],
                           claim_median_us=statistics.median(claims[1:]) * 1e6,
                           first_request_us=(claims[0] + transfers[0]) * 1e6)


def run_pairs(pairs: list[tuple[int, int]], say: Callable[[str], None], measured: Callable[[Record], None],
              orders: list[tuple[str, str]] = (("HND", "HND"),)) -> list[Record]:
    """Measure each pair at each (producer, consumer) order after its homogeneous reference (D:D, same orders), held
    against it; ``measured(record)`` as each is. Blocks (minutes on 2 cores); Ctrl-C (KeyboardInterrupt) stops at
    once, the records so far handed over."""
    from ..testing.kv_pools import run_pair  # torch: not for --help
    from .vllm_parties import start_directory

    token = secrets.token_hex(16)
    directory, address = start_directory(token)
    records: dict[tuple, Record] = {}
    try:
        for order in orders:
            for producer_tp, consumer_tp in dict.fromkeys([p for pair in pairs for p in ((pair[1], pair[1]), pair)]):
                say(f"TP {producer_tp} -> {consumer_tp}, {order[0]} -> {order[1]}: {REQUESTS} requests of {BLOCKS} "
                    "blocks")
                spec = _spec(producer_tp, consumer_tp, order, seed=producer_tp * 10 + consumer_tp)
                record = _record(producer_tp, consumer_tp, order, run_pair(spec, address, token))
                if producer_tp != consumer_tp:
                    record = record.against(records[consumer_tp, consumer_tp, order])
                records[producer_tp, consumer_tp, order] = record
                measured(record)
    finally:
        directory.close()
    return list(records.values())


HEADING = (f"{'pair':<20} {'via':<6} {'request median us':>18} {'p10':>9} {'p90':>9} {'claim us':>9} {'GB/s':>7} "
           f"{'vs D:D':>7}")
LEGEND = ["", f"request = every consumer rank's load, its claims with its READs beside them, of {BLOCKS} random "
          f"blocks x {LAYERS} layers x K/V x {KV_HEADS} heads x {TOKENS * DIM * 4 // 1024} KiB (the slowest rank's), "
          "the first request left out; claim = the claims' round trip (overlapping the READs); vs D:D = GB/s over "
          "the homogeneous pair at the consumer's TP and the same orders"]


def row(r: Record) -> str:
    return (f"{r.path:<20} {r.transport:<6} {r.median_us:18.1f} {r.p10_us:9.1f} {r.p90_us:9.1f} "
            f"{r.params['claim_median_us']:9.1f} {r.gbps:7.2f} {r.ratio_text():>7}")


def main_tp(args: argparse.Namespace) -> int:
    """``bench kv --tp``: the header, each pair's row as it is measured, the legend; ``--json`` / ``--plot``.
    Ctrl-C keeps the rows measured (exit 130)."""
    check_plot(args)
    head = header(args.argv)
    announce(header_lines(TITLE, head, [("pairs", ", ".join(f"{p}:{d} (and {d}:{d})" for p, d in args.tp)),
                                        ("orders", ", ".join(f"{p}:{c}" for p, c in args.orders)),
                                        ("timing", "the slowest consumer rank's load (claims and READs) per request, "
                                                   f"median, p10, p90 of {REQUESTS - 1} requests after the first")]))
    print(HEADING, flush=True)
    records: list[Record] = []

    def measured(record: Record) -> None:
        records.append(record)
        print(row(record), flush=True)

    interrupted = False
    try:
        run_pairs(args.tp, lambda text: progress("kv", text, args.quiet), measured, args.orders)
    except KeyboardInterrupt:
        interrupted = True
        if not records:
            print("bench kv: interrupted before any pair was measured", flush=True)
    return finish(args, head, records, LEGEND, plot_pairs, interrupted)


def plot_pairs(records: list[Record], path) -> None:
    """Request time per pair (bars), the claim's share hatched. A small PNG."""
    from .plot import require_matplotlib

    pyplot = require_matplotlib()
    figure, axis = pyplot.subplots(figsize=(7, 3.2), dpi=80)
    names = [r.path.removeprefix("handoff ") for r in records]
    axis.bar(names, [r.median_us / 1e3 for r in records], label="claim + READ (median)")
    axis.bar(names, [r.params["claim_median_us"] / 1e3 for r in records], hatch="//", label="claim round trip")
    axis.set_ylabel("ms per request", fontsize=9)
    axis.set_title(f"tensorwire bench kv --tp: {BLOCKS} blocks x {LAYERS} layers x {KV_HEADS} heads, host memory",
                   fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)
