"""``tensorwire doctor`` where vLLM is installed: it says whether the TensorwireConnector can carry a KV cache to a
peer (without NIXL a CPU instance's loads all fail, recomputed behind successful answers)."""

from __future__ import annotations

import importlib.util

from tensorwire import doctor


def _report(monkeypatch, vllm_found: bool, nixl_ok: bool) -> doctor.Report:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if vllm_found else None)
                        if name == "vllm" else real(name, *a))
    lines: list[str] = []
    report = doctor.Report(lines.append)
    doctor._report_vllm(report, nixl_ok)
    report.lines = lines
    return report


def test_without_nixl_next_to_vllm_the_doctor_warns_with_the_fix(monkeypatch):
    report = _report(monkeypatch, vllm_found=True, nixl_ok=False)
    assert len(report.problems) == 1 and "NIXL is not usable" in report.problems[0]
    assert any("pip install nixl" in line for line in report.lines)


def test_with_nixl_or_without_vllm_nothing_is_wrong(monkeypatch):
    assert not _report(monkeypatch, vllm_found=True, nixl_ok=True).problems
    quiet = _report(monkeypatch, vllm_found=False, nixl_ok=False)
    assert not quiet.problems and quiet.lines == []
