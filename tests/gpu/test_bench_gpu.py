"""The benchmarks' GPU clock: CUDA events with each chunk of calls queued before the GPU may start it.

Selected with ``pytest -m gpu``; skipped (with the reason) where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import time

import pytest
import torch

from tensorwire.bench.timing import Budget, CudaEventClock, measure_interleaved, summarize
from tensorwire.errors import InvalidArgumentError

pytestmark = pytest.mark.gpu


def test_queued_event_clock_leaves_the_cpus_gaps_out():
    """A call that launches a tiny kernel and then keeps the CPU away for 200 µs, over several chunks: plain
    events time the gap the GPU spends waiting for the next record, queued events time only the kernel;
    every call ran."""
    x = torch.zeros(1024, device="cuda")

    def launch_then_leave() -> None:
        x.add_(1)
        time.sleep(200e-6)

    calls = 3 * CudaEventClock._QUEUED_CHUNK + 5
    plain = summarize(CudaEventClock().time_calls(launch_then_leave, calls))
    queued = summarize(CudaEventClock(queue_ahead=True).time_calls(launch_then_leave, calls))
    assert plain.median_us >= 150, plain
    assert queued.median_us < 50 and queued.p90_us < 100, queued
    assert int(x[0]) == 2 * calls + 1  # both clocks' calls, and the queued clock's untimed one outside the gate


def test_queued_event_clock_runs_each_functions_first_call_outside_the_gate():
    """Interleaved functions share one queued clock: a function whose first call waits for the GPU (as lazy
    initialisation does) is not the first to be timed, yet its first call runs before any gate, so it is
    timed instead of refused."""
    x, y = torch.zeros(1024, device="cuda"), torch.zeros(1024, device="cuda")
    initialised: list[bool] = []

    def initialised_on_first_call() -> None:
        if not initialised:
            torch.cuda.synchronize()
            initialised.append(True)
        y.add_(1)

    clock = CudaEventClock(queue_ahead=True, gate_timeout_s=2.0)
    budget = Budget(iters=150, warmup_s=0.0, warmup_reps=1, rounds=2)
    timings = measure_interleaved({"plain": lambda: x.add_(1), "lazy": initialised_on_first_call}, clock, budget)
    assert [t.reps for t in timings.values()] == [150, 150]
    assert timings["lazy"].median_us < 50, timings
    assert int(y[0]) > 150


def test_queued_event_clock_refuses_a_call_that_waits_for_the_gpu():
    """A call that synchronizes would wait for the closed gate: the gate opens after its timeout and the clock
    raises instead of hanging or reporting the wait."""
    clock = CudaEventClock(queue_ahead=True, gate_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="waits for the GPU on the CPU or enqueues more"):
        clock.time_calls(torch.cuda.synchronize, 3)
    assert time.monotonic() - start < 10
