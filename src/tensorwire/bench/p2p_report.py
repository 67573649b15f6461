"""Reporting of ``tensorwire bench p2p``: the comparisons and the summary against the goals, the aligned text
table and the JSON document. Measuring lives in ``p2p_rank.py``; the JSON header (``header``, re-exported
here) in ``command.py``, shared by every benchmark."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .command import header, header_lines
from .p2p_records import (
    COPY,
    COPY_SYNC,
    IDLE_BYTES,
    RAW,
    STREAM_ORDERED,
    TENSORWIRE,
    TENSORWIRE_GRAPH,
    TENSORWIRE_IN_PROCESS,
    TENSORWIRE_NIXL,
    TENSORWIRE_PATHS,
    TENSORWIRE_STREAM,
    BenchConfig,
    BenchResult,
    Record,
    format_size,
)
from .partial import Table
from .record import STEADY_SPREAD, records_to_json

__all__ = ["TITLE", "TABLE", "header", "method_rows", "comparisons", "summary", "case_lines", "format_report",
           "tail_lines", "to_json"]

TITLE = "tensorwire bench p2p: rank 0 -> rank 1, two local processes"

_ROW_ORDER = (TENSORWIRE, TENSORWIRE_STREAM, TENSORWIRE_GRAPH, TENSORWIRE_IN_PROCESS, TENSORWIRE_NIXL, RAW, COPY,
              COPY_SYNC)


# --- reporting ---------------------------------------------------------------------------------------
def _cases(records: list[Record]) -> dict[tuple[str, str, int], dict[str, Record]]:
    cases: dict[tuple[str, str, int], dict[str, Record]] = {}
    for r in records:
        cases.setdefault((r.memory, r.op, r.nbytes), {})[r.path] = r
    return cases


def comparisons(records: list[Record]) -> list[dict[str, Any]]:
    """Per (memory, op, size) and tensorwire row: its bandwidth over the copy's (higher is better: the
    record's ``ratio``, its reference being the copy) and its time over raw NIXL's (lower is better)."""
    out = []
    for (memory, op, size), paths in _cases(records).items():
        raw = paths.get(RAW)
        for name in TENSORWIRE_PATHS:
            tw = paths.get(name)
            if tw is None:
                continue
            out.append({
                "memory": memory, "op": op, "size": size, "path": name, "transport": tw.transport,
                "bw_vs_copy": tw.ratio if tw.reference in (COPY, COPY_SYNC) else None,
                "reference": tw.reference,
                "time_vs_raw": tw.median_us / raw.median_us if raw and raw.spread <= STEADY_SPREAD else None,
            })
    return out


def summary(result: BenchResult) -> list[dict[str, Any]]:
    """The headline numbers against their goals; ``ok`` is None where a number was not measured, or its reference
    was too unsteady to hold it against."""
    cases = _cases(result.records)
    lines = [_bandwidth_line(cases.get(("cpu", "WRITE", 64 << 20), {})),
             _latency_line(cases.get(("cpu", "WRITE", 4 << 10), {}))]
    for w in result.wait_returns:
        ok = w["median_us"] < 20 and w["in_flight"] == w["reps"]
        lines.append({"name": f"wait(stream=) return, {w['transport']}", "value": w["median_us"], "goal": "< 20 us",
                      "ok": ok,
                      "text": f"wait(stream=) over {w['transport']} returned to the CPU after {w['median_us']:.1f} us "
                              f"median (p10-p90 {w['p10_us']:.1f}-{w['p90_us']:.1f}, first call {w['first_us']:.1f}) "
                              f"with a {format_size(w['size'])} {w['op']} in flight ({w['in_flight']}/{w['reps']} "
                              "still moving at return); goal < 20 us"})
    if any(r.memory == "cuda" for r in result.records):
        lines += _gpu_latency_lines(cases) + _gpu_eager_lines(cases)
    if result.idle:
        cores = max(i["cores"] for i in result.idle)
        lines.append({"name": "idle communicator CPU", "value": cores, "goal": "< 0.05 cores", "ok": cores < 0.05,
                      "text": f"idle communicator: {cores:.3f} cores (max over {len(result.idle)} ranks, "
                              f"{result.idle[0]['wall_s']:.1f} s, getrusage user+sys / wall); goal < 0.05"})
    else:
        lines.append({"name": "idle communicator CPU", "value": None, "goal": "< 0.05 cores", "ok": None,
                      "text": "idle communicator: not measured (--idle-seconds 0)"})
    return lines


def _unsteady(reference: Record) -> str:
    return (f"{reference.path} unsteady (p10-p90 spread {reference.spread:.0%} of its median, over "
            f"{STEADY_SPREAD:.0%}): not compared; run again on a quiet machine")


def _bandwidth_line(big: dict[str, Record]) -> dict[str, Any]:
    """64 MiB host WRITE: tensorwire's bandwidth over the one-thread copy's (goal >= 0.6)."""
    line = {"name": "64 MiB cpu WRITE bandwidth vs copy", "value": None, "goal": ">= 0.6", "ok": None}
    if TENSORWIRE not in big or COPY not in big:
        return {**line, "text": "64 MiB cpu WRITE: not measured (add 64M to --sizes and cpu to --memory)"}
    tw, copy = big[TENSORWIRE], big[COPY]
    if tw.ratio is None:
        return {**line, "text": f"64 MiB cpu WRITE: tensorwire {tw.gbps:.2f} GB/s; {_unsteady(copy)}"}
    return {**line, "value": tw.ratio, "ok": tw.ratio >= 0.6,
            "text": f"64 MiB cpu WRITE: tensorwire {tw.gbps:.2f} GB/s = {tw.ratio:.2f}x copy ({copy.gbps:.2f} GB/s, "
                    "1 thread); goal >= 0.6x"}


def _latency_line(small: dict[str, Record]) -> dict[str, Any]:
    """4 KiB host WRITE: tensorwire's median (goal <= 10 us) and its time over raw NIXL's (goal <= 1.1x)."""
    line = {"name": "4 KiB cpu WRITE latency", "value": None, "goal": "<= 10 us, <= 1.1x raw", "ok": None}
    if TENSORWIRE not in small or RAW not in small:
        return {**line, "text": "4 KiB cpu WRITE: not measured (add 4K to --sizes and cpu to --memory)"}
    us, raw = small[TENSORWIRE].median_us, small[RAW]
    if raw.spread > STEADY_SPREAD:
        return {**line, "value": us, "text": f"4 KiB cpu WRITE: tensorwire {us:.2f} us median; {_unsteady(raw)}"}
    ratio = us / raw.median_us
    return {**line, "value": us, "ratio_vs_raw": ratio, "ok": us <= 10 and ratio <= 1.1,
            "text": f"4 KiB cpu WRITE: tensorwire {us:.2f} us median (goal <= 10 us) = {ratio:.2f}x raw nixl's "
                    f"{raw.median_us:.2f} us (goal <= 1.1x)"}


def _gpu_latency_lines(cases: dict[tuple[str, str, int], dict[str, Record]]) -> list[dict[str, Any]]:
    """4 KiB on the GPU, post to completion seen on the stream, from a CUDA graph (goal <= 10 us of GPU
    time); the text puts the CPU's wall clock for ``post()`` + ``wait()`` beside it."""
    lines = []
    for op in ("READ", "WRITE"):
        case = cases.get(("cuda", op, 4 << 10), {})
        name = f"4 KiB cuda {op} GPU time, post to completion on the stream"
        if TENSORWIRE_GRAPH not in case:
            chosen = case.get(TENSORWIRE)
            if chosen is not None and chosen.transport not in STREAM_ORDERED:
                why = f"tensorwire chose {chosen.transport}, which is not stream-ordered"
            else:
                why = "add --graphs" if case else "add 4K to --sizes, and --graphs"
            lines.append({"name": name, "value": None, "goal": "<= 10 us", "ok": None,
                          "text": f"4 KiB cuda {op}: not measured from a graph ({why})"})
            continue
        graph = case[TENSORWIRE_GRAPH]
        others = "".join(f"; {path} {case[path].median_us:.1f} us"
                         for path in (TENSORWIRE_STREAM, COPY) if path in case)
        cpu = case.get(TENSORWIRE)
        cpu_text = (f"; the CPU's wall clock for post() + wait(): {cpu.median_us:.1f} us" if cpu is not None else "")
        lines.append({"name": name, "value": graph.median_us, "goal": "<= 10 us", "ok": graph.median_us <= 10,
                      "text": f"4 KiB cuda {op} over {graph.transport}, post to completion on the stream, GPU time "
                              f"(launches queued ahead): graph {graph.median_us:.1f} us median (p90 "
                              f"{graph.p90_us:.1f}){others}{cpu_text}; goal <= 10 us"})
    return lines


def _gpu_eager_lines(cases: dict[tuple[str, str, int], dict[str, Record]]) -> list[dict[str, Any]]:
    """Eager ``post()`` + ``wait()`` on GPU memory, the CPU's wall clock, against the copy and a sync of its stream
    measured alongside: 64 MiB at >= 0.9x its bandwidth, 4 KiB in <= 8 us."""
    lines = []
    for op in ("READ", "WRITE"):
        big, small = cases.get(("cuda", op, 64 << 20), {}), cases.get(("cuda", op, 4 << 10), {})
        name = f"64 MiB cuda {op} eager post()+wait() vs copy + sync"
        line = {"name": name, "value": None, "goal": ">= 0.9x", "ok": None}
        if TENSORWIRE not in big or COPY_SYNC not in big:
            lines.append({**line, "text": f"64 MiB cuda {op} eager: not measured (add 64M to --sizes)"})
        elif big[TENSORWIRE].ratio is None:
            lines.append({**line, "text": f"64 MiB cuda {op} eager: {_unsteady(big[COPY_SYNC])}"})
        else:
            tw, reference = big[TENSORWIRE], big[COPY_SYNC]
            lines.append({**line, "value": tw.ratio, "ok": tw.ratio >= 0.9,
                          "text": f"64 MiB cuda {op} eager post()+wait() over {tw.transport}: {tw.median_us:.1f} us = "
                                  f"{tw.ratio:.2f}x the copy + sync ({reference.median_us:.1f} us); goal >= 0.9x"})
        name = f"4 KiB cuda {op} eager post()+wait() wall time"
        if TENSORWIRE not in small:
            lines.append({"name": name, "value": None, "goal": "<= 8 us", "ok": None,
                          "text": f"4 KiB cuda {op} eager: not measured (add 4K to --sizes)"})
            continue
        tw = small[TENSORWIRE]
        reference = small.get(COPY_SYNC)
        beside = f"; copy + sync {reference.median_us:.1f} us" if reference is not None else ""
        lines.append({"name": name, "value": tw.median_us, "goal": "<= 8 us", "ok": tw.median_us <= 8,
                      "text": f"4 KiB cuda {op} eager post()+wait() over {tw.transport}: {tw.median_us:.1f} us median "
                              f"(p90 {tw.p90_us:.1f}){beside}; goal <= 8 us"})
    return lines


def format_report(result: BenchResult, head: dict[str, Any], config: BenchConfig, with_header: bool = True) -> str:
    """The whole report at once: the header (unless ``with_header`` is False), the table, then ``tail_lines``."""
    out = (_setup_lines(result, head, config) + [""] if with_header else []) + _table_lines(result.records)
    return "\n".join(out + tail_lines(result))


def tail_lines(result: BenchResult, interrupted: bool = False) -> list[str]:
    """What follows the table: the legend, the conditions of the run, the idle line and, last, the summary against
    the goals; of a run cut short, the legend alone (the rest would speak of what was not measured)."""
    out = [
        "",
        "  BW/copy = tensorwire GB/s / copy GB/s (higher is better); time/raw = tensorwire us / raw nixl us",
        "  (lower is better); GB/s = 1e9 bytes/s at the median; via = the transport that moved the bytes;",
        f"  unsteady = the reference's p10-p90 spread exceeded {STEADY_SPREAD:.0%} of its median: no ratio taken",
    ]
    if interrupted:
        return out
    out += _conditions_lines(result)
    out.append("")
    for line in summary(result):
        tag = {True: "[ok]  ", False: "[MISS]", None: "[n/a] "}[line["ok"]]
        out.append(f"{tag} {line['text']}")
    return out


def _setup_lines(result: BenchResult, head: dict[str, Any], config: BenchConfig) -> list[str]:
    """What ran where: the machine, the software, how each path and the timing were done (wrapped)."""
    return header_lines(TITLE, head, method_rows(config, result.raw_config, result.progress_wakeup_ms,
                                                 result.default_threads), ucx=result.ucx_version)


def method_rows(config: BenchConfig, raw_config: str, wakeup_ms: float, threads: int) -> list[tuple[str, str]]:
    """How each path and the timing are done (the header's method rows)."""
    budget = config.budget
    timing = (f"{budget.iters} calls" if budget.iters else f">= {budget.min_reps} calls and >= {budget.time_s:g} s")
    timing += f" per path, the transfer paths alternating in {budget.rounds} rounds"
    return [
        ("tensorwire", f"post() + wait() on one prepared handle; progress thread wakes every {wakeup_ms:g} ms when "
                       "idle"),
        ("raw nixl", f"{raw_config}; initialize_xfer once, then transfer() + tight check_xfer_state loop"),
        ("copy", f"dst.copy_(src) inside rank 0; host: 1 thread (torch's default {threads} threads in the JSON as "
                 "copy-mt); GPU: CUDA events, each chunk of calls queued before the GPU starts it"),
        ("copy + sync", "GPU: dst.copy_(src) then a sync of its stream, on the wall clock, timed alongside the eager "
                        "post() + wait() rows, which are held against it"),
        ("timing", f"{budget.warmup_s:g} s warm-up, then {timing}; each call timed alone; median, p10, p90; a copy "
                   f"spread over {STEADY_SPREAD:.0%} is measured again (3 tries), then flagged 'unsteady'"),
    ]


_COLUMNS = ("memory", "op", "size", "path", "via", "median us", "p10 us", "p90 us", "GB/s", "BW/copy", "time/raw")
# Fixed widths, so that a case printed as soon as it is measured lines up with those before it; a longer cell
# pushes only its own row. The first five columns are text (left-aligned), the others numbers.
_WIDTHS = (6, 5, 7, 23, 8, 10, 10, 10, 7, 19, 8)


def _table_lines(records: list[Record]) -> list[str]:
    """The column names, then every case's rows (``case_lines``)."""
    out = [_aligned(list(_COLUMNS))]
    for paths in _cases(records).values():
        out += case_lines(list(paths.values()))
    return out


def case_lines(records: list[Record]) -> list[str]:
    """The rows of one (memory, op, size) case, after a blank line: one row per path, in a fixed order."""
    ratios = {(c["memory"], c["op"], c["size"], c["path"]): c for c in comparisons(records)}
    out = [""]
    for (memory, op, size), paths in _cases(records).items():
        first = True
        for path in _ROW_ORDER:
            r = paths.get(path)
            if r is None:
                continue
            c = ratios.get((memory, op, size, path), {})
            out.append(_aligned([
                memory if first else "", op if first else "", format_size(size) if first else "", path, r.transport,
                f"{r.median_us:.2f}", f"{r.p10_us:.2f}", f"{r.p90_us:.2f}", f"{r.gbps:.2f}",
                r.ratio_text() + ("" if r.reference == COPY or not r.reference else f" ({r.reference})")
                if r.reference in (COPY, COPY_SYNC) else "",
                _time_vs_raw(c, paths.get(RAW)),
            ]))
            first = False
    return out


def _aligned(cells: list[str]) -> str:
    return "  ".join(cell.ljust(w) if i < 5 else cell.rjust(w)
                     for i, (cell, w) in enumerate(zip(cells, _WIDTHS))).rstrip()


TABLE = Table([_aligned(list(_COLUMNS))], case_lines)


def _time_vs_raw(comparison: dict[str, Any], raw: Record | None) -> str:
    if comparison.get("time_vs_raw"):
        return f"{comparison['time_vs_raw']:.2f}x"
    return "unsteady" if comparison and raw is not None else ""


def _conditions_lines(result: BenchResult) -> list[str]:
    """What else used the machine meanwhile, and the idle communicator's CPU per rank."""
    out = []
    other, steal = result.others.get("other_cores"), result.others.get("steal_cores")
    if other is not None:
        disturbed = other >= 0.1 or steal >= 0.1
        advice = "; these timings are disturbed, run again on a quiet machine" if disturbed else ""
        out.append(f"  {'!!! ' if disturbed else ''}meanwhile other processes used {other:.2f} cores and the "
                   f"hypervisor stole {steal:.2f}{advice}")
    if result.idle:
        per_rank = ", ".join(f"rank {i['rank']} {i['cores']:.3f}" for i in result.idle)
        out.append(f"  idle CPU: {per_rank} cores over {result.idle[0]['wall_s']:.1f} s "
                   f"(connected communicator, {format_size(IDLE_BYTES)} registered)")
    return out


def to_json(result: BenchResult, head: dict[str, Any], config: BenchConfig) -> dict[str, Any]:
    """Every record, with the header and the configuration they were measured under."""
    return {
        "header": {
            **head,
            "raw_nixl": result.raw_config,
            "tensorwire_progress_wakeup_ms": result.progress_wakeup_ms,
            "copy": (f"dst.copy_(src) in rank 0; copy: 1 thread, copy-mt: {result.default_threads} threads; cuda: CUDA "
                     "events, calls queued ahead of the GPU"),
            "budget": asdict(config.budget),
            "memories": list(config.memories),
            "ucx_version": result.ucx_version,
            "during_run": result.others,
        },
        "records": records_to_json(result.records),
        "comparisons": comparisons(result.records),
        "idle": result.idle,
        "wait_returns": result.wait_returns,
        "summary": summary(result),
    }
