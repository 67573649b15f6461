"""The ``Communicator``: the public surface of point-to-point tensorwire (``tw.init`` makes one: ``joining.py``).

A communicator owns its transports (built by ``backends.registry`` from one ``BackendContext``: every transport
that works here), its ``LocalMemory`` (registrations, epochs, the published map), its ``Peers`` (peers' memory
maps, the transport choice: see ``tensorwire.peers``), its ``Notifications`` and the ``Runtime`` every handle
shares (progress and deadline threads, pinned words, timeouts), which is also ``comm.runtime``, the seam of the
layers above. ``Transfer.transport`` tells which transport carries a transfer, ``prepare(transport=)`` overrides
the choice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from . import arguments
from . import blocks as blocks_module
from . import config as config_module
from .backends.base import BackendContext, Op
from .backends.transports import Transports
from .block_transfer import BlockTransfer
from .blocks import BlockPool, BlockPoolDesc
from .descriptors import MemoryKind, TensorDesc
from .errors import InvalidArgumentError, PeerLostError, TensorwireWarning, WaitTimeoutError
from .freshness import Freshness
from .local_memory import LocalMemory
from .meeting import Rendezvous
from .meeting.membership import Member
from .memory_map import host_identity
from .network import ucx_net_devices
from .notifications import Notifications
from .peers import Peers
from .progress import Inbox
from .registration import Registration
from .revocation import CHANNEL as REVOCATION_CHANNEL
from .revocation import Revocations
from .runtime import Runtime
from .transfer import Transfer

__all__ = ["Communicator"]



class Communicator:
    """One rank's endpoint. Context manager; ``close()`` is idempotent.

    ``rank``, ``world_size``, ``local_rank``, ``local_world_size``, ``device`` (``cuda:LOCAL_RANK % gpus``
    with CUDA, else ``cpu``; tensorwire never calls ``torch.cuda.set_device`` for you).
    """

    def __init__(self, rendezvous: Rendezvous, device: torch.device, cfg: config_module.Config,
                 timeout_s: float) -> None:
        """Made by ``tw.init`` (``tensorwire.joining``) once the rendezvous is reached."""
        env = rendezvous.env  # a fleet member's rank is the directory's
        self._world_size = env.world_size
        self.local_rank = env.local_rank
        self.local_world_size = env.local_world_size
        self.device = device
        self.config = cfg
        self.timeout_s = timeout_s
        self._rendezvous = rendezvous
        self.rank = env.rank
        self.name: str | None = env.name  # a fleet member's name (None in a launcher's world)
        self._memory: LocalMemory | None = None  # once the transports exist (their local view reads its map)
        # A transport that starts in the background (NIXL's agent, ~0.5 s) calls on_ready once its metadata
        # exists: the map is published again with it.
        transports = Transports(BackendContext(
            env.rank, cfg, lambda segment: self._memory.map.view(segment), self._rendezvous.liveness.lost,
            ucx_net_devices(self._rendezvous.liveness.address[0])[0], timeout_s,
            on_ready=lambda: self._memory is not None and self._memory.republish()))
        self._runtime = Runtime(env.rank, cfg, timeout_s, self._rendezvous, transports, Inbox(transports.notifications))
        self._memory = LocalMemory(self._runtime)
        self._peers = Peers(self._runtime, host_identity(), self._memory.regions)
        self._revocations = Revocations(self._runtime, self._peers)
        self._memory.connect(self._peers, self._revocations)
        self._notifications = Notifications(self._runtime, rendezvous.notification_senders)
        self._runtime.stream_waiters.add(self._notifications)
        self._open_channels(cfg)
        self._memory.publish()
        if rendezvous.has_peers:  # peers may revoke memory: answer whatever this rank's threads do
            self._revocations.listen()
        try:
            rendezvous.start(env.name, host_identity())  # last: a fleet member is listed, peers may use it at once
        except BaseException:
            self.close()  # its agent and threads too: nobody else holds this half-made communicator
            raise
        self._handed_out = True  # from here on a leak is the user's (see __del__)

    def _open_channels(self, cfg: config_module.Config) -> None:
        """The communicator's own message channel (revocations), and the map confirmations: its liveness listener
        tells askers its map epoch; with a token, its prepares ask the owners (``freshness.py``)."""
        runtime = self._runtime
        runtime.channel(REVOCATION_CHANNEL, self._revocations.handle)
        runtime.reach = self._revocations.reach
        runtime.liveness.map_epoch = lambda: self._memory.epoch
        if cfg.job_token is not None:
            self._peers.current_epoch = Freshness(runtime).current_epoch
        self._rendezvous.between_polls = self._revocations.pump  # a rank in a barrier answers revocations too
        runtime.between_polls = self._revocations.pump  # and so does every sleeping wait

    @property
    def runtime(self) -> Runtime:
        """The seam for layers built on this communicator (``tensorwire.runtime``): its store, notification
        channels of their own, the transports, ``close_with``, one ``extension`` slot each."""
        return self._runtime

    @property
    def closed(self) -> bool:
        return self._runtime.closed

    # --- memory ---------------------------------------------------------------------------------
    def register(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> Registration:
        """Register contiguous, non-empty CPU or CUDA tensors for one-sided access. Local, not collective;
        blocks while the backend pins the memory. Returns a ``Registration`` whose ``descs`` peers may use."""
        self._check_open("register")
        return self._memory.register(tensors)

    def peer_pointer(self, desc: TensorDesc) -> int:
        """A device pointer, valid in this process on ``self.device``, to ``desc``'s bytes in a same-host
        peer's GPU memory (a CUDA IPC mapping, opened once per peer allocation and closed with the
        communicator): for kernels that load and store peers' memory directly. Own memory maps to itself.
        Blocks on first contact with the peer (bounded by the timeout); not collective."""
        self._check_open("peer_pointer")
        if not isinstance(desc, TensorDesc) or desc.kind is not MemoryKind.CUDA:
            raise InvalidArgumentError(f"peer_pointer: needs a TensorDesc of CUDA memory, got {desc!r}")
        self._check_rank(desc.rank, "peer_pointer")
        self._peers.check_remote_ranges(desc.rank, [desc], "peer_pointer")
        if desc.rank == self.rank:
            return desc.addr
        return self._peers.ipc_pointer(desc, self.device.index)

    # --- descriptors through the store ----------------------------------------------------------
    def publish(self, key: str, descs: Sequence[TensorDesc] | TensorDesc) -> None:
        """Make ``descs`` visible to every rank under ``(key, self.rank)``. Non-blocking, not collective."""
        self._check_open("publish")
        arguments.check_key(key, "publish")
        self._rendezvous.set(f"user/{self.rank}/{key}", TensorDesc.pack(descs))

    def lookup(self, key: str, rank: int, *, timeout: float | None = None) -> list[TensorDesc]:
        """The descriptors ``rank`` published under ``key``; blocks until they exist (``WaitTimeoutError``)."""
        self._check_open("lookup")
        arguments.check_key(key, "lookup")
        self._check_rank(rank, "lookup")
        blob = self._rendezvous.get(
            f"user/{rank}/{key}", self._timeout(timeout), f"lookup: rank {rank} has not published {key!r}",
            ranks=(rank,))
        return TensorDesc.unpack(blob, source=f"lookup: what rank {rank} published under {key!r}")

    # --- transfers ------------------------------------------------------------------------------
    def prepare(self, op: Op, local: torch.Tensor | Sequence[torch.Tensor],
                remote: TensorDesc | Sequence[TensorDesc], *, notify: bytes | None = None,
                transport: str | None = None) -> Transfer:
        """Build a reusable transfer: item i of ``local`` (registered tensors or views inside them) pairs with
        item i of ``remote`` (descriptors of ONE rank, possibly this one). May block on first contact with a
        peer while its memory map is fetched (bounded by the timeout). Zero-byte items are skipped.

        ``transport`` forces one of ``backends.registry.FORCEABLE`` (``"local"``, ``"cuda_ipc"``, ``"shm"``,
        ``"nixl"``, and the tests' ``"fake"``) where it reaches the peer; by default the first that does is chosen
        (see the module docstring) and ``Transfer.transport`` says which."""
        self._check_open("prepare")
        local_tensors, remote_descs, peer = arguments.prepare_arguments(op, local, remote, notify, transport,
                                                                        self._world_size)
        pairs, registrations = arguments.segment_pairs(self._memory.map, local_tensors, remote_descs)
        if pairs and peer == self.rank:
            arguments.refuse_overlaps(pairs)
        kinds = {(s.kind, r.kind) for s, r in pairs}
        if len(kinds) > 1:
            raise InvalidArgumentError(f"prepare: items mix memory kinds {sorted((a.name, b.name) for a, b in kinds)}; "
                                       "prepare one transfer per (local, remote) memory kind")
        return self._prepared(op, peer, pairs, remote_descs, registrations, transport, notify, "prepare",
                              lambda backend: backend.prepare(op, [s for s, _ in pairs], [r for _, r in pairs], peer,
                                                              notify))

    def _prepared(self, op: Op, peer: int, pairs: list, remote_descs: list[TensorDesc], holders, transport: str | None,
                  notify: bytes | None, fn: str, build: Callable) -> Transfer:
        """The one prepare path of tensors and blocks: ``Peers.route`` (reach, transport, first touch), then
        ``build(backend)`` makes the request; the ``Transfer`` closes with the registrations in ``holders``."""
        backend = request = None
        if pairs:
            backend, request = self._peers.route(peer, remote_descs, pairs, transport, notify is not None, fn, build)
        uses_cuda = bool(pairs) and MemoryKind.CUDA in (pairs[0][0].kind, pairs[0][1].kind)
        transfer = Transfer(self._runtime, op, peer, sum(s.nbytes for s, _ in pairs), backend, request, notify,
                            uses_cuda, frozenset(d.epoch for d in remote_descs if d.nbytes))
        self._runtime.transfers.add(transfer)
        for registration in holders:
            registration.transfers.add(transfer)
        return transfer

    def read(self, local, remote, *, timeout: float | None = None) -> None:
        """READ remote -> local and wait for it (prepare + post + wait + close). Blocks."""
        with self.prepare(Op.READ, local, remote) as transfer:
            transfer.post()
            transfer.wait(timeout=timeout)

    def write(self, local, remote, *, notify: bytes | None = None, timeout: float | None = None) -> None:
        """WRITE local -> remote and wait for it; ``notify`` reaches the peer after the data. Blocks."""
        with self.prepare(Op.WRITE, local, remote, notify=notify) as transfer:
            transfer.post()
            transfer.wait(timeout=timeout)

    def wait_notification(self, from_rank: int, *, timeout: float | None = None,
                          stream: torch.cuda.Stream | None = None) -> bytes | None:
        """The next message a WRITE's ``notify=`` from ``from_rank`` delivered, in order. Blocks (sleeping)
        until one arrives; ``WaitTimeoutError`` after ``timeout`` seconds.

        With ``stream``: returns None at once and makes ``stream`` wait until that next notification has
        arrived (the message is consumed; the data of the WRITE it followed is in place), so a consumer
        kernel starts with no CPU in the loop. Do not mix CPU and stream waits for the same sender; ``stream``
        may not be CUDA's legacy default stream (``InvalidArgumentError``). If no notification arrives within
        ``timeout`` (default: the communicator's), the stream is released anyway (what it then reads is not
        valid) and the next ``wait_notification`` raises ``WaitTimeoutError``."""
        self._check_open("wait_notification")
        self._check_rank(from_rank, "wait_notification")
        self._notifications.raise_kept_error()
        if stream is not None:
            return self._notifications.wait_on_stream(from_rank, stream, self._timeout(timeout))
        return self._notifications.wait(from_rank, self._timeout(timeout))

    def poll_notifications(self) -> list[tuple[int, bytes]]:
        """Every notification that arrived from any sender and was not taken yet, as ``(sender rank, message)``,
        each sender's in arrival order. Never blocks (one poll of the backend). For a receiver that cannot name
        its senders in advance, e.g. a KV producer told by whichever consumer READ its blocks
        (``BlockTransfer.post(notify=)``). Do not mix it with ``wait_notification(stream=)`` for one sender."""
        self._check_open("poll_notifications")
        return self._runtime.inbox.take_all()

    # --- KV-cache blocks ---------------------------------------------------------------------------
    def register_blocks(self, views: torch.Tensor | Sequence[torch.Tensor]) -> BlockPool:
        """A ``BlockPool`` over ``views`` (each ``[num_blocks, ...]`` on one CPU or CUDA device, block i =
        ``view[i]``, one contiguous byte range). Views inside tensors registered with ``register`` use that
        registration; otherwise their spans are registered here (and deregistered by ``pool.close()``). Local,
        not collective; blocks while the memory is pinned. See ``tensorwire.blocks``."""
        self._check_open("register_blocks")
        views, layout = blocks_module.pool_layout(views)
        spans = layout.spans()
        memory = self._memory
        holders = [memory.map.find(s) for s in spans]
        if all(h is not None for h in holders):
            return BlockPool(self._runtime, views, layout, holders, None, memory.expose_pool, memory.withdraw_pool)
        if any(h is not None or memory.map.overlapping(s) for h, s in zip(holders, spans)):
            raise InvalidArgumentError(
                "register_blocks: some views lie in registered tensors and some do not (or only partly); register "
                "the tensors that hold all the views with comm.register first, or none of them")
        owned = self.register(blocks_module.spans_to_register(views, layout))
        return BlockPool(self._runtime, views, layout, [memory.map.find(s) for s in spans], owned)

    def publish_blocks(self, key: str, pool: BlockPool) -> None:
        """Make ``pool``'s descriptor visible to every rank under ``(key, self.rank)``. Non-blocking, not
        collective."""
        self._check_open("publish_blocks")
        arguments.check_key(key, "publish_blocks")
        blocks_module.check_pool(pool, self._runtime, "publish_blocks")
        self._rendezvous.set(f"blocks/{self.rank}/{key}", pool.desc.pack())

    def lookup_blocks(self, key: str, rank: int, *, timeout: float | None = None) -> BlockPoolDesc:
        """The ``BlockPoolDesc`` ``rank`` published under ``key``; blocks until it exists (``WaitTimeoutError``)."""
        self._check_open("lookup_blocks")
        arguments.check_key(key, "lookup_blocks")
        self._check_rank(rank, "lookup_blocks")
        blob = self._rendezvous.get(f"blocks/{rank}/{key}", self._timeout(timeout),
                                    f"lookup_blocks: rank {rank} has not published {key!r}", ranks=(rank,))
        try:
            desc = BlockPoolDesc.unpack(blob)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"lookup_blocks: the value under ({key!r}, rank {rank}) is not a block pool: "
                                       f"{e}") from e
        if desc.rank != rank:
            raise InvalidArgumentError(f"lookup_blocks: the pool under ({key!r}, rank {rank}) names rank {desc.rank}; "
                                       "the store value is corrupt")
        return desc

    def prepare_blocks(self, op: Op, pool: BlockPool, remote: BlockPoolDesc, *,
                       transport: str | None = None) -> BlockTransfer:
        """A reusable ``BlockTransfer`` between ``pool`` and the peer's pool ``remote`` (same number of views,
        same bytes per block in each). Blocks on first contact with the peer (bounded by the timeout). Picks
        the transport as ``prepare`` does; ``transport=`` forces one."""
        self._check_open("prepare_blocks")
        blocks_module.check_pool(pool, self._runtime, "prepare_blocks")
        pool.check_pair(op, remote, transport, self._world_size)
        peer, remote_layout = remote.rank, remote.layout()
        pairs = list(zip(pool.layout.spans(), remote_layout.spans()))
        built = []

        def build(backend):
            built.append((backend, backend.prepare_blocks(op, pool.layout, remote_layout, peer)))
            return built[0][1]

        core = self._prepared(op, peer, pairs, remote.spans(), pool.holders, transport, None, "prepare_blocks", build)
        transfer = BlockTransfer(core, pool, remote, *built[0], self._runtime)
        pool.transfers.add(transfer)
        return transfer

    def read_blocks(self, pool: BlockPool, local_ids, remote: BlockPoolDesc, remote_ids, *,
                    timeout: float | None = None) -> None:
        """READ block ``remote_ids[i]`` of ``remote`` into block ``local_ids[i]`` of ``pool`` and wait. Blocks."""
        with self.prepare_blocks(Op.READ, pool, remote) as transfer:
            transfer.post(local_ids, remote_ids)
            transfer.wait(timeout=timeout)

    def write_blocks(self, pool: BlockPool, local_ids, remote: BlockPoolDesc, remote_ids, *,
                     notify: bytes | None = None, timeout: float | None = None) -> None:
        """WRITE block ``local_ids[i]`` of ``pool`` to block ``remote_ids[i]`` of ``remote`` and wait; ``notify``
        reaches the peer after the data. Blocks."""
        with self.prepare_blocks(Op.WRITE, pool, remote) as transfer:
            transfer.post(local_ids, remote_ids, notify=notify)
            transfer.wait(timeout=timeout)

    # --- collective helpers & lifetime ------------------------------------------------------------
    def barrier(self, *, timeout: float | None = None) -> None:
        """Return when every rank has called ``barrier``. Collective, blocking (on the store). A launcher's
        world only: a fleet has no fixed set of members to wait for."""
        self._check_open("barrier")
        self._rendezvous.barrier(self._timeout(timeout))

    # --- fleets ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The number of ranks of a launcher's world; a fleet has none (``InvalidArgumentError``)."""
        return self._rendezvous.world_size

    def members(self) -> dict[int, Member]:
        """The fleet's members present now, by rank (``tw.Member``: rank, name, host, pid), this one included.
        Blocks for directory round trips and one concurrent connect per listed member (at most
        ``TENSORWIRE_LIVENESS_S``): a member that died is not listed within that bound. Fleets only."""
        self._check_open("members")
        return self._rendezvous.members()

    def rank_of(self, name: str, *, timeout: float | None = None) -> int:
        """The rank of the present member named ``name``; waits (sleeping, bounded by ``timeout``, default the
        communicator's) until one is, else ``WaitTimeoutError``. A member started again under its name has a
        new rank: call this again after a ``PeerLostError``. Fleets only."""
        self._check_open("rank_of")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"rank_of: name={name!r}; give a member's name")
        return self._rendezvous.rank_of(name, self._timeout(timeout))

    def close(self) -> None:
        """Release transfers, registrations and the backend agent. Not collective; rank 0 keeps the store
        up until every rank has closed or is gone (at most the communicator's timeout; a dead rank is noticed
        within ``TENSORWIRE_LIVENESS_S``). Idempotent.

        Everything local is closed even when a step fails, and ``closed`` is True afterwards. A peer or store
        that is gone does not make ``close`` fail (one ``TensorwireWarning`` says the departure was not recorded);
        a local failure (a backend refusing to release) is raised once, after everything is closed."""
        if self.closed:
            return
        self._memory.closing = True  # registrations closed below do not republish the map one by one
        failures: list[Exception] = []

        def attempt(step: Callable[[], None]) -> None:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - keep closing; report once at the end
                failures.append(e)

        self._close_handles(attempt)
        self._leave(attempt)
        remote = [e for e in failures if isinstance(e, (PeerLostError, WaitTimeoutError))]
        local = [e for e in failures if e not in remote]
        if remote:
            warnings.warn(f"tensorwire: close() of rank {self.rank}: closed locally, but the peers were not told "
                          f"({remote[0]})", TensorwireWarning, stacklevel=2)
        if local:
            raise local[0]

    def _close_handles(self, attempt: Callable[[Callable[[], None]], None]) -> None:
        """Everything handed out, dependents first (they close their own transfers and registrations), then the
        threads (after every stream wait was released)."""
        attempt(self._rendezvous.withdraw)  # first: a fleet's members() elsewhere stops listing this one at once
        for dependent in list(self._runtime.dependents):
            attempt(dependent.close)
        for transfer in list(self._runtime.transfers):
            attempt(transfer.close)
        attempt(self._revocations.leaving)  # owners revoking memory now need no answer from this rank
        for registration in list(self._memory.registrations):
            attempt(registration.close)
        attempt(self._memory.publish)  # peers see every range gone (revocation) before the agent goes
        self._runtime.closed = True
        attempt(self._revocations.stop)  # its thread ends before the backends go
        attempt(self._runtime.release_stream_waits)
        self._runtime.close(attempt)

    def _leave(self, attempt: Callable[[Callable[[], None]], None]) -> None:
        """Depart and close the transports. They go once no peer will send to this rank's agent any more: a rank
        that does not host the store leaves liveness first (peers see it gone and send it nothing); the store's
        host, which stays watchable until every rank departed, keeps its agent until then (a closing peer's last
        messages would otherwise reach a destroyed agent, which NIXL reports as an error line). A rank says it
        departed first, while the store is surely up (the store's host stops waiting for a rank whose liveness is
        gone, and may then take the store away)."""
        attempt(lambda: self._rendezvous.depart(self.timeout_s))  # the store's host: until every rank departed
        if not self._rendezvous.hosts_store:
            attempt(self._rendezvous.leave)
        self._close_backends(attempt)
        self._rendezvous.close()  # and its liveness sockets: peers watching this rank learn at once that it left

    def _close_backends(self, attempt: Callable[[Callable[[], None]], None]) -> None:
        self._runtime.transports.close(attempt)
        self._revocations.close()  # what was quarantined goes with the backends

    def __enter__(self) -> Communicator:
        return self

    def __del__(self) -> None:
        # Only a warning: closing is a departure the other ranks (and rank 0's store) wait for, which a
        # finalizer must not block on; the process's exit releases what is left.
        runtime = getattr(self, "_runtime", None)
        if getattr(self, "_handed_out", False) and not runtime.closed:
            warnings.warn(f"tensorwire: rank {self.rank}'s Communicator was garbage-collected without close(); "
                          "call comm.close() or use 'with tw.init() as comm'", ResourceWarning, stacklevel=2)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"name={self.name!r}" if self.name is not None else f"world_size={self._world_size}"
        return (f"Communicator(rank={self.rank}, {where}, device={self.device}, "
                f"backends={sorted(self._runtime.transports)})")

    # --- internals ------------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        return self._runtime.timeout(timeout)

    def _check_open(self, fn: str) -> None:
        self._runtime.check_open(fn)

    def _check_rank(self, rank: int, fn: str) -> None:
        arguments.check_rank(rank, self._world_size, fn)

