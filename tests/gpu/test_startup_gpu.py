"""Start-up under the user's CUDA work: ``tw.init`` while other threads of the process allocate CUDA memory, map
and unmap memory, and create the first CUDA tensor, as a serving engine does right after joining (load a model,
allocate its KV cache).

Making the NIXL agent installs UCX's memory hooks: UCX rewrites the entry of ``mmap``/``munmap`` and of the CUDA
driver's allocation functions in place. A thread that runs one of them while it is being rewritten dies of SIGSEGV,
so the hooks must be in place before ``init`` hands the process back to its user. Each rank here keeps threads
calling exactly those functions from before ``init`` until the agent exists, then moves CUDA memory over NIXL.

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
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    stop = threading.Event()
    threads = [threading.Thread(target=_map_and_unmap, args=(stop,), daemon=True),
               threading.Thread(target=_allocate_cuda, args=(stop, device), daemon=True)]
    for thread in threads:
        thread.start()
    try:
        with tw.init(timeout=INIT_TIMEOUT) as comm:
            mine = torch.zeros(WORDS, dtype=torch.int32, device=device)  # maybe the process's first CUDA tensor
            inbox = torch.zeros_like(mine)
            nixl = comm.runtime.transports.get("nixl")
            if nixl is not None:
                nixl.wait_ready()  # the load goes on until the agent, UCX's hooks with it, exists
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
