"""``tensorwire bench vllm``: vLLM's disaggregated prefill/decode with TensorwireConnector beside vLLM's own
NixlConnector, on the same tiny random-weights Llama (float32), block size and prompts, one pair at a time.

Per connector a producer and a consumer instance (``vllm_parties``) are started; TensorwireConnector's meet in
a ``tensorwire directory``, NixlConnector gets its best configuration here (``num_threads`` 0: vLLM's default of
4 threads saturates 2 cores, 3.9 s against ~0.5 ms per transfer). For each row (prompt length x concurrent
requests), ``--reps`` times with fresh prompts (no prefix-cache hit anywhere): the producer prefills them
(``max_tokens=1``, timed: the producer's time), the consumer loads their KV and samples one token (timed: the
consumer's time to first token), and the consumer's connector reports its transfers (``get_kv_connector_stats``,
recorded the same way for both: ``transfer_duration`` and ``bytes_transferred``). Figures per row, medians:

- transfer time per request: the connector's reported transfer time of the rep over its requests (NixlConnector
  reads each request apart; TensorwireConnector one READ per producer per engine step);
- bytes per request; consumer TTFT; the producer's time for the handed-off prefill against a plain run of the
  same row on the same instance (other prompts of the same lengths, no ``kv_transfer_params``, just before it:
  the same engine, load and neighbours, only the connector's part differs);
- first contact: the first remote request of a fresh pair's TTFT (after a local warm-up request on each
  instance) minus the median TTFT of the same row later.

Each connector reports its own transfer time: TensorwireConnector's is post to completion on its loader thread;
NixlConnector's is NIXL's telemetry, post to the completion that its ``get_finished`` polls once per engine step,
so it includes part of a step. The consumer's TTFT is the end-to-end figure that holds the same for both.

Like every benchmark: a header (machine, versions, method) and a progress line per rep on stderr; Ctrl-C kills the
instances at once and reports the reps measured so far (exit 130); a NixlConnector row whose transfer times spread
over 20% (p10 to p90 of the median) is flagged ``unsteady``, not divided by. Needs an interpreter with vLLM
(``TENSORWIRE_VLLM_PYTHON``, default ``.venv-vllm/bin/python``): without one the command fails at once, saying so.
The default run takes about 10 minutes on a 2-core machine (two vLLM instances start in about a minute a pair).
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError, TransferError
from .command import announce, at_least, check_plot, finish, header, header_lines, list_of, progress
from .record import Record
from .timing import quantile
from .vllm_parties import Party, make_model, start_directory, start_instance, vllm_python, wait_ready

__all__ = ["HELP", "VllmBenchConfig", "run", "add_arguments", "main", "format_report", "plot_vllm", "method_rows"]

HELP = "vLLM prefill -> decode: TensorwireConnector beside vLLM's NixlConnector (vLLM's CPU build)"
TITLE = "tensorwire bench vllm: vLLM prefill -> decode, TensorwireConnector beside vLLM's NixlConnector"

CONNECTORS = ("tensorwire", "nixl")
REFERENCE = "nixl"
MAX_TOKENS = 1
PLAIN_SEEDS = 10**9  # added to a row's seed: prompts of the producer's plain run, never those of a remote one


@dataclass(frozen=True)
class VllmBenchConfig:
    lengths: tuple[int, ...] = (256, 512, 992)
    concurrency: tuple[int, ...] = (1, 4)
    reps: int = 5
    block_size: int = 128
    connectors: tuple[str, ...] = CONNECTORS
    timeout_s: float = 300.0  # per answer of an instance (startup: twice that)
    quiet: bool = False


def _prompts(length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


def _seed(rep: int, length: int, count: int) -> int:
    """The prompts of one rep of one row: the same for every pair."""
    return (rep * 10_000 + length) * 100 + count


def _rows(config: VllmBenchConfig) -> list[tuple[int, int]]:
    return [(length, count) for count in config.concurrency for length in config.lengths]


class _Bench:
    """One run. ``measured``: connector -> row -> observations per rep, filled as reps end (what Ctrl-C reports)."""

    def __init__(self, config: VllmBenchConfig, python: str, model: str) -> None:
        self.config, self.python, self.model = config, python, model
        self.measured: dict[str, dict[tuple[int, int], dict[str, list]]] = {}

    def say(self, text: str) -> None:
        progress("vllm", text, self.config.quiet)

    def flags(self) -> tuple[str, ...]:
        return ("--block-size", str(self.config.block_size), "--kv-mb", "256")

    def pair(self, connector: str) -> None:
        """Every row of one connector's pair into ``measured[connector]``: observations per rep, and the first
        request's TTFT. On Ctrl-C the instances are killed at once (they run in sessions of their own: the
        terminal's SIGINT does not reach them)."""
        token = secrets.token_hex(16)
        directory, address = start_directory(token) if connector == "tensorwire" else (None, None)
        ports = [str(p) for p in random.Random().sample(range(20000, 30000), 2)]
        parties: list[Party] = []
        try:
            for role, port in zip(("producer", "consumer"), ports):
                parties.append(start_instance(
                    self.python, f"{connector}-{role}", self.model, role, connector=connector, directory=address,
                    token=token, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": port}, flags=self.flags()))
            startup = wait_ready(parties, 2 * self.config.timeout_s)
            self.say(f"{connector}: producer and consumer up ({startup[0]:.0f} s, {startup[1]:.0f} s)")
            self._measure(connector, *parties)
        except KeyboardInterrupt:
            for party in parties:
                party.kill()
            raise
        finally:
            for party in parties:
                party.close()
            if directory is not None:
                directory.close()

    def _measure(self, connector: str, producer: Party, consumer: Party) -> None:
        rows = self.measured.setdefault(connector, {})
        self._warm_up(producer)
        self._warm_up(consumer)
        first = _rows(self.config)[0]
        first_ttft = self._once(producer, consumer, *first, seed=-1)["ttft_s"]
        for rep in range(self.config.reps):
            seen = {(length, count): self._once(producer, consumer, length, count, seed=_seed(rep, length, count))
                    for length, count in _rows(self.config)}
            for key, observed in seen.items():  # a rep counts whole: rows stay comparable after Ctrl-C
                row = rows.setdefault(key, {"first_ttft_s": [first_ttft]} if key == first else {})
                for name, value in observed.items():
                    row.setdefault(name, []).append(value)
            self.say(f"{connector}: rep {rep + 1}/{self.config.reps}: "
                     + ", ".join(f"{length}x{count} {seen[length, count]['transfer_s'] * 1e3:.2f} ms"
                                 for length, count in seen))

    def _warm_up(self, instance: Party) -> None:
        """A local request (no transfer): the engine's first forward is slow, and would count as first contact."""
        prompts = _prompts(max(self.config.lengths), max(self.config.concurrency), seed=-2)
        instance.ask({"op": "generate", "prompts": prompts, "max_tokens": 2}, self.config.timeout_s)

    def _once(self, producer: Party, consumer: Party, length: int, count: int, seed: int) -> dict[str, Any]:
        timeout = self.config.timeout_s
        prompts = _prompts(length, count, seed)
        consumer.ask({"op": "stats"}, timeout)  # what earlier requests left
        plain = producer.ask({"op": "generate", "prompts": _prompts(length, count, seed + PLAIN_SEEDS),
                              "max_tokens": 1}, timeout)
        made = producer.ask({"op": "generate", "prompts": prompts, "max_tokens": 1,
                             "params": [{"do_remote_decode": True}] * count}, timeout)
        params = [out["kv_transfer_params"] for out in made["outputs"]]
        if not all(params):
            raise TransferError(f"bench vllm: the producer handed off {params}; its connector did not run")
        used = consumer.ask({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS, "params": params},
                            timeout)
        stats = consumer.ask({"op": "stats"}, timeout)["stats"]
        failed = sum(1 for out in used["outputs"] if out["finish_reason"] == "error")
        failed += len(stats.get("num_failed_transfers", [])) + len(stats.get("num_failed_handshakes", []))
        return {"ttft_s": used["wall_s"], "producer_s": made["wall_s"], "plain_s": plain["wall_s"], "failed": failed,
                "transfer_s": sum(stats.get("transfer_duration", [])) / count,
                "bytes": sum(stats.get("bytes_transferred", [])) / count,
                "transfers": len(stats.get("transfer_duration", []))}


def run(config: VllmBenchConfig) -> tuple[list[Record], bool]:
    """Measure every row for every connector: ``(records, interrupted)``, where Ctrl-C ends the run with the reps
    measured so far. Blocks for the whole run; every process it started is gone when it returns.
    ``BackendUnavailableError`` at once where vLLM is not installed."""
    python, why = vllm_python()
    if python is None:
        raise BackendUnavailableError(f"bench vllm: vLLM is not installed: {why}")
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="tw-bench-vllm-") as work:
        bench = _Bench(config, python, f"{work}/llama")
        try:
            make_model(python, bench.model, seed=0)
            for connector in config.connectors:
                bench.say(f"{connector}: starting a producer and a consumer")
                bench.pair(connector)
        except KeyboardInterrupt:
            interrupted = True
            print("bench vllm: interrupted; reporting the reps measured so far", file=sys.stderr, flush=True)
    return _records(config, bench.measured), interrupted


def _records(config: VllmBenchConfig, measured: dict) -> list[Record]:
    records = []
    for connector, rows in measured.items():
        for (length, count), row in ((k, v) for k, v in rows.items() if "transfer_s" in v):
            transfer = sorted(row["transfer_s"])
            ttft = statistics.median(row["ttft_s"])
            params = {"prompt_tokens": length, "requests": count, "block_size": config.block_size,
                      "ttft_ms": ttft * 1e3, "producer_ms": statistics.median(row["producer_s"]) * 1e3,
                      "plain_prefill_ms": statistics.median(row["plain_s"]) * 1e3,
                      "failed": sum(row["failed"]), "transfers_per_rep": statistics.median(row["transfers"])}
            params["producer_overhead"] = params["producer_ms"] / params["plain_prefill_ms"]
            if "first_ttft_s" in row:
                params["first_contact_ms"] = (row["first_ttft_s"][0] - ttft) * 1e3
            nbytes = int(statistics.median(row["bytes"]))
            median = quantile(transfer, 0.5)
            records.append(Record(
                "vllm", "cpu", f"{length} tokens x{count}", connector, "nixl", nbytes, len(transfer), median * 1e6,
                quantile(transfer, 0.1) * 1e6, quantile(transfer, 0.9) * 1e6,
                nbytes / median / 1e9 if median > 0 else 0.0, params=params))
    return _against_reference(records)


def _against_reference(records: list[Record]) -> list[Record]:
    """Each record with the NixlConnector record of its row as reference: ``ratio`` its transfer time over ours
    (None when its times spread over ``STEADY_SPREAD``: ``Record.against``), and the TTFT and first-contact
    ratios in ``params``."""
    reference = {r.op: r for r in records if r.path == REFERENCE}
    out = []
    for r in records:
        ref = reference.get(r.op)
        if ref is None or r.path == REFERENCE:
            out.append(r)
            continue
        params = dict(r.params, ttft_ratio=ref.params["ttft_ms"] / r.params["ttft_ms"])
        if "first_contact_ms" in r.params and "first_contact_ms" in ref.params:
            params["first_contact_ratio"] = ref.params["first_contact_ms"] / max(r.params["first_contact_ms"], 1e-3)
        held = r.against(ref)  # the same bytes per request on both sides: GB/s over GB/s is time over time
        out.append(replace(held, reference="NixlConnector", params=params,
                           ratio=None if held.ratio is None or not r.median_us else ref.median_us / r.median_us))
    return out


def format_report(records: list[Record]) -> str:
    lines = ["row                 connector   transfer/request   bytes/request   consumer TTFT   producer vs plain"
             "   first contact   failed   transfer vs NIXL"]
    for r in sorted(records, key=lambda r: (r.params["requests"], r.params["prompt_tokens"], r.path)):
        p = r.params
        first = f"{p['first_contact_ms']:9.0f} ms" if "first_contact_ms" in p else " " * 12
        ratio = f"{r.ratio_text():>7}"
        lines.append(f"{r.op:<19} {r.path:<11} {r.median_us / 1e3:13.3f} ms {r.nbytes / 2**20:11.2f} MiB "
                     f"{p['ttft_ms']:11.0f} ms {p['producer_overhead']:15.2f}x   {first}   {p['failed']:6d}   {ratio}")
    return "\n".join(lines)


def plot_vllm(records: list[Record], path: Path, title: str) -> None:
    from .plot import require_matplotlib

    pyplot = require_matplotlib()
    rows = sorted({r.op for r in records}, key=lambda op: [int(x) for x in op.replace("x", " ").split()[::2]])
    figure, axes = pyplot.subplots(1, 2, figsize=(11, 4))
    for i, connector in enumerate(sorted({r.path for r in records})):
        by_row = {r.op: r for r in records if r.path == connector}
        xs = [j + 0.4 * i for j in range(len(rows))]
        axes[0].bar(xs, [by_row[op].median_us / 1e3 if op in by_row else 0 for op in rows], 0.4, label=connector)
        axes[1].bar(xs, [by_row[op].params["ttft_ms"] if op in by_row else 0 for op in rows], 0.4, label=connector)
    for axis, label in zip(axes, ("transfer time per request (ms)", "consumer TTFT (ms)")):
        axis.set_xticks([j + 0.2 for j in range(len(rows))], rows, rotation=30, fontsize=8)
        axis.set_ylabel(label)
        axis.set_yscale("log")  # the two connectors differ by up to 100x here
        axis.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    pyplot.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = VllmBenchConfig()
    parser.description = HELP + ". About 10 minutes on a 2-core machine with the defaults."
    from .vllm_parties import PYTHON_ENV, default_vllm_python

    parser.epilog = (f"Needs: an interpreter with vLLM (its CPU build is enough) and tensorwire and nixl installed in "
                     f"it. Looks for it at ${PYTHON_ENV}, else at {default_vllm_python()} (the checkout's "
                     ".venv-vllm); fails at once, naming the path it tried, where neither imports vLLM.")
    parser.add_argument("--lengths", type=list_of(int, minimum=1), default=defaults.lengths, metavar="N,N",
                        help="prompt lengths in tokens (default 256,512,992)")
    parser.add_argument("--concurrency", type=list_of(int, minimum=1), default=defaults.concurrency,
                        metavar="N,N", help="requests sent together (default 1,4)")
    parser.add_argument("--reps", type=at_least(int, 1), default=defaults.reps, metavar="N",
                        help="repetitions of each row; medians over them (default 5)")
    parser.add_argument("--block-size", type=at_least(int, 32), default=defaults.block_size, metavar="N",
                        help="vLLM's block size, a multiple of 32 on the CPU (default 128)")
    parser.add_argument("--connectors", type=list_of(str, CONNECTORS), default=defaults.connectors, metavar="LIST",
                        help="tensorwire, nixl or both (default tensorwire,nixl)")
    parser.add_argument("--timeout", type=at_least(float, 1), default=defaults.timeout_s, metavar="S",
                        help="give up when an instance does not answer within S seconds (default 300)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every record to PATH")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="plot to PNG (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def method_rows(config: VllmBenchConfig) -> list[tuple[str, str]]:
    """How ``bench vllm`` measures (the header's method rows)."""
    return [
        ("cases", f"prompts of {','.join(map(str, config.lengths))} tokens x {','.join(map(str, config.concurrency))} "
                  f"requests sent together, {config.reps} reps of fresh prompts; a tiny random-weights Llama, "
                  f"float32, block size {config.block_size}"),
        ("pairs", f"{' then '.join(config.connectors)}: one vLLM producer and one consumer instance (CPU build) per "
                  "connector; TensorwireConnector's meet in a tensorwire directory, NixlConnector with num_threads 0"),
        ("timing", "transfer time as each connector reports it (get_kv_connector_stats), consumer TTFT as the wall "
                   "time of its generate; medians over the reps, held against NixlConnector's row, which is flagged "
                   "'unsteady' and not divided by when its p10-p90 spread exceeds 20%"),
    ]


def main(args: argparse.Namespace) -> int:
    """Run the benchmark: the header on stdout, a line per rep on stderr, then the report; write ``--json`` /
    ``--plot``. Ctrl-C kills the instances and reports the reps measured so far (exit 130)."""
    config = VllmBenchConfig(tuple(args.lengths), tuple(args.concurrency), args.reps, args.block_size,
                             tuple(args.connectors), args.timeout, args.quiet)
    check_plot(args)
    head = header(args.argv)
    announce(header_lines(TITLE, head, method_rows(config)))
    records, interrupted = run(config)  # a row is the median of its reps: the table comes once they are all in
    return finish(args, head, records, format_report(records).splitlines(),
                  lambda records, path: plot_vllm(records, path, " ".join(["tensorwire", *args.argv])), interrupted,
                  config=config)
