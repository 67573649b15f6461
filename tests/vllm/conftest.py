"""What the vLLM end-to-end tests share: one job for a test module, its instances launched apart."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tensorwire.bench.vllm_parties import start_directory, vllm_python


@dataclass(frozen=True)
class VllmJob:
    python: str  # the interpreter that has vLLM (TENSORWIRE_VLLM_PYTHON, or this one)
    work: str  # a scratch directory, removed with the job (models go here)
    token: str  # the job token every instance is given
    directory: str  # the address of the job's directory, where the instances meet


@pytest.fixture(scope="module")
def vllm_job() -> Iterator[VllmJob]:
    """vLLM's interpreter, a scratch directory, a job token and a running directory for one test module; skipped,
    saying why, where vLLM is not installed."""
    python, why = vllm_python()
    if python is None:
        pytest.skip(f"vLLM is not installed: {why}")
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="tw-vllm-") as work:
        directory, address = start_directory(token)
        try:
            yield VllmJob(python, work, token, address)
        finally:
            directory.close()
