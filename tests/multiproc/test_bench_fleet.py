"""``tensorwire bench fleet``, run as a user runs it (a subprocess) with tiny settings: a directory, one member
and a reader launched apart, and a 2-rank launcher world; every record is there with positive figures, and
bad usage is refused with the reason."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tensorwire.bench.record import records_from_json, records_to_json


def _tensorwire(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorwire", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.slow
def test_bench_fleet_records_join_first_read_and_the_steady_state_beside_one_world(tmp_path):
    out = tmp_path / "fleet.json"
    done = _tensorwire("bench", "fleet", "--members", "2", "--blocks", "100", "--block-bytes", "4K", "--time",
                       "0.05", "--rounds", "2", "--timeout", "200", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bench fleet:" in done.stderr  # progress lines
    document = json.loads(out.read_text())
    records = document["records"]
    assert {r["benchmark"] for r in records} == {"fleet"} and {r["memory"] for r in records} == {"cpu"}
    assert {(r["op"], r["path"], r["transport"]) for r in records} == {
        ("join", "fleet", "directory"), ("first READ", "fleet", "nixl"), ("first READ", "raw nixl", "nixl"),
        *{("READ", path, t) for path in ("fleet", "one world") for t in ("nixl", "shm")}}
    fleet_records = [r for r in records if r["path"] != "raw nixl"]
    assert all(r["params"]["members"] == 2 and r["median_us"] > 0 and r["reps"] >= 1 for r in fleet_records)
    join = next(r for r in records if r["op"] == "join")
    assert len(join["params"]["join_ms"]) == 2 and join["params"]["max_ms"] >= join["median_us"] / 1e3
    assert set(join["params"]["phases_ms"]) >= {"nixl agent (started)", "directory: connect, rank, liveness"}
    # serving = joined + first pool registered, which waits for the NIXL agent made in the background
    assert join["params"]["serving_ms"] >= join["median_us"] / 1e3 and join["params"]["serving_max_ms"] > 0
    fds = join["params"]["fds"]
    assert fds["reader after join"]["fds"] > 0 and fds["contacted members now"]["members"] == 1
    first = next(r for r in records if r["op"] == "first READ")
    assert first["params"]["targets"] == 1 and first["params"]["prepare_ms"] > 0 and first["gbps"] > 0
    raw = next(r for r in records if r["path"] == "raw nixl")
    assert raw["nbytes"] == first["nbytes"] and raw["params"]["contacts"] >= 1 and raw["median_us"] > 0
    assert first["reference"] == "raw nixl" and (first["ratio"] is None or first["ratio"] > 0)  # None: unsteady
    for r in records:
        if r["op"] == "READ":
            assert r["gbps"] > 0 and r["nbytes"] == 100 * 4096 and r["params"]["blocks"] == 100
            if r["path"] == "fleet":
                assert r["reference"] == "one world" and (r["ratio"] is None or r["ratio"] > 0)  # None: unsteady
    assert document["header"]["command"].startswith("tensorwire bench fleet")
    assert document["header"]["config"]["members"] == [2]
    assert json.dumps(records_to_json(records_from_json(document))) == json.dumps(records)  # one Record type
    assert document["interrupted"] is False
    # The header once, on stdout, before the fleet size's block, which came as soon as it was measured
    assert done.stdout.count("  machine ") == 1 and "  machine " not in done.stderr, done.stdout[-3000:]
    assert done.stdout.index("  machine ") < done.stdout.index("2 members") < done.stdout.index("raw NIXL first")


@pytest.mark.slow
def test_bench_fleet_refuses_bad_usage():
    for args, says in ((["--members", "1"], "2 or more"), (["--memory", "cuda"], "host memory only"),
                       (["--transports", "ucx"], "nixl, shm"), (["--block-bytes", "6"], "multiple of 4")):
        done = _tensorwire("bench", "fleet", *args, timeout=60)
        assert done.returncode == 2 and says in done.stderr, (args, done.stderr[-2000:])
