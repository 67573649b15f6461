"""Where the host time of an eager block post goes, on one GPU in one process (transport ``local``).

For READ and WRITE of ``--ids`` random int64 host block ids (fresh arrays each post, as a serving engine's
requests) between two pools of ``--pool-blocks`` blocks of ``--block-bytes``, it times on the host clock, with
the GPU idle before each call (``torch.cuda.synchronize`` outside the timing):

* ``post_us``: ``BlockTransfer.post`` alone (median and p90 of ``--reps``), and each step it takes, called
  the way ``post`` calls it: the id checks (``as_ids``), the staging of the ids (the cast into the pinned slot,
  the ``cuMemcpyAsync`` to the device), the kernel's launch, an event record and query; ``unaccounted_us`` is
  ``post`` less those steps (Python between them: the open checks, bindings, ``Transfer.post``);
* ``eager_us`` against ``copy_us``: ``synchronize; post; wait; synchronize`` against ``synchronize; one
  contiguous device copy of the same bytes; synchronize`` (what ``tensorwire bench kv`` reports as its eager
  figure), and their ratio ``copy_over_eager`` (1.0: the block post costs no more than the copy);
* ``jit_launches``: posts that went through Triton's JIT instead of the kernel compiled at prepare (want 0);
* ``profile_us_per_post``: cProfile's heaviest functions over ``--reps`` posts, own time per post (cProfile
  slows every Python call, so read these as shares, not as times).

Prints one JSON line; exits non-zero if a post moved the wrong bytes. ``--memory cpu`` runs the host-memory
path instead (no GPU steps), a smoke test on any machine.

    python benchmarks/scripts/block_post_profile.py --ids 10000 --block-bytes 16384
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

import tensorwire as tw
from tensorwire.bench.timing import Budget, HostClock, measure, quantile
from tensorwire.block_transfer import as_ids
from tensorwire.cuda import enqueue_on


def host_us(fn: Callable[[], object], reps: int, before: Callable[[], object]) -> dict[str, float]:
    """Median and p90 host time of ``fn`` in µs over ``reps`` calls, ``before()`` untimed ahead of each."""
    samples = []
    gc.disable()
    try:
        for _ in range(reps):
            before()
            start = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - start) / 1e3)
    finally:
        gc.enable()
    return {"median": round(quantile(samples, 0.5), 2), "p90": round(quantile(samples, 0.9), 2)}


class CountingJit:
    """Stands in for the request's Triton ``JITFunction``: counts the launches that went through it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]


def profile_op(comm, op, pools, args) -> dict:
    local_pool, remote_desc = (pools[1], pools[0].desc) if op is tw.READ else (pools[0], pools[1].desc)
    on_gpu = args.memory == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    rng = np.random.default_rng(args.ids)
    fresh = [(rng.permutation(args.pool_blocks)[:args.ids], rng.permutation(args.pool_blocks)[:args.ids])
             for _ in range(8)]
    turn = iter(range(1 << 62))

    def ids() -> tuple[np.ndarray, np.ndarray]:
        return fresh[next(turn) % len(fresh)]

    out: dict = {}
    with comm.prepare_blocks(op, local_pool, remote_desc) as x:
        request = x._request
        out["transport"] = x.transport
        for _ in range(10):  # warm: slots allocated, kernels compiled, caches filled
            x.post(*ids())
            x.wait(timeout=60)
        sync()
        jit = None
        if on_gpu:
            jit = request._kernel = CountingJit(request._kernel)

        def post() -> None:
            x.post(*ids())

        def after_post() -> None:
            x.wait(timeout=60)
            sync()

        steps = {"post": host_us(post, args.reps, after_post)}
        destination_is_local = op is tw.READ
        destination_blocks = local_pool.num_blocks if destination_is_local else remote_desc.num_blocks
        source_blocks = remote_desc.num_blocks if destination_is_local else local_pool.num_blocks
        steps["check_destination_ids"] = host_us(
            lambda: as_ids(ids()[0], destination_blocks, "post", None, True, destinations=x._destinations),
            args.reps, lambda: None)
        steps["check_source_ids"] = host_us(lambda: as_ids(ids()[1], source_blocks, "post", None, False),
                                            args.reps, lambda: None)
        if on_gpu:
            stream, handle = request._streams.of(None)
            slot = request._staging._slots[0]
            n = args.ids
            half = -(-n // 4) * 4

            def cast_into_pinned() -> None:
                local, remote = ids()
                slot.host_array[:n], slot.host_array[half:half + n] = local, remote

            steps["cast_into_pinned_slot"] = host_us(cast_into_pinned, args.reps, sync)
            copy = [(slot.device_addr, slot.host_addr, 4 * (half + n))]
            steps["enqueue_ids_to_device"] = host_us(
                lambda: enqueue_on(copy, handle, request.device_index, "profile"), args.reps, sync)
            local_ids, remote_ids = slot.device[:n], slot.device[half:half + n]
            destination, source = (local_ids, remote_ids) if destination_is_local else (remote_ids, local_ids)
            steps["launch_kernel"] = host_us(lambda: request._launch(destination, source, stream), args.reps, sync)
            steps["record_event"] = host_us(lambda: request.event.record(stream), args.reps, sync)
            steps["query_event"] = host_us(slot.event.query, args.reps, sync)
        accounted = sum(v["median"] for k, v in steps.items() if k != "post")
        steps["unaccounted"] = {"median": round(steps["post"]["median"] - accounted, 2)}
        out["steps_us"] = steps
        out["post_us"] = steps["post"]["median"]

        profiler = cProfile.Profile()
        for _ in range(args.reps):
            local, remote = ids()
            profiler.enable()
            x.post(local, remote)
            profiler.disable()
            after_post()
        stats = pstats.Stats(profiler).stats
        heaviest = sorted(stats.items(), key=lambda item: -item[1][2])[:args.top]
        out["profile_us_per_post"] = [[f"{path.split('/')[-1]}:{line}({name})", round(own * 1e6 / args.reps, 2)]
                                      for (path, line, name), (_, _, own, _, _) in heaviest]
        out["jit_launches"] = jit.calls if jit is not None else None

        budget = Budget(time_s=args.time_s, min_reps=args.reps, warmup_reps=3, rounds=1)

        def eager() -> None:
            local, remote = ids()
            sync()
            x.post(local, remote)
            x.wait(timeout=60)
            sync()

        eager_timing = measure(eager, HostClock(), budget)
        local, remote = fresh[0]
        x.post(local, remote)
        x.wait(timeout=60)
        sync()
        check(op, args.views, local, remote)

    words = args.ids * args.block_bytes // 4  # the same bytes, contiguous
    source_words, landing_words = (view.reshape(-1)[:words] for view in args.views)

    def copy_and_sync() -> None:
        sync()
        landing_words.copy_(source_words)
        sync()

    copy_timing = measure(copy_and_sync, HostClock(), budget)
    out["eager_us"] = round(eager_timing.median_us, 1)
    out["copy_us"] = round(copy_timing.median_us, 1)
    out["copy_over_eager"] = round(copy_timing.median_us / eager_timing.median_us, 3)
    out["eager_gbps"] = round(args.ids * args.block_bytes / eager_timing.median_us / 1e3, 1)
    return out


def check(op, views: list[torch.Tensor], local: np.ndarray, remote: np.ndarray) -> None:
    """The last post moved block ``source[i]`` to ``destination[i]`` (first 1000 pairs)."""
    source_view, target_view = views
    destination_ids, source_ids = (local, remote) if op is tw.READ else (remote, local)
    sample = slice(0, 1000)
    device = source_view.device
    got = target_view[torch.as_tensor(destination_ids[sample], device=device)]
    want = source_view[torch.as_tensor(source_ids[sample], device=device)]
    if not torch.equal(got, want):
        raise SystemExit(f"block_post_profile: the {op.value} moved wrong bytes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", type=int, default=10_000, help="block ids per post (default 10000)")
    parser.add_argument("--pool-blocks", type=int, default=None, help="blocks per pool (default: --ids)")
    parser.add_argument("--block-bytes", type=int, default=16384, help="bytes per block, a multiple of 4")
    parser.add_argument("--reps", type=int, default=200, help="timed calls per step (default 200)")
    parser.add_argument("--time-s", type=float, default=0.5, help="seconds of eager and copy timing each")
    parser.add_argument("--top", type=int, default=12, help="cProfile functions reported")
    parser.add_argument("--memory", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    args.pool_blocks = args.pool_blocks or args.ids
    if args.memory == "cuda" and not torch.cuda.is_available():
        print("block_post_profile: no CUDA device torch sees; --memory cpu runs the host path", file=sys.stderr)
        return 2
    comm = tw.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=tw.testing.free_port(), timeout=60)
    device = comm.device if args.memory == "cuda" else torch.device("cpu")
    if args.memory == "cuda":
        torch.cuda.set_device(device)
    words = args.block_bytes // 4
    args.views = [torch.arange(args.pool_blocks * words, dtype=torch.int32, device=device).view(-1, words) + role
                  for role in (0, 1 << 30)]  # source, target: every word differs
    pools = [comm.register_blocks([view]) for view in args.views]
    report = {
        "device": torch.cuda.get_device_name(device) if args.memory == "cuda" else "cpu",
        "torch": torch.__version__, "numpy": np.__version__, "ids": args.ids, "pool_blocks": args.pool_blocks,
        "block_bytes": args.block_bytes, "reps": args.reps,
    }
    for op in (tw.READ, tw.WRITE):
        report[op.value] = profile_op(comm, op, pools, args)
    for pool in pools:
        pool.close()
    comm.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
