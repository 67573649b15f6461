"""``Peers``: what this rank knows of its peers' memory, and which transport reaches it.

Memory maps travel through the store lazily: a rank publishes its map (host identity, every backend's
metadata, registered ranges, stamped with an epoch) whenever it registers or deregisters, and a rank loads a
peer's map the first time it addresses a descriptor newer than the view it holds, and again at every
``prepare`` (one store round trip): a descriptor of memory the peer has deregistered since must fail
validation, not reach freed memory through a stale view. No collective is needed to add a peer.

One question per prepare (``route``), for tensors and blocks alike: are the remote ranges inside what the peer
registered (its map loaded and checked), which transport carries them (the first of
``backends.registry.TRANSPORTS`` that reaches the peer: the peer is this rank -> ``local``; same host and GPU
memory on both sides, exported through IPC -> ``cuda_ipc``; same host and host memory the peer keeps in a shared
file -> ``shm``; otherwise -> ``nixl``), and which remote allocations a ``first_touch`` transport must touch before
a stream may wait on them. The transport then builds its request, a peer's death in between reported as such.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from . import cuda
from .backends import registry
from .backends.base import Backend, FirstTouch, Segment, Status
from .descriptors import MemoryKind, TensorDesc
from .errors import (
    AuthenticationError,
    BackendUnavailableError,
    InvalidArgumentError,
    PeerLostError,
    RevokedError,
    TensorwireWarning,
    TransferError,
)
from .meeting import Rendezvous
from .memory_map import MemoryMap, PeerView, typed_decoding
from .progress import wait_until
from .runtime import Runtime

__all__ = ["Peers"]

_EPOCH_SLACK = 1 << 16  # a descriptor this far ahead of its rank's published map is refused without waiting


class Peers:
    """Peers' memory maps as this rank last loaded them, checked against descriptors, and the transport choice.

    ``local_regions()`` returns this rank's own registered ranges and epoch (a transfer to itself is checked
    against those)."""

    def __init__(self, runtime: Runtime, host: str, local_regions: Callable[[], tuple[list[TensorDesc], int]]) -> None:
        self._runtime = runtime
        self._rendezvous: Rendezvous = runtime.store
        self._backends = runtime.transports
        self.host = host
        self._local_regions = local_regions
        self._views: dict[int, PeerView] = {}
        self._touched: set[tuple] = set()  # remote ranges NIXL has mapped (see touch_remote_allocations)
        self._revoked: dict[int, set[int]] = {}  # rank -> registration epochs it revoked (tensorwire.revocation)
        self._floor: dict[int, int] = {}  # rank -> the map epoch its last revocation announced: nothing older counts
        self._confirmed: dict[int, int] = {}  # rank -> the map epoch it confirmed is current (freshness.py)
        self._loading = threading.RLock()  # one view replaced at a time (re-entrant: a store wait pumps)
        # (rank, timeout) -> rank's current map epoch as it says (Freshness.current_epoch); set by the communicator
        # in an authenticated job, None otherwise.
        self.current_epoch: Callable[[int, float], int] | None = None
        self._warned: set[str] = set()

    def publish(self, rank: int, epoch: int, regions: list[TensorDesc]) -> None:
        """Publish this rank's memory map at ``epoch``. Each range keeps the epoch of the registration that
        made it: a descriptor is valid only while that very registration is, even if the same addresses are
        registered again later."""
        sections = {"host": self.host.encode()}
        sections.update({name: metadata for name, backend in self._backends.items()
                         if backend.capabilities.remote and (metadata := backend.metadata()) is not None})
        self._rendezvous.set(f"memmap/{rank}", MemoryMap(epoch, sections, regions).pack())

    def revoked(self, rank: int, epochs: list[int], map_epoch: int) -> None:
        """``rank`` revoked these registration epochs and published map ``map_epoch`` without them: a later
        ``prepare`` of them is refused (``RevokedError``) whatever the store holds, and a map of ``rank`` older than
        ``map_epoch`` (an old value written back into the store) is not loaded. Called from the pump."""
        self._revoked.setdefault(rank, set()).update(epochs)
        self._floor[rank] = max(self._floor.get(rank, 0), map_epoch)

    def host_of(self, rank: int) -> str:
        """The host of a peer whose view is loaded (``view`` first)."""
        return self._views[rank].host

    def view(self, rank: int, min_epoch: int, timeout_s: float, confirm: bool = True) -> PeerView:
        """``rank``'s current memory map (at least ``min_epoch``), read from the store on every call. Blocks
        for one store round trip (longer while the map is behind ``min_epoch``: bounded by ``timeout_s``). In an
        authenticated job a map at an epoch not confirmed yet is confirmed with ``rank`` itself (``freshness.py``:
        one round trip, first contact and after the map changed) unless ``confirm`` is False (the revocation
        thread loading a peer's metadata only to answer it)."""
        what = f"prepare: loading the memory map of rank {rank}"
        self._runtime.liveness.watch(rank)  # connect now (not from the progress thread), so waits know if it dies
        self._wait_for_map(rank, min_epoch, timeout_s, what)
        if confirm and self.current_epoch is not None and self._confirmed.get(rank) != self._views[rank].epoch:
            said = self.current_epoch(rank, min(timeout_s, 2 * self._runtime.config.liveness_s))
            if said > self._views[rank].epoch:  # the store holds an older map than its owner published
                self._floor[rank] = max(self._floor.get(rank, 0), said)
                self._wait_for_map(rank, min_epoch, timeout_s, what)
            self._confirmed[rank] = self._views[rank].epoch
        return self._views[rank]

    def _wait_for_map(self, rank: int, min_epoch: int, timeout_s: float, what: str) -> None:
        give_up_at = time.monotonic() + min(timeout_s, self._runtime.config.liveness_s)
        wait_until(lambda: self._load(rank, min_epoch, timeout_s, give_up_at), timeout_s,
                   lambda: f"prepare: memory map of rank {rank} at epoch >= {min_epoch} with its messenger's metadata",
                   self._runtime.config,
                   self._runtime.alive(rank, what))

    def _load(self, rank: int, min_epoch: int, timeout_s: float, give_up_at: float) -> bool:
        """One look at ``rank``'s map in the store: True once a view of at least ``min_epoch`` is loaded."""
        # Verified by the rendezvous (AuthenticationError otherwise); the view below changes only after that.
        blob = self._rendezvous.get(f"memmap/{rank}", timeout_s, f"prepare: loading the memory map of rank {rank}",
                                    ranks=(rank,))
        source = f"prepare: the memory map of rank {rank} (store key 'memmap/{rank}')"
        epoch = MemoryMap.epoch_of(blob, source)
        if epoch < min_epoch:
            # A rank publishes its map before the descriptors stamped with its epoch exist, so a descriptor
            # ahead of the map is garbled or forged: far ahead, refuse it now; a little, within the bound.
            if min_epoch - epoch > _EPOCH_SLACK or time.monotonic() > give_up_at:
                raise InvalidArgumentError(
                    f"prepare: a descriptor of rank {rank} names epoch {min_epoch}, but rank {rank}'s memory map "
                    f"is at epoch {epoch}; the descriptor is corrupt or was not made by that rank: look it up again")
            return False
        floor = self._floor.get(rank, 0)
        if epoch < floor:
            # The owner published ``floor`` before it told this rank so; an older map in the store now was
            # written back by someone else (or the store lost the newer one). Never use it: it may name memory
            # the owner has freed and reused.
            if time.monotonic() > give_up_at:
                raise AuthenticationError(
                    f"prepare: the store holds memory map epoch {epoch} of rank {rank}, older than epoch {floor}, the "
                    f"one rank {rank} says is current: an old value was written back (a replay by a "
                    "process that reaches the store) or the store lost the newer one; it was not used. Keep the store "
                    "port away from processes outside the job, and look the descriptors up again")
            return False
        # The user's thread and the revocation thread (loading a peer's metadata to answer it) may both load a map
        # of one rank: the look at the view held and the load replacing it are one step, so an older map read
        # first never replaces a newer one loaded meanwhile (NIXL would then miss the newer registrations).
        with self._loading:
            return self._replace_view(rank, epoch, blob, source, give_up_at)

    def _replace_view(self, rank: int, epoch: int, blob: bytes, source: str, give_up_at: float) -> bool:
        view = self._views.get(rank)
        # With a job token a newer view is authentic: an older map (a replayed value) never replaces it. Without
        # one, a forged map with a far-off epoch must not shadow the real one for good.
        if view is not None and (view.epoch == epoch or (view.epoch > epoch and self._runtime.config.job_token)):
            return True
        memory_map = MemoryMap.unpack(blob, source)
        host = memory_map.sections.pop("host").decode()
        for name, metadata in memory_map.sections.items():
            if name in self._backends and (not self._backends[name].capabilities.same_host_only or host == self.host):
                loading = f"prepare: loading rank {rank}'s {name} metadata"
                with typed_decoding(f"{source}, section {name!r}"), self.lost_as_such(rank, loading):
                    self._backends[name].load_peer(rank, metadata)
        messenger = self._backends.messenger.name
        if messenger not in memory_map.sections:
            # Its messenger (NIXL's agent) is still being made (the map published once it exists carries it),
            # within the bound.
            if time.monotonic() > give_up_at:
                raise InvalidArgumentError(
                    f"{source}: epoch {epoch} has no {messenger} section: rank {rank}'s {messenger} agent was not made "
                    "(its own register() says why) or the map is corrupt")
            return False
        self._views[rank] = PeerView(epoch, host, memory_map.regions)
        return True

    @contextlib.contextmanager
    def lost_as_such(self, rank: int, what: str) -> Iterator[None]:
        """A backend's failure with ``rank`` is ``PeerLostError`` when ``rank`` is gone (a dead peer's metadata
        or endpoint fails in the backend's own words: NIXL says ``NIXL_ERR_BACKEND``); looks for the death for up
        to the liveness period, as a transport may see it before the liveness view does."""
        try:
            yield
        except (TransferError, BackendUnavailableError) as e:
            gone = self._runtime.gone_among([rank], self._runtime.config.liveness_s)
            if gone is not None:
                raise PeerLostError(f"{what}: rank {rank} is gone ({gone[1]}); it exited, crashed or closed its "
                                    "communicator. Its memory cannot be reached: drop what refers to it") from e
            raise

    def check_remote_ranges(self, peer: int, remote_descs: list[TensorDesc], fn: str = "prepare") -> None:
        """Every non-empty remote range must lie inside memory ``peer`` registered (refreshing the view), in the
        very registration the descriptor names. Blocks for a store round trip (a peer other than this rank)."""
        if peer == self._runtime.rank:
            regions, epoch = self._local_regions()
        else:
            view = self.view(peer, max(d.epoch for d in remote_descs), self._runtime.timeout_s)
            regions, epoch = view.regions, view.epoch
        revoked = self._revoked.get(peer, ())
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
            if d.epoch in revoked:  # the map says it is there: an old map (a replay) the owner revoked past
                raise RevokedError(
                    f"{fn}: remote item {i} [0x{d.addr:x}, +{d.nbytes}) comes from registration epoch {d.epoch} of "
                    f"rank {peer}, which was closed (rank {peer} revoked it); look the descriptor up again")

    def choose_transport(self, peer: int, pairs: list[tuple[Segment, Segment]], requested: str | None,
                         fn: str = "prepare") -> str:
        """The first transport of the registry that reaches ``peer`` for these segments (or the requested one,
        checked: ``InvalidArgumentError`` with the usable list). The view of ``peer`` is loaded."""
        local_kind, remote_kind = pairs[0][0].kind, pairs[0][1].kind
        to_self = peer == self._runtime.rank
        same_host = to_self or self._views[peer].host == self.host
        usable = registry.reachable(self._backends, to_self, same_host, local_kind, remote_kind, peer,
                                    [r for _, r in pairs])
        remotes = [r for _, r in pairs]
        if requested is None and usable:
            if same_host and not to_self:
                self._warn_if_degraded(peer, usable[0], local_kind, remote_kind, remotes)
            return usable[0]
        if requested is not None and requested not in self._backends:
            self._backends.require(requested, fn)  # a test transport is built when a test first asks for it
            usable = registry.reachable(self._backends, to_self, same_host, local_kind, remote_kind, peer,
                                        [r for _, r in pairs])
        if requested is None:  # nothing reaches it: why not, transport by transport
            reasons = {t.name: self._unusable_reason(t.name, peer, to_self, same_host, local_kind, remote_kind, remotes)
                       for t in registry.TRANSPORTS if t.capabilities.memory_kinds}
            why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
            raise InvalidArgumentError(f"{fn}: no transport reaches rank {peer} for {local_kind.name}->"
                                       f"{remote_kind.name} memory here ({why})")
        if requested not in usable:
            usable = [name for name in usable if name in registry.NAMES]  # the tests' own transports unnamed
            why = self._unusable_reason(requested, peer, to_self, same_host, local_kind, remote_kind, remotes)
            raise InvalidArgumentError(
                f"{fn}: transport={requested!r} cannot reach rank {peer} for {local_kind.name}->"
                f"{remote_kind.name} memory here: {why}; usable: {usable}")
        return requested

    def _warn_if_degraded(self, peer: int, chosen: str, local_kind: MemoryKind, remote_kind: MemoryKind,
                          remotes: list[Segment]) -> None:
        """Once per peer: a same-host transfer that takes a slower transport than the one meant to carry it."""
        if local_kind is remote_kind is MemoryKind.CUDA and not self._backends[chosen].capabilities.stream_ordered:
            self._warn_once(f"gpu-not-stream-ordered-{peer}",
                            f"tensorwire: GPU transfers with rank {peer} on this host take {chosen}, not a "
                            f"stream-ordered copy between GPUs ({self._ipc_reason()}); expect lower bandwidth")
        shm = self._backends.get("shm")
        if local_kind is remote_kind is MemoryKind.CPU and shm is not None and chosen != "shm":
            refused = shm.refused_file(peer, remotes)
            if refused is not None:
                self._warn_once(f"shm-refused-{peer}", f"tensorwire: host memory transfers with rank {peer} take "
                                f"{chosen}, not shm: {refused}; expect lower bandwidth")

    def _unusable_reason(self, requested: str, peer: int, to_self: bool, same_host: bool, local_kind: MemoryKind,
                         remote_kind: MemoryKind, remotes: list[Segment]) -> str:
        """Why the transport a caller forced cannot carry this transfer (for its error message)."""
        backend = self._backends.get(requested)
        if backend is None:
            info = registry.transport(requested).info() if requested in registry.NAMES else None
            return f"it is not loaded here ({info.reason if info else 'a test transport this communicator lacks'})"
        refusal = registry.capability_refusal(backend.capabilities, to_self, same_host, local_kind, remote_kind)
        if refusal is not None:
            return refusal
        if requested == "shm":
            return backend.unreached_reason(peer, remotes) or "the peer's file cannot be mapped here"
        if backend.capabilities.peer_pointers:
            return self._ipc_reason()
        return f"rank {peer}'s ranges are not reachable by it"

    def _ipc_reason(self) -> str:
        if self._backends.with_capability("peer_pointers") is None:
            return cuda.availability()[1]
        return "the peer's memory could not be exported through cudaIpc (expandable_segments/VMM memory?)"

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, TensorwireWarning, stacklevel=4)

    def ipc_pointer(self, desc: TensorDesc, device_index: int) -> int:
        """A device pointer on ``device_index`` to ``desc``'s bytes in a same-host peer's GPU memory, through a
        CUDA IPC mapping (``BackendUnavailableError`` saying why where there is none). The view is loaded."""
        ipc = self._backends.with_capability("peer_pointers")
        if ipc is None:
            raise BackendUnavailableError(f"peer_pointer: no CUDA IPC here: {cuda.availability()[1]}")
        if self._views[desc.rank].host != self.host:
            raise BackendUnavailableError(
                f"peer_pointer: rank {desc.rank} runs on another host; its memory is reachable with prepare() only")
        segment = Segment(desc.addr, desc.nbytes, desc.kind, desc.device_index)
        if not ipc.reaches(desc.rank, [segment]):
            raise BackendUnavailableError(
                f"peer_pointer: rank {desc.rank} could not export this range through CUDA IPC (memory from "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments cannot be); allocate it without expandable segments")
        return ipc.pointer(desc.rank, segment, device_index)

    def _touch_remote_allocations(self, toucher: Any, peer: int, pairs: list[tuple[Segment, Segment]]) -> None:
        """Let ``toucher`` (a ``FirstTouch`` backend) map each remote registered range once, before any stream can
        wait on a transfer to it (see ``NixlBackend.touch``). Blocks for one tiny READ per range, on first contact
        only."""
        local = pairs[0][0]
        regions = self._views[peer].regions
        runtime = self._runtime
        for _, remote in pairs:
            region = next(r for r in regions if r.addr <= remote.addr and remote.addr + remote.nbytes <= r.end)
            key = (toucher.name, peer, region.addr, region.nbytes, local.kind, local.device_index)
            if key in self._touched:
                continue
            request = toucher.touch(peer, Segment(region.addr, 1, region.kind, region.device_index),
                                    local.kind, local.device_index)
            try:
                wait_until(lambda request=request: toucher.status(request) is not Status.IN_PROGRESS,
                           runtime.timeout_s, lambda: f"prepare: first contact with rank {peer}'s memory",
                           runtime.config, runtime.alive(peer, "prepare: first contact"))
            finally:
                toucher.release(request)
            self._touched.add(key)

    def _touchers(self, backend: Backend, peer: int, uses_cuda: bool, notifies: bool) -> list[FirstTouch]:
        """Who must touch the remote allocations before a stream may wait: the transport itself (``first_touch``,
        GPU memory involved), and the messenger when it carries this transfer's notifications (a first contact
        made later, while the peer's stream waits for that very notification, can wait forever)."""
        touchers: list[Any] = []
        if uses_cuda and backend.capabilities.first_touch:
            touchers.append(backend)
        messenger = self._backends.messenger
        if (notifies and peer != self._runtime.rank and not backend.capabilities.message_channel
                and messenger.capabilities.first_touch and messenger not in touchers):
            touchers.append(messenger)
        return touchers

    def route(self, peer: int, remote_descs: list[TensorDesc], pairs: list[tuple[Segment, Segment]],
              requested: str | None, notifies: bool, fn: str, build: Callable[[Backend], Any]) -> tuple[Backend, Any]:
        """Reach, transport and first touch in one question, then ``build(backend)`` (the transport's request):
        checks the remote ranges against ``peer``'s map (``check_remote_ranges``), picks the transport
        (``choose_transport``), touches what must be touched, and reports a backend's failure as ``PeerLostError``
        when ``peer`` is gone. Returns ``(backend, request)``. Blocks on first contact (bounded by the timeout)."""
        self.check_remote_ranges(peer, remote_descs, fn)
        backend = self._backends[self.choose_transport(peer, pairs, requested, fn)]
        uses_cuda = MemoryKind.CUDA in (pairs[0][0].kind, pairs[0][1].kind)
        with self.lost_as_such(peer, fn):
            for toucher in self._touchers(backend, peer, uses_cuda, notifies):
                self._touch_remote_allocations(toucher, peer, pairs)
            return backend, build(backend)
