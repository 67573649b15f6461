"""NIXL backend: one-sided READ/WRITE through the ``nixl`` package (UCX underneath).

One NIXL agent per communicator. Scope: DRAM and VRAM on the UCX backend; metadata exchange is the
communicator's job (``metadata`` / ``load_peer``).

Members only. An agent's name is ``tw<rank>-<nonce>-<tag>``: a fresh random nonce per agent, and with a job token
``tag = HMAC-SHA256(token, label | rank | nonce)`` (truncated to 128 bits). A name cannot be guessed from a rank, and
only a process holding the token can make one that claims a rank: ``load_peer`` refuses metadata whose agent
does not prove the rank it is loaded for, and ``notifications`` drops (and counts, warning once per name) what
arrives from an agent that does not prove a rank, so a stranger's message never reaches ``wait_notification``
and never costs a member's messages of the same batch. Without a token the name still carries a random nonce
(a rank alone does not name an agent) but proves nothing: such a job is unauthenticated (see ``config.py``).
UCX's TCP transport listens on the job's interface only (``network.ucx_net_devices``), unless the user set
``UCX_NET_DEVICES``.

Progress. NIXL's Python wrapper builds its agent with ``pthrDelay = 0``, which makes UCX's progress
thread ``poll()`` with a zero timeout: a whole core per agent, idle. We rebuild the bindings agent with a
wake-up period instead: the thread then sleeps in ``poll()`` on the UCX worker's event fd, wakes on
traffic (so a busy or idle rank still answers a peer's connection handshake) and costs ~0 when idle.
Waiters in tensorwire poll ``status`` themselves, which also progresses the worker.

Thread safety. tensorwire calls the agent from user threads and from its own progress thread (which
polls in-flight transfers nobody else waits on), so the agent is created in NIXL's ``STRICT`` sync mode:
NIXL serialises every call with its own C++ lock, which costs far less on the 4 KiB hot path than a
Python lock. ``RW`` is not enough: it lets two threads check the same request at once, and NIXL's UCX
request bookkeeping then races (seen as segfaults under MoE traffic).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..descriptors import MemoryKind
from ..errors import AuthenticationError, BackendUnavailableError, PeerLostError, TensorwireWarning, TransferError
from .base import BackendContext, Capabilities, Op, Poster, Segment, Status
from .block_copy import BlockLayout
from .nixl_blocks import BlockRequest, strided_rows
from .nixl_names import agent_name, member_rank
from .nixl_setup import _error_classes, import_nixl, info, make_agent, nixl_installed, quiet_nixl_logging

__all__ = ["NixlBackend", "info", "agent_name", "member_rank", "quiet_nixl_logging"]

_MEM_TYPE = {MemoryKind.CPU: "DRAM", MemoryKind.CUDA: "VRAM"}
_MADE_WITH_AGENT = frozenset({"agent", "_bound", "_errors", "_success", "_statuses"})
_ERROR = Status.ERROR  # every NIXL code but success and in-progress


class NixlBackend:
    """The ``Backend`` protocol over one NIXL agent."""

    name = "nixl"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.CPU, MemoryKind.CUDA}), remote=True,
                                stream_ordered=False, message_channel=True, first_touch=True)

    @classmethod
    def create(cls, context: BackendContext) -> NixlBackend | None:
        """The agent, made inside ``init`` where the process can use CUDA, else on a thread of its own (see
        ``__init__``); None where nixl is not installed (an extra: the ranks of one host then meet over ``shm``,
        ``cuda_ipc`` and the ``socket`` message channel)."""
        if not nixl_installed():
            return None
        return cls(context.rank, progress_wakeup_ms=context.config.progress_wakeup_ms, token=context.config.job_token,
                   net_devices=context.net_devices, on_ready=context.on_ready,
                   ready_timeout_s=max(context.timeout_s, 60.0), background=not torch.cuda.is_available())

    def __init__(self, rank: int, *, progress_wakeup_ms: float = 10.0, token: bytes | None = None,
                 net_devices: str | None = None, on_ready: Callable[[], None] | None = None,
                 ready_timeout_s: float = 60.0, background: bool = False) -> None:
        """``token``: the job token (agent names prove membership with it); ``net_devices``: the network devices
        UCX may listen on (``network.ucx_net_devices``; None: UCX's default, every interface).

        Makes the agent, then calls ``on_ready()``; a failure to make it is kept and raised as
        ``BackendUnavailableError`` by every call that needs the agent. Under UCX's own options a process's first
        NIXL agent costs 0.5-2 s, nearly all of it UCX rewriting the entry of ``mmap``, ``munmap`` and the CUDA
        driver's allocation functions in place with a grace period per function (``UCX_MEM_BISTRO_GRACE_DURATION``,
        50 ms each; on an H100 host ``init`` of 2 ranks took 1.3-2.2 s); under the start-up options
        ``nixl_setup`` sets (no memory hooks) it costs 0.02-0.05 s there, and ``init`` 0.21 s.

        Where the process can use CUDA the agent is made here, on the caller's thread, blocking: a thread that
        makes its first CUDA context while UCX rewrites the driver's functions can die of SIGSEGV (a rank making
        its first CUDA tensor did, in 2 of 28 runs of the GPU conformance case; 0 of 58 made so), and after
        ``init`` the user's threads do exactly that (load a model, allocate a KV cache). With ``background``
        (no CUDA device: nothing of that race can happen) it is made on a thread of its own and ``init`` returns
        at once, a member joining a fleet in milliseconds; until it exists ``metadata()`` is None and
        ``notifications()`` is empty, and every other call waits for it (at most ``ready_timeout_s``:
        ``BackendUnavailableError``, as when making it failed)."""
        if importlib.util.find_spec("nixl") is None:
            import_nixl()  # raises BackendUnavailableError saying how to install it, before any thread
        self.rank = rank
        self._token = token
        self.agent_name = agent_name(rank, token)
        self._names: dict[int, str] = {}  # rank -> the agent name its loaded metadata proved
        self._strangers: dict[str, int] = {}  # agent names that proved no rank -> notifications dropped
        if "UCX_NET_DEVICES" in os.environ:
            net_devices = None  # the user's choice stands
        self.net_devices = net_devices
        self._loaded_peers: set[int] = set()
        self._scratch: dict[tuple[MemoryKind, int], tuple[Any, Any]] = {}  # (kind, device) -> (tensor, reg)
        self._creation_error: BackendUnavailableError | None = None
        self._ready = threading.Event()
        self._ready_timeout_s = ready_timeout_s
        self._maker: threading.Thread | None = None
        if background:
            self._maker = threading.Thread(target=self._make, args=(progress_wakeup_ms, on_ready), daemon=True,
                                           name=f"tensorwire-nixl-agent-{rank}")
            self._maker.start()
        else:
            self._make(progress_wakeup_ms, on_ready)

    def _make(self, progress_wakeup_ms: float, on_ready: Callable[[], None] | None) -> None:
        """Set ``agent``, ``_bound``, the status codes and error classes, then ``on_ready()`` (on the agent's
        thread where it is made in the background)."""
        try:
            api, bindings = import_nixl()
            self._errors = _error_classes(bindings)
            self._success = bindings.NIXL_SUCCESS
            # NIXL's status codes as ``Status``, the one mapping (post, its unbundled form and status read it):
            # ``self._statuses.get(code, _ERROR)``, a lookup in C on the hot path.
            self._statuses = {bindings.NIXL_SUCCESS: Status.DONE, bindings.NIXL_IN_PROG: Status.IN_PROGRESS}
            agent = make_agent(api, bindings, self.agent_name, progress_wakeup_ms, net_devices=self.net_devices)
            self._bound = agent.agent  # the nixlBind.nixlAgent under nixl_agent
            self.agent = agent
        except BackendUnavailableError as e:
            self._creation_error = e
        except Exception as e:  # noqa: BLE001 - NIXL raises plain RuntimeError/its own classes
            self._creation_error = BackendUnavailableError(
                f"nixl: creating agent {self.agent_name!r} with the UCX backend failed: {e}; "
                "run 'tensorwire doctor' to see what works here")
        finally:
            self._ready.set()
        if on_ready is not None and self._creation_error is None:
            try:
                on_ready()
            except Exception:  # noqa: BLE001 - e.g. the store is gone: peers waiting for the agent end typed
                pass

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes that making the agent sets, before it exists (made in the background) or
        # when making it failed. Once set, a plain lookup finds them and this costs nothing on the hot path.
        if name in _MADE_WITH_AGENT:
            self.wait_ready()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def ready(self) -> bool:
        """The agent exists (non-blocking)."""
        return self._ready.is_set() and self._creation_error is None

    def wait_ready(self) -> None:
        """Block until the agent exists: ``BackendUnavailableError`` when making it failed or took longer than
        ``ready_timeout_s``."""
        if not self._ready.wait(self._ready_timeout_s):
            raise BackendUnavailableError(
                f"nixl: agent {self.agent_name!r} was not made within {self._ready_timeout_s:g}s (importing nixl and "
                "starting UCX); the machine is overloaded or UCX hangs: run 'tensorwire doctor'")
        if self._creation_error is not None:
            raise BackendUnavailableError(str(self._creation_error)) from self._creation_error

    # --- memory -------------------------------------------------------------------------------
    def register(self, segment: Segment) -> Any:
        entry = [(segment.addr, segment.nbytes, max(segment.device_index, 0), "")]
        try:
            return self.agent.register_memory(entry, _MEM_TYPE[segment.kind])
        except Exception as e:  # noqa: BLE001
            what = f"registering {segment.nbytes} bytes of {_MEM_TYPE[segment.kind]} at 0x{segment.addr:x}"
            raise self._translate(e, what) from e

    def deregister(self, handle: Any) -> None:
        try:
            self.agent.deregister_memory(handle)
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, "deregistering memory") from e

    # --- peers --------------------------------------------------------------------------------
    def metadata(self) -> bytes | None:
        """The agent's metadata; None while it is being made (the communicator publishes again once it is)."""
        return self.agent.get_agent_metadata() if self.ready else None

    def reaches(self, peer: int, remote: list[Segment]) -> bool:
        return True  # what the peer registered: the communicator checked the ranges against its map

    def load_peer(self, rank: int, metadata: bytes) -> None:
        """Load ``rank``'s agent metadata; ``AuthenticationError`` when its agent's name does not prove ``rank``
        (nothing is kept of it)."""
        try:
            name = self.agent.add_remote_agent(metadata)
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, f"loading the metadata of rank {rank}", peer=rank) from e
        name = name.decode() if isinstance(name, bytes) else name
        if member_rank(name, self._token) != rank:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - refused either way
                pass
            raise AuthenticationError(
                f"nixl: the memory map of rank {rank} names NIXL agent {name[:64]!r}, which does not prove rank {rank} "
                "with this job's token; it was not loaded. Set the same TENSORWIRE_JOB_TOKEN on every rank")
        old = self._names.get(rank)
        if old is not None and old != name:  # the rank's agent was replaced: no request goes to the old one
            try:
                self.agent.remove_remote_agent(old)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._names[rank] = name
        self._loaded_peers.add(rank)

    def _name_of(self, peer: int) -> str:
        try:
            return self._names[peer]
        except KeyError:
            raise TransferError(f"nixl: rank {peer}'s metadata is not loaded; prepare a transfer to it first") from None

    def loaded_peers(self) -> frozenset[int]:
        """The ranks whose metadata this agent holds (it can send them notifications)."""
        return frozenset(self._loaded_peers)

    # --- transfers ----------------------------------------------------------------------------
    def prepare(self, op: Op, local: list[Segment], remote: list[Segment], peer: int, notify: bytes | None) -> Any:
        local_kind, remote_kind = local[0].kind, remote[0].kind
        try:
            local_descs = self.agent.get_xfer_descs(
                [(s.addr, s.nbytes, max(s.device_index, 0)) for s in local], _MEM_TYPE[local_kind]
            )
            remote_descs = self.agent.get_xfer_descs(
                [(s.addr, s.nbytes, max(s.device_index, 0)) for s in remote], _MEM_TYPE[remote_kind]
            )
            return self.agent.initialize_xfer(
                op.value, local_descs, remote_descs, self._name_of(peer), notify or b""
            )
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, f"preparing a {op.value} with rank {peer}", peer=peer) from e

    def touch(self, peer: int, remote: Segment, local_kind: MemoryKind, local_device: int) -> Any:
        """Post a 1-byte READ of ``remote`` into a private scratch buffer; returns the request to poll.

        UCX maps a peer's GPU allocation (``cuIpcOpenMemHandle``) on the first transfer that touches it,
        and mapping can wait for the device to go idle. If that first transfer is posted while a stream
        waits for it (``wait(stream=)``, a doorbell in a CUDA graph), the two wait for each other forever.
        Touching each remote allocation once at ``prepare`` time moves the mapping out of that window.
        Reading leaves the peer's bytes untouched.
        """
        key = (local_kind, local_device)
        if key not in self._scratch:
            import torch

            device = "cpu" if local_kind is MemoryKind.CPU else f"cuda:{local_device}"
            tensor = torch.zeros(64, dtype=torch.uint8, device=device)
            self._scratch[key] = (tensor, self.register(Segment(tensor.data_ptr(), 64, local_kind, local_device)))
        scratch = self._scratch[key][0]
        request = self.prepare(
            Op.READ, [Segment(scratch.data_ptr(), 1, local_kind, local_device)],
            [Segment(remote.addr, 1, remote.kind, remote.device_index)], peer, None,
        )
        self.post(request, None)
        return request

    # --- block transfers ----------------------------------------------------------------------
    def prepare_blocks(self, op: Op, local: BlockLayout, remote: BlockLayout, peer: int) -> BlockRequest:
        """Both pools as prepped descriptor lists, made once: one strided row per region (NIXL expands it
        to a descriptor per block, index ``region * num_blocks + block``)."""
        for layout in (local, remote):
            if len(layout.regions) * layout.num_blocks >= 2**31:
                raise TransferError(f"nixl: {len(layout.regions)} views x {layout.num_blocks} blocks exceed NIXL's "
                                    "int32 descriptor indices; register fewer blocks or views per pool")
        try:
            local_list = self.agent.prep_xfer_dlist("", strided_rows(local), _MEM_TYPE[local.kind])
            try:
                remote_list = self.agent.prep_xfer_dlist(self._name_of(peer), strided_rows(remote),
                                                         _MEM_TYPE[remote.kind])
            except Exception:
                self.agent.release_dlist_handle(local_list)
                raise
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, f"preparing block lists for a {op.value} with rank {peer}", peer=peer) from e
        return BlockRequest(self.agent, op, local_list, remote_list, local.num_blocks, remote.num_blocks,
                             len(local.regions))

    def bind_blocks(self, request: BlockRequest, local_ids: np.ndarray, remote_ids: np.ndarray,
                    notify: bytes | None) -> None:
        """One NIXL request for these ids (every region of each block): ``make_prepped_xfer`` with int32
        index arrays; NIXL merges descriptors that are adjacent in memory."""
        try:
            handle = self.agent.make_prepped_xfer(
                request.op.value, request.local_list, request.indices(local_ids, request.local_blocks),
                request.remote_list, request.indices(remote_ids, request.remote_blocks), notify or b"")
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, f"building a {request.op.value} of {len(local_ids)} blocks") from e
        request.bindings.bind((handle, notify or b""))

    def _post_blocks(self, request: BlockRequest) -> Any:
        """Post the next bound NIXL request (the one it replaces has completed: a transfer is not re-posted
        while in flight); returns NIXL's code."""
        request.bindings.advance()
        handle, notify = request.bindings.current
        return self._bound.postXferReq(handle._handle, notify)

    # post/status are the hot path (a 4 KiB WRITE takes ~1.7 us in NIXL): they call the bindings agent
    # directly rather than nixl_agent's wrappers, which only map the same status codes to strings.
    def post(self, request: Any, notify: bytes | None, stream: Any = None) -> Status:
        try:
            if isinstance(request, BlockRequest):
                code = self._post_blocks(request)
            else:
                code = self._bound.postXferReq(request._handle, notify or b"")
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, "posting a transfer") from e
        return self._statuses.get(code, _ERROR)

    def poster(self, request: Any, notify: bytes | None) -> Poster:
        """``post`` unbundled for ``Transfer``'s hot path: the NIXL call with its arguments resolved once,
        the raw code that means DONE, and the slow mapping for every other outcome. A re-post then costs
        one C call and one comparison (a 4 KiB WRITE is ~1.5 us inside NIXL)."""
        if isinstance(request, BlockRequest):
            call = functools.partial(self._post_blocks, request)
        else:
            call = functools.partial(self._bound.postXferReq, request._handle, notify or b"")
        return Poster(
            call=call,
            done=self._success,
            finish=self._status_of,
            error=lambda e: self._translate(e, "posting a transfer"),
        )

    def _status_of(self, code: Any) -> Status:
        return self._statuses.get(code, _ERROR)

    def status(self, request: Any) -> Status:
        try:
            code = self._bound.getXferStatus(request._handle)
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, "checking a transfer") from e
        return self._statuses.get(code, _ERROR)

    def release(self, request: Any) -> None:
        try:
            request.release()
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, "releasing a transfer") from e

    def notifications(self) -> list[tuple[int, bytes]]:
        """``(sender rank, message)`` of what arrived, in order per sender. Messages from an agent that proves no
        rank are dropped here (``strangers()`` counts them; one ``TensorwireWarning`` per name)."""
        if not self.ready:
            return []  # no agent yet: nobody can have sent anything
        try:
            new = self.agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, "reading notifications") from e
        arrived = []
        for name, messages in new.items():
            rank = member_rank(name, self._token)
            if rank is None:
                self._dropped(name, len(messages))
                continue
            arrived += [(rank, bytes(message)) for message in messages]
        return arrived

    def _dropped(self, name: Any, count: int) -> None:
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        if name not in self._strangers:
            warnings.warn(
                f"tensorwire: dropped {count} NIXL notification(s) from agent {name[:64]!r}, which is not a member of "
                f"this job (its name proves no rank{' with the job token' if self._token else ''}); a process "
                "outside the job reached this rank's NIXL agent", TensorwireWarning, stacklevel=3)
        self._strangers[name] = self._strangers.get(name, 0) + count

    def strangers(self) -> dict[str, int]:
        """Agent names that sent notifications without proving a rank -> how many were dropped."""
        return dict(self._strangers)

    def send_notification(self, peer: int, message: bytes) -> None:
        """A standalone notification to ``peer`` (whose metadata is loaded), delivered in order."""
        try:
            self.agent.send_notif(self._name_of(peer), message)
        except Exception as e:  # noqa: BLE001
            raise self._translate(e, f"notifying rank {peer}", peer=peer) from e

    def close(self) -> None:
        # Dropping the agent joins NIXL's progress thread and closes UCX endpoints.
        if self._maker is not None:
            self._maker.join(self._ready_timeout_s)
        if not self.ready:
            self.agent = self._bound = None
            return
        for _, registration in self._scratch.values():
            self.deregister(registration)
        self._scratch.clear()
        self.agent = self._bound = None

    # --- errors -------------------------------------------------------------------------------
    def _translate(self, error: Exception, what: str, peer: int | None = None) -> Exception:
        """A NIXL exception as the tensorwire error that says which peer and what failed. NIXL's exception, the
        cause, loses its traceback: its frames hold the request's NIXL handles, which hold the agent (its threads
        and sockets) for as long as anyone keeps the error, past the communicator's close."""
        if isinstance(error, BackendUnavailableError):
            return error  # no agent to do it with (``wait_ready``): that says it all
        error.__traceback__ = None
        kind = type(error).__name__
        where = f" (peer rank {peer})" if peer is not None else ""
        if kind == "nixlRemoteDisconnectError":
            return PeerLostError(f"nixl: {what}{where}: the remote agent disconnected ({error}); the peer process "
                                 "exited or its network broke")
        if kind in self._errors:
            return TransferError(f"nixl: {what}{where} failed with {kind}: {error}")
        return TransferError(f"nixl: {what}{where} failed: {kind}: {error}")
