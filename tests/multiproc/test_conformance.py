"""Every registered transport through the same cases: the plug-in contract of ``backends/base.py``, with real
processes and real NIXL.

The transports come from ``backends.registry`` (production and test ones alike), so a transport added there is run
here without a line of this file changing. What each case needs is derived from the transport's declared
``Capabilities``, never from its name: one that reaches only this process runs in a one-rank world with transfers
to itself; one that reaches other processes runs between two ranks on this host, in host memory kept in shared
files (which ``shm`` needs and the others take too). Each transfer is forced onto the transport under test
(``transport=``) and ``Transfer.transport`` must name it.

Cases, in one launch per transport: READ and WRITE of one tensor, lists of ranges in one transfer, ``notify=``
after the data, re-posting one handle with new data each round, block READ and WRITE by id, ``close`` (idempotent,
posts refused after it, and with the registration under the transfer); a dead peer in a launch of its own
(``PeerLostError`` within the liveness bound). The same cases run on CUDA memory with stream posts and waits for
every transport that moves CUDA memory (``gpu`` marker).
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

import tensorwire as tw
from tensorwire.backends import registry
from tensorwire.descriptors import MemoryKind
from tensorwire.testing.data import assert_equal, rank_values
from tensorwire.testing.suite import GPU_ENV, INIT_TIMEOUT, WAIT, drain, launch

ALL = registry.TRANSPORTS + registry.TEST_TRANSPORTS
NAMES = [t.name for t in ALL]
WORDS = 4096  # int32 words per buffer: 16 KiB
NUM_BLOCKS, BLOCK_WORDS = 16, 256
LIVENESS_S = 2.0


def _world_size(name: str) -> int:
    return 2 if registry.transport(name).capabilities.remote else 1


def _skip_unless_moves(name: str, kind: MemoryKind) -> None:
    caps = registry.transport(name).capabilities
    if kind not in caps.memory_kinds:
        pytest.skip(f"{name} moves {sorted(k.name for k in caps.memory_kinds)} memory only, not {kind.name}")
    if kind is MemoryKind.CPU and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here: the host buffers of the suite live in shared files")


class _Buffers:
    """One rank's memory for the cases: ``mine`` (its own values), ``inbox`` (what peers write or it reads),
    registered at once; host buffers in shared files (removed at ``close``)."""

    def __init__(self, comm: tw.Communicator, device: str) -> None:
        self.device, self._files = device, []
        self.mine, self.inbox = self.tensor(WORDS), self.tensor(WORDS)
        self.registration = comm.register([self.mine, self.inbox])

    def tensor(self, words: int) -> torch.Tensor:
        if self.device != "cpu":
            return torch.zeros(words, dtype=torch.int32, device=self.device)
        self._files.append(f"/dev/shm/tensorwire-conformance-{uuid.uuid4().hex}")
        return torch.from_file(self._files[-1], shared=True, size=words, dtype=torch.int32)

    def close(self) -> None:
        for path in self._files:
            os.unlink(path)


def _settle(device: str, stream=None) -> None:
    """The bytes written so far are in place (GPU: the default stream's kernels and ``stream``'s copies ran)."""
    if device != "cpu":
        torch.cuda.synchronize()
        if stream is not None:
            drain(stream)


def _complete(transfer, stream) -> None:
    """Post and complete ``transfer``: on the CPU, or on ``stream`` (then drained) for the GPU variant."""
    if stream is None:
        transfer.post()
        transfer.wait(timeout=WAIT)
        return
    transfer.post(stream=stream)
    transfer.wait(stream=stream, timeout=WAIT)
    drain(stream)


def _read_and_write(comm, name, peer, mine, theirs, stream) -> None:
    """READ the peer's values into ``inbox``; WRITE ours into the peer's ``inbox`` (both checked)."""
    mine.mine.copy_(rank_values(comm.rank, WORDS, torch.int32, mine.device))
    _settle(mine.device)
    comm.barrier(timeout=WAIT)
    with comm.prepare(tw.READ, mine.inbox, theirs[0], transport=name) as read:
        assert read.transport == name, read
        _complete(read, stream)
    assert_equal(mine.inbox, rank_values(peer, WORDS, torch.int32, mine.device), f"{name} READ from rank {peer}")
    comm.barrier(timeout=WAIT)
    with comm.prepare(tw.WRITE, mine.mine, theirs[1], transport=name) as write:
        _complete(write, stream)
    comm.barrier(timeout=WAIT)
    assert_equal(mine.inbox, rank_values(peer, WORDS, torch.int32, mine.device), f"{name} WRITE from rank {peer}")


def _lists(comm, name, peer, mine, theirs, stream) -> None:
    """Three ranges of the peer's ``mine`` into three places of our ``inbox``, in one transfer."""
    mine.inbox.zero_()
    _settle(mine.device)
    ranges = [(0, 100), (1000, 1), (2048, 2048)]  # (word offset, words)
    remote = [theirs[0].narrow(4 * offset, 4 * words) for offset, words in ranges]
    local = [mine.inbox[WORDS - offset - words:WORDS - offset] for offset, words in ranges]
    with comm.prepare(tw.READ, local, remote, transport=name) as read:
        _complete(read, stream)
    expected = rank_values(peer, WORDS, torch.int32, mine.device)
    for (offset, words), got in zip(ranges, local):
        assert_equal(got, expected[offset:offset + words], f"{name} READ list item at word {offset}")


def _notify_and_repost(comm, name, peer, mine, theirs, stream) -> None:
    """One WRITE handle posted four times with new data, each post followed by its notification."""
    comm.barrier(timeout=WAIT)
    with comm.prepare(tw.WRITE, mine.mine, theirs[1], notify=f"conformance {comm.rank}".encode(),
                      transport=name) as write:
        for round_ in range(4):
            mine.mine.copy_(rank_values(comm.rank, WORDS, torch.int32, mine.device, offset=round_))
            _settle(mine.device)
            _complete(write, stream)
            message = comm.wait_notification(peer, timeout=WAIT)
            assert message == f"conformance {peer}".encode(), (name, round_, message)
            expected = rank_values(peer, WORDS, torch.int32, mine.device, offset=round_)
            assert_equal(mine.inbox, expected, f"{name} WRITE round {round_} from rank {peer}, after its notify")
            comm.barrier(timeout=WAIT)  # the peer's next round overwrites what was just checked


def _blocks(comm, name, peer, mine, stream) -> None:
    """Block READ and WRITE by id between two pools (ids reversed, every second block)."""
    cache = mine.tensor(NUM_BLOCKS * BLOCK_WORDS).view(NUM_BLOCKS, BLOCK_WORDS)
    values = rank_values(comm.rank, NUM_BLOCKS * BLOCK_WORDS, torch.int32, mine.device).view(NUM_BLOCKS, BLOCK_WORDS)
    cache.copy_(values)
    _settle(mine.device)
    with comm.register_blocks(cache) as pool:
        comm.publish_blocks(f"conformance-{name}", pool)
        remote = comm.lookup_blocks(f"conformance-{name}", peer, timeout=WAIT)
        remote_ids, local_ids = list(range(0, NUM_BLOCKS, 2)), list(range(NUM_BLOCKS - 1, 0, -2))
        comm.barrier(timeout=WAIT)
        theirs = rank_values(peer, NUM_BLOCKS * BLOCK_WORDS, torch.int32, mine.device).view(NUM_BLOCKS, BLOCK_WORDS)
        with comm.prepare_blocks(tw.READ, pool, remote, transport=name) as read:
            assert read.transport == name, read
            read.post(local_ids, remote_ids, stream=stream)
            read.wait(timeout=WAIT, stream=stream)
            _settle(mine.device, stream)
        for local, remote_id in zip(local_ids, remote_ids):
            assert_equal(cache[local], theirs[remote_id], f"{name} block READ {remote_id} -> {local}")
        comm.barrier(timeout=WAIT)
        cache.copy_(values)
        _settle(mine.device)
        comm.barrier(timeout=WAIT)
        with comm.prepare_blocks(tw.WRITE, pool, remote, transport=name) as write:
            write.post(local_ids, remote_ids, stream=stream)
            write.wait(timeout=WAIT, stream=stream)
            _settle(mine.device, stream)
        comm.barrier(timeout=WAIT)
        for local, remote_id in zip(local_ids, remote_ids):
            assert_equal(cache[remote_id], theirs[local], f"{name} block WRITE {local} -> {remote_id} from {peer}")
        comm.barrier(timeout=WAIT)


def _close(comm, name, mine, theirs) -> None:
    """close() is idempotent and refuses later posts; closing the registration closes what was prepared on it."""
    transfer = comm.prepare(tw.READ, mine.inbox, theirs[0], transport=name)
    transfer.close()
    transfer.close()
    with pytest.raises(tw.ClosedError):
        transfer.post()
    scratch = mine.tensor(64)
    registration = comm.register(scratch)
    on_scratch = comm.prepare(tw.READ, scratch, theirs[0].narrow(0, 256), transport=name)
    comm.barrier(timeout=WAIT)  # both ranks hold the peer's map before either closes memory
    registration.close()
    assert on_scratch.closed
    with pytest.raises(tw.ClosedError):
        on_scratch.post()


def _conformance(name: str, device: str) -> str:
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        if device != "cpu":
            device = f"cuda:{comm.device.index}"
        remote = registry.transport(name).capabilities.remote
        peer = 1 - comm.rank if remote else comm.rank
        mine = _Buffers(comm, device)
        try:
            comm.publish("conformance", mine.registration.descs)
            theirs = comm.lookup("conformance", peer, timeout=WAIT)
            stream = torch.cuda.Stream(device) if device != "cpu" else None
            _read_and_write(comm, name, peer, mine, theirs, stream)
            _lists(comm, name, peer, mine, theirs, stream)
            _notify_and_repost(comm, name, peer, mine, theirs, stream)
            _blocks(comm, name, peer, mine, stream)
            _close(comm, name, mine, theirs)
            comm.barrier(timeout=WAIT)
        finally:
            mine.close()
    return name


@pytest.mark.parametrize("name", NAMES)
def test_a_transport_passes_every_case_on_host_memory(name):
    _skip_unless_moves(name, MemoryKind.CPU)
    assert launch(_conformance, _world_size(name), name, "cpu") == [name] * _world_size(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_a_transport_passes_every_case_on_gpu_memory_with_stream_posts(name):
    _skip_unless_moves(name, MemoryKind.CUDA)
    world_size = _world_size(name)  # two ranks share the GPU where there is one
    assert launch(_conformance, world_size, name, "cuda", env=GPU_ENV) == [name] * world_size


def _dead_peer(name: str) -> float | None:
    """Rank 1 dies (``os._exit``) with a transfer of rank 0 prepared to it; rank 0 posts until the transfer
    fails and returns how long after the death that took."""
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        mine = _Buffers(comm, "cpu")
        try:
            comm.publish("conformance", mine.registration.descs)
            theirs = comm.lookup("conformance", 1 - comm.rank, timeout=WAIT)
            transfer = comm.prepare(tw.WRITE, mine.mine, theirs[1], transport=name)
            comm.barrier(timeout=WAIT)
            if comm.rank == 1:
                mine.close()
                os._exit(0)
            died = time.monotonic()
            with pytest.raises(tw.PeerLostError):
                while time.monotonic() - died < LIVENESS_S + 10:
                    transfer.post()
                    transfer.wait(timeout=WAIT)
                    time.sleep(0.01)
            return time.monotonic() - died
        finally:
            mine.close()


@pytest.mark.parametrize("name", NAMES)
def test_a_transport_reports_a_dead_peer(name):
    caps = registry.transport(name).capabilities
    if not caps.remote:
        pytest.skip(f"{name} reaches this process only: it has no peer that could die")
    _skip_unless_moves(name, MemoryKind.CPU)
    seconds = launch(_dead_peer, 2, name, env={"TENSORWIRE_LIVENESS_S": str(LIVENESS_S)}, may_die=(1,))[0]
    assert seconds is not None and seconds < LIVENESS_S + 10, seconds
