"""Start-up under the user's CUDA work: ``tw.init`` while other threads of the process allocate CUDA memory, map
and unmap memory, and create the first CUDA tensor, as a serving engine does right after joining (load a model,
allocate its KV cache).

Making the NIXL agent installs UCX's memory hooks: UCX rewrites the entry of ``mmap``/``munmap`` and of the CUDA
driver's allocation functions in place. A thread that runs one of them while it is being rewritten dies of SIGSEGV,
so the hooks must be in place before ``init`` hands the process back to its user. Each rank here makes its first
CUDA tensor right after ``init``, with threads calling those functions around it, then moves CUDA memory over NIXL.
The GPU conformance case (``test_conformance.py``, ``gpu_memory``), which does the same without the extra threads,
is what showed the race: 2 of 28 runs lost a rank to SIGSEGV while the agent was still being made on a thread of
its own, 0 of 58 once it was made before ``init`` returned. This test alone did not crash in 80 launches with the
agent made on its own thread; it guards the pattern, the conformance case the race.

Selected with ``pytest -m gpu``; ``TENSORWIRE_STARTUP_LAUNCHES`` sets how many jobs each case starts (a race shows
in some start-ups, not all).
"""

from __future__ import annotations

import mmap
import os
import threading

import pytest
import torch

import tensorwire as tw
from tensorwire.testing.data import assert_equal, rank_values
from tensorwire.testing.suite import GPU_ENV, INIT_TIMEOUT, WAIT, launch

pytestmark = pytest.mark.gpu

LAUNCHES = int(os.environ.get("TENSORWIRE_STARTUP_LAUNCHES", "4"))
WORDS = 1 << 16


def _map_and_unmap(stop: threading.Event) -> None:
    """``mmap`` + ``munmap`` of 1 MiB, over and over (the GIL is released around both calls)."""
    while not stop.is_set():
        mmap.mmap(-1, 1 << 20).close()


def _allocate_cuda(stop: threading.Event, device: torch.device) -> None:
    """``cudaMalloc`` + ``cudaFree`` of 1 MiB, over and over (the caching allocator returns each block at once)."""
    torch.cuda.set_device(device)
    while not stop.is_set():
        block = torch.empty(1 << 20, dtype=torch.uint8, device=device)
        del block
        torch.cuda.empty_cache()


def _start_up_under_load() -> str:
    """One rank: ``mmap`` traffic from before ``init``; right after it, the process's first CUDA tensor (its CUDA
    context is made here, every module loaded at once with ``CUDA_MODULE_LOADING=EAGER``) beside a thread that
    allocates CUDA memory, until the NIXL agent exists; then a NIXL READ of the peer's CUDA memory."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    stop = threading.Event()
    threads = [threading.Thread(target=_map_and_unmap, args=(stop,), daemon=True)]
    threads[0].start()
    try:
        with tw.init(timeout=INIT_TIMEOUT) as comm:
            threads.append(threading.Thread(target=_allocate_cuda, args=(stop, device), daemon=True))
            threads[-1].start()
            mine = torch.zeros(WORDS, dtype=torch.int32, device=device)  # the process's first CUDA tensor
            inbox = torch.zeros_like(mine)
            nixl = comm.runtime.transports.get("nixl")
            if nixl is not None:
                nixl.wait_ready()
            stop.set()
            for thread in threads:
                thread.join(timeout=WAIT)
            registration = comm.register([mine, inbox])
            mine.copy_(rank_values(comm.rank, WORDS, torch.int32, device))
            torch.cuda.synchronize()
            comm.publish("startup", registration.descs)
            theirs = comm.lookup("startup", 1 - comm.rank, timeout=WAIT)
            comm.barrier(timeout=WAIT)
            transport = "nixl" if nixl is not None else None
            with comm.prepare(tw.READ, inbox, theirs[0], transport=transport) as read:
                read.post()
                read.wait(timeout=WAIT)
                used = read.transport
            assert_equal(inbox, rank_values(1 - comm.rank, WORDS, torch.int32, device), "READ after start-up")
            comm.barrier(timeout=WAIT)
            registration.close()
            return used
    finally:
        stop.set()


@pytest.mark.parametrize("launch_index", range(LAUNCHES))
def test_start_up_survives_threads_using_cuda_and_mmap(launch_index):
    used = launch(_start_up_under_load, 2, env=GPU_ENV)
    assert used[0] == used[1], used
