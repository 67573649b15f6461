"""``tensorwire bench``: the time budget's repetition count and the p2p summary lines held against their goals."""

from __future__ import annotations

from tensorwire.descriptors import MemoryKind

CPU, CUDA = MemoryKind.CPU, MemoryKind.CUDA


def test_bench_budget_fills_the_time_but_caps_slow_calls():
    """Fast calls fill the time budget (at least min_reps, at most max_reps); a call of seconds gets a few."""
    from tensorwire.bench.timing import Budget

    budget = Budget(time_s=0.3, min_reps=20, max_reps=100_000)
    assert budget.reps_for(1e-3) == 300
    assert budget.reps_for(1e-7) == 100_000
    assert budget.reps_for(0.1) == 20  # min_reps still holds while 20 calls cost at most ten budgets
    assert budget.reps_for(0.5) == 6
    assert budget.reps_for(2.0) == 3
    assert Budget(iters=7).reps_for(2.0) == 7



# --- bench report -------------------------------------------------------------------------------
def test_bench_summary_holds_wait_returns_against_their_goal():
    """Each measured wait(stream=) return becomes a summary line: ok only below 20 µs and with the transfer
    still in flight at every return; the JSON keeps the raw measurement."""
    from tensorwire.bench import p2p
    from tensorwire.bench import p2p_report as report
    from tensorwire.bench.timing import Budget

    def wait_return(transport, median_us, in_flight):
        return {"transport": transport, "op": "WRITE", "size": 1 << 30, "median_us": median_us, "p10_us": median_us,
                "p90_us": median_us, "first_us": 3 * median_us, "reps": 20, "in_flight": in_flight}

    returns = [wait_return("cuda_ipc", 6.0, 20), wait_return("nixl", 24.0, 20), wait_return("shm", 6.0, 19)]
    result = p2p.BenchResult(records=[], idle=[], raw_config="raw", progress_wakeup_ms=10, default_threads=1,
                             ucx_version=None, wait_returns=returns)
    lines = {line["name"]: line for line in report.summary(result)}
    assert [lines[f"wait(stream=) return, {t}"]["ok"] for t in ("cuda_ipc", "nixl", "shm")] == [True, False, False]
    assert "19/20 still moving" in lines["wait(stream=) return, shm"]["text"]
    head = {"versions": {}, "hostname": "h", "date": "2026-01-01"}
    assert report.to_json(result, head, p2p.BenchConfig(budget=Budget()))["wait_returns"] == returns


def test_bench_summary_holds_4k_gpu_graph_latency_against_its_goal():
    """A 4 KiB GPU row replayed from a graph becomes a summary line, ok only at <= 10 µs, naming the stream,
    copy and CPU-timed rows beside it; a GPU run without graph rows says why (no --graphs, or a transport
    that is not stream-ordered); a host-only run has no such line."""
    from tensorwire.bench import p2p
    from tensorwire.bench import p2p_report as report

    def record(op, path, median_us, transport="cuda_ipc"):
        gbps = 4096 / median_us / 1e3
        return p2p.Record("p2p", "cuda", op, path, transport, 4096, 20, median_us, median_us, median_us, gbps)

    def lines_of(records):
        result = p2p.BenchResult(records=records, idle=[], raw_config="raw", progress_wakeup_ms=10,
                                 default_threads=1, ucx_version=None)
        return {line["name"]: line for line in report.summary(result)}

    name = "4 KiB cuda {} GPU time, post to completion on the stream".format
    lines = lines_of([record("READ", p2p.TENSORWIRE_GRAPH, 6.5), record("READ", "copy", 3.0, "torch"),
                      record("READ", p2p.TENSORWIRE, 15.5), record("WRITE", p2p.TENSORWIRE_GRAPH, 10.5),
                      record("WRITE", p2p.TENSORWIRE_STREAM, 7.0)])
    read, write = lines[name("READ")], lines[name("WRITE")]
    assert (read["ok"], read["value"], write["ok"], write["value"]) == (True, 6.5, False, 10.5)
    assert "copy 3.0 us" in read["text"] and "tensorwire (stream) 7.0 us" in write["text"]
    assert "post() + wait(): 15.5 us" in read["text"] and "post() + wait()" not in write["text"]
    unmeasured = lines_of([record("READ", p2p.TENSORWIRE_STREAM, 7.0)])[name("READ")]
    assert unmeasured["ok"] is None and "(add --graphs)" in unmeasured["text"]
    no_4k = lines_of([record("WRITE", p2p.TENSORWIRE_GRAPH, 3.0)])[name("READ")]
    assert no_4k["ok"] is None and "add 4K to --sizes, and --graphs" in no_4k["text"]
    over_nixl = lines_of([record("READ", p2p.TENSORWIRE, 40.0, "nixl")])[name("READ")]
    assert over_nixl["ok"] is None and "chose nixl, which is not stream-ordered" in over_nixl["text"]
    assert not any("cuda" in name for name in lines_of([]))


def test_bench_summary_holds_gpu_eager_post_and_wait_against_the_copy_and_sync():
    """GPU memory: the eager rows are held against the copy + sync measured beside them (not against the copy's
    GPU time from CUDA events), 64 MiB ok from 0.9x, 4 KiB ok up to 8 µs; the comparison names that reference."""
    from tensorwire.bench import p2p
    from tensorwire.bench import p2p_report as report
    from tensorwire.bench.p2p_records import COPY, COPY_SYNC, EAGER_PATHS, TENSORWIRE
    from tensorwire.bench.record import compare_with

    def record(op, path, size, median_us):
        return p2p.Record("p2p", "cuda", op, path, "cuda_ipc", size, 20, median_us, median_us, median_us,
                          size / median_us / 1e3)

    big = compare_with([record("READ", TENSORWIRE, 64 << 20, 70.0), record("READ", COPY_SYNC, 64 << 20, 62.0),
                        record("READ", COPY, 64 << 20, 45.0)], COPY_SYNC, paths=EAGER_PATHS)
    small = compare_with([record("READ", TENSORWIRE, 4096, 9.5), record("READ", COPY_SYNC, 4096, 8.0)], COPY_SYNC,
                         paths=EAGER_PATHS)
    result = p2p.BenchResult(records=big + small, idle=[], raw_config="raw", progress_wakeup_ms=10, default_threads=1,
                             ucx_version=None)
    lines = {line["name"]: line for line in report.summary(result)}
    eager_big = lines["64 MiB cuda READ eager post()+wait() vs copy + sync"]
    assert eager_big["value"] == 62.0 / 70.0 and eager_big["ok"] is False  # 0.89x
    assert "copy + sync (62.0 us)" in eager_big["text"]
    eager_small = lines["4 KiB cuda READ eager post()+wait() wall time"]
    assert eager_small["ok"] is False and "copy + sync 8.0 us" in eager_small["text"]
    assert lines["64 MiB cuda WRITE eager post()+wait() vs copy + sync"]["ok"] is None  # not measured: says so
    eager = [c for c in report.comparisons(big) if c["path"] == TENSORWIRE]
    assert [(c["reference"], c["bw_vs_copy"]) for c in eager] == [(COPY_SYNC, 62.0 / 70.0)]
