"""The report of ``tensorwire bench fleet``: the names of its paths, its goals, its text (one block per fleet size)
and its plot (a small PNG)."""

from __future__ import annotations

from pathlib import Path

from .partial import Table
from .record import Record

__all__ = ["FLEET", "WORLD", "RAW_NIXL", "GOALS_MS", "GOAL_RATIO", "TABLE", "stage_lines", "tail_lines",
           "format_report", "plot_fleet"]

RAW_NIXL = "raw nixl"  # the first READ's reference: two bare NIXL agents' first contact (``fleet_raw``)
FLEET, WORLD = "fleet", "one world"  # the steady state's paths: members of two launches; two ranks of one
GOALS_MS = {"join": 50.0, "first READ": 20.0}  # the goals on a 2-core host; steady state: >= 0.97x one world
GOAL_RATIO = 0.97


def stage_lines(records: list[Record]) -> list[str]:
    """One block per fleet size: join, first READ, steady state per transport (fleet beside one world); times in
    us and ratios as BW/<reference>, as in every ``tensorwire bench`` report (the JSON keeps each step's ms)."""
    lines = []
    records = [r for r in records if r.path != RAW_NIXL]
    for size in sorted({r.params["members"] for r in records}):
        rows = [r for r in records if r.params["members"] == size]
        lines.append(f"{size} members")
        lines += _latency_lines(rows)
        for r in rows:
            if r.op == "READ":
                ratio = f"  BW/world {r.ratio_text()} (goal >= {GOAL_RATIO}x)" if r.reference == WORLD else ""
                lines.append(f"  READ {r.params['blocks']}x{r.params['block_bytes'] // 1024}KiB {r.transport:5} "
                             f"{r.path:10} median {r.median_us:10,.0f} us  {r.gbps:6.2f} GB/s{ratio}")
        join = next((r for r in rows if r.op == "join"), None)
        for what, counts in (join.params["fds"].items() if join else ()):
            if counts is not None:
                text = (f"{counts['fds']} ({counts['sockets']} sockets)" if not isinstance(counts["fds"], dict)
                        else f"median {counts['fds']['median']:.0f}, max {counts['fds']['max']} "
                             f"({counts['sockets']['max']} sockets at most) over {counts['members']}")
                lines.append(f"  fds {what:28} {text}")
    return lines


def tail_lines(records: list[Record]) -> list[str]:
    """What follows the fleet sizes' blocks: raw NIXL's first contact (measured last) and the first READs held
    against it, and what 'unsteady' means where a ratio was not taken."""
    lines = []
    for r in (r for r in records if r.path == RAW_NIXL):
        lines.append(f"raw NIXL first contact (metadata load + first READ of the same blocks, no lookup): median "
                     f"{r.median_us:,.0f} us, max {r.params['max_ms'] * 1e3:,.0f} us over {r.params['contacts']} "
                     "fresh pair(s) of processes")
    for r in records:
        if r.op == "first READ" and r.reference == RAW_NIXL:
            lines.append(f"  {r.params['members']} members: first READ BW/raw nixl {r.ratio_text()} (raw NIXL's "
                         "first contact time over ours)")
    if any(r.reference is not None and r.ratio is None for r in records):
        lines.append("unsteady: the reference's p10-p90 spread exceeded 20% of its median, no ratio taken")
    return lines


TABLE = Table([], stage_lines)


def format_report(records: list[Record]) -> str:
    """The whole report at once: every fleet size's block, then ``tail_lines``."""
    return "\n".join([*stage_lines(records), *tail_lines(records)])


def _latency_lines(rows: list[Record]) -> list[str]:
    """Join, serving and first READ of one fleet size, in us."""
    out = []
    join = next((r for r in rows if r.op == "join"), None)
    if join is not None:
        p = join.params
        phases = ", ".join(f"{k} {v * 1e3:,.0f}" for k, v in p["phases_ms"].items())
        out.append(f"  join        median {join.median_us:10,.0f} us  max {p['max_ms'] * 1e3:10,.0f} us  "
                   f"(goal <= {GOALS_MS['join'] * 1e3:,.0f}; median phases, us: {phases})")
        if "serving_ms" in p:
            out.append(f"  serving     median {p['serving_ms'] * 1e3:10,.0f} us  (joined and first pool registered: "
                       "NIXL's agent, made meanwhile, is up)")
    first = next((r for r in rows if r.op == "first READ"), None)
    if first is not None:
        p = first.params
        out.append(f"  first READ  median {first.median_us:10,.0f} us  max {p['max_ms'] * 1e3:10,.0f} us  "
                   f"(goal <= {GOALS_MS['first READ'] * 1e3:,.0f}) over {p['targets']} never-seen member(s): rank_of "
                   f"{p['rank_of_ms'] * 1e3:,.0f}, lookup {p['lookup_ms'] * 1e3:,.0f}, prepare "
                   f"{p['prepare_ms'] * 1e3:,.0f}, READ {p['read_ms'] * 1e3:,.0f} us; again {p['again_us']:,.0f} us")
    return out


def plot_fleet(records: list[Record], path: Path, title: str = "tensorwire bench fleet") -> None:
    """Two panels over the fleet size: join and first-READ ms (median, max dotted); steady GB/s of the fleet
    and of one world per transport. A small PNG."""
    from .plot import require_matplotlib

    pyplot = require_matplotlib()
    raw = [r for r in records if r.path == RAW_NIXL]
    records = [r for r in records if r.path != RAW_NIXL]
    sizes = sorted({r.params["members"] for r in records})
    figure, (latency, steady) = pyplot.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    for op, color in (("join", "#1f77b4"), ("first READ", "#ff7f0e")):
        rows = sorted((r for r in records if r.op == op), key=lambda r: r.params["members"])
        latency.plot(sizes, [r.median_us / 1e3 for r in rows], marker="o", color=color, label=f"{op} (median)")
        latency.plot(sizes, [r.params["max_ms"] for r in rows], marker=".", linestyle=":", color=color,
                     label=f"{op} (max)")
        latency.axhline(GOALS_MS[op], color=color, linewidth=0.8, linestyle="--", alpha=0.6)
    for r in raw:
        latency.axhline(r.median_us / 1e3, color="#7f7f7f", linewidth=1.0, linestyle="-.",
                        label="raw NIXL first contact (median)")
    latency.set_yscale("log")
    latency.set_ylabel("ms", fontsize=9)
    latency.set_title("join and first READ (handshake included); goals dashed", fontsize=9)
    colors = iter(["#2ca02c", "#9467bd", "#8c564b", "#17becf"])
    for transport in dict.fromkeys(r.transport for r in records if r.op == "READ"):
        color = next(colors)
        for name, style in ((FLEET, "-"), (WORLD, "--")):
            rows = sorted((r for r in records if r.op == "READ" and (r.path, r.transport) == (name, transport)),
                          key=lambda r: r.params["members"])
            steady.plot(sizes, [r.gbps for r in rows], marker="o", linestyle=style, color=color,
                        label=f"{name} ({transport})")
    sample = next(r for r in records if r.op == "READ")
    steady.set_ylim(bottom=0)
    steady.set_ylabel("GB/s (median)", fontsize=9)
    steady.set_title(f"steady READ {sample.params['blocks']} x {sample.params['block_bytes'] // 1024} KiB random "
                     "blocks", fontsize=9)
    for axis in (latency, steady):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(s) for s in sizes], fontsize=8)
        axis.minorticks_off()
        axis.set_xlabel("members", fontsize=9)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
