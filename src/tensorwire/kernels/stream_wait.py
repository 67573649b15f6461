"""A one-thread Triton kernel that holds a stream until a host-mapped word reaches a value.

Why a kernel and not ``cuStreamWaitValue32``: a blocking stream memory operation stalls the hardware
work queue it sits in, and CUDA multiplexes many streams onto few queues. A copy that NIXL/UCX enqueues
on its own stream in the same process can land behind the wait in the same queue: the copy never runs,
the word is never released, and the GPU deadlocks (seen on an H200 with a NIXL READ over cuda_ipc
feeding a CUDA-graph replay). A running kernel does not hold its queue, so work behind it proceeds.

Contract: ``flag`` is a 32-bit word in pinned host memory (mapped into every context at the same
address), written only by the CPU. The kernel spins with volatile loads until ``flag >= target`` and
exits; kernels after it on the stream see everything that completed before the CPU's store.
Graph-capturable; occupies one warp of one SM while it waits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _wait_geq(flag_ptr, target):
    value = tl.load(flag_ptr, volatile=True)
    while value < target:
        value = tl.load(flag_ptr, volatile=True)


def wait_geq(flag: torch.Tensor, target: int, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream`` a wait until ``flag[0] >= target``. ``flag``: int32 [1], pinned host memory."""
    with torch.cuda.stream(stream):
        _wait_geq[(1,)](flag, target, num_warps=1)


@functools.cache
def warm_up(device_index: int) -> None:
    """Compile and load the kernel once, before any stream can block on it (lazy loading deadlocks)."""
    flag = torch.ones(1, dtype=torch.int32, pin_memory=True)
    with torch.cuda.device(device_index):
        stream = torch.cuda.current_stream()
        wait_geq(flag, 0, stream)
        stream.synchronize()
