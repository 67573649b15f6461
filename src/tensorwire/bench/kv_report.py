"""What ``tensorwire bench kv`` prints and plots from its records (measuring lives in ``kv.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["format_report", "plot_kv"]


def format_report(records: list[dict[str, Any]]) -> str:
    """One line per (case, path): post p50/p99, total, GB/s, and the ratio to the contiguous copy."""
    lines = [f"{'case':<44} {'path':<20} {'transport':<9} {'post p50':>10} {'p99':>10} {'total':>11} {'GB/s':>8} "
             f"{'x copy':>7}"]
    copies = {_case_key(r): r for r in records if r["path"] == "contiguous copy"}
    for r in records:
        case = (f"{r['memory']} {r['op']} {r['pattern']} {r['blocks']}x{r['block_bytes'] // 1024}KiB"
                + (f" x{r['views']} views ({r['layout']})" if r["views"] > 1 else ""))
        post = f"{r['post_p50_us']:9.1f}u {r['post_p99_us']:9.1f}u" if "post_p50_us" in r else f"{'':>10} {'':>10}"
        copy = copies.get(_case_key(r))
        ratio = f"{copy['total_us'] / r['total_us']:6.2f}x" if copy else ""
        lines.append(f"{case:<44} {r['path']:<20} {r['transport']:<9} {post} {r['total_us'] / 1e3:9.3f}ms "
                     f"{r['gbps']:8.2f} {ratio:>7}")
    return "\n".join(lines)


def _case_key(r: dict[str, Any]) -> tuple:
    return r["memory"], r["op"], r["pattern"], r["blocks"], r["block_bytes"], r["views"]


def plot_kv(records: list[dict[str, Any]], path: Path) -> None:
    """GB/s per path for every case with random ids (log scale), one panel per memory kind. A small PNG."""
    from .plot import require_matplotlib

    pyplot = require_matplotlib()
    memories = sorted({r["memory"] for r in records})
    figure, axes = pyplot.subplots(len(memories), 1, figsize=(11, 3.6 * len(memories)), dpi=80, squeeze=False)
    paths = list(dict.fromkeys(r["path"] for r in records))
    for axis, memory in zip(axes.flat, memories):
        rows = [r for r in records if r["memory"] == memory and r["pattern"] == "random"]
        keys = list(dict.fromkeys(_case_key(r) for r in rows))
        width = 0.8 / len(paths)
        for p, name in enumerate(paths):
            values = [next((r["gbps"] for r in rows if _case_key(r) == k and r["path"] == name), 0.0) for k in keys]
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
