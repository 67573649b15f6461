"""``init()`` and the ``Communicator``: the public surface of point-to-point tensorwire.

A communicator owns its backends (NIXL always; CUDA IPC where CUDA and cuda-python are present; shm;
the same-process copy), the local memory map, its ``Peers`` (peers' memory maps, the transport choice: see
``tensorwire.peers``), its ``Notifications`` and the ``Runtime`` every handle shares (progress and deadline
threads, pinned words, timeouts). ``Transfer.transport`` tells which transport carries a transfer,
``prepare(transport=)`` overrides the choice.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import arguments, cuda
from . import blocks as blocks_module
from . import config as config_module
from .backends.base import Backend, Op, Segment
from .backends.fake import FakeBackend
from .backends.local import LocalBackend
from .backends.nixl import NixlBackend
from .backends.shm import ShmBackend
from .blocks import BlockPool, BlockPoolDesc, BlockTransfer
from .bootstrap import Rendezvous
from .descriptors import MemoryKind, TensorDesc
from .directory_client import DirectoryRendezvous
from .environment import resolve_environment
from .errors import InvalidArgumentError, PeerLostError, TensorwireWarning, WaitTimeoutError
from .freshness import CHANNEL as FRESHNESS_CHANNEL
from .freshness import Freshness
from .membership import Member, Membership
from .memory_map import host_identity
from .network import ucx_net_devices
from .notifications import Notifications
from .peers import Peers
from .progress import Inbox
from .registration import LocalMemoryMap, Registration
from .revocation import CHANNEL as REVOCATION_CHANNEL
from .revocation import Revocations
from .runtime import Runtime
from .transfer import Transfer

__all__ = ["Communicator", "init"]

_FLEET_STREAM_SENDERS = 1024  # members a fleet member may wait for with wait_notification(stream=)


def init(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: torch.device | str | None = None,
    timeout: float | None = None,
    store: dist.Store | None = None,
    directory: str | None = None,
    name: str | None = None,
) -> Communicator:
    """Join the job described by the launcher's environment (torchrun, mpirun, SLURM) or the keywords; or,
    with ``directory="tcp://HOST:PORT"`` and ``name=`` (or ``TENSORWIRE_DIRECTORY`` / ``TENSORWIRE_NAME``), join
    a *fleet*: members launched apart that meet in a directory (``tensorwire directory``, or an etcd cluster:
    ``directory="etcd://HOST:PORT[,HOST:PORT...]"``). A member's rank is
    assigned by the directory (unique for its life, never reused), its name is unique among present members,
    and everything else (register, publish/lookup, prepare, transfers, blocks, notifications, revocation,
    liveness, the job token) works as in a launcher's world. Joining costs O(1) directory operations and no
    connection to anyone; ``members()`` and ``rank_of(name)`` find the others.

    Blocks until rank 0's store is reachable (at most ``timeout`` seconds). Not collective beyond that:
    peers are connected lazily. ``store=`` reuses an existing torch.distributed store (keys are prefixed).
    Calls on it are bounded as on tensorwire's own store (``TENSORWIRE_LIVENESS_S``; a wait: its timeout plus
    that), but tensorwire cannot cut a connection it does not own: each call runs on a helper thread that the
    caller stops waiting for. A call past its bound raises ``PeerLostError``, as does every later store call of
    this communicator; the helper thread stays blocked in the abandoned call (a daemon), and the store object is
    left in whatever state that call leaves it.
    """
    cfg = config_module.load()
    timeout_s = cfg.timeout_s if timeout is None else float(timeout)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidArgumentError(f"init: timeout={timeout!r}; give a positive, finite number of seconds")
    if directory is None and name is None and rank is None and world_size is None:
        directory, name = cfg.directory, cfg.name
    env = resolve_environment(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                              directory=directory, name=name)
    if device is None:
        if torch.cuda.is_available():
            device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        else:
            device = torch.device("cpu")
    return Communicator(env, torch.device(device), cfg, timeout_s, store)


class Communicator:
    """One rank's endpoint. Context manager; ``close()`` is idempotent.

    ``rank``, ``world_size``, ``local_rank``, ``local_world_size``, ``device`` (``cuda:LOCAL_RANK % gpus``
    with CUDA, else ``cpu``; tensorwire never calls ``torch.cuda.set_device`` for you).
    """

    def __init__(self, env, device: torch.device, cfg: config_module.Config, timeout_s: float,
                 store: dist.Store | None) -> None:
        self._world_size = env.world_size
        self.local_rank = env.local_rank
        self.local_world_size = env.local_world_size
        self.device = device
        self.config = cfg
        self.timeout_s = timeout_s
        if env.fleet:
            if store is not None:
                raise InvalidArgumentError("init: store= and directory= are two ways to meet; give one")
            self._rendezvous: Rendezvous = DirectoryRendezvous(env, timeout_s, token=cfg.job_token,
                                                               liveness_s=cfg.liveness_s)
        else:
            self._rendezvous = Rendezvous(env, timeout_s, store, token=cfg.job_token, liveness_s=cfg.liveness_s)
        env = self._rendezvous.env  # a fleet member's rank is the directory's
        self.rank = env.rank
        self.name: str | None = env.name  # a fleet member's name (None in a launcher's world)
        self._membership: Membership | None = None
        self._local_map = LocalMemoryMap()
        self._nixl = NixlBackend(env.rank, progress_wakeup_ms=cfg.progress_wakeup_ms, token=cfg.job_token,
                                 net_devices=ucx_net_devices(self._rendezvous.liveness.address[0])[0])
        self._backends: dict[str, Backend] = {"nixl": self._nixl, "local": LocalBackend(self._local_map.view),
                                              "shm": ShmBackend(authenticated=cfg.job_token is not None,
                                                                peer_lost=self._rendezvous.liveness.lost),
                                              "fake": FakeBackend()}
        if cuda.availability()[0]:
            from .backends.cuda_ipc import CudaIpcBackend

            self._backends["cuda_ipc"] = CudaIpcBackend()
        self._inbox = Inbox(self._nixl.notifications)
        self._runtime = Runtime(env.rank, cfg, timeout_s, self._rendezvous.liveness, self._send_notification)
        self._peers = Peers(self._runtime, self._rendezvous, self._backends, self._nixl, host_identity(),
                            lambda: (self._published_ranges(), self._epoch))
        self._notifications = Notifications(self._runtime, self._inbox,
                                            _FLEET_STREAM_SENDERS if env.fleet else env.world_size)
        self._runtime.stream_waiters.add(self._notifications)
        self._revocations = Revocations(self._runtime, self._inbox, self._nixl, self._peers)
        self._inbox.open_channel(REVOCATION_CHANNEL, self._revocations.handle)
        # Maps are confirmed with their owners (an old one written back is refused), whose revocation threads
        # answer in the store: not on a store the user lent to init and calls too (a blocking wait of theirs on
        # that one client would hold our answer, and the peer waiting for it, until the timeouts).
        if cfg.job_token is not None and self._rendezvous.owns_store:
            freshness = Freshness(self._runtime, self._nixl, self._rendezvous, lambda: self._epoch)
            self._inbox.open_channel(FRESHNESS_CHANNEL, freshness.handle)
            self._peers.current_epoch = freshness.current_epoch
        self._rendezvous.between_polls = self._revocations.pump  # a rank in a barrier answers revocations too
        self._runtime.between_polls = self._revocations.pump  # and so does every sleeping wait
        self._epoch = 0
        self._pool_spans: dict[int, list[TensorDesc]] = {}  # epoch -> spans of an open pool in user registrations
        self._closing = False
        self._registrations: weakref.WeakSet[Registration] = weakref.WeakSet()
        self._dependents: weakref.WeakSet = weakref.WeakSet()  # objects with close() (MoE engines): closed first
        self._publish_memory_map()
        if env.fleet or env.world_size > 1:  # peers may revoke memory: answer whatever this rank's threads do
            self._revocations.listen()
        if env.fleet:  # last: once listed, peers may prepare transfers to this member at once
            self._membership = Membership(self._rendezvous, env.name, host_identity())
            self._rendezvous.start_heartbeat()
        self._handed_out = True  # from here on a leak is the user's (see __del__)

    @property
    def closed(self) -> bool:
        return self._runtime.closed

    # --- memory ---------------------------------------------------------------------------------
    def register(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> Registration:
        """Register contiguous, non-empty CPU or CUDA tensors for one-sided access. Local, not collective;
        blocks while the backend pins the memory. Returns a ``Registration`` whose ``descs`` peers may use."""
        self._check_open("register")
        tensors, segments = arguments.new_segments(tensors, self._local_map)
        handles: list[dict] = []
        try:
            for s in segments:
                handles.append({})
                for name, backend in self._backends.items():
                    if s.kind in backend.capabilities.memory_kinds:
                        handles[-1][name] = backend.register(s)
        except Exception:
            self._release_handles(handles)
            raise
        epoch = self._epoch + 1
        descs = [TensorDesc(self.rank, s.addr, s.nbytes, s.kind, s.device_index, epoch) for s in segments]
        registration = Registration(self._deregister, tensors, segments, handles, descs)
        for s, t in zip(segments, tensors):
            self._local_map.add(s, registration, t)
        self._registrations.add(registration)
        self._publish_memory_map()
        return registration

    def _deregister(self, registration: Registration, handles: list | None) -> None:
        """Unmap, republish, revoke peers' transfers (blocks for their answers), release; ``handles=None``: a
        ``close()`` again after the peers' answers timed out waits for them once more."""
        epochs = sorted({d.epoch for d in registration.descs})
        if handles is None:
            if not self.closed:
                self._revocations.retry(epochs)
            return
        for s in registration.segments:
            self._local_map.remove(s)
        pools = [epoch for epoch, spans in self._pool_spans.items()  # pools in it go with it
                 if any(d.contains(span) for span in spans for d in registration.descs)]
        for epoch in pools:
            del self._pool_spans[epoch]
        if self.closed:
            return  # the backends are gone and took the registrations with them
        if not self._closing:
            # First the map without these ranges (peers' prepares refuse them), then the peers' prepared transfers
            # to them are revoked, then the backends let go (see tensorwire.revocation).
            self._publish_memory_map()
        tensors = registration._tensors  # kept alive by the release while peers may still post (quarantine)
        epochs = sorted(set(epochs) | set(pools))
        self._revocations.revoke(epochs, self._epoch, lambda: (self._release_handles(handles), tensors.clear()),
                                 wait=not self._closing)

    def _release_handles(self, handles: list[dict]) -> None:
        for per_backend in handles:
            for name, handle in per_backend.items():
                self._backends[name].deregister(handle)

    def _publish_memory_map(self) -> None:
        self._epoch += 1
        self._peers.publish(self.rank, self._epoch, self._published_ranges())

    def _published_ranges(self) -> list[TensorDesc]:
        """The registered ranges, and the spans of the pools in them that have their own epoch (a descriptor of
        such a pool is valid while its spans are published: until the pool closes)."""
        return self._local_map.descs() + [d for spans in self._pool_spans.values() for d in spans]

    def _expose_pool(self, spans: list[Segment]) -> int:
        """Publish ``spans`` (a pool's, inside registrations) under a new epoch; return it."""
        epoch = self._epoch + 1
        self._pool_spans[epoch] = [TensorDesc(self.rank, s.addr, s.nbytes, s.kind, s.device_index, epoch)
                                   for s in spans]
        self._publish_memory_map()
        return epoch

    def _withdraw_pool(self, epoch: int) -> None:
        """The pool exposed under ``epoch`` closed: its spans leave the map (a peer's ``prepare_blocks`` refuses
        its descriptor) and the peers' transfers to it are revoked; the memory stays the user's."""
        if self._pool_spans.pop(epoch, None) is None or self.closed:
            return  # withdrawn with the registration holding it
        if not self._closing:
            self._publish_memory_map()
        self._revocations.revoke([epoch], self._epoch, lambda: None, wait=not self._closing)

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

    def lookup(self, key: str, rank: int, timeout: float | None = None) -> list[TensorDesc]:
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
                remote: TensorDesc | Sequence[TensorDesc], notify: bytes | None = None,
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
        pairs, registrations = arguments.segment_pairs(self._local_map, local_tensors, remote_descs)
        backend, request, uses_cuda = None, None, False
        if pairs and peer == self.rank:
            arguments.refuse_overlaps(pairs)
        if pairs:
            self._peers.check_remote_ranges(peer, remote_descs)
            kinds = {(s.kind, r.kind) for s, r in pairs}
            if len(kinds) > 1:
                raise InvalidArgumentError(
                    f"prepare: items mix memory kinds {sorted((a.name, b.name) for a, b in kinds)}; "
                    "prepare one transfer per (local, remote) memory kind"
                )
            backend = self._backends[self._peers.choose_transport(peer, pairs, transport)]
            uses_cuda = MemoryKind.CUDA in next(iter(kinds))
            channel_less = backend is not self._nixl and peer != self.rank
            with self._peers.lost_as_such(peer, "prepare"):
                if (backend is self._nixl and uses_cuda) or (notify is not None and channel_less):
                    # Also for a transport whose notifications travel through NIXL: a first NIXL contact made
                    # later, while the peer's stream waits for that very notification, can wait forever.
                    self._peers.touch_remote_allocations(peer, pairs)
                request = backend.prepare(op, [s for s, _ in pairs], [r for _, r in pairs], peer, notify)
        nbytes = sum(s.nbytes for s, _ in pairs)
        transfer = Transfer(self._runtime, op, peer, nbytes, backend, request, notify, uses_cuda,
                            frozenset(d.epoch for d in remote_descs if d.nbytes))
        self._runtime.transfers.add(transfer)
        for registration in registrations:
            registration.transfers.add(transfer)
        return transfer

    def read(self, local, remote, timeout: float | None = None) -> None:
        """READ remote -> local and wait for it (prepare + post + wait + close). Blocks."""
        with self.prepare(Op.READ, local, remote) as transfer:
            transfer.post()
            transfer.wait(timeout)

    def write(self, local, remote, notify: bytes | None = None, timeout: float | None = None) -> None:
        """WRITE local -> remote and wait for it; ``notify`` reaches the peer after the data. Blocks."""
        with self.prepare(Op.WRITE, local, remote, notify=notify) as transfer:
            transfer.post()
            transfer.wait(timeout)

    def wait_notification(self, from_rank: int, timeout: float | None = None,
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
        return self._inbox.take_all()

    def _send_notification(self, peer: int, message: bytes) -> None:
        if peer == self.rank:
            self._inbox.push(self.rank, message)
        else:
            self._nixl.send_notification(peer, message)

    # --- KV-cache blocks ---------------------------------------------------------------------------
    def register_blocks(self, views: torch.Tensor | Sequence[torch.Tensor]) -> BlockPool:
        """A ``BlockPool`` over ``views`` (each ``[num_blocks, ...]`` on one CPU or CUDA device, block i =
        ``view[i]``, one contiguous byte range). Views inside tensors registered with ``register`` use that
        registration; otherwise their spans are registered here (and deregistered by ``pool.close()``). Local,
        not collective; blocks while the memory is pinned. See ``tensorwire.blocks``."""
        self._check_open("register_blocks")
        views, layout = blocks_module.pool_layout(views)
        spans = layout.spans()
        holders = [self._local_map.find(s) for s in spans]
        owned = None
        if any(h is None for h in holders):
            if any(h is not None or self._local_map.overlapping(s) for h, s in zip(holders, spans)):
                raise InvalidArgumentError(
                    "register_blocks: some views lie in registered tensors and some do not (or only partly); register "
                    "the tensors that hold all the views with comm.register first, or none of them")
            owned = self.register(blocks_module.spans_to_register(views, layout))
            holders = [self._local_map.find(s) for s in spans]
            return BlockPool(self, views, layout, holders, owned)
        return BlockPool(self, views, layout, holders, None, self._expose_pool, self._withdraw_pool)

    def publish_blocks(self, key: str, pool: BlockPool) -> None:
        """Make ``pool``'s descriptor visible to every rank under ``(key, self.rank)``. Non-blocking, not
        collective."""
        self._check_open("publish_blocks")
        arguments.check_key(key, "publish_blocks")
        self._check_pool(pool, "publish_blocks")
        self._rendezvous.set(f"blocks/{self.rank}/{key}", pool.desc.pack())

    def lookup_blocks(self, key: str, rank: int, timeout: float | None = None) -> BlockPoolDesc:
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

    def prepare_blocks(self, op: Op, pool: BlockPool, remote: BlockPoolDesc,
                       transport: str | None = None) -> BlockTransfer:
        """A reusable ``BlockTransfer`` between ``pool`` and the peer's pool ``remote`` (same number of views,
        same bytes per block in each). Blocks on first contact with the peer (bounded by the timeout). Picks
        the transport as ``prepare`` does; ``transport=`` forces one."""
        self._check_open("prepare_blocks")
        self._check_pool(pool, "prepare_blocks")
        arguments.check_block_pools(op, pool, remote, transport, self.rank, self._world_size)
        peer = remote.rank
        self._peers.check_remote_ranges(peer, remote.spans(), "prepare_blocks")
        pairs = list(zip(pool.layout.spans(), remote.layout().spans()))
        backend = self._backends[self._peers.choose_transport(peer, pairs, transport, "prepare_blocks")]
        uses_cuda = MemoryKind.CUDA in (pool.layout.kind, remote.kind)
        with self._peers.lost_as_such(peer, "prepare_blocks"):
            if backend is self._nixl and uses_cuda:
                self._peers.touch_remote_allocations(peer, pairs)
            request = backend.prepare_blocks(op, pool.layout, remote.layout(), peer)
        core = Transfer(self._runtime, op, peer, 0, backend, request, None, uses_cuda,
                        frozenset(region[3] for region in remote.regions))
        self._runtime.transfers.add(core)
        for registration in set(pool._holders):
            registration.transfers.add(core)
        transfer = BlockTransfer(core, pool, remote, backend, request, self._runtime)
        pool.transfers.add(transfer)
        return transfer

    def read_blocks(self, pool: BlockPool, local_ids, remote: BlockPoolDesc, remote_ids,
                    timeout: float | None = None) -> None:
        """READ block ``remote_ids[i]`` of ``remote`` into block ``local_ids[i]`` of ``pool`` and wait. Blocks."""
        with self.prepare_blocks(Op.READ, pool, remote) as transfer:
            transfer.post(local_ids, remote_ids)
            transfer.wait(timeout)

    def write_blocks(self, pool: BlockPool, local_ids, remote: BlockPoolDesc, remote_ids,
                     notify: bytes | None = None, timeout: float | None = None) -> None:
        """WRITE block ``local_ids[i]`` of ``pool`` to block ``remote_ids[i]`` of ``remote`` and wait; ``notify``
        reaches the peer after the data. Blocks."""
        with self.prepare_blocks(Op.WRITE, pool, remote) as transfer:
            transfer.post(local_ids, remote_ids, notify=notify)
            transfer.wait(timeout)

    def _check_pool(self, pool: BlockPool, fn: str) -> None:
        if not isinstance(pool, BlockPool) or pool._comm is not self:
            raise InvalidArgumentError(
                f"{fn}: pass a BlockPool from this communicator's register_blocks(), got {pool!r}")
        pool._check_open(fn)

    # --- collective helpers & lifetime ------------------------------------------------------------
    def barrier(self, timeout: float | None = None) -> None:
        """Return when every rank has called ``barrier``. Collective, blocking (on the store). A launcher's
        world only: a fleet has no fixed set of members to wait for."""
        self._check_open("barrier")
        if self._membership is not None:
            raise InvalidArgumentError(
                "barrier: a fleet has no fixed world to wait for; wait for the members you need with "
                "comm.rank_of(name) and exchange readiness through publish()/lookup() or notifications")
        self._rendezvous.barrier(self._timeout(timeout))

    # --- fleets ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The number of ranks of a launcher's world; a fleet has none (``InvalidArgumentError``)."""
        if self.name is not None:
            raise InvalidArgumentError(
                f"world_size: {self.name!r} is a member of a fleet, whose members come and go; use comm.members() "
                "for who is present now and comm.rank_of(name) to find one")
        return self._world_size

    def members(self) -> dict[int, Member]:
        """The fleet's members present now, by rank (``tw.Member``: rank, name, host, pid), this one included.
        Blocks for directory round trips and one concurrent connect per listed member (at most
        ``TENSORWIRE_LIVENESS_S``): a member that died is not listed within that bound. Fleets only."""
        self._check_open("members")
        return self._fleet("members").members()

    def rank_of(self, name: str, timeout: float | None = None) -> int:
        """The rank of the present member named ``name``; waits (sleeping, bounded by ``timeout``, default the
        communicator's) until one is, else ``WaitTimeoutError``. A member started again under its name has a
        new rank: call this again after a ``PeerLostError``. Fleets only."""
        self._check_open("rank_of")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"rank_of: name={name!r}; give a member's name")
        return self._fleet("rank_of").rank_of(name, self._timeout(timeout))

    def _fleet(self, fn: str) -> Membership:
        if self._membership is None:
            raise InvalidArgumentError(
                f"{fn}: this communicator is a rank of a launcher's world (ranks 0..world_size-1), not a fleet "
                "member; join a fleet with tw.init(directory='tcp://HOST:PORT', name=...)")
        return self._membership

    def close(self) -> None:
        """Release transfers, registrations and the backend agent. Not collective; rank 0 keeps the store
        up until every rank has closed or is gone (at most the communicator's timeout; a dead rank is noticed
        within ``TENSORWIRE_LIVENESS_S``). Idempotent.

        Everything local is closed even when a step fails, and ``closed`` is True afterwards. A peer or store
        that is gone does not make ``close`` fail (one ``TensorwireWarning`` says the departure was not recorded);
        a local failure (a backend refusing to release) is raised once, after everything is closed."""
        if self.closed:
            return
        self._closing = True  # registrations closed below do not republish the map one by one
        failures: list[Exception] = []

        def attempt(step: Callable[[], None]) -> None:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - keep closing; report once at the end
                failures.append(e)

        if self._membership is not None:  # first: members() elsewhere stops listing this one at once
            attempt(self._rendezvous.stop_heartbeat)
            attempt(self._membership.leave)
        for dependent in list(self._dependents):  # first: they close their own transfers and registrations
            attempt(dependent.close)
        for transfer in list(self._runtime.transfers):
            attempt(transfer.close)
        attempt(self._revocations.leaving)  # owners revoking memory now need no answer from this rank
        for registration in list(self._registrations):
            attempt(registration.close)
        attempt(self._publish_memory_map)  # peers see every range gone (revocation) before the agent goes
        self._runtime.closed = True
        attempt(self._revocations.stop)  # its thread ends before the backends go
        attempt(self._runtime.release_stream_waits)
        self._runtime.close(attempt)
        # The backends go once no peer will send to this rank's agent any more: a rank that does not host the
        # store leaves liveness first (peers see it gone and send it nothing); the store's host, which stays
        # watchable until every rank departed, keeps its agent until then (a closing peer's last messages would
        # otherwise reach a destroyed agent, which NIXL reports as an error line).
        # A rank says it departed first, while the store is surely up (the store's host stops waiting for a rank
        # whose liveness is gone, and may then take the store away).
        hosts_store = self._rendezvous.hosts_store
        if not hosts_store:
            attempt(lambda: self._rendezvous.depart(self.timeout_s))
            attempt(self._rendezvous.leave)
            self._close_backends(attempt)
        else:
            attempt(lambda: self._rendezvous.depart(self.timeout_s))  # until every rank departed or is gone
            self._close_backends(attempt)
        self._rendezvous.close()  # and its liveness sockets: peers watching this rank learn at once that it left
        remote = [e for e in failures if isinstance(e, (PeerLostError, WaitTimeoutError))]
        local = [e for e in failures if e not in remote]
        if remote:
            warnings.warn(f"tensorwire: close() of rank {self.rank}: closed locally, but the peers were not told "
                          f"({remote[0]})", TensorwireWarning, stacklevel=2)
        if local:
            raise local[0]

    def _close_backends(self, attempt: Callable[[Callable[[], None]], None]) -> None:
        for backend in self._backends.values():
            attempt(backend.close)
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
                f"backends={sorted(self._backends)})")

    # --- internals ------------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        return self._runtime.timeout(timeout)

    def _check_open(self, fn: str) -> None:
        self._runtime.check_open(fn)

    def _check_rank(self, rank: int, fn: str) -> None:
        arguments.check_rank(rank, self._world_size, fn)

