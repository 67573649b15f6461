"""What ``tensorwire bench kv`` prints and plots from its records (measuring lives in ``kv.py``). A record's
case (pattern, blocks, block bytes, views, layout) and its ``post`` times are in its ``params``."""

from __future__ import annotations

from pathlib import Path

from .partial import Table
from .record import STEADY_SPREAD, Record

__all__ = ["COPY", "EAGER", "EAGER_COPY", "HEADING", "LEGEND", "TABLE", "rows", "format_report", "plot_kv"]

COPY = "contiguous copy"  # the reference of every path: the same bytes copied in one piece inside rank 0
EAGER = "tensorwire eager"  # GPU: synchronize; post(host ids); wait(); synchronize, timed on the host
EAGER_COPY = "copy + sync"  # its reference: synchronize; the contiguous copy; synchronize, timed on the host


HEADING = [f"{'case':<44} {'path':<20} {'via':<9} {'post p50 us':>11} {'post p99 us':>11} {'median us':>11} "
           f"{'GB/s':>8} {'BW/copy':>8}"]
LEGEND = ["", "BW/copy = GB/s over the same bytes copied contiguously inside rank 0 (tensorwire eager: against "
          "copy + sync, both timed on the host from a synchronize to the next); unsteady = that copy's "
          "p10-p90 spread", f"exceeded {STEADY_SPREAD:.0%} of its median after 3 tries: no ratio taken; via = the "
          "transport that moved the bytes"]


def rows(records: list[Record]) -> list[str]:
    """One line per (case, path): post p50/p99, the whole request's median, GB/s, and the ratio to the contiguous
    copy; times in us, as in every ``tensorwire bench`` report. Fixed columns: a case's rows line up with the
    others' printed before."""
    lines = []
    for r in records:
        p = r.params
        case = (f"{r.memory} {r.op} {p['pattern']} {p['blocks']}x{p['block_bytes'] // 1024}KiB"
                + (f" x{p['views']} views ({p['layout']})" if p["views"] > 1 else ""))
        post = f"{p['post_p50_us']:11.1f} {p['post_p99_us']:11.1f}" if "post_p50_us" in p else f"{'':>11} {'':>11}"
        ratio = r.ratio_text() if r.reference in (COPY, EAGER_COPY) else ""
        lines.append(f"{case:<44} {r.path:<20} {r.transport:<9} {post} {r.median_us:11.1f} {r.gbps:8.2f} {ratio:>8}")
    return lines


TABLE = Table(HEADING, rows, LEGEND)


def format_report(records: list[Record]) -> str:
    """The whole table at once: the heading, every record's row, the legend."""
    return "\n".join([*HEADING, *rows(records), *LEGEND])


def _case_key(r: Record) -> tuple:
    p = r.params
    return r.memory, r.op, p["pattern"], p["blocks"], p["block_bytes"], p["views"]


def plot_kv(records: list[Record], path: Path) -> None:
    """GB/s per path for every case with random ids (log scale), one panel per memory kind. A small PNG."""
    from .plot import require_matplotlib

    pyplot = require_matplotlib()
    memories = sorted({r.memory for r in records})
    figure, axes = pyplot.subplots(len(memories), 1, figsize=(11, 3.6 * len(memories)), dpi=80, squeeze=False)
    paths = list(dict.fromkeys(r.path for r in records))
    for axis, memory in zip(axes.flat, memories):
        rows = [r for r in records if r.memory == memory and r.params["pattern"] == "random"]
        keys = list(dict.fromkeys(_case_key(r) for r in rows))
        width = 0.8 / len(paths)
        for p, name in enumerate(paths):
            values = [next((r.gbps for r in rows if _case_key(r) == k and r.path == name), 0.0) for k in keys]
            axis.bar([i + p * width for i in range(len(keys))], values, width=width, label=name)
        labels = [f"{op} {n}x{b // 1024}K" + (f"x{v}" if v > 1 else "") for _, op, _, n, b, v in keys]
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], labels, fontsize=7, rotation=30)
        axis.set_yscale("log")
        axis.set_ylabel("GB/s (median)", fontsize=9)
        axis.set_title(f"tensorwire bench kv: {memory} memory, 2 processes, random block ids", fontsize=9)
        axis.legend(fontsize=7, ncol=3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
