"""The one record type of ``tensorwire bench``: records go to JSON and back unchanged, a case's paths are held
against its reference, the reports read them, and the JSON files of benchmarks/results (written before the
benchmarks shared ``Record``) still read as records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tensorwire.bench import kv_report, moe, p2p_report, vllm
from tensorwire.bench.command import header_lines
from tensorwire.bench.p2p_records import BenchConfig, BenchResult
from tensorwire.bench.partial import PartialRecords, RowPrinter, Table, measure_until_interrupted
from tensorwire.bench.record import Record, compare_with, records_from_json, records_to_json
from tensorwire.bench.timing import Timing, quantile, steadiest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _timing(median_us: float) -> Timing:
    return Timing(reps=20, median_us=median_us, p10_us=0.95 * median_us, p90_us=1.1 * median_us, min_us=median_us,
                  mean_us=median_us)


def _p2p_case(memory: str = "cpu", op: str = "WRITE", size: int = 4096) -> list[Record]:
    paths = (("tensorwire", "shm", 2.0), ("raw nixl", "nixl", 4.0), ("copy", "torch", 1.0))
    records = [Record.measured("p2p", memory, op, path, transport, size, _timing(us)) for path, transport, us in paths]
    return compare_with(records, "copy", paths=("tensorwire",))


def test_a_record_goes_to_json_and_back_unchanged():
    copy = Record.measured("kv", "cpu", "READ", "contiguous copy", "copy", 1 << 20, _timing(50.0))
    record = Record.measured("kv", "cpu", "READ", "tensorwire", "shm", 1 << 20, _timing(100.0), blocks=256,
                             pattern="random").against(copy)
    data = json.loads(json.dumps(records_to_json([record])))
    assert data[0]["params"] == {"blocks": 256, "pattern": "random"} and data[0]["reference"] == "contiguous copy"
    assert records_from_json({"records": data}) == [record]
    assert record.gbps == pytest.approx((1 << 20) / 100e-6 / 1e9) and record.ratio == pytest.approx(0.5)
    assert record.ratio_text() == "0.50x" and record.reference_spread == pytest.approx(0.15)


def test_an_unsteady_reference_is_flagged_never_divided_by():
    """A copy whose p10-p90 spread exceeds 20% of its median gives no ratio; the record says why, in JSON too."""
    wobbly = Timing(reps=20, median_us=50.0, p10_us=30.0, p90_us=90.0, min_us=30.0, mean_us=60.0)
    copy = Record.measured("p2p", "cpu", "WRITE", "copy", "torch", 4096, wobbly)
    record = Record.measured("p2p", "cpu", "WRITE", "tensorwire", "shm", 4096, _timing(10.0)).against(copy)
    assert record.ratio is None and record.reference == "copy" and record.reference_spread == pytest.approx(1.2)
    assert record.ratio_text() == "unsteady"
    assert records_from_json({"records": json.loads(json.dumps(records_to_json([record])))}) == [record]


def test_a_reference_is_measured_again_while_unsteady():
    wobbly = Timing(reps=20, median_us=50.0, p10_us=30.0, p90_us=90.0, min_us=30.0, mean_us=60.0)
    tries = iter([wobbly, _timing(40.0), _timing(45.0)])
    calls = []

    def measure_once() -> Timing:
        calls.append(1)
        return next(tries)

    assert steadiest(measure_once) == _timing(40.0) and len(calls) == 2  # stops once steady
    assert steadiest(lambda: wobbly, tries=3) == wobbly  # stays unsteady: the steadiest try, then flagged


def test_a_run_cut_short_reports_the_records_it_measured(tmp_path):
    """What the measuring rank added is read back; a line cut short by a killed writer is left out."""
    partial = PartialRecords(str(tmp_path / "partial.jsonl"))
    case = _p2p_case()
    partial.add(case)
    with open(partial.path, "a") as file:
        file.write('{"benchmark": "p2p", "memo')
    assert partial.read() == case
    partial.remove()
    assert partial.read() == [] and not (tmp_path / "partial.jsonl").exists()


def test_each_case_is_printed_as_it_comes_under_one_heading(tmp_path, capsys):
    """The command prints a case's rows once its line is whole, the heading once before the first; a case cut
    short is not printed."""
    partial = PartialRecords(str(tmp_path / "partial.jsonl"))
    printer = RowPrinter(partial, Table(["HEADING"], lambda case: [f"row {r.path}" for r in case]))
    partial.add(_p2p_case())
    partial.add(_p2p_case()[:1])
    with open(partial.path, "a") as file:
        file.write('[{"benchmark": "p2p", "memo')
    assert printer.stop() == 2
    paths = [r.path for r in _p2p_case()]
    assert capsys.readouterr().out.splitlines() == ["HEADING", *(f"row {p}" for p in paths), f"row {paths[0]}"]


def test_a_run_interrupted_before_any_case_says_so_in_one_line(capsys):
    def interrupted(_partial: PartialRecords) -> None:
        raise KeyboardInterrupt

    table = Table(["HEADING"], lambda case: ["row"])
    assert measure_until_interrupted(interrupted, "kv", table) == (None, [])
    out = capsys.readouterr().out
    assert out == "bench kv: interrupted before any case was measured\n", out


def test_every_header_names_the_machine_the_software_and_the_method():
    head = {"versions": {"tensorwire": "0.1", "torch": "2.13", "nixl": "0.7", "nixl_module": "nixl_cu12", "ucx": None,
                         "python": "3.11"}, "cpu": {"model": "EPYC", "usable_cores": 2}, "gpus": [],
            "source": {"commit": "abc123", "modified": False}}
    lines = header_lines("tensorwire bench kv: blocks", head, [("timing", "0.2 s per path")], ucx="1.19")
    text = "\n".join(lines)
    assert lines[0] == "tensorwire bench kv: blocks"
    for words in ("machine     EPYC, 2 cores; no CUDA device", "tensorwire 0.1 (git abc123)", "UCX 1.19",
                  "timing      0.2 s per path"):
        assert words in text, text


def test_the_paths_of_a_case_are_held_against_its_reference():
    tensorwire, raw, copy = _p2p_case()
    assert (tensorwire.reference, tensorwire.ratio) == ("copy", pytest.approx(0.5))
    assert raw.reference is None and copy.reference is None  # only the paths asked for
    assert compare_with([raw], "copy") == [raw]  # no reference measured: unchanged


def test_the_p2p_table_takes_bw_over_copy_from_the_records():
    result = BenchResult(records=_p2p_case(), idle=[], raw_config="raw", progress_wakeup_ms=10, default_threads=1,
                         ucx_version=None)
    head = {"versions": {"tensorwire": "0", "torch": "2", "nixl": "1", "nixl_module": "nixl", "ucx": None,
                         "python": "3"}, "cpu": {"model": "cpu", "usable_cores": 2}, "gpus": []}
    text = p2p_report.format_report(result, head, BenchConfig())
    row = next(line for line in text.splitlines() if line.startswith("cpu"))
    assert row.split()[-2:] == ["0.50x", "0.50x"]  # BW/copy, then time/raw
    assert p2p_report.comparisons(result.records)[0]["bw_vs_copy"] == pytest.approx(0.5)


def test_host_quantiles_interpolate_as_numpy_does():
    samples = [5.0, 1.0, 9.0, 2.0, 7.5, 3.0]
    for q in (0.1, 0.5, 0.9, 0.99):
        assert quantile(samples, q) == pytest.approx(float(np.percentile(samples, 100 * q)))


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_the_committed_results_read_as_records(path):
    """Each benchmark's old keys land in the common fields; its own in params."""
    records = records_from_json(json.loads(path.read_text()))
    benchmark = records[0].benchmark if records else None
    if path.name.startswith("fleet-"):  # joins and first contacts are times, not transfers
        assert benchmark == "fleet" and all(r.median_us > 0 for r in records)
        assert any(r.gbps > 0 for r in records) and all(r.gbps > 0 for r in records if r.op == "READ")
        return
    if path.name.startswith("startup-"):  # start-up times under UCX's options, no bytes of their own
        assert benchmark == "startup" and all(r.median_us > 0 and "options" in r.params for r in records)
        return
    if path.name.startswith("vllm-"):  # each connector's transfers, held against NixlConnector's
        assert benchmark == "vllm" and all(r.median_us > 0 and r.nbytes > 0 for r in records)
        assert {r.path for r in records} == {"tensorwire", "nixl"} and "consumer TTFT" in vllm.format_report(records)
        return
    if path.name.startswith("kv-tp-"):  # handoffs between TP sizes, held against the homogeneous pair
        from tensorwire.bench import kv_tp

        assert benchmark == "kv" and all(r.median_us > 0 and "consumer_tp" in r.params for r in records)
        assert all(kv_tp.row(r).startswith("handoff TP") for r in records)
        return
    assert records and all(r.median_us > 0 and r.gbps > 0 and r.nbytes > 0 for r in records)
    assert benchmark == ("kv" if path.name.startswith("kv-") else "moe" if path.name.startswith("moe-") else "p2p")
    if benchmark == "moe":
        assert all(r.reference == "copy" and "tokens" in r.params for r in records)
        assert "engine" in moe.format_moe_report(records)
    if benchmark == "kv":
        assert all("pattern" in r.params for r in records)
        assert "contiguous copy" in kv_report.format_report(records)


def test_an_old_moe_file_still_plots(tmp_path):
    """The oldest MoE results have no shared copy; the plot leaves its line out."""
    pytest.importorskip("matplotlib")
    from tensorwire.bench.plot import plot_moe

    records = records_from_json(json.loads((RESULTS / "moe-cpu-2core-2026-12-02.json").read_text()))
    assert all("shared_copy_gbps" not in r.params for r in records)
    plot_moe(records, tmp_path / "moe.png")
    assert 0 < (tmp_path / "moe.png").stat().st_size < 100_000
