"""The benchmarks' GPU clock: CUDA events with each chunk of calls queued before the GPU may start it.

Selected with ``pytest -m gpu``; skipped (with the reason) where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import time

import pytest
import torch

from tensorwire.bench.timing import CudaEventClock, summarize
from tensorwire.errors import InvalidArgumentError

pytestmark = pytest.mark.gpu


def test_queued_event_clock_leaves_the_cpus_gaps_out():
    """A call that launches a tiny kernel and then keeps the CPU away for 2 ms: plain events time the gap the
    GPU spends waiting for the next record, queued events time only the kernel; every call ran."""
    x = torch.zeros(1024, device="cuda")

    def launch_then_leave() -> None:
        x.add_(1)
        time.sleep(2e-3)

    plain = summarize(CudaEventClock().time_calls(launch_then_leave, 10))
    queued = summarize(CudaEventClock(queue_ahead=True).time_calls(launch_then_leave, 10))
    assert plain.median_us >= 1500, plain
    assert queued.median_us < 500, queued
    assert int(x[0]) == 21  # 10 + 10 timed calls, and the queued clock's first call outside the gate


def test_queued_event_clock_refuses_a_call_that_waits_for_the_gpu():
    """A call that synchronizes would wait for the closed gate: the gate opens after its timeout and the clock
    raises instead of hanging or reporting the wait."""
    clock = CudaEventClock(queue_ahead=True, gate_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="waits for the GPU on the CPU"):
        clock.time_calls(torch.cuda.synchronize, 3)
    assert time.monotonic() - start < 10
