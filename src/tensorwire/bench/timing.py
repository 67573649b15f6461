"""The one timing primitive of tensorwire's benchmarks, in the manner of Triton's ``do_bench``.

``measure(fn, clock, budget)`` warms ``fn`` up, estimates one call's time, then times enough calls to fill
a time budget (never fewer than ``budget.min_reps``), each call on its own, and summarises them by median
and p10/p90 quantiles in microseconds. ``measure_interleaved(fns, ...)`` does the same for several
functions that are to be compared, alternating them in rounds so that a slow drift of the machine (memory
placement, clocks, a neighbour process) weighs on all of them alike instead of on whichever ran last.

Two clocks:

- ``HostClock``: ``time.perf_counter_ns`` around each call. Right for anything whose completion the CPU
  observes, e.g. a transfer's ``post()`` + ``wait()`` (host or GPU memory alike: the call returns only once
  the bytes have landed).
- ``CudaEventClock``: CUDA events recorded on the current stream around each call. Right for work the CPU
  only enqueues, e.g. ``dst.copy_(src)`` on a GPU. For very small copies the time includes the launch gap
  an eager PyTorch user pays too, unless ``queue_ahead=True``: then the calls are enqueued while the stream
  is held, as a busy serving loop keeps its GPU fed, and each interval is the GPU's own time for the call.

For what cannot be timed as repetitions of one function, the same host clock: ``time_call`` times a single
call (calls that need untimed work between them, or that every rank makes together), ``host_seconds`` reads
the clock for an interval that is not a call (a run's CPU accounting), ``quantile`` summarises samples beyond
``Timing``'s quantiles.

Non-goals: flushing caches between repetitions (transfers are measured warm, as a serving loop sees them)
and statistics beyond quantiles.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..errors import InvalidArgumentError

T = TypeVar("T")

__all__ = ["Budget", "Timing", "Clock", "HostClock", "CudaEventClock", "measure", "measure_interleaved", "steadiest",
           "summarize", "time_call", "host_seconds", "quantile"]


@dataclass(frozen=True)
class Budget:
    """How long to measure one thing: timed calls fill ``time_s`` but number at least ``min_reps`` and at
    most ``max_reps``; ``iters`` fixes the count instead. Warm-up runs ``warmup_s`` (at least
    ``warmup_reps`` calls) and is not reported. ``rounds``: how many turns ``measure_interleaved`` takes."""

    time_s: float = 0.3
    min_reps: int = 20
    max_reps: int = 100_000
    warmup_s: float = 0.05
    warmup_reps: int = 3
    iters: int | None = None
    rounds: int = 5

    def reps_for(self, seconds_per_call: float) -> int:
        """How many timed calls this budget buys when one call takes ``seconds_per_call``. ``min_reps``
        yields for slow calls (a path on TCP emulation can take seconds per GiB): never more than about
        ten budgets' worth of calls, and never fewer than 3."""
        if self.iters is not None:
            return self.iters
        per_call = max(seconds_per_call, 1e-9)
        floor = min(self.min_reps, max(3, math.ceil(10 * self.time_s / per_call)))
        return max(floor, min(self.max_reps, math.ceil(self.time_s / per_call)))


@dataclass(frozen=True)
class Timing:
    """Summary of timed calls; times in microseconds."""

    reps: int
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    mean_us: float

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how much the timed calls varied."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us > 0 else float("inf")

    def gbps(self, nbytes: int) -> float:
        """Bandwidth at the median, in GB/s (1e9 bytes per second)."""
        return nbytes / (self.median_us * 1e-6) / 1e9 if self.median_us > 0 else float("inf")


class Clock(Protocol):
    name: str

    def time_calls(self, fn: Callable[[], Any], n: int) -> list[float]:
        """Call ``fn`` ``n`` times; the duration of each call in seconds."""


class HostClock:
    """Wall-clock time of each call, read with ``perf_counter_ns`` (tens of ns of overhead)."""

    name = "perf_counter"

    def time_calls(self, fn: Callable[[], Any], n: int) -> list[float]:
        clock = time.perf_counter_ns
        samples = [0] * n
        for i in range(n):
            start = clock()
            fn()
            samples[i] = clock() - start
        return [s * 1e-9 for s in samples]


class CudaEventClock:
    """Device time of each call between two CUDA events on the current stream.

    Events are reused in chunks so a long run does not allocate hundreds of thousands of them; the
    synchronisation between chunks falls outside every timed interval.

    ``queue_ahead=True``: each chunk is enqueued behind a gate, a ``cuStreamWaitValue32`` on a pinned host
    word, which the CPU opens once the whole chunk is enqueued. The GPU then runs the calls back to back and
    no interval contains a gap where the GPU waited for the CPU's next launch: a 4 KiB copy measures its
    time on the GPU, not the launch rate of the CPU. Only for calls that enqueue GPU work and never wait for
    it on the CPU (such a call would wait for the closed gate), and that enqueue few commands each (a chunk
    of calls that overfills CUDA's launch queue blocks the CPU behind the gate too): a chunk not enqueued
    within ``gate_timeout_s`` opens the gate from a timer and raises ``InvalidArgumentError``. The gate is
    on the current stream; a legacy-default current stream would also hold the other blocking streams of
    this device, but only until the chunk is enqueued. Each ``time_calls`` starts with one untimed call
    outside the gate, so that a function's first call (lazy module loading, a first allocation, both of
    which wait for the GPU) never runs behind one. Needs cuda-python.
    """

    name = "cuda-events"
    _CHUNK = 1000
    _QUEUED_CHUNK = 64  # calls per gate: for a few stream commands each, far below CUDA's launch queue

    def __init__(self, queue_ahead: bool = False, gate_timeout_s: float = 10.0) -> None:
        import torch  # lazily: timing host code must not need a CUDA-capable torch

        self._torch = torch
        self._gate = None
        self._gate_timeout_s = gate_timeout_s
        if queue_ahead:
            from ..cuda import HostWords, driver

            driver()  # cuda-python missing: say so here, not from inside the first gate
            self._gate = HostWords(1)
            self.name = "cuda-events, queued ahead"
        self._gate_value = 0  # the value that opens the latest gate; each chunk waits for one more

    def time_calls(self, fn: Callable[[], Any], n: int) -> list[float]:
        """Call ``fn`` ``n`` times on the current stream; each call's GPU time in seconds. Blocks until the
        GPU has run every call (a ``synchronize`` per chunk)."""
        cuda = self._torch.cuda
        if self._gate is not None:
            fn()  # outside the gate: a first call may load modules or allocate, which waits for the GPU
            cuda.synchronize()
        chunk = min(n, self._CHUNK if self._gate is None else self._QUEUED_CHUNK)
        starts = [cuda.Event(enable_timing=True) for _ in range(chunk)]
        ends = [cuda.Event(enable_timing=True) for _ in range(chunk)]
        samples: list[float] = []
        while len(samples) < n:
            count = min(chunk, n - len(samples))
            with self._gated(count):
                for i in range(count):
                    starts[i].record()
                    fn()
                    ends[i].record()
            cuda.synchronize()
            samples.extend(starts[i].elapsed_time(ends[i]) * 1e-3 for i in range(count))
        return samples

    @contextlib.contextmanager
    def _gated(self, count: int) -> Iterator[None]:
        """Hold the current stream while the block enqueues ``count`` calls (no-op without ``queue_ahead``).
        The gate is opened however the block ends; a timer opens it if the block takes too long (the timer's
        thread needs the GIL, which a call blocked in CUDA's launch queue or in a wait releases)."""
        if self._gate is None:
            yield
            return
        from ..cuda import stream_wait_value

        self._gate_value = (self._gate_value + 1) & 0xFFFFFFFF
        value, word = self._gate_value, self._gate.values
        fired = threading.Event()

        def open_gate() -> None:  # a call that waits for the GPU on the CPU would otherwise wait forever
            word[0] = value
            fired.set()

        timer = threading.Timer(self._gate_timeout_s, open_gate)
        try:
            stream_wait_value(self._torch.cuda.current_stream(), self._gate.addr(0), value)
            timer.start()
            yield
        finally:
            timer.cancel()
            word[0] = value
        if fired.is_set():
            raise InvalidArgumentError(
                f"CudaEventClock(queue_ahead=True): enqueuing {count} calls took over {self._gate_timeout_s:g}s "
                "behind a closed gate, so a call waits for the GPU on the CPU or enqueues more than CUDA queues "
                "without blocking; time it with CudaEventClock() or HostClock()")


def measure(fn: Callable[[], Any], clock: Clock | None = None, budget: Budget | None = None) -> Timing:
    """Warm ``fn`` up, then time ``budget.reps_for(...)`` calls of it with ``clock`` (default: host).

    Blocks for about ``budget.warmup_s + budget.time_s``. Python's garbage collector is paused while
    timing so that a collection does not land inside one sample.
    """
    clock = clock or HostClock()
    budget = budget or Budget()
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        per_call = _warm_up(fn, clock, budget)
        samples = clock.time_calls(fn, budget.reps_for(per_call))
    finally:
        if gc_was_enabled:
            gc.enable()
    return summarize(samples)


def measure_interleaved(fns: dict[str, Callable[[], Any]], clock: Clock | None = None,
                        budget: Budget | None = None) -> dict[str, Timing]:
    """Time several functions against each other: each is warmed up and gets its own repetition count from
    ``budget`` (as ``measure`` would), but the timed calls run in ``budget.rounds`` rounds, every function in
    turn within a round. Blocks for about ``len(fns) * (budget.warmup_s + budget.time_s)``."""
    clock = clock or HostClock()
    budget = budget or Budget()
    rounds = max(budget.rounds, 1)
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        per_round = {name: math.ceil(budget.reps_for(_warm_up(fn, clock, budget)) / rounds) for name, fn in fns.items()}
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                samples[name].extend(clock.time_calls(fn, per_round[name]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: summarize(values) for name, values in samples.items()}


def steadiest(measure_once: Callable[[], T], spread_of: Callable[[T], float] = lambda t: t.spread,
              tries: int = 3, spread: float = 0.2) -> T:
    """A measurement repeated until its reference is steady: ``measure_once()`` again while ``spread_of`` its
    result (p10 to p90 over the median of the reference's calls; default: the result is that ``Timing``)
    exceeds ``spread``, at most ``tries`` times in all; the steadiest of the tries. Benchmarks flag a reference
    that stays unsteady instead of dividing by it (``record.Record.against``)."""
    best = measure_once()
    for _ in range(tries - 1):
        if spread_of(best) <= spread:
            break
        again = measure_once()
        best = again if spread_of(again) < spread_of(best) else best
    return best


def _warm_up(fn: Callable[[], Any], clock: Clock, budget: Budget) -> float:
    """Run ``fn`` for ``budget.warmup_s`` (at least ``warmup_reps`` calls); the median call time in s.
    Batches double so that a microsecond call is not dominated by the loop's bookkeeping."""
    samples: list[float] = []
    batch = max(budget.warmup_reps, 1)
    deadline = host_seconds() + budget.warmup_s
    while True:
        samples.extend(clock.time_calls(fn, batch))
        if host_seconds() >= deadline:
            break
        batch = min(batch * 2, 4096)
    samples.sort()
    return samples[len(samples) // 2]


def time_call(fn: Callable[[], Any], clock: Clock | None = None) -> float:
    """Seconds one call of ``fn`` takes on ``clock`` (default: host), for calls that cannot be timed as
    repetitions: each needs untimed work around it, or every rank makes it together. No warm-up."""
    return (clock or HostClock()).time_calls(fn, 1)[0]


def host_seconds() -> float:
    """The host clock (``perf_counter``) in seconds, for an interval that is not one call of a function."""
    return time.perf_counter()


def summarize(samples_s: list[float]) -> Timing:
    """Median, p10, p90, min and mean of durations given in seconds, reported in microseconds."""
    if not samples_s:
        raise InvalidArgumentError("summarize: no samples; time at least one call")
    us = sorted(s * 1e6 for s in samples_s)
    return Timing(
        reps=len(us),
        median_us=_quantile(us, 0.5),
        p10_us=_quantile(us, 0.1),
        p90_us=_quantile(us, 0.9),
        min_us=us[0],
        mean_us=sum(us) / len(us),
    )


def quantile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``samples``, in their unit; interpolated as numpy's default does."""
    if not samples:
        raise InvalidArgumentError("quantile: no samples; time at least one call")
    return _quantile(sorted(samples), q)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)
