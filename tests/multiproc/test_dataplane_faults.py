"""The data plane with real processes: descriptors as untrusted input, a peer killed during a transfer loop
over ``shm``, and a block pool closed under a peer that keeps posting.

* A ``BlockPoolDesc`` or ``TensorDesc`` built by hand (or unpacked from bytes) with negative, overflowing or
  out-of-range fields is refused with ``InvalidArgumentError`` before anything moves, over ``nixl``, ``shm`` and
  ``local``; every byte of both ranks' memory (guard rows around the target pool included) is checked after.
* ``kill -9`` of a peer during a READ or WRITE loop over ``shm`` (plain and block transfers) ends the loop in
  ``PeerLostError`` within the liveness bound, every later post raises too, and no post completes once the
  liveness bound has passed after the death (before: ~10 s of silent success into the dead rank's file).
* ``BlockPool.close()`` of a pool made of views inside a user's own registration revokes the peers' block
  transfers to it (``RevokedError``) and refuses a new ``prepare_blocks``; the memory is not written after close
  returned, and the registration itself keeps working.

Bounded-time claims use generous margins: ``LIVENESS_S + 10`` seconds.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.shared_memory import owned_file_name
from tensorwire.testing.data import assert_equal, rank_values
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch

LIVENESS_S = 2.0
BOUND_S = LIVENESS_S + 10.0
ENV = {"TENSORWIRE_LIVENESS_S": str(LIVENESS_S)}
NUM_BLOCKS = 16
BLOCK_WORDS = 64  # int64 words per block: 512 bytes
U64 = 1 << 64

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here: shm needs a shared file")


def _shm_path() -> str:
    return owned_file_name()


def _host_tensor(values: torch.Tensor, path: str | None) -> torch.Tensor:
    """``values`` copied into plain host memory, or into a shared file at ``path`` (reachable over ``shm``)."""
    if path is None:
        return values.clone()
    shared = torch.from_file(path, shared=True, size=values.numel(), dtype=values.dtype)
    return shared.view(values.shape).copy_(values)


def _wait_until_dead(pid: int) -> None:
    """Return once every thread of ``pid`` has exited (a zombie or reaped): the kernel has closed its sockets
    by then (they close with the last thread, not with the main thread, which turns zombie first)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return  # reaped
        try:
            states = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[-1].split()[:1])
            if all(state in (["Z"], ["X"]) for state in states):
                return
        except OSError:  # a thread (or the process) went while it was looked at: look again
            pass
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not die within 30 s of SIGKILL")


# --- descriptors as untrusted input ------------------------------------------------------------------
def _guarded_values(rank: int) -> torch.Tensor:
    """``[3 * NUM_BLOCKS, BLOCK_WORDS]`` int64 of ``rank``: guard rows, the target pool's rows, guard rows."""
    return rank_values(rank, 3 * NUM_BLOCKS * BLOCK_WORDS, torch.int64).view(3 * NUM_BLOCKS, BLOCK_WORDS)


def _bad_pool_descs(remote: tw.BlockPoolDesc) -> dict:
    """Hand-built variants of ``remote`` (callables: building one may itself be what is refused)."""
    addr, stride, block_bytes, epoch = remote.regions[0]
    rank, kind, n = remote.rank, remote.kind, remote.num_blocks
    top = addr + (n - 1) * stride

    def pool(regions, num_blocks=n, rank=rank, kind=kind, device_index=remote.device_index):
        return lambda: tw.BlockPoolDesc(rank, kind, device_index, num_blocks, tuple(regions))

    def unpacked(region_fields, num_blocks=n):
        header = struct.pack("<3sBiBxhQI", b"TWB", 1, rank, int(kind), remote.device_index, num_blocks, 1)
        return lambda: tw.BlockPoolDesc.unpack(header + struct.pack("<QQQI4x", *region_fields))

    return {
        "negative stride": pool([(top, -stride, block_bytes, epoch)]),
        "zero stride": pool([(addr, 0, block_bytes, epoch)]),
        "stride below the block size": pool([(addr, block_bytes // 2, block_bytes, epoch)]),
        "negative addr": pool([(-block_bytes, stride, block_bytes, epoch)]),
        "negative block bytes": pool([(addr, stride, -block_bytes, epoch)]),
        "zero block bytes": pool([(addr, stride, 0, epoch)]),
        "stride * blocks wraps u64": pool([(addr, U64 // (n - 1) + block_bytes, block_bytes, epoch)]),
        "huge num_blocks": pool([(addr, stride, block_bytes, epoch)], num_blocks=U64 // stride + 2),
        "negative num_blocks": pool([(addr, stride, block_bytes, epoch)], num_blocks=-4),
        "addr past u64": pool([(U64 + addr, stride, block_bytes, epoch)]),
        "negative epoch": pool([(addr, stride, block_bytes, -1)]),
        "no views": pool([]),
        "negative rank": pool([(addr, stride, block_bytes, epoch)], rank=-1),
        "cpu pool on device 7": pool([(addr, stride, block_bytes, epoch)], device_index=7),
        "unpacked negative stride (u64 wrap)": unpacked((top, U64 - stride, block_bytes, epoch)),
        "unpacked stride * blocks wraps u64": unpacked((addr, U64 // (n - 1) + block_bytes, block_bytes, epoch)),
        "one block past the registration": pool([(addr, stride, block_bytes, epoch)], num_blocks=n + 1),
        "one block before the registration": pool([(addr - stride, stride, block_bytes, epoch)]),
        "another rank's registration epoch": pool([(addr, stride, block_bytes, epoch + (1 << 20))]),
    }


def _bad_tensor_descs(remote: tw.TensorDesc) -> dict:
    def desc(addr=remote.addr, nbytes=remote.nbytes, kind=remote.kind, device_index=remote.device_index,
             epoch=remote.epoch, rank=remote.rank):
        return lambda: tw.TensorDesc(rank, addr, nbytes, kind, device_index, epoch)

    return {
        "negative addr": desc(addr=-8),
        "negative nbytes": desc(nbytes=-remote.nbytes),
        "addr + nbytes wraps u64": desc(addr=U64 - 8),
        "addr past u64": desc(addr=U64 + remote.addr),
        "cpu range on device 3": desc(device_index=3),
        "negative epoch": desc(epoch=-1),
        "epoch past u32": desc(epoch=1 << 32),
        "negative rank": desc(rank=-1),
        "unpacked addr + nbytes wraps u64": lambda: tw.TensorDesc.unpack(
            struct.pack("<3sBI", b"TWD", 1, 1) + struct.pack("<iBxhIQQ", remote.rank, int(remote.kind),
                                                              remote.device_index, remote.epoch, U64 - 8,
                                                              remote.nbytes))[0],
        "one byte past the registration": desc(addr=remote.addr + 8),
    }


def _descriptor_refusals(transport: str, paths: list[str]):
    comm = tw.init(timeout=INIT_TIMEOUT)
    peer = comm.rank if transport == "local" else 1 - comm.rank
    memory = _host_tensor(_guarded_values(comm.rank), paths[comm.rank] if transport == "shm" else None)
    target = comm.register_blocks(memory[NUM_BLOCKS:2 * NUM_BLOCKS])  # guard rows around it stay unregistered
    mine_values = rank_values(comm.rank + 10, NUM_BLOCKS * BLOCK_WORDS, torch.int64).view(NUM_BLOCKS, BLOCK_WORDS)
    mine = comm.register_blocks(mine_values)
    flat = comm.register(torch.zeros(NUM_BLOCKS * BLOCK_WORDS, dtype=torch.int64))
    comm.publish_blocks("target", target)
    comm.publish("flat", flat.descs)
    comm.barrier(timeout=WAIT)
    outcomes = {}
    if comm.rank == 0:
        remote_pool = comm.lookup_blocks("target", peer, timeout=WAIT)
        remote_flat = comm.lookup("flat", peer, timeout=WAIT)[0]
        with comm.prepare_blocks(tw.WRITE, mine, remote_pool, transport=transport) as x:  # the path works
            assert x.transport == transport, x
            x.post([0], [0])
            x.wait(timeout=WAIT)
        ids = [0, NUM_BLOCKS - 1]
        for name, build in _bad_pool_descs(remote_pool).items():
            for op in (tw.READ, tw.WRITE):
                try:
                    with comm.prepare_blocks(op, mine, build(), transport=transport) as x:
                        x.post(ids, ids)
                        x.wait(timeout=WAIT)
                    outcomes[f"pool {name} {op.value}"] = "moved"
                except tw.InvalidArgumentError:
                    outcomes[f"pool {name} {op.value}"] = "refused"
        out = torch.zeros(NUM_BLOCKS * BLOCK_WORDS, dtype=torch.int64)
        comm.register(out)
        for name, build in _bad_tensor_descs(remote_flat).items():
            for op in (tw.READ, tw.WRITE):
                try:
                    with comm.prepare(op, out, build(), transport=transport) as x:
                        x.post()
                        x.wait(timeout=WAIT)
                    outcomes[f"tensor {name} {op.value}"] = "moved"
                except tw.InvalidArgumentError:
                    outcomes[f"tensor {name} {op.value}"] = "refused"
        with comm.prepare_blocks(tw.WRITE, mine, remote_pool, transport=transport) as x:  # ids: checked per post
            for bad_ids in ([NUM_BLOCKS], [-1], [0, 0]):
                try:
                    x.post([1] * len(bad_ids), bad_ids)
                    outcomes[f"remote ids {bad_ids}"] = "moved"
                except tw.InvalidArgumentError:
                    outcomes[f"remote ids {bad_ids}"] = "refused"
    comm.barrier(timeout=WAIT)
    expected = _guarded_values(comm.rank)
    if comm.rank == (0 if transport == "local" else 1):  # the one block the working WRITE moved
        expected[NUM_BLOCKS] = rank_values(10, BLOCK_WORDS, torch.int64)
    assert_equal(memory, expected, f"rank {comm.rank}'s target pool and its guard rows")
    assert_equal(mine_values, rank_values(comm.rank + 10, NUM_BLOCKS * BLOCK_WORDS, torch.int64).view(
        NUM_BLOCKS, BLOCK_WORDS), f"rank {comm.rank}'s own pool")
    comm.barrier(timeout=WAIT)
    comm.close()
    return outcomes


@pytest.mark.parametrize("transport", ["nixl", "shm", "local"])
@pytest.mark.slow
def test_hand_built_descriptors_are_refused_before_anything_moves(transport):
    """Before: a negative stride was accepted by prepare_blocks and its post wrote below the pool (the issue
    saw SIGSEGV over shm); wrapping or negative fields reached the copy or struct.error."""
    paths = [_shm_path(), _shm_path()]
    try:
        outcomes = launch(_descriptor_refusals, 2, transport, paths)[0]
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
    moved = sorted(name for name, outcome in outcomes.items() if outcome != "refused")
    print(f"\n{transport}: {len(outcomes)} hand-built descriptors and ids; not refused: {moved}")
    assert not moved, f"over {transport}, these were not refused with InvalidArgumentError: {moved}"


def test_descriptor_messages_say_what_failed_the_values_and_the_fix():
    stride_message = r"BlockPoolDesc: view 0's stride -512 is outside \[0, 2\*\*64\).*lookup_blocks"
    with pytest.raises(tw.InvalidArgumentError, match=stride_message):
        tw.BlockPoolDesc(1, tw.MemoryKind.CPU, -1, 4, ((0x10000, -512, 512, 1),))
    with pytest.raises(tw.InvalidArgumentError, match=r"TensorDesc: \[0x[0-9a-f]+, \+4096\) ends past 2\*\*64"):
        tw.TensorDesc(1, U64 - 8, 4096, tw.MemoryKind.CPU, -1, 1)


# --- a peer killed during a transfer loop over shm ------------------------------------------------------
def _loop_against_a_killed_peer(op_name: str, kind: str, path: str, pid_path: str):
    comm = tw.init(timeout=60)
    op = tw.READ if op_name == "READ" else tw.WRITE
    n = NUM_BLOCKS * BLOCK_WORDS
    if comm.rank == 1:
        data = _host_tensor(rank_values(1, n, torch.int64), path)  # in a shared file: reached over shm
        if kind == "blocks":
            pool = comm.register_blocks(data.view(NUM_BLOCKS, BLOCK_WORDS))
            comm.publish_blocks("kv", pool)
        else:
            registration = comm.register(data)
            comm.publish("kv", registration.descs)
        with open(pid_path, "w") as f:
            f.write(str(os.getpid()))
        comm.barrier(timeout=WAIT)
        time.sleep(120)  # outside tensorwire until rank 0 kills this process
        raise AssertionError(f"rank 1 was not killed ({pool if kind == 'blocks' else registration})")
    local = rank_values(0, n, torch.int64)
    if kind == "blocks":
        pool = comm.register_blocks(local.view(NUM_BLOCKS, BLOCK_WORDS))
        x = comm.prepare_blocks(op, pool, comm.lookup_blocks("kv", 1, timeout=WAIT), transport="shm")
        ids = list(range(NUM_BLOCKS))

        def post():
            x.post(ids, ids)
            x.wait(timeout=WAIT)
    else:
        comm.register(local)
        x = comm.prepare(op, local, comm.lookup("kv", 1, timeout=WAIT)[0], transport="shm")

        def post():
            x.post()
            x.wait(timeout=WAIT)
    assert x.transport == "shm", x
    comm.barrier(timeout=WAIT)
    post()  # works while the peer lives
    with open(pid_path) as f:
        victim = int(f.read())
    killed: dict[str, float] = {}

    def kill() -> None:
        time.sleep(0.3)
        killed["at"] = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _wait_until_dead(victim)
        killed["dead"] = time.monotonic()

    killer = threading.Thread(target=kill)
    killer.start()
    last_done, done_after_death, error = 0.0, 0, None
    while error is None and time.monotonic() - killed.get("at", time.monotonic()) < BOUND_S:
        try:
            post()
        except tw.TensorwireError as e:
            error = (type(e).__name__, time.monotonic() - killed["at"], str(e))
            continue
        last_done = time.monotonic()
        if "dead" in killed:
            done_after_death += 1
    killer.join()
    later = []
    for _ in range(20):
        try:
            post()
            later.append("done")
        except tw.TensorwireError as e:
            later.append(type(e).__name__)
    x.close()
    comm.close()
    return {"error": error, "done_after_death": done_after_death, "last_done_after_death": last_done - killed["dead"],
            "later": later}


@pytest.mark.parametrize("kind", ["plain", "blocks"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.slow
def test_a_peer_killed_during_a_shm_loop_is_peer_lost_within_the_liveness_bound(tmp_path, op, kind):
    """Before: no error for 10 s: WRITEs "succeeded" into the dead rank's file, READs returned its stale bytes."""
    path = _shm_path()
    try:
        result = launch(_loop_against_a_killed_peer, 2, op, kind, path, str(tmp_path / "pid"), env=ENV,
                        may_die=(1,))[0]
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print(f"\n{op} {kind} over shm, peer killed: {result['error']}; {result['done_after_death']} posts done after "
          f"its death was seen, the last {result['last_done_after_death'] * 1e3:.1f} ms after")
    assert result["error"] is not None, f"{op}s over shm kept succeeding for {BOUND_S}s after the peer was killed"
    assert result["error"][0] == "PeerLostError", result["error"]
    assert result["error"][1] < BOUND_S
    assert set(result["later"]) == {"PeerLostError"}, f"posts after the first PeerLostError: {result['later']}"
    assert result["last_done_after_death"] < LIVENESS_S, "a post completed past the liveness bound after the death"


# --- a block pool over a user's registration, closed while a peer holds transfers to it ------------------
def _closed_pool_over_a_user_registration(memory: str, path: str):
    comm = tw.init(timeout=60)
    owner = 1  # rank 0 holds transfers to its pool
    shape = (2, NUM_BLOCKS, BLOCK_WORDS)  # the K/V halves cache[0] / cache[1]
    if comm.rank == owner:
        values = rank_values(owner, 2 * NUM_BLOCKS * BLOCK_WORDS, torch.int64).view(shape)
        cache = _host_tensor(values, path if memory == "shm" else None)
        registration = comm.register(cache)
        pool = comm.register_blocks([cache[0], cache[1]])
        assert pool._owned is None, "the pool should use the user's registration"
        comm.publish_blocks("kv", pool)
        comm.publish("cache", registration.descs)
        comm.barrier(timeout=WAIT)  # the holder prepared a READ and a WRITE and posted both once
        pool.close()
        cache.fill_(-7)  # from here on no peer may write
        comm.barrier(timeout=WAIT)  # the holder tries again (and answers the revocation while it waits)
        comm.barrier(timeout=60)
        untouched = bool((cache == -7).all())
        registration.close()
        comm.close()
        return untouched
    local = comm.register_blocks([torch.zeros(NUM_BLOCKS, BLOCK_WORDS, dtype=torch.int64) for _ in range(2)])
    remote = comm.lookup_blocks("kv", owner, timeout=WAIT)
    write = comm.prepare_blocks(tw.WRITE, local, remote)
    read = comm.prepare_blocks(tw.READ, local, remote)
    transport = write.transport
    ids = list(range(NUM_BLOCKS))
    for x in (write, read):
        x.post(ids, ids)
        x.wait(timeout=WAIT)
    comm.barrier(timeout=WAIT)
    comm.barrier(timeout=WAIT)
    try:  # sleep in a wait, as a rank waiting for its next request would: it handles the revocation meanwhile
        comm.lookup("never-published", comm.rank, timeout=LIVENESS_S)
    except tw.WaitTimeoutError:
        pass
    outcomes = {}
    for name, x in (("WRITE", write), ("READ", read)):
        try:
            x.post(ids, ids)
            x.wait(timeout=WAIT)
            outcomes[f"post {name}"] = "done"
        except tw.TensorwireError as e:
            outcomes[f"post {name}"] = type(e).__name__
        x.close()
    try:
        comm.prepare_blocks(tw.WRITE, local, remote).close()
        outcomes["prepare_blocks"] = "prepared"
    except tw.InvalidArgumentError as e:
        outcomes["prepare_blocks"] = type(e).__name__
    cache = comm.lookup("cache", owner, timeout=WAIT)[0]
    out = torch.zeros(2 * NUM_BLOCKS * BLOCK_WORDS, dtype=torch.int64)
    comm.register(out)
    comm.read(out, cache, timeout=WAIT)  # the user's registration itself is still there
    outcomes["registration still readable"] = bool((out == -7).all())
    comm.barrier(timeout=60)
    comm.close()
    return transport, outcomes


@pytest.mark.parametrize("memory", ["plain", "shm"])
@pytest.mark.slow
def test_a_closed_pool_over_a_user_registration_refuses_every_peer(memory):
    """Before: the peer's READs and WRITEs into the closed pool went on succeeding and a new prepare_blocks was
    accepted (the pool's descriptor named the registration's epoch, which stayed live)."""
    path = _shm_path()
    try:
        (transport, outcomes), untouched = launch(_closed_pool_over_a_user_registration, 2, memory, path, env=ENV)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print(f"\npool in {memory} memory over {transport}: {outcomes}; owner's memory untouched after close: {untouched}")
    assert transport == ("shm" if memory == "shm" else "nixl")
    assert outcomes["post WRITE"] == "RevokedError", outcomes
    assert outcomes["post READ"] == "RevokedError", outcomes
    assert outcomes["prepare_blocks"] == "InvalidArgumentError", outcomes
    assert outcomes["registration still readable"], outcomes
    assert untouched, "a peer wrote into the pool's memory after BlockPool.close() returned"
