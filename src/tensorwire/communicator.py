"""``init()`` and the ``Communicator``: the public surface of point-to-point tensorwire.

A communicator owns its backends (NIXL always; CUDA IPC where CUDA and cuda-python are present; the
same-process copy), the local memory map, this process's view of each peer's memory map, the
notification inbox and the progress thread. Memory maps travel through the store lazily: a rank
publishes its map (host identity, every backend's metadata, registered ranges, stamped with an epoch)
whenever it registers or deregisters, and a rank loads a peer's map the first time it addresses a
descriptor newer than the view it holds. No collective is needed to add a peer.

Transport selection, per transfer (``Transfer.transport`` tells, ``prepare(transport=)`` overrides): the
first transport of ``backends.registry.TRANSPORTS`` that reaches the peer: the peer is this rank -> ``local``;
same host and GPU memory on both sides, exported through IPC -> ``cuda_ipc``; same host and host memory the
peer keeps in a shared file -> ``shm``; otherwise -> ``nixl``.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import blocks as blocks_module
from . import config as config_module
from . import cuda
from .backends import registry
from .backends.base import Backend, Op, Segment, Status
from .backends.local import LocalBackend
from .backends.nixl import NixlBackend
from .backends.shm import ShmBackend
from .blocks import BlockPool, BlockPoolDesc, BlockTransfer
from .bootstrap import Rendezvous, resolve_environment
from .descriptors import MemoryKind, TensorDesc
from .errors import BackendUnavailableError, ClosedError, InvalidArgumentError, PeerLostError, WaitTimeoutError
from .memory_map import MemoryMap, PeerView, host_identity, typed_decoding
from .progress import Deadlines, Inbox, ProgressEngine, wait_until, warn_from_progress_thread
from .registration import LocalMemoryMap, Registration, as_tensor_list, segment_of
from .revocation import CHANNEL as REVOCATION_CHANNEL
from .revocation import Revocations
from .transfer import Transfer

__all__ = ["Communicator", "init"]

_EPOCH_SLACK = 1 << 16  # a descriptor this far ahead of its rank's published map is refused without waiting

def init(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: torch.device | str | None = None,
    timeout: float | None = None,
    store: dist.Store | None = None,
) -> Communicator:
    """Join the job described by the launcher's environment (torchrun, mpirun, SLURM) or the keywords.

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
    env = resolve_environment(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port)
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
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.local_world_size = env.local_world_size
        self.device = device
        self.config = cfg
        self.timeout_s = timeout_s
        self.closed = False
        self._rendezvous = Rendezvous(env, timeout_s, store, token=cfg.job_token, liveness_s=cfg.liveness_s)
        self._liveness = self._rendezvous.liveness
        self._host = host_identity()
        self._local_map = LocalMemoryMap()
        self._nixl = NixlBackend(env.rank, progress_wakeup_ms=cfg.progress_wakeup_ms)
        self._backends: dict[str, Backend] = {"nixl": self._nixl, "local": LocalBackend(self._local_map.view),
                                              "shm": ShmBackend(authenticated=cfg.job_token is not None)}
        if cuda.availability()[0]:
            from .backends.cuda_ipc import CudaIpcBackend

            self._backends["cuda_ipc"] = CudaIpcBackend()
        self._inbox = Inbox(self._nixl.notifications)
        self._revocations = Revocations(self)
        self._inbox.open_channel(REVOCATION_CHANNEL, self._revocations.handle)
        self._rendezvous.between_polls = self._revocations.pump  # a rank in a barrier answers revocations too
        self._engine = ProgressEngine(cfg)
        self._deadlines = Deadlines()  # the timeouts that release stream waits, apart from the progress thread
        self._warned: set[str] = set()
        self._touched: set[tuple] = set()  # remote ranges NIXL has mapped (see _touch_remote_allocations)
        self._outbox: dict[int, collections.deque] = {}  # per peer: (done, message) in posting order
        self._outbox_lock = threading.Lock()
        self._notification_words = None  # per-sender arrival counters the GPU can wait on
        self._transfer_words = cuda.HostWordSlabs(4)  # each stream-completed CPU-driven transfer's words
        self._notifications_awaited = [0] * self.world_size
        self._notifications_delivered = [0] * self.world_size
        self._notification_lock = threading.Lock()  # arrivals (progress thread) vs. timeouts (deadline thread)
        self._stream_notification_errors: collections.deque = collections.deque()  # raised by wait_notification
        self._epoch = 0
        self._closing = False
        self._peers: dict[int, PeerView] = {}
        self._registrations: weakref.WeakSet[Registration] = weakref.WeakSet()
        self._transfers: weakref.WeakSet[Transfer] = weakref.WeakSet()
        # Whatever GPU streams may wait on (transfers' pinned words): each has
        # _release_stream_waits(), which close() calls before the progress thread stops.
        self._stream_waiters: weakref.WeakSet = weakref.WeakSet()
        self._dependents: weakref.WeakSet = weakref.WeakSet()  # objects with close() (MoE engines): closed first
        self._publish_memory_map()

    # --- memory ---------------------------------------------------------------------------------
    def register(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> Registration:
        """Register contiguous, non-empty CPU or CUDA tensors for one-sided access. Local, not collective;
        blocks while the backend pins the memory. Returns a ``Registration`` whose ``descs`` peers may use."""
        self._check_open("register")
        tensors = as_tensor_list(tensors, "register")
        segments = [segment_of(t, i, "register") for i, t in enumerate(tensors)]
        for i, (t, s) in enumerate(zip(tensors, segments)):
            if s.nbytes == 0:
                raise InvalidArgumentError(
                    f"register: tensor {i} has zero bytes (shape {tuple(t.shape)}); register only non-empty tensors"
                )
            clash = self._local_map.overlapping(s)
            if clash is None:
                clash = next((o for o in segments[:i] if o.kind == s.kind and o.device_index == s.device_index
                              and o.addr < s.addr + s.nbytes and s.addr < o.addr + o.nbytes), None)
            if clash is not None:
                raise InvalidArgumentError(
                    f"register: tensor {i} [0x{s.addr:x}, +{s.nbytes}) overlaps registered range "
                    f"[0x{clash.addr:x}, +{clash.nbytes}); register each byte range once and transfer views of it"
                )
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
        registration = Registration(self, tensors, segments, handles, descs)
        for s, t in zip(segments, tensors):
            self._local_map.add(s, registration, t)
        self._registrations.add(registration)
        self._publish_memory_map()
        return registration

    def _deregister(self, registration: Registration, handles: list) -> None:
        for s in registration.segments:
            self._local_map.remove(s)
        if self.closed:
            return  # the backends are gone and took the registrations with them
        if not self._closing:
            # First the map without these ranges (peers' prepares refuse them), then the peers' prepared transfers
            # to them are revoked, then the backends let go (see tensorwire.revocation).
            self._publish_memory_map()
        tensors = registration._tensors  # kept alive by the release while peers may still post (quarantine)
        epochs = sorted({d.epoch for d in registration.descs})
        self._revocations.revoke(epochs, lambda: (self._release_handles(handles), tensors.clear()),
                                 wait=not self._closing)

    def _release_handles(self, handles: list[dict]) -> None:
        for per_backend in handles:
            for name, handle in per_backend.items():
                self._backends[name].deregister(handle)

    def _publish_memory_map(self) -> None:
        self._epoch += 1
        # Each range keeps the epoch of the registration that made it: a descriptor is valid only while
        # that very registration is, even if the same addresses are registered again later.
        regions = self._local_map.descs()
        sections = {"host": self._host.encode()}
        sections.update({name: backend.metadata() for name, backend in self._backends.items() if name != "local"})

        self._rendezvous.set(f"memmap/{self.rank}", MemoryMap(self._epoch, sections, regions).pack())

    def _peer_view(self, rank: int, min_epoch: int, timeout_s: float) -> PeerView:
        """``rank``'s current memory map (at least ``min_epoch``), read from the store on every call.

        One store round trip per ``prepare``: a descriptor of memory the peer has deregistered since must
        fail validation here instead of reaching freed memory through a stale view."""

        what = f"prepare: loading the memory map of rank {rank}"
        self._liveness.watch(rank)  # connect now (not later from the progress thread), so waits know if it dies

        def fetch() -> bool:
            # Verified by the rendezvous (AuthenticationError otherwise); the view below changes only after that.
            blob = self._rendezvous.get(f"memmap/{rank}", timeout_s, what, ranks=(rank,))
            source = f"prepare: the memory map of rank {rank} (store key 'memmap/{rank}')"
            epoch = MemoryMap.epoch_of(blob, source)
            if epoch < min_epoch:
                # A rank publishes its map before the descriptors stamped with its epoch exist, so a descriptor
                # ahead of the map is garbled or forged: far ahead, refuse it now; a little, within the bound.
                if min_epoch - epoch > _EPOCH_SLACK or time.monotonic() > give_up_at:
                    raise InvalidArgumentError(
                        f"prepare: a descriptor of rank {rank} names epoch {min_epoch}, but rank {rank}'s memory map "
                        f"is at epoch {epoch}; the descriptor is corrupt or was not made by that rank: look it up "
                        "again")
                return False
            view = self._peers.get(rank)
            # With a job token a newer view is authentic: an older map (a replayed value) never replaces it. Without
            # one, a forged map with a far-off epoch must not shadow the real one for good.
            if view is not None and (view.epoch == epoch or (view.epoch > epoch and self.config.job_token)):
                return True
            memory_map = MemoryMap.unpack(blob, source)
            host = memory_map.sections.pop("host").decode()
            for name, metadata in memory_map.sections.items():
                if name in self._backends and (not self._backends[name].capabilities.same_host_only
                                               or host == self._host):
                    with typed_decoding(f"{source}, section {name!r}"):
                        self._backends[name].load_peer(rank, metadata)
            self._peers[rank] = PeerView(epoch, host, memory_map.regions)
            return True

        give_up_at = time.monotonic() + min(timeout_s, self.config.liveness_s)
        wait_until(fetch, timeout_s, lambda: f"prepare: memory map of rank {rank} at epoch >= {min_epoch}", self.config,
                   self._alive(rank, what))
        return self._peers[rank]

    def peer_pointer(self, desc: TensorDesc) -> int:
        """A device pointer, valid in this process on ``self.device``, to ``desc``'s bytes in a same-host
        peer's GPU memory (a CUDA IPC mapping, opened once per peer allocation and closed with the
        communicator): for kernels that load and store peers' memory directly. Own memory maps to itself.
        Blocks on first contact with the peer (bounded by the timeout); not collective."""
        self._check_open("peer_pointer")
        if not isinstance(desc, TensorDesc) or desc.kind is not MemoryKind.CUDA:
            raise InvalidArgumentError(f"peer_pointer: needs a TensorDesc of CUDA memory, got {desc!r}")
        self._check_rank(desc.rank, "peer_pointer")
        self._check_remote_ranges(desc.rank, [desc])
        if desc.rank == self.rank:
            return desc.addr
        ipc = self._backends.get("cuda_ipc")
        if ipc is None:
            raise BackendUnavailableError(f"peer_pointer: no CUDA IPC here: {cuda.availability()[1]}")
        if self._peers[desc.rank].host != self._host:
            raise BackendUnavailableError(
                f"peer_pointer: rank {desc.rank} runs on another host; its memory is reachable with prepare() only"
            )
        segment = Segment(desc.addr, desc.nbytes, desc.kind, desc.device_index)
        if not ipc.reaches(desc.rank, [segment]):
            raise BackendUnavailableError(
                f"peer_pointer: rank {desc.rank} could not export this range through CUDA IPC (memory from "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments cannot be); allocate it without expandable segments"
            )
        return ipc.pointer(desc.rank, segment, self.device.index)

    # --- descriptors through the store ----------------------------------------------------------
    def publish(self, key: str, descs: Sequence[TensorDesc] | TensorDesc) -> None:
        """Make ``descs`` visible to every rank under ``(key, self.rank)``. Non-blocking, not collective."""
        self._check_open("publish")
        self._check_key(key, "publish")
        self._rendezvous.set(f"user/{self.rank}/{key}", TensorDesc.pack(descs))

    def lookup(self, key: str, rank: int, timeout: float | None = None) -> list[TensorDesc]:
        """The descriptors ``rank`` published under ``key``; blocks until they exist (``WaitTimeoutError``)."""
        self._check_open("lookup")
        self._check_key(key, "lookup")
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

        ``transport`` forces one of ``backends.registry.NAMES`` (``"local"``, ``"cuda_ipc"``, ``"shm"``,
        ``"nixl"``) where it reaches the peer; by default the first that does is chosen (see the module docstring)
        and ``Transfer.transport`` says which."""
        self._check_open("prepare")
        local_tensors, remote_descs, peer = self._prepare_arguments(op, local, remote, notify, transport)
        pairs, registrations = self._segment_pairs(local_tensors, remote_descs)
        backend, request, uses_cuda = None, None, False
        if pairs and peer == self.rank:
            _refuse_overlaps(pairs)
        if pairs:
            self._check_remote_ranges(peer, remote_descs)
            kinds = {(s.kind, r.kind) for s, r in pairs}
            if len(kinds) > 1:
                raise InvalidArgumentError(
                    f"prepare: items mix memory kinds {sorted((a.name, b.name) for a, b in kinds)}; "
                    "prepare one transfer per (local, remote) memory kind"
                )
            backend = self._backends[self._choose_transport(peer, pairs, transport)]
            uses_cuda = MemoryKind.CUDA in next(iter(kinds))
            channel_less = backend is not self._nixl and peer != self.rank
            if (backend is self._nixl and uses_cuda) or (notify is not None and channel_less):
                # Also for a transport whose notifications travel through NIXL: a first NIXL contact made
                # later, while the peer's stream waits for that very notification, can wait forever.
                self._touch_remote_allocations(peer, pairs)
            request = backend.prepare(op, [s for s, _ in pairs], [r for _, r in pairs], peer, notify)
        transfer = Transfer(self, op, peer, sum(s.nbytes for s, _ in pairs), backend, request, notify, uses_cuda)
        transfer._remote_epochs = {d.epoch for d in remote_descs if d.nbytes}
        self._transfers.add(transfer)
        for registration in registrations:
            if registration is not None:
                registration.transfers.add(transfer)
        return transfer

    def _prepare_arguments(self, op: Op, local, remote, notify: bytes | None,
                           transport: str | None) -> tuple[list[torch.Tensor], list[TensorDesc], int]:
        """``prepare``'s arguments checked: the local tensors, the remote descriptors (of one rank) and that rank."""
        if not isinstance(op, Op):
            raise InvalidArgumentError(f"prepare: op={op!r}; pass tw.READ or tw.WRITE")
        local_tensors = as_tensor_list(local, "prepare")
        if isinstance(remote, TensorDesc):
            remote_descs = [remote]
        else:
            remote_descs = list(remote) if isinstance(remote, (list, tuple)) else None
        if not remote_descs:
            raise InvalidArgumentError(
                f"prepare: remote must be a TensorDesc or a non-empty list of them, got {remote!r}")
        for i, d in enumerate(remote_descs):
            if not isinstance(d, TensorDesc):
                raise InvalidArgumentError(
                    f"prepare: remote item {i} is a {type(d).__name__}; pass TensorDesc values from lookup()")
        if len(local_tensors) != len(remote_descs):
            raise InvalidArgumentError(
                f"prepare: {len(local_tensors)} local tensors but {len(remote_descs)} remote descriptors; item i of "
                "each list pairs up"
            )
        peers = sorted({d.rank for d in remote_descs})
        if len(peers) > 1:
            raise InvalidArgumentError(
                f"prepare: remote descriptors belong to ranks {peers}; one transfer reaches one rank, prepare one "
                "per rank")
        peer = peers[0]
        self._check_rank(peer, "prepare")
        if transport is not None and transport not in registry.NAMES:
            raise InvalidArgumentError(f"prepare: transport={transport!r}; pass one of {registry.NAMES} or None")
        if notify is not None and (not isinstance(notify, (bytes, bytearray)) or len(notify) == 0):
            raise InvalidArgumentError(
                f"prepare: notify must be non-empty bytes (NIXL does not deliver empty messages), got {notify!r}; "
                "pass e.g. notify=b'done'"
            )
        return local_tensors, remote_descs, peer

    def _segment_pairs(self, local_tensors: list[torch.Tensor], remote_descs: list[TensorDesc]
                       ) -> tuple[list[tuple[Segment, Segment]], list[Registration | None]]:
        """(local, remote) segments of the non-empty items, and the registration holding each local one."""
        pairs: list[tuple[Segment, Segment]] = []
        registrations: list[Registration | None] = []
        for i, (t, d) in enumerate(zip(local_tensors, remote_descs)):
            s = segment_of(t, i, "prepare")
            if s.nbytes != d.nbytes:
                raise InvalidArgumentError(
                    f"prepare: item {i}: local tensor has {s.nbytes} bytes, remote descriptor {d.nbytes}; sizes "
                    "must match"
                )
            if s.nbytes == 0:
                continue
            registration = self._local_map.find(s)
            registrations.append(registration)
            if registration is None:
                raise InvalidArgumentError(
                    f"prepare: local tensor {i} ({s.nbytes} bytes at 0x{s.addr:x} on {t.device}) is not inside any "
                    "registered tensor; call comm.register(...) on it (or on the tensor it views) first"
                )
            pairs.append((s, Segment(d.addr, d.nbytes, d.kind, d.device_index)))
        return pairs, registrations

    def _touch_remote_allocations(self, peer: int, pairs: list[tuple[Segment, Segment]]) -> None:
        """Let NIXL map each remote registered range once, before any stream can wait on a transfer to it
        (see ``NixlBackend.touch``). Blocks for one tiny READ per range, on first contact only."""
        local = pairs[0][0]
        regions = self._peers[peer].regions
        for _, remote in pairs:
            region = next(r for r in regions if r.addr <= remote.addr and remote.addr + remote.nbytes <= r.end)
            key = (peer, region.addr, region.nbytes, local.kind, local.device_index)
            if key in self._touched:
                continue
            request = self._nixl.touch(peer, Segment(region.addr, 1, region.kind, region.device_index),
                                       local.kind, local.device_index)
            try:
                wait_until(lambda request=request: self._nixl.status(request) is not Status.IN_PROGRESS, self.timeout_s,
                           lambda: f"prepare: first contact with rank {peer}'s memory", self.config,
                           self._alive(peer, "prepare: first contact"))
            finally:
                self._nixl.release(request)
            self._touched.add(key)

    def _check_remote_ranges(self, peer: int, remote_descs: list[TensorDesc], fn: str = "prepare") -> None:
        """Every non-empty remote range must lie inside memory ``peer`` registered (refreshing our view)."""
        if peer == self.rank:
            regions, epoch = self._local_map.descs(), self._epoch
        else:
            view = self._peer_view(peer, max(d.epoch for d in remote_descs), self.timeout_s)
            regions, epoch = view.regions, view.epoch
        for i, d in enumerate(remote_descs):
            if not d.nbytes:
                continue
            holders = [region for region in regions if region.contains(d)]
            if not holders:
                raise InvalidArgumentError(
                    f"{fn}: remote item {i} [0x{d.addr:x}, +{d.nbytes}) on {d.device} is outside what rank {peer} "
                    f"has registered (epoch {epoch}); use descriptors from lookup() or narrow() inside them"
                )
            if all(region.epoch != d.epoch for region in holders):
                raise InvalidArgumentError(
                    f"{fn}: remote item {i} [0x{d.addr:x}, +{d.nbytes}) comes from a registration of rank {peer} "
                    f"that was closed (descriptor epoch {d.epoch}; those bytes now belong to registration epoch "
                    f"{holders[0].epoch}); look the descriptor up again"
                )

    def _choose_transport(self, peer: int, pairs: list[tuple[Segment, Segment]], requested: str | None) -> str:
        """The first transport of the registry that reaches ``peer`` for these segments (or the requested one,
        checked)."""
        local_kind, remote_kind = pairs[0][0].kind, pairs[0][1].kind
        same_host = peer == self.rank or self._peers[peer].host == self._host
        usable = registry.reachable(self._backends, peer == self.rank, same_host, local_kind, remote_kind, peer,
                                    [r for _, r in pairs])
        if requested is None and usable:
            if usable[0] == "nixl" and local_kind is remote_kind is MemoryKind.CUDA and same_host:
                self._warn_once(
                    f"cuda_ipc-unavailable-{peer}",
                    f"tensorwire: GPU transfers with rank {peer} on this host take NIXL, not CUDA IPC "
                    f"({self._ipc_reason(peer, pairs)}); expect lower bandwidth",
                )
            return usable[0]
        if requested not in usable:
            raise InvalidArgumentError(
                f"prepare: transport={requested!r} cannot reach rank {peer} for {local_kind.name}->"
                f"{remote_kind.name} memory here; usable: {usable}")
        return requested

    def _ipc_reason(self, peer: int, pairs: list[tuple[Segment, Segment]]) -> str:
        if "cuda_ipc" not in self._backends:
            return cuda.availability()[1]
        return "the peer's memory could not be exported through cudaIpc (expandable_segments/VMM memory?)"

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _keep_stream_notification_error(self, error: Exception) -> None:
        self._stream_notification_errors.append(error)
        warn_from_progress_thread(f"tensorwire: {error}")

    def _notify_when(self, peer: int, message: bytes, done: Callable[[], bool]) -> None:
        """Deliver ``message`` to ``peer``'s inbox once ``done()`` (its copy completed) and after every
        message queued to ``peer`` before it: a later copy may complete first, its message must not. Used
        by transports without a message channel. Never blocks; the progress thread drains the queue."""
        with self._outbox_lock:
            queue = self._outbox.setdefault(peer, collections.deque())
            if not queue and done():
                self._send_notification(peer, message)
                return
            queue.append((done, message))
            if len(queue) > 1:
                return  # the watch started for the first queued message drains this one too
        self._engine.watch(lambda: self._drain_outbox(peer))

    def _notification_failed(self, error: Exception) -> None:
        """A queued notification could not be sent: say so now (the peer's wait for it will time out)."""
        warn_from_progress_thread(f"tensorwire: a notification could not be sent and was dropped ({error}); the "
                                  "peer's wait_notification for it will time out: check that the peer is alive and "
                                  "reachable ('tensorwire doctor')")

    def _drain_outbox(self, peer: int) -> bool:
        with self._outbox_lock:
            queue = self._outbox[peer]
            while queue:
                done, message = queue[0]
                try:
                    if not done():
                        break
                    queue.popleft()
                    self._send_notification(peer, message)
                except Exception as e:  # noqa: BLE001 - one lost message must not strand the ones behind it
                    if queue and queue[0][1] is message:
                        queue.popleft()
                    self._notification_failed(e)
            return not queue

    def _send_notification(self, peer: int, message: bytes) -> None:
        if peer == self.rank:
            self._inbox.push(self.rank, message)
        else:
            self._nixl.send_notification(peer, message)

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
        if self._stream_notification_errors:
            raise self._stream_notification_errors.popleft()
        if stream is not None:
            return self._wait_notification_on_stream(from_rank, stream, self._timeout(timeout))
        message: list[bytes] = []

        def arrived() -> bool:
            m = self._inbox.try_pop(from_rank)
            if m is not None:
                message.append(m)
            return bool(message)

        wait_until(arrived, self._timeout(timeout), lambda: f"wait_notification: nothing from rank {from_rank}",
                   self.config, self._alive(from_rank, f"wait_notification(from_rank={from_rank})"))
        return message[0]

    def _wait_notification_on_stream(self, from_rank: int, stream: torch.cuda.Stream, timeout_s: float) -> None:
        cuda.refuse_legacy_default_stream(stream, f"wait_notification(from_rank={from_rank}, stream=)")
        if self._notification_words is None:
            self._notification_words = cuda.HostWords(self.world_size)
        words = self._notification_words
        self._notifications_awaited[from_rank] += 1
        target = self._notifications_awaited[from_rank]
        delivered, lock = self._notifications_delivered, self._notification_lock

        key = ("notification", from_rank, target)

        def deliver() -> bool:  # progress thread: count arrivals into the word the stream waits on
            while delivered[from_rank] < target:
                if self._inbox.try_pop(from_rank) is None:
                    reason = self._liveness.lost(from_rank)
                    if reason is not None:  # it will not come: release the stream now, not at the timeout
                        self._deadlines.disarm(key)
                        release(PeerLostError(
                            f"wait_notification(stream=): rank {from_rank} is gone ({reason}); the stream was released "
                            "and what it read since is not valid"))
                        return True
                    return False
                with lock:
                    if delivered[from_rank] < target:  # else the deadline released it: this one came late
                        delivered[from_rank] += 1
                        words.values[from_rank] = delivered[from_rank]
            self._deadlines.disarm(key)
            return True

        def release(error: Exception) -> None:
            with lock:
                if delivered[from_rank] >= target:
                    return
                delivered[from_rank] = target  # what arrives late counts toward a later wait
                words.values[from_rank] = target
            self._keep_stream_notification_error(error)

        def release_late() -> None:  # deadline thread: a stuck or dead peer must not hold the GPU forever
            release(WaitTimeoutError(
                f"wait_notification(stream=): nothing from rank {from_rank} within {timeout_s:.3g}s; the stream "
                "was released and what it read since is not valid; check that rank"))

        self._deadlines.arm(key, time.monotonic() + timeout_s, release_late)
        cuda.stream_wait_value(stream, words.addr(from_rank), target)  # before waking the progress thread
        self._engine.watch(deliver, on_error=self._keep_stream_notification_error)
        return None

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

    def publish_blocks(self, key: str, pool: BlockPool) -> None:
        """Make ``pool``'s descriptor visible to every rank under ``(key, self.rank)``. Non-blocking, not
        collective."""
        self._check_open("publish_blocks")
        self._check_key(key, "publish_blocks")
        self._check_pool(pool, "publish_blocks")
        self._rendezvous.set(f"blocks/{self.rank}/{key}", pool.desc.pack())

    def lookup_blocks(self, key: str, rank: int, timeout: float | None = None) -> BlockPoolDesc:
        """The ``BlockPoolDesc`` ``rank`` published under ``key``; blocks until it exists (``WaitTimeoutError``)."""
        self._check_open("lookup_blocks")
        self._check_key(key, "lookup_blocks")
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
        if not isinstance(op, Op):
            raise InvalidArgumentError(f"prepare_blocks: op={op!r}; pass tw.READ or tw.WRITE")
        self._check_pool(pool, "prepare_blocks")
        if not isinstance(remote, BlockPoolDesc):
            raise InvalidArgumentError(f"prepare_blocks: remote is a {type(remote).__name__}; pass the BlockPoolDesc "
                                       "from lookup_blocks() (or pool.desc)")
        if pool.block_bytes != remote.block_bytes:
            raise InvalidArgumentError(
                f"prepare_blocks: local pool has {len(pool.block_bytes)} views of {pool.block_bytes} bytes per block, "
                f"rank {remote.rank}'s {len(remote.block_bytes)} of {remote.block_bytes}; both pools need the same "
                "views in the same order, with equal bytes per block")
        peer = remote.rank
        self._check_rank(peer, "prepare_blocks")
        if peer == self.rank and pool.layout.kind is not remote.kind:
            raise InvalidArgumentError("prepare_blocks: host and GPU pools of one rank; copy between them with torch "
                                       "(index_select / index_copy_)")
        self._check_remote_ranges(peer, remote.spans(), "prepare_blocks")
        pairs = list(zip(pool.layout.spans(), remote.layout().spans()))
        if transport is not None and transport not in registry.NAMES:
            raise InvalidArgumentError(f"prepare_blocks: transport={transport!r}; pass one of {registry.NAMES} or None")
        backend = self._backends[self._choose_transport(peer, pairs, transport)]
        uses_cuda = MemoryKind.CUDA in (pool.layout.kind, remote.kind)
        if backend is self._nixl and uses_cuda:
            self._touch_remote_allocations(peer, pairs)
        request = backend.prepare_blocks(op, pool.layout, remote.layout(), peer)
        core = Transfer(self, op, peer, 0, backend, request, None, uses_cuda)
        core._remote_epochs = {region[3] for region in remote.regions}
        self._transfers.add(core)
        for registration in set(pool._holders):
            registration.transfers.add(core)
        transfer = BlockTransfer(core, pool, remote)
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
        """Return when every rank has called ``barrier``. Collective, blocking (on the store)."""
        self._check_open("barrier")
        self._rendezvous.barrier(self._timeout(timeout))

    def close(self) -> None:
        """Release transfers, registrations and the backend agent. Not collective; rank 0 keeps the store
        up until every rank has closed or is gone (at most the communicator's timeout; a dead rank is noticed
        within ``TENSORWIRE_LIVENESS_S``). Idempotent.

        Everything local is closed even when a step fails, and ``closed`` is True afterwards. A peer or store
        that is gone does not make ``close`` fail (one ``RuntimeWarning`` says the departure was not recorded);
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

        for dependent in list(self._dependents):  # first: they close their own transfers and registrations
            attempt(dependent.close)
        for transfer in list(self._transfers):
            attempt(transfer.close)
        for registration in list(self._registrations):
            attempt(registration.close)
        attempt(self._publish_memory_map)  # peers see every range gone (revocation) before the agent goes
        self.closed = True
        attempt(self._release_stream_waits)
        attempt(self._engine.close)
        attempt(self._deadlines.close)
        for backend in self._backends.values():
            attempt(backend.close)
        self._revocations.close()
        attempt(lambda: self._rendezvous.depart(self.timeout_s))  # rank 0: until every rank departed or is gone
        self._rendezvous.close()  # and its liveness sockets: peers watching this rank learn at once that it left
        remote = [e for e in failures if isinstance(e, (PeerLostError, WaitTimeoutError))]
        local = [e for e in failures if e not in remote]
        if remote:
            warnings.warn(f"tensorwire: close() of rank {self.rank}: closed locally, but the peers were not told "
                          f"({remote[0]})", RuntimeWarning, stacklevel=2)
        if local:
            raise local[0]

    def _release_stream_waits(self) -> None:
        """Closing ends the progress thread: a GPU stream still waiting on a word it would have written
        must not wait forever. Release every such word (and warn: the bytes those streams read are not
        guaranteed)."""
        pending = [t for t in self._stream_waiters if t._release_stream_waits()]
        if self._notification_words is not None:
            for rank, awaited in enumerate(self._notifications_awaited):
                if self._notification_words.values[rank] != awaited:
                    pending.append(rank)
                    self._notification_words.values[rank] = awaited
        if pending:
            warnings.warn(
                f"tensorwire: close() released {len(pending)} stream wait(s) that were not complete; close the "
                "communicator only after the GPU work that waits on its transfers has run", RuntimeWarning,
                stacklevel=3,
            )

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"backends={sorted(self._backends)})")

    # --- internals ------------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
                or timeout < 0):
            raise InvalidArgumentError(
                f"timeout={timeout!r}; give a finite number of seconds >= 0, or None for the default")
        return float(timeout)

    def _check_open(self, fn: str) -> None:
        if self.closed:
            raise ClosedError(f"{fn}: the communicator is closed; create a new one with tw.init()")

    def _check_rank(self, rank: int, fn: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise InvalidArgumentError(f"{fn}: rank {rank!r} is outside [0, {self.world_size})")

    @staticmethod
    def _check_key(key: str, fn: str) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"{fn}: key must be a non-empty str, got {key!r}")

    def _alive(self, rank: int, what: str | Callable[[], str]) -> Callable[[], None] | None:
        """For ``wait_until``: raises ``PeerLostError`` once ``rank`` is gone (None for this rank)."""
        if rank == self.rank:
            return None
        liveness, revocations = self._liveness, self._revocations

        def alive() -> None:
            liveness.check(rank, what)
            revocations.pump()  # a sleeping wait also handles revocations that arrived

        return alive

    def _forget_transfer(self, transfer: Transfer) -> None:
        self._transfers.discard(transfer)


def _refuse_overlaps(pairs: list[tuple[Segment, Segment]]) -> None:
    """A transfer within one rank whose source and destination bytes overlap cannot be one copy."""
    for i, (a, _) in enumerate(pairs):
        for j, (_, b) in enumerate(pairs):
            if a.kind == b.kind and a.device_index == b.device_index and a.addr < b.addr + b.nbytes \
                    and b.addr < a.addr + a.nbytes:
                raise InvalidArgumentError(
                    f"prepare: local item {i} [0x{a.addr:x}, +{a.nbytes}) overlaps remote item {j} [0x{b.addr:x}, "
                    f"+{b.nbytes}) in this rank's own memory; copy through a separate buffer, or use "
                    "non-overlapping views")
