"""torch.distributed collectives on a communicator, without ``init_process_group``: the ``torch`` engine's.

A communicator already owns a store, behind its ``Rendezvous``. This module builds a process group over a
``SealedStore`` view of it (keys under ``pg/gloo/`` for host tensors, ``pg/nccl/`` for CUDA tensors), so that
the group's rendezvous values (Gloo's socket addresses, NCCL's unique id) are sealed with the job token like
every other value the job stores, and a forged one ends the group's creation with ``AuthenticationError``. A
group is built once per communicator and kind, the first time a collective needs it; every rank does so in the
same collective call, which is what a group's rendezvous requires.

The groups are cached in a ``WeakKeyDictionary`` keyed by the communicator, so they go when it goes;
``shutdown(comm)`` aborts them eagerly (the ``torch`` engine calls it when the communicator closes). Collectives call
the group's own methods (``allgather``, ``alltoall_base``): the functional ``torch.distributed`` API wants
a default process group, which tensorwire does not require users to create.

Non-goals: a general torch.distributed wrapper. This is what ``tensorwire.moe``'s ``"torch"`` engine
needs: an all-gather of small rows and an all-to-all with uneven splits.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import BackendUnavailableError, PeerLostError, TransferError, WaitTimeoutError
from ..meeting.sealed_store import SealedStore
from ..progress import wait_until

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["all_gather", "all_to_all", "availability", "process_group", "shutdown"]

_GROUPS: weakref.WeakKeyDictionary[Communicator, dict[str, Any]] = weakref.WeakKeyDictionary()
_STORES: weakref.WeakKeyDictionary[Communicator, dict[str, Any]] = weakref.WeakKeyDictionary()  # alive with groups


def _kind(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def availability(device: torch.device) -> tuple[bool, str]:
    """Whether this torch build has the collective library for ``device`` tensors, and why not."""
    if not dist.is_available():
        return False, f"torch {torch.__version__} was built without torch.distributed"
    if _kind(device) == "gloo":
        if not dist.is_gloo_available():
            return False, f"torch {torch.__version__} was built without Gloo (host tensors)"
        return True, "Gloo"
    if not dist.is_nccl_available():
        return False, f"torch {torch.__version__} was built without NCCL (CUDA tensors)"
    return True, "NCCL"


def process_group(comm: Communicator, device: torch.device) -> Any:
    """The Gloo (host) or NCCL (CUDA) process group of ``comm``, created on first use. Collective on
    first use (every rank must ask for the same kind in the same call); cached afterwards."""
    kind = _kind(device)
    groups = _GROUPS.setdefault(comm, {})
    group = groups.get(kind)
    if group is None:
        available, reason = availability(device)
        if not available:
            other = "'nixl' or 'cuda'" if kind == "nccl" else "'nixl'"
            raise BackendUnavailableError(
                f"torch engine unavailable for {device.type} tensors: {reason}; "
                f"pass engine={other}"
            )
        peers = tuple(rank for rank in range(comm.world_size) if rank != comm.rank)
        store = SealedStore(comm.runtime.store, f"pg/{kind}/", peers, comm.timeout_s)
        timeout = datetime.timedelta(seconds=comm.timeout_s)
        if kind == "gloo":
            group = dist.ProcessGroupGloo(store, comm.rank, comm.world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, comm.rank, comm.world_size, options)
        groups[kind] = group
        # The group holds the store through a C++ trampoline that does not keep this Python object alive; NCCL
        # connects lazily, at the first collective (and its heartbeat reads the store later), so the store must
        # live as long as the group.
        _STORES.setdefault(comm, {})[kind] = store
    return group


def shutdown(comm: Communicator) -> None:
    """Abort and forget ``comm``'s process groups (idempotent; local, never blocks on peers)."""
    groups = _GROUPS.pop(comm, {})
    for group in groups.values():
        method = getattr(group, "abort", None) or getattr(group, "shutdown", None)
        if method is not None:
            with contextlib.suppress(Exception):  # best effort: the peers may be gone already
                method()
    groups.clear()  # the groups (and NCCL's monitor thread, which reads the store) go before their stores
    _STORES.pop(comm, None)


def _wait(work: Any, comm: Communicator, what: str, on_host: bool) -> None:
    """Complete ``work``: host collectives block until done (sleeping, bounded by the communicator's timeout,
    ended with ``PeerLostError`` once a peer is gone: Gloo's own wait notices a closed connection but not a cut
    link); NCCL collectives make the current stream wait (no host block)."""
    runtime = comm.runtime
    peers = [rank for rank in range(comm.world_size) if rank != comm.rank]
    try:
        if on_host:
            for rank in peers:
                runtime.liveness.watch(rank)

            def alive() -> None:
                for rank in peers:
                    runtime.liveness.check(rank, what)
                runtime.between_polls()

            wait_until(work.is_completed, comm.timeout_s, lambda: f"{what}: a peer may be slow, stuck or dead",
                       comm.config, alive)
        work.wait(datetime.timedelta(seconds=comm.timeout_s))
    except RuntimeError as e:
        text = str(e)
        gone = runtime.gone_among(peers, comm.config.liveness_s)  # Gloo may see a closed connection first
        if gone is not None:
            raise PeerLostError(f"{what}: rank {gone[0]} is gone ({gone[1]}); torch.distributed said: "
                                f"{text.splitlines()[0] if text else type(e).__name__}") from e
        if "imeout" in text or "timed out" in text:  # Gloo and NCCL say it in words only
            raise WaitTimeoutError(f"{what}: not done after {comm.timeout_s:.3g}s ({text.splitlines()[0]}); "
                                   "a peer may be slow, stuck or dead") from e
        raise TransferError(f"{what} failed: {text.splitlines()[0] if text else type(e).__name__}") from e


def all_gather(comm: Communicator, row: torch.Tensor) -> torch.Tensor:
    """``[W, *row.shape]``: every rank's ``row`` (same shape and dtype everywhere), on ``row``'s device.
    Collective. Host tensors: blocks until done. CUDA tensors: stream-ordered (NCCL)."""
    group = process_group(comm, row.device)
    row = row.contiguous()
    parts = [torch.empty_like(row) for _ in range(comm.world_size)]
    _wait(group.allgather([parts], [row]), comm, "all_gather over torch.distributed", row.device.type == "cpu")
    return torch.stack(parts)


def all_to_all(comm: Communicator, output: torch.Tensor, input: torch.Tensor,
               output_splits: list[int], input_splits: list[int]) -> None:
    """Rows ``input[sum(input_splits[:r]) : +input_splits[r]]`` go to rank ``r``; rows from rank ``s`` land
    at ``output[sum(output_splits[:s]) : +output_splits[s]]``. Both tensors contiguous, same dtype and row
    shape, on one device. Collective; host tensors block, CUDA tensors are stream-ordered (NCCL)."""
    group = process_group(comm, input.device)
    work = group.alltoall_base(output, input.contiguous(), list(output_splits), list(input_splits))
    _wait(work, comm, "all_to_all over torch.distributed", input.device.type == "cpu")
