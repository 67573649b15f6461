"""MoE dispatch / combine and all_to_all_v between real processes, on host memory, against a
single-process reference written in plain torch (``tensorwire.testing.moe_reference``).

Every rank's inputs are a pure function of (case, rank), so each rank rebuilds all ranks' inputs locally and
computes what it must receive. Token rows encode their sender (``x[t, h] = rank * 1000 + t + h / 64``), so a
row from the wrong rank or token names where it came from. One launched job per (engine, world size) runs
every case, back to back on one communicator, which also exercises round-keeping between calls.
"""

from __future__ import annotations

import pytest
import torch

import tensorwire as tw
from tensorwire import moe
from tensorwire.testing.data import assert_equal
from tensorwire.testing.moe_reference import (
    CASES,
    EXPERTS_PER_RANK,
    Case,
    a2a_counts,
    a2a_rows,
    check_close,
    check_dispatch,
    make_inputs,
    reference_combine,
    reference_dispatch,
    scaled_expert,
)
from tensorwire.testing.suite import INIT_TIMEOUT, launch

HOST_ENGINES = ["torch", "nixl"]
# --- rank functions ------------------------------------------------------------------------------
def _run_cases(comm: tw.Communicator, engine: str) -> list[str]:
    world, me = comm.world_size, comm.rank
    num_experts = EXPERTS_PER_RANK * world
    done = []
    for case in CASES:
        inputs = [make_inputs(case, r, world) for r in range(world)]
        x, topk_idx, topk_weights = inputs[me]
        expected = reference_dispatch(inputs, me, world)
        what = f"{engine}/{case.name} rank {me}"

        d = moe.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, comm=comm, engine=engine)
        check_dispatch(d, expected, expected["recv_src_rank"].numel(), what)
        y = moe.combine(scaled_expert(d.recv_x, d.tokens_per_expert, me), d)
        check_close(y, reference_combine(x, topk_idx, topk_weights, scaled=True), f"{what}: combine, scaled experts")

        d = moe.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, comm=comm, engine=engine)
        y = moe.combine(d.recv_x.clone(), d)
        check_close(y, reference_combine(x, topk_idx, topk_weights, scaled=False), f"{what}: combine, identity experts")
        valid_weight = torch.where(topk_idx >= 0, topk_weights, 0.0).sum(1, keepdim=True)
        tolerance = 1e-2 if case.dtype != torch.float32 else 1e-5
        torch.testing.assert_close(y.float(), x.float() * valid_weight, rtol=tolerance, atol=1e-2,
                                   msg=lambda m, what=what: f"{what}: identity experts give x * sum(valid w): {m}")
        done.append(case.name)
    return done


def _run_capacity(comm: tw.Communicator, engine: str) -> None:
    """capacity=: static shapes, valid rows counted; too small -> the same error on every rank, then the
    communicator keeps working."""
    world, me = comm.world_size, comm.rank
    case = CASES[1]
    inputs = [make_inputs(case, r, world) for r in range(world)]
    x, topk_idx, topk_weights = inputs[me]
    expected = [reference_dispatch(inputs, r, world) for r in range(world)]
    most = max(e["recv_src_rank"].numel() for e in expected)
    capacity = most + 5
    d = moe.dispatch(x, topk_idx, topk_weights, num_experts=EXPERTS_PER_RANK * world, comm=comm, engine=engine,
                     capacity=capacity)
    check_dispatch(d, expected[me], capacity, f"{engine}/capacity rank {me}")
    y = moe.combine(scaled_expert(d.recv_x, d.tokens_per_expert, me), d)
    check_close(y, reference_combine(x, topk_idx, topk_weights, scaled=True), f"{engine}/capacity rank {me}: combine")
    with pytest.raises(tw.InvalidArgumentError, match=f"capacity={most - 1} is too small.*pass capacity >= {most}"):
        moe.dispatch(x, topk_idx, topk_weights, num_experts=EXPERTS_PER_RANK * world, comm=comm, engine=engine,
                     capacity=most - 1)


def _run_in_flight(comm: tw.Communicator, engine: str) -> None:
    """Two dispatches in flight combine correctly; a third one before combining the first is refused."""
    world, me = comm.world_size, comm.rank
    num_experts = EXPERTS_PER_RANK * world
    batches = [make_inputs(CASES[i], me, world) for i in (0, 2, 3)]
    first, second, third = (moe.dispatch(x, i, w, num_experts=num_experts, comm=comm, engine=engine)
                            for x, i, w in batches)
    with pytest.raises(tw.InvalidArgumentError, match="combine each dispatch before the second one after it"):
        moe.combine(first.recv_x, first)
    for (x, topk_idx, topk_weights), d in zip(batches[1:], (second, third)):
        y = moe.combine(scaled_expert(d.recv_x, d.tokens_per_expert, me), d)
        check_close(y, reference_combine(x, topk_idx, topk_weights, scaled=True), f"{engine}/in-flight rank {me}")
    with pytest.raises(tw.InvalidArgumentError, match="already combined"):
        moe.combine(third.recv_x, third)


def _run_all_to_all_v(comm: tw.Communicator, engine: str) -> None:
    world, me = comm.world_size, comm.rank
    for seed, dtype in ((0, torch.int64), (1, torch.float32), (2, torch.bfloat16)):
        counts = a2a_counts(seed, world)
        send = a2a_rows(me, sum(counts[me])).to(dtype)
        send_counts = torch.tensor(counts[me]) if seed % 2 else counts[me]
        recv, recv_counts = tw.all_to_all_v(send, send_counts, comm=comm, engine=engine)
        expected_parts = []
        for source in range(world):
            start = sum(counts[source][:me])
            expected_parts.append(a2a_rows(source, sum(counts[source]))[start:start + counts[source][me]])
        assert_equal(recv_counts, torch.tensor([counts[s][me] for s in range(world)]), f"{engine} a2av recv_counts")
        assert_equal(recv, torch.cat(expected_parts).to(dtype), f"{engine} a2av rows seed {seed}, rank {me}")
    # Nothing at all to send anywhere.
    recv, recv_counts = tw.all_to_all_v(torch.empty(0, 3), [0] * world, comm=comm, engine=engine)
    assert recv.shape == (0, 3) and recv_counts.tolist() == [0] * world


def _everything(engine: str):
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        done = _run_cases(comm, engine)
        _run_capacity(comm, engine)
        _run_in_flight(comm, engine)
        _run_all_to_all_v(comm, engine)
        comm.barrier()
    return done


@pytest.mark.parametrize("world", [2, 4], ids=["world2", "world4"])
@pytest.mark.parametrize("engine", HOST_ENGINES)
@pytest.mark.slow
def test_dispatch_combine_all_to_all_v(engine, world):
    """Every case (K = 1, 2, 4, 8; skew; a silent rank; a rank with no tokens; float32 and bfloat16),
    capacity, two dispatches in flight and all_to_all_v, against the single-process reference."""
    results = launch(_everything, world, engine, timeout=150)
    assert results == [[c.name for c in CASES]] * world


# --- bad input ----------------------------------------------------------------------------------
def _provoke(comm: tw.Communicator) -> dict[str, str]:
    """Each bad call on every rank (so nobody waits on a peer that raised); the message each raised."""
    world, me = comm.world_size, comm.rank
    x, topk_idx, topk_weights = make_inputs(CASES[1], me, world)
    experts = EXPERTS_PER_RANK * world
    out_of_range = topk_idx.clone()
    if me == 0:
        out_of_range[0, 0] = experts  # one bad id on rank 0: every rank must report it
    calls = {
        "x 1-D": lambda: moe.dispatch(x[0], topk_idx, topk_weights, num_experts=experts, comm=comm),
        "x int": lambda: moe.dispatch(x.long(), topk_idx, topk_weights, num_experts=experts, comm=comm),
        "idx rows": lambda: moe.dispatch(x, topk_idx[1:], topk_weights[1:], num_experts=experts, comm=comm),
        "idx int32": lambda: moe.dispatch(x, topk_idx.int(), topk_weights, num_experts=experts, comm=comm),
        "weights K": lambda: moe.dispatch(x, topk_idx, topk_weights[:, :1], num_experts=experts, comm=comm),
        "weights int": lambda: moe.dispatch(x, topk_idx, topk_idx, num_experts=experts, comm=comm),
        "device": lambda: moe.dispatch(x, topk_idx.to("meta"), topk_weights, num_experts=experts, comm=comm),
        "E % world": lambda: moe.dispatch(x, topk_idx, topk_weights, num_experts=experts + 1, comm=comm),
        "capacity 0": lambda: moe.dispatch(x, topk_idx, topk_weights, num_experts=experts, comm=comm, capacity=0),
        "engine name": lambda: moe.dispatch(x, topk_idx, topk_weights, num_experts=experts, comm=comm, engine="nccl"),
        "engine cuda on cpu": lambda: moe.dispatch(x, topk_idx, topk_weights, num_experts=experts, comm=comm,
                                                    engine="cuda"),
        "expert id >= E": lambda: moe.dispatch(x, out_of_range, topk_weights, num_experts=experts, comm=comm),
        "a2av counts length": lambda: tw.all_to_all_v(x, [x.shape[0]], comm=comm),
        "a2av counts sum": lambda: tw.all_to_all_v(x, [0] * world, comm=comm),
        "a2av negative": lambda: tw.all_to_all_v(x, [x.shape[0] + 1] + [-1] * (world - 1), comm=comm),
        "combine shape": lambda: moe.combine(d.recv_x[:, :1], d),
        "combine dtype": lambda: moe.combine(d.recv_x.double(), d),
    }
    d = moe.dispatch(x, topk_idx, topk_weights, num_experts=experts, comm=comm)
    seen = {}
    for name, call in calls.items():
        try:
            call()
        except tw.TensorwireError as e:
            seen[name] = f"{type(e).__name__}: {e}"
        else:
            seen[name] = "no error"
    moe.combine(d.recv_x, d)  # the communicator still works after every refusal
    return seen


def _bad_input():
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        seen = _provoke(comm)
        comm.barrier()
    return seen


EXPECTED_ERRORS = {
    "x 1-D": ("InvalidArgumentError", "reshape it to 2-D"),
    "x int": ("InvalidArgumentError", "pass float32, bfloat16 or float16"),
    "idx rows": ("InvalidArgumentError", "pass topk_idx as [num_tokens="),
    "idx int32": ("InvalidArgumentError", "pass int64 (topk_idx.long())"),
    "weights K": ("InvalidArgumentError", "pass one weight per (token, k) entry"),
    "weights int": ("InvalidArgumentError", "pass floating point weights"),
    "device": ("InvalidArgumentError", "move it with .to(x.device)"),
    "E % world": ("InvalidArgumentError", "is not divisible by the world size"),
    "capacity 0": ("InvalidArgumentError", "pass a positive number of rows"),
    "engine name": ("InvalidArgumentError", "is not one of 'torch', 'nixl', 'cuda'"),
    "engine cuda on cpu": ("BackendUnavailableError", "pass engine='nixl' or 'torch'"),
    "expert id >= E": ("InvalidArgumentError", "topk_idx on rank(s) [0] holds expert ids outside [-1,"),
    "a2av counts length": ("InvalidArgumentError", "pass one per rank"),
    "a2av counts sum": ("InvalidArgumentError", "the counts must cover every row"),
    "a2av negative": ("InvalidArgumentError", "has negative entries"),
    "combine shape": ("InvalidArgumentError", "return one output row per received row"),
    "combine dtype": ("InvalidArgumentError", "cast it with .to(torch.float32)"),
}


@pytest.fixture(scope="module")
def bad_input_results():
    return launch(_bad_input, 2)


@pytest.mark.parametrize("case", sorted(EXPECTED_ERRORS))
def test_bad_input_is_refused_with_the_fix(bad_input_results, case):
    """Every bad call raises the typed error whose message names the fix, on every rank."""
    kind, fix = EXPECTED_ERRORS[case]
    for rank, seen in enumerate(bad_input_results):
        assert seen[case].startswith(kind) and fix in seen[case], f"rank {rank}, {case}: {seen[case]}"


# --- single-process pieces ------------------------------------------------------------------------
def test_layout_orders_pairs_by_rank_then_expert_then_token():
    from tensorwire.moe.layout import placement, send_layout

    topk_idx = torch.tensor([[3, 0], [-1, 3], [1, -1]])
    layout = send_layout(topk_idx, num_experts=4, world_size=2)
    assert layout.order.tolist()[:4] == [1, 4, 0, 3]  # expert 0 (t0k1), expert 1 (t2k0), expert 3 (t0k0, t1k1)
    assert layout.token_of_row.tolist()[:4] == [0, 2, 0, 1]
    assert layout.expert_counts.tolist() == [1, 1, 0, 2]
    assert layout.n_tokens_to_rank.tolist() == [2, 2]
    assert layout.position_of_pair.tolist() == [[2, 0], [4, 3], [1, 5]]
    where = placement(torch.tensor([[1, 1, 0, 2], [2, 0, 1, 1]]), rank=1)
    assert where.recv_counts.tolist() == [[0, 2], [1, 1]]  # from rank 0: expert 3 x2; from rank 1: 2 and 3
    assert where.recv_start.tolist() == [[0, 1], [0, 3]]  # expert 2: [r1]; expert 3: [r0, r0, r1]
    assert where.tokens_per_expert.tolist() == [1, 3]
    assert where.return_start.tolist() == [[2, 2], [2, 3]]  # where those blocks sit in each source's send order


# --- the "cuda" engine's kernels on Triton's interpreter (no GPU needed; needs triton) ------------
def _interpreted_cuda_steps(world: int, capacity_slack: int) -> list[str]:
    """The ``"cuda"`` engine's steps (``engines/cuda_steps``' functions and ``nvlink``'s kernels) for ``world``
    ranks in this one process, on host tensors standing in for the IPC-mapped spaces and a host check
    standing in for the stream waits (every awaited flag word must have reached its target), followed by
    the ``consume_flags`` kernel, as on the stream. Ranks run each step in turn; the count exchange runs twice,
    since in its first pass (ranks in turn, waits skipped) earlier ranks copy their slots before later ranks
    stored into them; the second pass repeats the same stores and then finds every row. Run under
    TRITON_INTERPRET=1 (the flag must be set before triton is imported)."""
    from tensorwire.moe.count_rows import ERROR_OVERFLOW
    from tensorwire.moe.engines import cuda_routing, cuda_steps
    from tensorwire.moe.engines.cuda_spaces import DataSpace, SignalSpace, word_dtype
    from tensorwire.moe.kernels import nvlink, routing

    case = Case("interpreted", topk=4, hidden=24, tokens=6, skew=True, seed=11)
    num_experts = EXPERTS_PER_RANK * world
    inputs = [make_inputs(case, r, world) for r in range(world)]
    for _, topk_idx, topk_weights in inputs:
        topk_weights[topk_idx < 0] = float("nan")  # an unused slot's weight must never be multiplied in
    expected = [reference_dispatch(inputs, r, world) for r in range(world)]
    most = max(e["recv_src_rank"].numel() for e in expected)
    capacity = most + capacity_slack
    row_bytes = case.hidden * 4

    def spaces(nbytes, make):
        tensors = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world)]
        bases = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
        return [make(t, bases) for t in tensors]

    stride = 64
    signals = spaces(SignalSpace.nbytes(world, stride), lambda t, b: SignalSpace(t, b, world, stride))
    data = spaces(DataSpace.nbytes(world, capacity, row_bytes),
                  lambda t, b: DataSpace(t, b, world, capacity, row_bytes))
    errors = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    layouts = [cuda_routing.send_layout(routing, i, num_experts, world) for _, i, _ in inputs]

    problems = []

    def host_wait(space, first_word, target, count):
        flags = space.view(torch.int32)[2 * first_word:2 * (first_word + count):2]  # low halves of int64 words
        if (flags < target).any():
            problems.append(f"a wait for {target} at word {first_word} found flags {flags.tolist()}")
        before = flags.clone()
        nvlink.consume_flags[(1,)](space_ptr=space.view(torch.int64), first_word=first_word, target=target,
                                   count=count, BLOCK=4)
        if not torch.equal(flags, before - target):
            problems.append(f"consume_flags({target}) turned {before.tolist()} into {flags.tolist()}")

    for s in signals:
        s.round.add_(1)
    for attempt in range(2):
        for r in range(world):
            wait = host_wait if attempt else (lambda *args: None)
            cuda_steps.exchange_counts(nvlink, signals[r], layouts[r].expert_counts, layouts[r].out_of_range,
                                       row_bytes, capacity, num_experts, r, world, wait)
    wheres = [cuda_routing.block_tables(routing, signals[r].slots, signals[r].round, r, world, EXPERTS_PER_RANK,
                                        errors[r], capacity) for r in range(world)]
    for r in range(world):
        if capacity_slack >= 0:
            data[r].next_half()  # the second dispatch into a space: half 1
    halves = [d.next_half() for d in data]  # the overflow case stays in half 0: a spill would reach half 1
    for r in range(world):  # a sentinel in the other half: a store or a load that strays there shows
        data[r].rows(torch.float32, case.hidden, 1 - halves[r]).fill_(7.0)
    for r, (x, _, weights) in enumerate(inputs):
        layout = layouts[r]
        cuda_steps.store_rows(nvlink, data[r], x.view(word_dtype(row_bytes)), layout.order, layout.expert_of_pair,
                              weights, layout.topk, wheres[r], halves[r], r, world)
    results = []
    for r in range(world):
        host_wait(data[r].tensor, data[r].flags_offset, cuda_steps.SCATTER_PROGRAMS, world)
        recv_x = data[r].rows(torch.float32, case.hidden, halves[r])
        src_rank, src_idx, weights = cuda_steps.received_meta(data[r], halves[r], capacity, torch.float32)
        untouched = data[r].rows(torch.float32, case.hidden, 1 - halves[r])
        if (untouched != 7.0).any():
            problems.append(f"rank {r}: rows landed in the other half of the space")
        n = min(expected[r]["recv_src_rank"].numel(), capacity)  # an overflow drops the rows past capacity
        for name, got, want in (("recv_x", recv_x[:n], expected[r]["recv_x"][:n]),
                                ("recv_src_rank", src_rank[:n], expected[r]["recv_src_rank"][:n]),
                                ("recv_src_idx", src_idx[:n], expected[r]["recv_src_idx"][:n]),
                                ("recv_weights", weights[:n], expected[r]["recv_weights"][:n]),
                                ("tokens_per_expert", wheres[r].tokens_per_expert, expected[r]["tokens_per_expert"])):
            if not torch.equal(got, want):
                problems.append(f"rank {r}: {name} differs: {got.tolist()} != {want.tolist()}")
        results.append((recv_x, wheres[r].tokens_per_expert))
    # combine: outputs into each rank's own ROWS, ready signals, waits, pulls
    for r, (recv_x, per_expert) in enumerate(results):
        out = scaled_expert(recv_x, per_expert, r) if capacity_slack >= 0 else recv_x * 2
        recv_x.copy_(out)  # what combine does with outputs not computed in place
    for r in range(world):
        cuda_steps.signal_ready(nvlink, data[r], r, world)
    for r, (x, topk_idx, topk_weights) in enumerate(inputs):
        host_wait(data[r].tensor, data[r].ready_offset, 1, world)
        y = torch.empty_like(x)
        cuda_steps.pull_combine(nvlink, y, layouts[r], wheres[r], topk_weights, data[r], halves[r])
        if capacity_slack >= 0:
            want = reference_combine(x, topk_idx, topk_weights, scaled=True)
        else:  # pairs whose row fell past the capacity were dropped and add nothing
            experts = topk_idx.clamp(min=0)
            row = (wheres[r].destination_start.reshape(-1)[experts] + layouts[r].position_of_pair
                   - wheres[r].send_start.reshape(-1)[experts])
            kept = torch.where(row < capacity, topk_idx, -1)
            want = 2 * reference_combine(x, kept, topk_weights, scaled=False)
        if not torch.allclose(y, want, rtol=1e-6, atol=1e-4):
            problems.append(f"rank {r}: combine differs by {float((y - want).abs().max())}")
    # A peer that runs ahead signals the next combine before this rank consumed the current one: both
    # signals must survive (two combines in a row).
    for _ in range(2):
        for r in range(world):
            cuda_steps.signal_ready(nvlink, data[r], r, world)
    for _ in range(2):
        for r in range(world):
            host_wait(data[r].tensor, data[r].ready_offset, 1, world)
    bits = [int(e) for e in errors]
    if capacity_slack >= 0:
        problems += [f"rank {r}: error bits {b}" for r, b in enumerate(bits) if b]
    elif not all(b & ERROR_OVERFLOW for b in bits):
        problems.append(f"capacity {capacity} < {most} rows must flag OVERFLOW on every rank, got bits {bits}")
    return problems


def _interpreter_probe() -> str | None:
    """Why Triton's interpreter cannot run these kernels here, or None. (Triton 3.6's interpreter turns a
    runtime loop bound into a 1-element array, which numpy >= 2.4 refuses to convert to an int.)"""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(out_ptr, n):
        for i in range(0, n, 1):
            tl.store(out_ptr + i, i)

    out = torch.zeros(3, dtype=torch.int64)
    try:
        probe[(1,)](out, 3)
    except Exception as e:  # noqa: BLE001 - any failure of the probe means "cannot run here"
        import numpy

        return f"Triton {triton.__version__}'s interpreter fails on numpy {numpy.__version__}: {e}"
    return None


_SKIP = 3


def _interpreter_job(call: str) -> None:
    """Run ``test_moe.<call>`` (a list of problems) in a fresh interpreter with TRITON_INTERPRET=1."""
    import os
    import subprocess
    import sys

    code = (f"import test_moe; reason = test_moe._interpreter_probe(); print(reason or ''); "
            f"problems = [] if reason else test_moe.{call}; "
            f"print('\\n'.join(problems)); raise SystemExit({_SKIP} if reason else 1 if problems else 0)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=os.path.dirname(__file__), env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    if done.returncode == _SKIP:
        pytest.skip(done.stdout.strip().splitlines()[0])
    assert done.returncode == 0, f"interpreted {call}:\n{done.stdout}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("world,slack", [(2, 3), (3, -1)], ids=["world2", "world3-overflow"])
@pytest.mark.slow
def test_cuda_backend_kernels_on_the_triton_interpreter(world, slack):
    """The cuda engine's kernels and device tables, run by Triton's interpreter on host memory: rows land
    where the receive order says, combine pulls and sums them, an overflow is flagged (not written)."""
    pytest.importorskip("triton", reason="Triton is not installed (the cuda engine's kernels need it)")
    _interpreter_job(f"_interpreted_cuda_steps({world}, {slack})")


def _interpreted_routing_tables() -> list[str]:
    """``routing``'s kernels against ``layout``'s torch ops: the same send order (valid pairs; invalid
    pairs after them, a permutation), counts and out-of-range flag; the same block tables from count rows
    in a signal space's slots, and the error bits with a capacity."""
    from tensorwire.moe.count_rows import ERROR_EXPERT_OUT_OF_RANGE, ERROR_MISMATCH, ERROR_OVERFLOW, HEADER
    from tensorwire.moe.engines import cuda_routing
    from tensorwire.moe.kernels import routing
    from tensorwire.moe.layout import placement, send_layout

    problems = []
    generator = torch.Generator().manual_seed(5)
    # (T, K, E, W): several sort blocks (1025 * 2 > 2 * PAIR_BLOCK), no pairs, top-1, 3 ranks
    for tokens, topk, experts, world in ((6, 4, 8, 2), (1025, 2, 16, 4), (0, 2, 4, 2), (5, 1, 6, 3), (700, 8, 64, 2)):
        topk_idx = torch.randint(-1, experts, (tokens, topk), generator=generator)
        if tokens > 3:
            topk_idx[1, 0] = experts + 3
        want, got = send_layout(topk_idx, experts, world), cuda_routing.send_layout(routing, topk_idx, experts, world)
        n = int(want.num_pairs)
        case = f"T={tokens} K={topk} E={experts} W={world}"
        if not torch.equal(want.order[:n], got.order[:n]):
            problems.append(f"{case}: send order differs")
        if sorted(got.order.tolist()) != list(range(tokens * topk)) or (got.position_of_pair[~got.valid] < n).any():
            problems.append(f"{case}: the invalid pairs are not a permutation after the valid ones")
        for name in ("position_of_pair", "expert_of_pair", "expert_counts", "out_of_range", "valid"):
            a, b = getattr(want, name), getattr(got, name)
            if name == "position_of_pair":
                a, b = a[want.valid], b[got.valid]
            if not torch.equal(a, b):
                problems.append(f"{case}: {name} differs: {b.tolist()} != {a.tolist()}")
        counts = torch.randint(0, 50, (world, experts), generator=generator)
        slots = torch.zeros(2, world, 128, dtype=torch.int64)
        slots[1, :, :HEADER] = torch.tensor([0, 448, 10**6, experts])
        slots[1, :, HEADER:HEADER + experts] = counts
        round_word = torch.tensor([3])  # odd: the rows are in slots[1]
        for rank in range(world):
            error = torch.zeros(1, dtype=torch.int64)
            tables = cuda_routing.block_tables(routing, slots, round_word, rank, world, experts // world, error, 10**6)
            where = placement(counts, rank)
            for name in ("send_start", "destination_start", "tokens_per_expert", "num_recv_rows", "rows_per_rank"):
                if not torch.equal(getattr(tables, name), getattr(where, name)):
                    problems.append(f"{case} rank {rank}: {name} differs")
            if int(error):
                problems.append(f"{case} rank {rank}: error bits {int(error)} on consistent rows")
        slots[1, world - 1, 1] = 999  # another row size on the last rank, an out-of-range id on rank 0
        slots[1, 0, 0] = ERROR_EXPERT_OUT_OF_RANGE
        error = torch.zeros(1, dtype=torch.int64)
        # capacity 1: overflow
        cuda_routing.block_tables(routing, slots, round_word, 0, world, experts // world, error, 1)
        if int(error) != ERROR_EXPERT_OUT_OF_RANGE | ERROR_MISMATCH | ERROR_OVERFLOW:
            problems.append(f"{case}: error bits {int(error)}, expected all three")
    return problems


@pytest.mark.slow
def test_routing_kernels_compute_the_torch_tables():
    """The cuda engine's routing kernels (counting sort, block tables) on Triton's interpreter give what
    ``layout``'s torch ops give."""
    pytest.importorskip("triton", reason="Triton is not installed (the cuda engine's kernels need it)")
    _interpreter_job("_interpreted_routing_tables()")


# --- user notifications beside MoE traffic ------------------------------------------------------
def _user_notifications_beside_moe():
    """Rank 1 notifies rank 0 (a user WRITE) right before both run a nixl dispatch/combine; the user's
    message must wait in rank 0's inbox untouched and arrive after the MoE call."""
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        world, me = comm.world_size, comm.rank
        buf = torch.zeros(64)
        with comm.register(buf) as reg:
            comm.publish("buf", reg.descs)
            if me == 1:
                src = torch.ones(64)
                with comm.register(src):
                    comm.write(src, comm.lookup("buf", 0), notify=b"user-before")
            inputs = [make_inputs(CASES[0], r, world) for r in range(world)]
            x, topk_idx, topk_weights = inputs[me]
            d = moe.dispatch(x, topk_idx, topk_weights, num_experts=EXPERTS_PER_RANK * world, comm=comm,
                             engine="nixl")
            y = moe.combine(d.recv_x.clone(), d)
            check_close(y, reference_combine(x, topk_idx, topk_weights, scaled=False), "combine beside user traffic")
            message = comm.wait_notification(1, timeout=10) if me == 0 else None
            comm.barrier()
    return message


def test_user_notifications_do_not_disturb_moe():
    """MoE's notifications travel in their own channel: a user's notification neither breaks a dispatch
    nor gets consumed by it."""
    assert launch(_user_notifications_beside_moe, 2, timeout=90)[0] == b"user-before"


# --- the nixl engine's prepared WRITEs ------------------------------------------------------------
def _counted(method, calls: list[str]):
    """``method``, noting each call's name in ``calls``."""
    def counting(*args, **kwargs):
        calls.append(method.__name__)
        return method(*args, **kwargs)
    return counting


def _prepares_per_step() -> list[int]:
    """Four nixl dispatch + combine steps of one shape; how many transfers each step prepared."""
    with tw.init(timeout=INIT_TIMEOUT) as comm:
        world, me = comm.world_size, comm.rank
        prepared: list[str] = []
        for name in ("prepare", "prepare_blocks"):
            setattr(comm, name, _counted(getattr(comm, name), prepared))
        x, topk_idx, topk_weights = make_inputs(CASES[1], me, world)
        per_step = []
        for _ in range(4):
            before = len(prepared)
            d = moe.dispatch(x, topk_idx, topk_weights, num_experts=EXPERTS_PER_RANK * world, comm=comm,
                             engine="nixl")
            y = moe.combine(d.recv_x.clone(), d)
            check_close(y, reference_combine(x, topk_idx, topk_weights, scaled=False), "repeated step")
            per_step.append(len(prepared) - before)
        comm.barrier()
    return per_step


def test_nixl_prepares_its_writes_once():
    """A step of a shape seen before prepares nothing (``prepare`` costs a store round trip): the WRITEs are
    prepared once and posted again with new row ids. Count slots and return buffers alternate between two
    calls, so the first two steps prepare."""
    for per_step in launch(_prepares_per_step, 2, timeout=90):
        assert per_step[0] > 0 and per_step[2:] == [0, 0], per_step
