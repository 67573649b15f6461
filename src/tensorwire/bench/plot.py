"""The benchmarks' records (``record.Record``) as small PNGs: ``plot`` draws ``bench p2p``'s GB/s against
transfer size, one line per path, one panel per (memory, op); ``plot_moe`` draws ``bench moe``'s as bars
(``bench kv``'s are drawn by ``kv_report.plot_kv``).

matplotlib is optional (``pip install 'tensorwire[plot]'`` or ``pip install matplotlib``) and imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from .p2p_records import (
    COPY,
    COPY_MT,
    COPY_SYNC,
    RAW,
    TENSORWIRE,
    TENSORWIRE_GRAPH,
    TENSORWIRE_IN_PROCESS,
    TENSORWIRE_NIXL,
    TENSORWIRE_STREAM,
    format_size,
)
from .record import Record

__all__ = ["plot", "plot_moe", "require_matplotlib"]

_DPI = 80  # small files: a 2x2 grid stays well under 100 KB
_STYLE = {
    TENSORWIRE: {"color": "#1f77b4", "marker": "o", "linewidth": 2.0},
    TENSORWIRE_STREAM: {"color": "#17becf", "marker": "*"},
    TENSORWIRE_IN_PROCESS: {"color": "#8c564b", "marker": "x", "linestyle": "-."},
    TENSORWIRE_GRAPH: {"color": "#e377c2", "marker": "P"},
    TENSORWIRE_NIXL: {"color": "#9467bd", "marker": "D"},
    RAW: {"color": "#ff7f0e", "marker": "s", "linestyle": "--"},
    COPY: {"color": "#2ca02c", "marker": "^", "linestyle": ":"},
    COPY_MT: {"color": "#7f7f7f", "marker": "v", "linestyle": ":"},
    COPY_SYNC: {"color": "#bcbd22", "marker": "<", "linestyle": ":"},
}


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend, or ``InvalidArgumentError`` saying how to get it."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        if e.name == "matplotlib":
            raise InvalidArgumentError(
                "--plot needs matplotlib, which is not installed; pip install matplotlib "
                "(or pip install 'tensorwire[plot]'), or drop --plot"
            ) from e
        raise InvalidArgumentError(
            f"--plot: importing matplotlib failed because {e.name!r} is missing; install it") from e
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as pyplot

    return pyplot


def plot(records: list[Record], path: Path, title: str = "tensorwire bench") -> None:
    """Write the PNG: 720 px wide, 250 px per row of panels, under 100 KB."""
    pyplot = require_matplotlib()
    panels = sorted({(r.memory, r.op) for r in records}, key=lambda k: (k[0] != "cpu", k[0], k[1]))
    columns = 2
    rows = (len(panels) + columns - 1) // columns
    figure, axes = pyplot.subplots(rows, columns, figsize=(9, 3.1 * rows), dpi=_DPI, squeeze=False)
    for axis, (memory, op) in zip(axes.flat, panels):
        for path_name, style in _STYLE.items():
            points = sorted((r.nbytes, r.gbps) for r in records if (r.memory, r.op, r.path) == (memory, op, path_name))
            if not points:
                continue
            label = path_name
            transport = next((r.transport for r in records if (r.memory, r.path) == (memory, path_name)), None)
            if path_name == TENSORWIRE and transport:
                label += f" (via {transport})"
            threads = next((r.params["threads"] for r in records
                            if (r.memory, r.path) == (memory, path_name) and r.params.get("threads")), None)
            if threads:
                label += f" ({threads} thread{'s' if threads > 1 else ''})"
            axis.plot([p[0] for p in points], [p[1] for p in points], label=label, markersize=4, **style)
        sizes = sorted({r.nbytes for r in records if (r.memory, r.op) == (memory, op)})
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(sizes, [format_size(s).replace(" ", "") for s in sizes], fontsize=7, rotation=30)
        axis.minorticks_off()
        axis.set_title(f"{memory} {op}", fontsize=10)
        axis.set_ylabel("GB/s (median)", fontsize=9)
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(fontsize=7, loc="upper left")
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=_DPI)
    pyplot.close(figure)


def plot_moe(records: list[Record], path: Path, title: str = "tensorwire bench moe") -> None:
    """``bench moe`` records as bars: GB/s per engine (the records' path), dispatch and combine side by side,
    one panel per token count, the copy of the same bytes as a dashed line. A small PNG."""
    if not records:
        raise InvalidArgumentError("bench moe --plot: no records to plot (no engine was timed)")
    pyplot = require_matplotlib()
    token_counts = sorted({r.params["tokens"] for r in records})
    engines = list(dict.fromkeys(r.path for r in records))
    figure, axes = pyplot.subplots(1, len(token_counts), figsize=(4.5 * len(token_counts), 3.2), dpi=_DPI,
                                   squeeze=False)
    for axis, tokens in zip(axes.flat, token_counts):
        rows = [r for r in records if r.params["tokens"] == tokens]
        for offset, (op, color) in enumerate((("dispatch", "#1f77b4"), ("combine", "#ff7f0e"))):
            values = [next((r.gbps for r in rows if (r.path, r.op) == (b, op)), 0.0) for b in engines]
            axis.bar([i + 0.4 * offset for i in range(len(engines))], values, width=0.4, label=op, color=color)
        copy = max((r.params["copy_gbps"] for r in rows), default=0.0)
        axis.axhline(copy, color="#2ca02c", linestyle="--", label=f"copy {copy:,.0f} GB/s")
        shared = max((r.params.get("shared_copy_gbps", 0.0) for r in rows), default=0.0)  # older JSONs lack it
        sample = rows[0].params
        if shared and sample["world_size"] > 1:
            axis.axhline(shared, color="#9467bd", linestyle=":", label=f"shared copy {shared:,.0f} GB/s")
        axis.set_xticks([i + 0.2 for i in range(len(engines))], engines, fontsize=8)
        axis.set_yscale("log")
        axis.set_ylabel("GB/s (median)", fontsize=9)
        axis.set_title(f"T={tokens}, H={sample['hidden']} {sample['dtype']}, top-{sample['topk']}, "
                       f"{sample['world_size']} rank(s)", fontsize=9)
        axis.legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=_DPI)
    pyplot.close(figure)
