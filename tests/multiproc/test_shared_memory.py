"""Shared host memory: ``tw.shared_empty`` allocates a tensor that owns its ``/dev/shm`` file (a peer on this host
reaches it over ``shm``; the file goes with the tensor, and what a killed process left goes with the next
tensorwire process), and a transfer that loses ``shm`` says why: a warning once when it falls back to NIXL,
the reason in the error when ``shm`` was forced."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import tensorwire as tw
from tensorwire.shared_memory import SHM_DIRECTORY, orphans, remove_orphans
from tensorwire.testing.data import assert_equal, rank_values
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIRECTORY), reason="no /dev/shm here: nothing to share")


def _file_of(tensor: torch.Tensor) -> str:
    from tensorwire.backends.shm import shared_file_of

    found = shared_file_of(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    assert found is not None, "shared_empty's tensor is not in a shared file a peer can open"
    return found.path


def test_a_shared_tensor_owns_its_file():
    tensor = tw.shared_empty((4, 1024), dtype=torch.bfloat16)
    assert tensor.shape == (4, 1024) and tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
    path = _file_of(tensor)
    assert os.path.dirname(path) == SHM_DIRECTORY and os.path.basename(path).startswith("tensorwire-")
    assert os.stat(path).st_size == 4 * 1024 * 2
    del tensor
    gc.collect()
    assert not os.path.exists(path), "the file outlived its tensor"


@pytest.mark.parametrize("shape, dtype, says", [
    ((0, 4), torch.float32, "shape=(0, 4)"), ((-1,), torch.float32, "shape=(-1,)"), ((), torch.float32, "shape=()"),
    ((4,), "float32", "dtype='float32'"),
])
def test_bad_shapes_and_dtypes_are_refused(shape, dtype, says):
    with pytest.raises(tw.InvalidArgumentError, match=f"shared_empty: {says}".replace("(", r"\(").replace(")", r"\)")):
        tw.shared_empty(shape, dtype=dtype)


_ALLOCATE_THEN_DIE = """
import os, signal, torch, tensorwire as tw
from tensorwire.backends.shm import shared_file_of
tensor = tw.shared_empty(4096, dtype=torch.uint8)
print(shared_file_of(tensor.data_ptr(), 4096).path, flush=True)
{end}
"""


@pytest.mark.parametrize("end", ["os.kill(os.getpid(), signal.SIGKILL)", "os._exit(3)"])
def test_what_a_killed_process_left_is_removed_by_the_next_one(end):
    """A process that ends without any cleanup running leaves its file; the next one (here its ``shared_empty``)
    removes it, never its own."""
    done = subprocess.run([sys.executable, "-c", _ALLOCATE_THEN_DIE.format(end=end)], capture_output=True, text=True,
                          timeout=120, check=False)
    path = done.stdout.strip()
    assert path.startswith(SHM_DIRECTORY) and os.path.exists(path), (done.returncode, done.stderr[-2000:])
    assert path in orphans()
    alive = tw.shared_empty(16)  # the next tensorwire call of this host: it removes what the dead one left
    assert not os.path.exists(path)
    assert _file_of(alive) not in orphans() and _file_of(alive) not in remove_orphans()
    assert os.path.exists(_file_of(alive))


def test_tw_init_removes_what_killed_processes_left():
    path = os.path.join(SHM_DIRECTORY, f"tensorwire-{_namespace()}-{_dead_pid()}-0123abcd")
    with open(path, "wb") as file:
        file.write(b"left behind")
    port = tw.testing.free_port()
    with tw.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, timeout=INIT_TIMEOUT):
        assert not os.path.exists(path)


def test_a_file_whose_pid_now_belongs_to_another_process_is_an_orphan_and_a_live_ones_is_not():
    """The name records its process's start time: a file named with a live pid (this one) but another start
    time was left by a process that had this pid before (a reused pid), and is removed; this process's own
    name stays."""
    own = os.path.basename(tw.shared_memory.owned_file_name())
    namespace, pid, start, random = own.split("-")[1:]
    assert pid == str(os.getpid()) and int(start) > 0, own
    earlier = os.path.join(SHM_DIRECTORY, f"tensorwire-{namespace}-{pid}-{int(start) - 1}-{random}")
    mine = os.path.join(SHM_DIRECTORY, own)
    for path in (earlier, mine):
        with open(path, "wb") as file:
            file.write(b"x")
    try:
        removed = remove_orphans()
        assert earlier in removed and not os.path.exists(earlier)
        assert mine not in removed and os.path.exists(mine)
    finally:
        for path in (earlier, mine):
            if os.path.exists(path):
                os.unlink(path)


def test_a_process_ended_by_an_uncaught_exception_removes_its_files():
    done = subprocess.run([sys.executable, "-c", _ALLOCATE_THEN_DIE.format(end="raise RuntimeError('boom')")],
                          capture_output=True, text=True, timeout=120, check=False)
    path = done.stdout.strip()
    assert done.returncode == 1 and "RuntimeError: boom" in done.stderr and path.startswith(SHM_DIRECTORY), done
    assert not os.path.exists(path), "the file outlived its process"


_ALLOCATE_THEN_WAIT = """
import time, torch, tensorwire as tw
from tensorwire.backends.shm import shared_file_of
tensor = tw.shared_empty(4096, dtype=torch.uint8)
print(shared_file_of(tensor.data_ptr(), 4096).path, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP])
def test_a_process_ended_by_sigterm_or_sighup_removes_its_files_and_still_dies_of_the_signal(number):
    process = subprocess.Popen([sys.executable, "-c", _ALLOCATE_THEN_WAIT], stdout=subprocess.PIPE, text=True)
    try:
        path = process.stdout.readline().strip()
        assert path.startswith(SHM_DIRECTORY) and os.path.exists(path), path
        process.send_signal(number)
        assert process.wait(timeout=60) == -number  # ended by the signal, as without tensorwire
        assert not os.path.exists(path), "the file outlived its process"
    finally:
        process.kill()
        process.wait(timeout=60)


def _namespace() -> int:
    return int(os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]"))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def _shm_file_removed_before_first_contact():
    """Rank 1 registers a shared tensor and publishes it, then its file is removed (as a cleanup script might)
    before rank 0 ever reaches it: rank 0's READ falls back to NIXL, warning why; forcing shm says why not; rank
    1 registering that memory again is warned that peers cannot reach it through the file."""
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        out = {}
        if comm.rank == 1:
            source = tw.shared_empty(1024)
            source.copy_(rank_values(1, 1024))
            with comm.register(source) as reg:
                comm.publish("source", reg.descs)
                os.unlink(_file_of(source))
                comm.barrier(timeout=WAIT)  # the file is gone
                comm.barrier(timeout=WAIT)  # rank 0 is done
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                comm.register(source).close()
            out["register"] = [str(w.message) for w in caught if issubclass(w.category, tw.TensorwireWarning)]
            return out
        comm.barrier(timeout=WAIT)
        remote = comm.lookup("source", 1, timeout=WAIT)[0]
        inbox = torch.zeros(1024)
        with comm.register(inbox):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(2):  # warned once
                    with comm.prepare(tw.READ, inbox, remote) as x:
                        out["transport"] = x.transport
                        x.post()
                        x.wait(timeout=WAIT)
            out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, tw.TensorwireWarning)]
            assert_equal(inbox, rank_values(1, 1024), "READ over the fallback")
            out["forced"] = _forced_error(comm, inbox, remote)
        comm.barrier(timeout=WAIT)
        return out


def _forced_error(comm, inbox, remote) -> str:
    with pytest.raises(tw.InvalidArgumentError) as error:
        comm.prepare(tw.READ, inbox, remote, transport="shm")
    return str(error.value)


def test_losing_shm_warns_once_and_a_forced_shm_says_why():
    rank0, rank1 = launch(_shm_file_removed_before_first_contact, 2)
    assert rank0["transport"] == "nixl", rank0
    assert len(rank0["warnings"]) == 1 and "not shm" in rank0["warnings"][0], rank0["warnings"]
    assert "cannot be opened" in rank0["warnings"][0], rank0["warnings"]
    assert "transport='shm' cannot reach rank 1" in rank0["forced"] and "cannot be opened" in rank0["forced"], rank0
    assert any("removed after it was mapped" in w for w in rank1["register"]), rank1
