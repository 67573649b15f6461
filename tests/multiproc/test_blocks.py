"""KV-cache block transfers (``register_blocks`` / ``prepare_blocks`` / ``read_blocks`` / ``write_blocks``).

Pools hold values that encode their rank, view and block (``pool_values``), so a block from the wrong rank,
the wrong view or the wrong id shows up; every result is compared with a reference built by plain indexing.
Host memory runs over real NIXL between processes (plain ``torch.empty`` memory), over ``shm`` (memory in
``/dev/shm`` files) and in one process (``local``); GPU memory runs in ``test_blocks_gpu.py``.
"""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.block_transfer import DestinationIds, as_ids
from tensorwire.shared_memory import owned_file_name
from tensorwire.testing.data import assert_equal
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch

NUM_BLOCKS = 96
SHAPES = ((2, 4, 8), (16,))  # a vLLM-like [num_blocks, 2, block, head_dim] view and a flat one


def pool_values(rank: int, view: int, shape: tuple, device="cpu") -> torch.Tensor:
    """``[NUM_BLOCKS, *shape]`` int32: ``rank * 10^7 + view * 10^6 + block * 1000 + index in block``."""
    per_block = int(np.prod(shape))
    values = (torch.arange(NUM_BLOCKS, dtype=torch.int32)[:, None] * 1000 + torch.arange(per_block, dtype=torch.int32))
    return (values + rank * 10**7 + view * 10**6).view(NUM_BLOCKS, *shape).to(device)


def make_views(rank: int, memory: str, files: list[str]) -> list[torch.Tensor]:
    """One view per entry of SHAPES (this rank's values), in plain host memory or, for ``memory='shm'``, in
    files under /dev/shm (their paths appended to ``files``: the caller removes them)."""
    views = []
    for i, shape in enumerate(SHAPES):
        values = pool_values(rank, i, shape)
        if memory == "shm":
            files.append(owned_file_name())
            view = torch.from_file(files[-1], shared=True, size=values.numel(), dtype=torch.int32).view(values.shape)
            views.append(view.copy_(values))
        else:
            views.append(values)
    return views


def expected_after(before: list[torch.Tensor], source: list[torch.Tensor], dst_ids, src_ids) -> list[torch.Tensor]:
    out = [b.clone() for b in before]
    for o, s in zip(out, source):
        o[torch.as_tensor(dst_ids)] = s[torch.as_tensor(src_ids)]
    return out


# --- unit: ids and descriptors ---------------------------------------------------------------------
def test_ids_accept_lists_arrays_and_tensors():
    for ids in ([3, 1, 2], np.array([3, 1, 2], dtype=np.int32), torch.tensor([3, 1, 2])):
        out = as_ids(ids, 8, "ids", None, unique=True)
        assert out.dtype == np.int64 and out.tolist() == [3, 1, 2]
    assert len(as_ids([], 8, "ids", None, unique=True)) == 0


@pytest.mark.parametrize("ids, fragment", [
    ([0, 8], "id 8 at position 1 is outside [0, 8)"),
    ([-1], "id -1 at position 0"),
    ([2, 5, 2], "destination block 2 appears 2 times"),
    ([1.0, 2.0], "pass 1-D integer block ids"),
    (np.zeros((2, 2), dtype=np.int64), "pass 1-D integer block ids"),
    (torch.zeros(3, dtype=torch.float32), "pass a 1-D int32 or int64 tensor"),
    ("12", "pass a 1-D integer tensor"),
])
def test_bad_ids_are_refused_with_the_fix(ids, fragment):
    with pytest.raises(tw.InvalidArgumentError, match=fragment.replace("[", r"\[").replace(")", r"\)")):
        as_ids(ids, 8, "ids", None, unique=True)


def test_duplicate_sources_are_allowed():
    assert as_ids([2, 2], 8, "ids", None, unique=False).tolist() == [2, 2]


@pytest.mark.parametrize("num_blocks, count", [(1000, 900), (1000, 40), (100_000, 50)])  # bitmap, then positions
def test_duplicate_check_kept_across_posts_finds_every_repeat(num_blocks, count):
    rng = np.random.default_rng(num_blocks + count)
    destinations = DestinationIds(num_blocks)
    for _ in range(50):  # one scratch for many posts: what one post leaves behind must not show in the next
        ids = rng.permutation(num_blocks)[:count]
        assert not destinations.repeated(ids)
        repeat = ids.copy()
        first, second = sorted(rng.choice(count, 2, replace=False))
        repeat[second] = repeat[first]
        assert destinations.repeated(repeat), f"block {repeat[first]} at {first} and {second} not found"
        with pytest.raises(tw.InvalidArgumentError, match=f"destination block {repeat[first]} appears 2 times"):
            as_ids(repeat, num_blocks, "ids", None, unique=True, destinations=destinations)


def test_pool_desc_round_trips_and_rejects_corrupt_bytes():
    desc = tw.BlockPoolDesc(3, tw.MemoryKind.CUDA, 1, 512, ((0x7000, 4096, 1024, 5), (0x90000, 2048, 2048, 6)))
    assert tw.BlockPoolDesc.unpack(desc.pack()) == desc
    blob = desc.pack()
    rng = np.random.default_rng(0)
    for cut in range(len(blob)):
        with pytest.raises(tw.InvalidArgumentError):
            tw.BlockPoolDesc.unpack(blob[:cut])
    for _ in range(200):  # random bytes never escape as struct.error / ValueError / OverflowError
        noise = rng.integers(0, 256, size=rng.integers(0, 120), dtype=np.uint8).tobytes()
        with pytest.raises(tw.InvalidArgumentError):
            tw.BlockPoolDesc.unpack(b"TWB\x01" + noise)
    overlapping = (struct.pack("<3sBiBxhQI", b"TWB", 1, 0, 0, -1, 4, 1)  # the wire admits what the constructor
                   + struct.pack("<QQQI4x", 0x1000, 8, 16, 1))  # refuses: 4 blocks of 16 bytes, 8 bytes apart
    with pytest.raises(tw.InvalidArgumentError, match="not a valid pool.*stride 8 for blocks of 16 bytes"):
        tw.BlockPoolDesc.unpack(overlapping)
    with pytest.raises(tw.InvalidArgumentError, match="stride 8 for blocks of 16 bytes"):
        tw.BlockPoolDesc(0, tw.MemoryKind.CPU, -1, 4, ((0x1000, 8, 16, 1),))


# --- one process: local transport, layouts, validation --------------------------------------------
def _in_process(port: int):
    comm = tw.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, timeout=INIT_TIMEOUT)
    with comm:
        yield comm


@pytest.fixture
def comm():
    yield from _in_process(tw.testing.free_port())


def test_layouts_vllm_kv_split_and_block_major_move_the_right_bytes(comm):
    rng = np.random.default_rng(1)
    per_layer = pool_values(0, 0, (2, 4, 8))  # [num_blocks, K/V, block, dim]
    kv_split = torch.stack([pool_values(0, 1, (16,)), pool_values(0, 2, (16,))])  # [K/V, num_blocks, ...]
    block_major = pool_values(0, 3, (3, 5))
    sources = [per_layer, kv_split[0], kv_split[1], block_major]
    targets = [torch.full_like(s, -1) for s in sources]
    with comm.register_blocks(sources) as source_pool, comm.register_blocks(targets) as target_pool:
        assert source_pool.block_bytes == (256, 64, 64, 60)
        remote = source_pool.desc
        dst_ids, src_ids = rng.permutation(NUM_BLOCKS)[:40], rng.integers(0, NUM_BLOCKS, 40)
        before = [t.clone() for t in targets]
        with comm.prepare_blocks(tw.READ, target_pool, remote) as x:
            assert x.transport == "local" and x.bytes_per_block == 444
            x.post(torch.from_numpy(dst_ids), src_ids.tolist())
            x.wait(timeout=WAIT)
            assert x.status() is tw.Status.DONE
        for i, (got, want) in enumerate(zip(targets, expected_after(before, sources, dst_ids, src_ids))):
            assert_equal(got, want, f"view {i} after a local block READ")


def test_write_and_repost_with_new_ids(comm):
    sources = [pool_values(0, i, s) for i, s in enumerate(SHAPES)]
    targets = [torch.full_like(s, -1) for s in sources]
    with comm.register_blocks(sources) as mine, comm.register_blocks(targets) as theirs:
        comm.publish_blocks("targets", theirs)
        remote = comm.lookup_blocks("targets", 0, timeout=WAIT)
        assert remote == theirs.desc
        with comm.prepare_blocks(tw.WRITE, mine, remote) as x:
            for round_ in range(3):
                src_ids, dst_ids = [round_, 10 + round_], [50 + round_, 90 - round_]
                before = [t.clone() for t in targets]
                x.post(src_ids, dst_ids)
                x.wait(timeout=WAIT)
                for got, want in zip(targets, expected_after(before, sources, dst_ids, src_ids)):
                    assert_equal(got, want, f"round {round_}")
            x.post([], [])  # 0 ids: a no-op that completes
            x.wait(timeout=WAIT)
            assert x.status() is tw.Status.DONE


def test_bad_posts_move_nothing(comm):
    sources = [pool_values(0, i, s) for i, s in enumerate(SHAPES)]
    targets = [torch.full_like(s, -1) for s in sources]
    with comm.register_blocks(sources) as mine, comm.register_blocks(targets) as theirs:
        with comm.prepare_blocks(tw.READ, theirs, mine.desc) as x:
            for local_ids, remote_ids, fragment in [
                ([1, 1], [2, 3], "destination block 1 appears 2 times"),
                ([1], [NUM_BLOCKS], "remote_ids: id 96"),
                ([1, 2], [3], "2 local ids but 1 remote ids"),
            ]:
                with pytest.raises(tw.InvalidArgumentError, match=fragment):
                    x.post(local_ids, remote_ids)
            assert all(bool((t == -1).all()) for t in targets), "a refused post moved bytes"
            x.post([4], [5])  # the handle still works after refused posts
            x.wait(timeout=WAIT)
            assert_equal(targets[1][4], sources[1][5], "block 4 after refused posts")


def test_mismatched_pools_and_views_are_refused(comm):
    a = [pool_values(0, i, s) for i, s in enumerate(SHAPES)]
    with comm.register_blocks(a) as pool:
        with comm.register_blocks([torch.zeros(NUM_BLOCKS, 2, 4, 8, dtype=torch.int32)]) as one_view:
            with pytest.raises(tw.InvalidArgumentError, match="same views in the same order"):
                comm.prepare_blocks(tw.READ, one_view, pool.desc)
        with comm.register_blocks([torch.zeros(NUM_BLOCKS, 2, 4, 8, dtype=torch.int32),
                                   torch.zeros(NUM_BLOCKS, 8, dtype=torch.int32)]) as smaller:
            with pytest.raises(tw.InvalidArgumentError, match="equal bytes per block"):
                comm.prepare_blocks(tw.READ, smaller, pool.desc)
        with pytest.raises(tw.InvalidArgumentError, match="pass tw.READ or tw.WRITE"):
            comm.prepare_blocks("READ", pool, pool.desc)
    with pytest.raises(tw.InvalidArgumentError, match="same num_blocks"):
        comm.register_blocks([torch.zeros(4, 8), torch.zeros(5, 8)])
    with pytest.raises(tw.InvalidArgumentError, match="not one non-empty dense byte range"):
        comm.register_blocks([torch.zeros(4, 8, 4)[:, :, :2]])  # every other pair of elements: gaps in a block


def test_a_stride_permuted_view_is_a_pool_of_its_bytes(comm):
    """vLLM lays a logical [2, num_blocks, block_size, heads, dim] cache out heads-outermost (HND) and hands over the
    permuted view: each block is still one byte range, registered and moved as such."""
    physical = torch.arange(2 * NUM_BLOCKS * 4 * 8 * 16, dtype=torch.int32).reshape(2, NUM_BLOCKS, 4, 8, 16)
    logical = physical.permute(0, 1, 3, 2, 4)  # [2, num_blocks, tokens=8, heads=4, dim=16], heads outermost in memory
    target = torch.zeros_like(physical).permute(0, 1, 3, 2, 4)
    with comm.register_blocks([logical[0], logical[1]]) as source, \
            comm.register_blocks([target[0], target[1]]) as destination:
        assert source.block_bytes == (4 * 8 * 16 * 4,) * 2
        with comm.prepare_blocks(tw.READ, destination, source.desc) as transfer:
            transfer.post([0, 3], [5, 1])
            transfer.wait(timeout=30)
    assert torch.equal(target[:, 0], logical[:, 5]) and torch.equal(target[:, 3], logical[:, 1])
    assert not target[:, 1].any()


def test_selected_ranges_move_only_their_bytes(comm):
    """select(): (view, offset, size) ranges of every block, in any order, each a view of the derived pool."""
    source_views = [torch.arange(NUM_BLOCKS * 64, dtype=torch.uint8).reshape(NUM_BLOCKS, 64) for _ in range(2)]
    target = [torch.zeros(NUM_BLOCKS, 64, dtype=torch.uint8) for _ in range(2)]
    with comm.register_blocks(source_views) as source, comm.register_blocks(target) as destination:
        local = destination.select([(1, 0, 8), (0, 40, 8)])
        remote = source.desc.select([(0, 16, 8), (1, 56, 8)])
        with comm.prepare_blocks(tw.READ, local, remote) as transfer:
            transfer.post([2], [4])
            transfer.wait(timeout=30)
        for bad, match in (([(2, 0, 8)], "names view 2"), ([(0, 60, 8)], "outside|offset"), ([], "1 to"),
                           ([(0, 0)], "give \\(view, offset, size\\)")):
            with pytest.raises(tw.InvalidArgumentError, match=match):
                destination.select(bad)
    assert torch.equal(target[1][2, 0:8], source_views[0][4, 16:24])
    assert torch.equal(target[0][2, 40:48], source_views[1][4, 56:64])
    assert int(target[0].count_nonzero()) + int(target[1].count_nonzero()) == 16  # nothing else written


def test_views_inside_a_registered_tensor_use_that_registration(comm):
    cache = torch.zeros(2, NUM_BLOCKS, 16, dtype=torch.int32)
    with comm.register(cache) as registration:
        with comm.register_blocks([cache[0], cache[1]]) as pool:
            assert pool._owned is None
        with pytest.raises(tw.InvalidArgumentError, match="some views lie in registered tensors"):
            comm.register_blocks([cache[0], torch.zeros(NUM_BLOCKS, 16, dtype=torch.int32)])
        with comm.register_blocks([cache[1]]) as pool:
            x = comm.prepare_blocks(tw.READ, pool, pool.desc)
        registration.close()
        with pytest.raises(tw.ClosedError):
            x.post([0], [1])


# --- two processes: nixl and shm ----------------------------------------------------------------------
def _two_ranks(memory: str, transport: str):
    """Rank 0 READs random blocks of rank 1's pool, then WRITEs some back with a notification; then rank 1
    closes its pool and rank 0's next read with the old descriptor is refused."""
    files: list[str] = []
    try:
        return _two_ranks_body(memory, transport, files)
    finally:
        for path in files:
            os.unlink(path)


def _two_ranks_body(memory: str, transport: str, files: list[str]):
    comm = tw.init(timeout=INIT_TIMEOUT)
    rng = np.random.default_rng(comm.rank)
    views = make_views(comm.rank, memory, files)
    pool = comm.register_blocks(views)
    comm.publish_blocks("kv", pool)
    peer = 1 - comm.rank
    remote = comm.lookup_blocks("kv", peer, timeout=WAIT)
    if comm.rank == 0:
        peer_values = [pool_values(peer, i, s) for i, s in enumerate(SHAPES)]
        with comm.prepare_blocks(tw.READ, pool, remote) as x:
            assert x.transport == transport, x
            for round_ in range(3):
                dst_ids = torch.from_numpy(10 + rng.permutation(NUM_BLOCKS - 10)[:30])  # blocks 0-9 stay ours
                src_ids = rng.integers(0, NUM_BLOCKS, 30)
                before = [v.clone() for v in views]
                x.post(dst_ids, src_ids)
                x.wait(timeout=WAIT)
                for got, want in zip(views, expected_after(before, peer_values, dst_ids, src_ids)):
                    assert_equal(got, want, f"rank 0 READ over {transport}, round {round_}")
        comm.write_blocks(pool, [0, 1, 2], remote, [93, 94, 95], notify=b"kv-written", timeout=WAIT)
        comm.barrier(timeout=WAIT)  # rank 1 checks, then closes its pool
        comm.barrier(timeout=WAIT)
        before = [v.clone() for v in views]
        with pytest.raises(tw.InvalidArgumentError, match="was closed|outside what rank 1"):
            comm.read_blocks(pool, [5], remote, [6], timeout=WAIT)
        assert all(torch.equal(a, b) for a, b in zip(views, before))
    else:
        assert comm.wait_notification(0, timeout=WAIT) == b"kv-written"  # after the data
        writer = [pool_values(0, i, s) for i, s in enumerate(SHAPES)]
        for i, (got, want) in enumerate(zip(views, writer)):
            assert_equal(got[93:96], want[0:3], f"view {i} written by rank 0")
        comm.barrier(timeout=WAIT)
        pool.close()
        comm.barrier(timeout=WAIT)
    comm.barrier(timeout=WAIT)
    comm.close()
    return True


@pytest.mark.parametrize("memory, transport", [("plain", "nixl"), ("shm", "shm")])
@pytest.mark.slow
def test_two_processes_read_write_notify_and_revoke(memory, transport):
    assert launch(_two_ranks, 2, memory, transport) == [True, True]


def test_disaggregated_kv_example_runs():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "disaggregated_kv.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "decode read 63 blocks x 4 layers" in done.stdout, done.stdout


def _reader_notifies_owner() -> bool:
    """Rank 1 READs rank 0's blocks with ``notify=``; rank 0 never names rank 1 but finds the message with
    ``poll_notifications`` (what a KV producer does to learn that a consumer is done with its blocks)."""
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        rank = comm.rank
        pool = comm.register_blocks(pool_values(rank, 0, SHAPES[0]).clone())
        comm.publish_blocks("kv", pool)
        if rank == 1:
            with comm.prepare_blocks(tw.READ, pool, comm.lookup_blocks("kv", 0, timeout=WAIT)) as x:
                x.post([0, 1], [5, 6], notify=b"read 5,6")
                x.wait(timeout=WAIT)
                x.post([], [], notify=b"nothing to read")  # 0 ids: the message still goes
            comm.barrier(timeout=WAIT)
            ok = torch.equal(pool.views[0][:2], pool_values(0, 0, SHAPES[0])[5:7])
        else:
            assert comm.poll_notifications() == []
            taken: list = []
            deadline = time.monotonic() + WAIT
            while len(taken) < 2 and time.monotonic() < deadline:
                taken += comm.poll_notifications()
                time.sleep(0.01)
            comm.barrier(timeout=WAIT)
            ok = taken == [(1, b"read 5,6"), (1, b"nothing to read")] and comm.poll_notifications() == []
        pool.close()
        return ok


def test_poll_notifications_takes_every_senders_messages():
    assert launch(_reader_notifies_owner, 2) == [True, True]
