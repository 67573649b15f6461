"""The ``shm`` transport's view of host memory: which ranges lie in a shared file a peer can open."""

from __future__ import annotations

import dataclasses

import torch


def test_shared_file_of_finds_only_mappings_a_peer_can_open(tmp_path):
    """A range inside a MAP_SHARED file mapping is found with its file offset and identity; anonymous
    memory, and a mapping whose path now names another file (or none), are not."""
    import os

    from tensorwire.backends.shm import shared_file_of

    path = str(tmp_path / "shared")
    mapped = torch.from_file(path, shared=True, size=8192, dtype=torch.uint8)
    found = shared_file_of(mapped.data_ptr() + 100, 1000)
    assert (found.path, found.offset, found.inode) == (path, 100, os.stat(path).st_ino) and found.is_at_path()
    assert not dataclasses.replace(found, inode=found.inode + 1).is_at_path()  # same name, another file
    assert shared_file_of(mapped.data_ptr(), 8192 + 1) is None  # runs past the mapping
    assert shared_file_of(torch.zeros(4096, dtype=torch.uint8).data_ptr(), 4096) is None
    os.unlink(path)
    assert shared_file_of(mapped.data_ptr(), 10) is None and not found.is_at_path()
    torch.from_file(path, shared=True, size=8192, dtype=torch.uint8)  # a new file under the old name
    assert shared_file_of(mapped.data_ptr(), 10) is None and not found.is_at_path()


def test_a_killed_ranks_files_go_by_its_pid_while_it_is_still_alive():
    """A launcher that killed a rank removes its files at once, though the rank may still be alive while the kernel
    tears it down (``remove_orphans`` spares a live process's files); another live process's file stays."""
    import os
    import subprocess

    import pytest

    from tensorwire import shared_memory

    if not os.path.isdir(shared_memory.SHM_DIRECTORY):
        pytest.skip("no /dev/shm here")
    rank = subprocess.Popen(["sleep", "60"])
    try:
        started = shared_memory.start_time(rank.pid)
        namespace = os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]")
        its, other = (os.path.join(shared_memory.SHM_DIRECTORY, f"tensorwire-{namespace}-{pid}-{start}-0a1b")
                      for pid, start in ((rank.pid, started), (os.getpid(), shared_memory.start_time(os.getpid()))))
        for path in (its, other):
            open(path, "wb").close()
        assert its not in shared_memory.orphans()  # alive: no later process would remove it
        assert shared_memory.remove_files_of(rank.pid, started) == [its]
        assert not os.path.exists(its) and os.path.exists(other)
    finally:
        rank.kill()
        rank.wait()
        for path in (its, other):
            if os.path.exists(path):
                os.unlink(path)
