"""The ``tensorwire`` command line, run as a user runs it (a subprocess): ``bench`` on host memory writes
verified records of every path, which read back as ``Record``s, ``bench moe`` reports each engine, ``doctor``
gives a verdict, and a bad argument is refused with the reason."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tensorwire.bench.record import Record, records_from_json, records_to_json


def _tensorwire(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorwire", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def _round_trip(document: dict) -> list[Record]:
    """The file's records read as ``Record``s, which write back to the very same JSON."""
    records = records_from_json(document)
    assert records and all(isinstance(r, Record) for r in records)
    assert json.dumps(records_to_json(records)) == json.dumps(document["records"])
    return records


def _header_and_progress(done: subprocess.CompletedProcess, benchmark: str) -> None:
    """The header (machine, software, method) once on stdout, before the rows; a progress line per case on stderr."""
    out = done.stdout
    assert out.count(f"tensorwire bench {benchmark}:") == 1 and out.count("  software ") == 1, out[-3000:]
    assert out.index("  machine ") < out.index("median us"), out[-3000:]
    assert f"bench {benchmark}: " in done.stderr and "  software " not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_bench_writes_every_path_on_host_memory(tmp_path):
    """Each size has tensorwire, raw NIXL and the copy (and tensorwire in-process for WRITE), with positive
    bandwidth; the bytes were checked on the way (a path moving wrong bytes makes the command fail)."""
    out = tmp_path / "bench.json"
    done = _tensorwire("bench", "--memory", "cpu", "--sizes", "4K,1M", "--time-budget", "0.02", "--min-reps", "3",
                       "--warmup", "0.01", "--idle-seconds", "0.2", "--quiet", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    seen = {(r["op"], r["nbytes"], r["path"]) for r in result["records"]}
    for size in (4096, 1 << 20):
        expected = {(op, size, path) for op in ("READ", "WRITE") for path in ("tensorwire", "raw nixl", "copy")}
        expected.add(("WRITE", size, "tensorwire (in-process)"))
        assert expected <= seen, f"missing {sorted(expected - seen)}"
    assert {r["transport"] for r in result["records"] if r["path"] == "tensorwire (in-process)"} == {"local"}
    assert all(r["gbps"] > 0 and r["reps"] >= 3 and r["benchmark"] == "p2p" for r in result["records"])
    assert all(r["reference"] == "copy" and (r["ratio"] is None or r["ratio"] > 0)  # None: the copy was unsteady
               for r in result["records"] if r["path"] == "tensorwire")
    assert result["header"]["command"].startswith("tensorwire bench")
    assert len(result["idle"]) == 2 and all(i["cores"] >= 0 for i in result["idle"])
    assert {r.benchmark for r in _round_trip(result)} == {"p2p"} and result["interrupted"] is False


def test_bench_moe_reports_each_engine():
    """``bench moe`` on host memory: dispatch and combine rows for torch and nixl (the engine is a record's
    path), each held against the copy, checked combine output."""
    from tensorwire.bench import moe

    records = moe.run_moe_bench(memory="cpu", tokens=(32,), hidden=64, reps=2, warmup=1, timeout_s=200)
    assert {(r.path, r.op) for r in records} == {
        (b, op) for b in ("torch", "nixl") for op in ("dispatch", "combine")}
    assert all(r.params["rows"] > 0 and r.median_us > 0 and r.benchmark == "moe" for r in records)
    assert all(r.reference == "copy" and (r.ratio is None or r.ratio > 0) for r in records)  # None: copy unsteady
    assert all(r.params["shared_copy_gbps"] > 0 for r in records)


@pytest.mark.slow
def test_bench_moe_takes_ranks_and_engines(tmp_path):
    """``bench moe --ranks 1 --engines nixl``: only that engine's rows, measured by one rank (and a small PNG
    with --plot where matplotlib is installed)."""
    out, png = tmp_path / "moe.json", tmp_path / "moe.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    done = _tensorwire("bench", "moe", "--memory", "cpu", "--ranks", "1", "--engines", "nixl", "--json", str(out),
                       *plot)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    assert {r["path"] for r in records} == {"nixl"} and {r["params"]["world_size"] for r in records} == {1}
    assert {r.benchmark for r in _round_trip({"records": records})} == {"moe"}
    _header_and_progress(done, "moe")
    if plot:
        assert 0 < png.stat().st_size < 100_000


@pytest.mark.slow
def test_bench_kv_writes_every_path_on_host_memory(tmp_path):
    """``bench kv`` on host memory: tensorwire (shm, and nixl forced), raw NIXL per-request and prepped, and the
    contiguous copy for every case, the tensorwire paths' bytes verified (wrong bytes fail the command)."""
    out = tmp_path / "kv.json"
    done = _tensorwire("bench", "kv", "--memory", "cpu", "--blocks", "300", "--block-bytes", "4096", "--no-llama",
                       "--patterns", "random,contiguous",
                       "--time", "0.02", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    paths = {(r["op"], r["params"]["pattern"], r["path"]) for r in result["records"]}
    for op in ("READ", "WRITE"):
        for pattern in ("random", "contiguous"):
            for path in ("tensorwire", "tensorwire (nixl)", "raw nixl descs", "raw nixl prepped", "contiguous copy"):
                assert (op, pattern, path) in paths, (op, pattern, path)
    assert {r["transport"] for r in result["records"] if r["path"] == "tensorwire"} == {"shm"}
    assert all(r["gbps"] > 0 and r["params"]["blocks"] == 300 for r in result["records"])
    assert all(r["reference"] == "contiguous copy" and (r["ratio"] is None or r["ratio"] > 0)  # None: copy unsteady
               for r in result["records"])
    posts = [r["params"] for r in result["records"] if "post_p50_us" in r["params"]]
    assert posts and all(p["post_p99_us"] >= p["post_p50_us"] > 0 for p in posts)
    assert result["header"]["command"].startswith("tensorwire bench kv")
    assert {r.benchmark for r in _round_trip(result)} == {"kv"}
    _header_and_progress(done, "kv")


def _in_a_terminal(*args: str) -> str:
    """``tensorwire *args`` with stdout and stderr on one pseudo-terminal, as in a user's terminal; all it showed."""
    import os
    import pty
    import threading

    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "tensorwire", *args], stdout=follower, stderr=follower,
                               stdin=subprocess.DEVNULL)
    os.close(follower)
    shown: list[bytes] = []

    def read() -> None:  # drained as it comes: a full terminal buffer would block the command
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command closed its end
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert process.wait(timeout=240) == 0, b"".join(shown).decode(errors="replace")[-3000:]
    reader.join(timeout=60)
    os.close(leader)
    return b"".join(shown).decode(errors="replace")


def test_a_bench_in_a_terminal_shows_its_header_once_and_a_saved_report_keeps_it():
    """The header goes to stdout once, before the rows, whether stdout is the terminal or a file."""
    args = ("bench", "kv", "--memory", "cpu", "--blocks", "200", "--block-bytes", "4K", "--no-llama", "--no-raw",
            "--time", "0.2", "--patterns", "random")
    screen = _in_a_terminal(*args)
    assert screen.count("tensorwire bench kv:") == 1 and screen.count("  software ") == 1, screen[-3000:]
    saved = _tensorwire(*args)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert saved.stdout.count("  software ") == 1 and "  software " not in saved.stderr, saved.stdout[-3000:]


def test_doctor_gives_a_verdict():
    done = _tensorwire("doctor", "--timeout", "60")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verdict" in done.stdout and "nixl" in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize("args, words", [
    (("bench", "--sizes", "12Q"), "size"),
    (("bench", "--time-budget", "-1"), "pass 0 or more"),
    (("bench", "moe", "--engines", "torch,nccl"), "unknown or no engine ['nccl']"),
    (("bench", "moe", "--engines", ","), "unknown or no engine"),
    (("bench", "moe", "--ranks", "0"), "pass 1 or more"),
    (("bench", "--ranks", "4"), "applies to 'tensorwire bench moe'"),
])
@pytest.mark.slow
def test_bad_arguments_are_refused_with_the_reason(args, words):
    done = _tensorwire(*args, timeout=60)
    assert done.returncode == 2 and words in done.stderr.lower(), done.stderr

