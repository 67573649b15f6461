"""``Transfer``: a prepared one-sided READ or WRITE between local tensors and one peer's memory.

Lifecycle: ``comm.prepare(...)`` (expensive, once) -> ``post()`` -> ``status()`` / ``wait()`` ->
``post()`` again ... -> ``close()``. A transfer whose items are all zero bytes completes at once.

Completion without the CPU
--------------------------
``wait(stream=s)`` returns at once and makes ``s`` wait for the transfer; ``post(stream=s)`` starts it
when ``s`` reaches that point. How depends on the transport:

* stream-ordered transports (``local``, ``cuda_ipc``) enqueue their copies on the stream and record an
  event: plain stream order, CUDA-graph capturable.
* ``nixl`` and ``shm`` are driven by the CPU, so the stream and the progress thread meet in pinned host words
  (``tensorwire.stream_completion``): a CPU post's completion is published as a sequence number the stream
  waits for; a stream post rings a doorbell the progress thread serves, and raises a done flag the stream
  waits for. Capturable in a CUDA graph and replayable; a stream is not left waiting past the timeout (the
  next call on the handle raises ``WaitTimeoutError``), and it may not be CUDA's legacy default stream (see
  ``cuda.refuse_legacy_default_stream``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch

from . import cuda
from .backends.base import Backend, Op, Poster, Status
from .errors import ClosedError, InvalidArgumentError, PeerLostError, TransferError, WaitTimeoutError
from .lifetime import Closeable
from .progress import wait_until, warn_from_progress_thread
from .stream_completion import DoneSeq, StreamSide
from .transfer_state import TransferState

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Transfer"]

_DONE, _IN_PROGRESS = Status.DONE, Status.IN_PROGRESS


class Transfer(Closeable):
    """A reusable transfer handle. Not thread-safe: drive one handle from one thread.

    Attributes: ``op`` (READ/WRITE), ``peer`` (remote rank), ``nbytes`` (total), ``transport`` (the backend
    that carries it: ``"nixl"``, ``"cuda_ipc"``, ``"shm"`` or ``"local"``; ``"none"`` when there is nothing to
    move), ``remote_epochs`` (registration epochs of the peer's memory it reaches: what a revocation names),
    ``shared`` (the ``TransferState`` its other threads act on).
    """

    def __init__(self, runtime: Runtime, op: Op, peer: int, nbytes: int, backend: Backend | None,
                 request: Any, notify: bytes | None, uses_cuda: bool = False,
                 remote_epochs: frozenset[int] = frozenset()) -> None:
        self._runtime = runtime
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.transport = backend.name if backend is not None and request is not None else "none"
        self._backend = backend
        self._request = request  # None when there is nothing to move
        self._notify = notify
        self.remote_epochs = remote_epochs
        # The CPU post, bound once (``shared.post_call`` is None when closed, empty or failed for good).
        post_call = None
        if request is not None:
            post_call, self._post_done, self._post_finish, self._post_error = Poster.of(backend, request, notify)
        self.shared = TransferState(post_call)  # state, posts, post call, errors: what other threads touch
        self._posted_on_stream = False
        # Where streams meet a CPU-driven transport's transfer; made here, not inside a CUDA graph capture (where
        # allocating its pinned words is not allowed), when a GPU is involved.
        self._stream_side: StreamSide | None = None
        self._done_seq: DoneSeq | None = None  # its CPU posts completed on streams (the hot path tests it)
        if uses_cuda and self._request is not None and not self._stream_ordered:
            self._streams()
            runtime.start_threads()  # wait(stream=) hands completion to the progress thread and arms its
            # timeout on the deadline thread: have them running before the first
        self._watches: list = []  # progress-thread watches on this transfer's request, drained on close
        self._streams_used: set = set()  # streams this transfer's GPU-side waits were enqueued on
        # Why the last CPU post failed, as its type and message (raised again by wait()): not the exception, whose
        # traceback holds this transfer's frames and the backend's (a cycle that kept a failed transfer, its request
        # and the NIXL agent under it alive after close until a gc pass).
        self._post_failure: tuple[type[Exception], str] | None = None
        self.closed = False

    @property
    def _stream_ordered(self) -> bool:
        return self._backend is not None and self._backend.capabilities.stream_ordered

    # --- posting --------------------------------------------------------------------------------
    def post(self, *, stream: torch.cuda.Stream | None = None) -> None:
        """Start the transfer. Non-blocking (a small or same-host transfer may finish inside the call).

        With ``stream``, the transfer starts when ``stream`` reaches this point (after the kernels that
        produce the data) and the CPU does not wait; CUDA-graph capturable. On a CPU-driven transport (``nixl``,
        ``shm``) each ``post(stream=)`` is followed by exactly one ``wait(stream=)`` before the next one, on a
        stream other than the legacy default stream. Raises ``InvalidArgumentError`` if a CPU-posted transfer is
        still in flight or one of those rules is broken; ``TransferError``/``PeerLostError`` if the backend
        refuses it.
        """
        shared = self.shared
        if (stream is not None or shared.state is _IN_PROGRESS or shared.post_call is None) and (
                self._post_off_the_hot_path(stream)):
            return
        # Hot path: a CPU post of an open, non-empty transfer that is not in flight (a transfer once posted on a
        # stream stays IN_PROGRESS to the CPU, so it never gets here). No lock: see transfer_state.py. Inline, not
        # a helper: post() + wait() are ~1 µs on a 4 KiB shm copy, and a Python call is ~4% of that.
        shared.posts += 1
        shared.posting = True  # before post_call is read: a revocation waits for it (transfer_state.py)
        try:
            result = shared.post_call()  # None once revoked: the TypeError is handled as the revocation
        except Exception as e:  # noqa: BLE001 - the backend says what its exceptions mean
            self._post_failed(shared, e)
        shared.posting = False
        shared.state = state = _DONE if result == self._post_done else self._post_finish(result)
        if state is not _DONE or self._notify is not None or self._done_seq is not None:
            self._after_cpu_post(state)

    def _post_off_the_hot_path(self, stream: torch.cuda.Stream | None) -> bool:
        """The checks and posts the hot path leaves out: raises what makes the post fail, makes a stream post or
        the post of an empty transfer (True: done), or returns False when the CPU post goes ahead."""
        shared = self.shared
        if self.closed or shared.stuck is not None:  # closed (also by closing the communicator) or failed: raise
            self.check_open("post")
        if stream is not None:
            self._post_on_stream(stream)
            return True
        if shared.state is Status.IN_PROGRESS and self._posted_on_stream:
            raise InvalidArgumentError(
                f"post: the {self.op.value} to rank {self.peer} was posted on a stream; a transfer posted on a "
                "stream stays stream-driven: keep using post(stream=)/wait(stream=), or prepare a second transfer "
                "for CPU posts"
            )
        self.refuse_repost_in_flight("post", "")
        self._posted_on_stream = False
        if self._request is None:
            shared.posts += 1
            shared.state = Status.DONE
            return True
        return False

    def refuse_repost_in_flight(self, call: str, kind: str) -> None:
        """Raise ``InvalidArgumentError`` if the last CPU post is still in flight (polls the backend, never
        blocks); ``kind`` names the transfer in the message (``"block "`` for a ``BlockTransfer``)."""
        if self.shared.state is Status.IN_PROGRESS and not self._posted_on_stream and self.status() is _IN_PROGRESS:
            raise InvalidArgumentError(f"{call}: the {kind}{self.op.value} to rank {self.peer} is still in flight; "
                                       "call wait() before posting it again")

    def _post_failed(self, shared: TransferState, e: Exception) -> NoReturn:
        """The backend raised ``e`` from a CPU post: raise what it means for this transfer."""
        shared.posting = False
        if self._done_seq is not None and self._done_seq.active:  # no stream may wait for a post that never
            self._done_seq.advance(shared.posts & 0xFFFFFFFF)  # started
        if shared.stuck is not None:  # revoked between the hot path's check and the call
            raise shared.stuck.with_traceback(None) from None
        # A failed post is not done: a wait() after it must raise, not report the previous post's success.
        shared.state = Status.ERROR
        error = self._peer_lost_or(self._post_error(e), "post")
        self._post_failure = (type(error), str(error))
        try:
            if error is e:
                raise e
            raise error from e
        finally:  # this frame is in the error's traceback: its locals must not hold the error (a cycle)
            del error, e

    def _after_cpu_post(self, state: Status) -> None:
        """A CPU post that did not simply complete: publish it to stream waiters, raise a rejection, notify."""
        if self._done_seq is not None and self._done_seq.active:
            self._done_seq.after_post()
        if state is _DONE and self._notify is None:
            return
        self._after_post()

    def rebind(self, notify: bytes | None, nbytes: int) -> None:
        """The next post carries ``notify`` and moves ``nbytes`` (a block transfer binds new ids to the same request
        before each post). User thread."""
        self._notify, self.nbytes = notify, nbytes

    def _after_post(self) -> None:
        if self.shared.state is Status.ERROR:
            raise TransferError(f"post: the backend {self.transport} rejected the {self.op.value} to rank {self.peer}")
        if self._notify is not None:
            self._notify_after_copy()

    def _drive_until_done(self) -> None:
        """Poll an in-flight transfer from the progress thread. A message channel (NIXL) sends a transfer's
        notification when a status check observes completion, so a sender that goes on to wait for something
        else (its own wait_notification, a barrier) must not leave its notification unsent."""
        backend, request = self._backend, self._request
        self._watch(lambda: backend.status(request) is not Status.IN_PROGRESS)

    def _post_on_stream(self, stream: torch.cuda.Stream) -> None:
        if self._request is not None and not self._stream_ordered:
            cuda.refuse_legacy_default_stream(stream, f"post(stream=) of the {self.op.value} over {self.transport}")
            self._streams().doorbell.ring(stream)
        self._posted_on_stream = True
        self._streams_used.add(stream)
        self.shared.state = Status.IN_PROGRESS
        if self._request is not None and self._stream_ordered:
            self._backend.post(self._request, self._notify, stream)
            if self._notify is not None:
                self._notify_after_copy()

    # --- completion -----------------------------------------------------------------------------
    def status(self) -> Status:
        """DONE, IN_PROGRESS or ERROR; polls the backend (never blocks). For a transfer posted on a stream
        the CPU cannot know: it reports IN_PROGRESS until ``wait(stream=)`` completes on the GPU."""
        self.check_open("status")
        shared = self.shared
        if shared.state is None:
            raise InvalidArgumentError("status: the transfer was never posted; call post() first")
        if shared.state is Status.IN_PROGRESS and not self._posted_on_stream:
            shared.state = self._backend.status(self._request)
        return shared.state

    def wait(self, *, timeout: float | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """Complete the transfer.

        Without ``stream``: block the calling thread (sleeping, not spinning) until done; raises
        ``WaitTimeoutError`` after ``timeout`` seconds (default: the communicator's), ``TransferError`` or
        ``PeerLostError`` if it failed.
        With ``stream``: return at once; work enqueued on ``stream`` afterwards runs after the transfer.
        CUDA-graph capturable together with ``post(stream=)``. For a transport the CPU drives (``nixl``,
        ``shm``), ``stream`` may not be CUDA's legacy default stream (``InvalidArgumentError``: that wait could
        deadlock with the transfer's own CUDA copies), and ``timeout`` (default: the communicator's) bounds the
        stream's wait: a CPU post not done by then releases the stream, warns, and the next call on this
        transfer raises ``WaitTimeoutError``. After ``post(stream=)`` it bounds the later stream posts of this
        handle (the communicator's until a ``wait(stream=, timeout=)``); one that times out leaves the handle
        failed: every call raises, and rings are released without moving bytes until it is closed.
        """
        shared = self.shared
        if shared.state is _DONE and stream is None:  # close() clears the state
            if timeout is not None:
                self._runtime.timeout(timeout)  # still reject a bad timeout
            return  # fast path: small and same-host transfers often complete inside post()
        self.check_open("wait")
        if shared.state is None:
            raise InvalidArgumentError("wait: the transfer was never posted; call post() first")
        if stream is not None:
            return self._wait_on_stream(stream, timeout)
        if self._posted_on_stream:
            raise InvalidArgumentError(
                f"wait: the {self.op.value} to rank {self.peer} was posted on a stream; pass wait(stream=...)"
            )
        if shared.state is Status.ERROR and self._post_failure is not None:
            kind, message = self._post_failure
            raise kind(f"wait: the last post failed, nothing was transferred: {message}")
        if self._stream_ordered:
            # Copies on a stream complete when their event fires: poll it alone, not the backend's status through
            # status() (an eager 4 KiB copy over cuda_ipc is done in a few µs, and each poll counts). What other
            # threads did meanwhile (a revocation, a close, a kept failure) is raised once the copies are done.
            wait_until(self._backend.completion_event(self._request).query, self._runtime.timeout(timeout),
                       self._waiting, self._runtime.config, self._runtime.alive(self.peer, self._waiting))
            self.check_open("wait")
            shared.state = _DONE
            return
        wait_until(lambda: self.status() is not Status.IN_PROGRESS, self._runtime.timeout(timeout), self._waiting,
                   self._runtime.config, self._runtime.alive(self.peer, self._waiting))
        if shared.state is Status.ERROR:
            raise self._peer_lost_or(TransferError(
                f"wait: the {self.op.value} of {self.nbytes} bytes with rank {self.peer} over {self.transport} failed; "
                "the peer may have exited or deregistered the memory"
            ), "wait")

    def _waiting(self) -> str:
        """What a blocking wait waits for, in its timeout's message."""
        return f"wait: {self.op.value} of {self.nbytes} bytes with rank {self.peer} over {self.transport}"

    def _peer_lost_or(self, error: Exception, call: str) -> Exception:
        """``PeerLostError`` instead of a backend's generic failure when the peer is gone (NIXL reports a dead
        peer as ``NIXL_ERR_BACKEND``); ``error`` otherwise."""
        if isinstance(error, PeerLostError) or self.peer == self._runtime.rank or not isinstance(error, TransferError):
            return error
        reason = self._runtime.peer_lost(self.peer, fresh=True)
        if reason is None:
            return error
        return PeerLostError(f"{call}: the {self.op.value} to rank {self.peer} over {self.transport} failed: rank "
                             f"{self.peer} is gone ({reason}); backend said: {error}")

    def _wait_on_stream(self, stream: torch.cuda.Stream, timeout: float | None) -> None:
        stream_timeout_s = self._runtime.timeout(timeout)  # rejects a bad timeout on every transport
        if self._request is None:
            return
        if self._stream_ordered:
            self._streams_used.add(stream)
            event = self._backend.completion_event(self._request)
            if event is not None:
                stream.wait_event(event)
            return
        cuda.refuse_legacy_default_stream(stream, f"wait(stream=) of the {self.op.value} over {self.transport}")
        side = self._streams()
        (side.doorbell if self._posted_on_stream else side.done_seq).wait_on(stream, stream_timeout_s)
        self._streams_used.add(stream)

    def _watch(self, poll) -> None:
        """Have the progress thread poll ``poll`` (until it returns True or this transfer closes)."""
        engine = self._runtime.engine
        self._watches = engine.still_watched(self._watches) + [poll]  # forget finished ones
        engine.watch(poll, on_error=self.shared.fail)  # raised by the next post/status/wait

    def _streams(self) -> StreamSide:
        """Where streams meet this transfer (made once, outside any graph capture where a GPU is involved: see
        ``__init__``)."""
        if self._stream_side is None:
            self._stream_side = StreamSide(self, self.shared, self._runtime, self._backend, self._request,
                                           self._notify, self._watch, self._peer_lost_or)
            self._done_seq = self._stream_side.done_seq
        return self._stream_side

    def _notify_after_copy(self) -> None:
        """A transport with a message channel sends ``notify`` itself once a status check sees the copy complete
        (the progress thread keeps checking); the others hand it to the outbox."""
        if self._backend.capabilities.message_channel:
            if self.shared.state is Status.IN_PROGRESS and not self._posted_on_stream:
                self._drive_until_done()
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise InvalidArgumentError(
                f"post: notify= on the {self.transport} transport cannot be captured in a CUDA graph; "
                "signal the peer from the graph with a transfer over a transport with a message channel (nixl)"
            )
        # Not tied to this handle's lifetime: the copy's event outlives close(), and so does the message.
        backend, request = self._backend, self._request
        self._runtime.outbox.send_after(self.peer, self._notify, lambda: backend.status(request) is Status.DONE)

    # --- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the backend request. Idempotent.

        A CPU-posted transfer still in flight is waited for first (sleeping, bounded by the communicator's
        timeout, and ended early when the peer is gone), so once ``close`` returns no byte of it lands: NIXL
        cannot cancel a READ or WRITE that UCX has started. A peer that is gone moves no more bytes; one that is
        alive but did not complete within the timeout is warned about (``TensorwireWarning``): its bytes may still
        land. A stream post enqueued before ``close`` whose ring comes later is still served (the request is
        released once the GPU work enqueued before ``close`` has run). Never raises for the transfer's own
        failure."""
        if self.closed:
            return
        shared = self.shared
        if shared.state is Status.IN_PROGRESS and not self._posted_on_stream and self._request is not None:
            self._finish_in_flight()
        self.closed = True
        shared.post_call, shared.state = None, None
        request, self._request = self._request, None
        self._runtime.transfers.discard(self)
        if request is None:
            return
        engine = self._runtime.engine
        watches = engine.still_watched(self._watches)
        if not watches:
            if self._stream_side is not None:
                self._stream_side.doorbell.disarm()  # nothing in flight, no ring to serve
            self._backend.release(request)
            return
        # A stream may still be waiting on this transfer (wait(stream=), a doorbell a graph rings): let the
        # progress thread finish what the GPU waits for, then release the request there. Never blocks.
        events = [cuda.record_event(stream) for stream in self._streams_used]
        shared.close_after(events)  # only once recorded: an unrecorded event would read as "done"
        backend = self._backend

        def release_when_drained() -> bool:
            if engine.still_watched(watches):
                return False
            backend.release(request)
            return True

        engine.watch(release_when_drained)

    def _finish_in_flight(self) -> None:
        backend, request, runtime = self._backend, self._request, self._runtime
        what = (f"close: the {self.op.value} of {self.nbytes} bytes with rank {self.peer} over {self.transport} "
                "in flight")
        try:
            wait_until(lambda: backend.status(request) is not Status.IN_PROGRESS, runtime.timeout_s, lambda: what,
                       runtime.config, runtime.alive(self.peer, what))
        except WaitTimeoutError:
            warn_from_progress_thread(f"tensorwire: {what} did not complete within {runtime.timeout_s:.3g}s; it was "
                                      "released, and bytes may still land: close transfers after wait()")
        except Exception:  # noqa: BLE001 - failed or the peer is gone: nothing more lands
            pass

    def revoke(self, error: Exception) -> None:
        """The peer deregistered the memory this transfer reaches: every later call raises ``error``; the CPU
        post's bound call is cleared (the hot path then takes the slow path, which raises), and a stream post's
        doorbell is released without posting (``TransferState.revoke``). The revocation thread calls it."""
        self.shared.revoke(error)

    def posting(self) -> bool:
        """A CPU post of this transfer is on its way into the backend right now (any thread; see
        ``TransferState.posting``): a revocation waits until it is not before it answers."""
        return self.shared.posting

    def request_in_flight(self) -> bool:
        """The backend reports the request in flight (a CPU post, or a stream post the progress thread made);
        False once closed or failed. Polls, never blocks; any thread (a revocation waits on it)."""
        backend, request = self._backend, self._request
        if request is None:
            return False
        try:
            return backend.status(request) is Status.IN_PROGRESS
        except Exception:  # noqa: BLE001 - failed: nothing more lands
            return False

    def check_open(self, fn: str) -> None:
        """Raise what makes a call on this transfer fail: closed, failed for good, or the oldest failure another
        thread kept (raised once). User thread."""
        if self.closed:
            raise ClosedError(f"{fn}: the transfer is closed; prepare a new one with comm.prepare(...)")
        self._runtime.check_open(fn)
        shared = self.shared
        stuck = shared.stuck
        if stuck is not None:
            raise stuck.with_traceback(None)  # the same error each time: do not let its traceback grow
        error = shared.take_error()
        if error is not None:
            raise error

    def _release_local(self) -> None:
        """Garbage-collected open: no post can come any more; the request is released here when nothing is in
        flight and nothing waits on it (a local call), else left to the backend's close (releasing a request
        in flight would mean waiting for it)."""
        shared = self.shared
        self.closed = True
        shared.post_call = None
        request, self._request = self._request, None
        in_flight = shared.state is Status.IN_PROGRESS or shared.posting
        if request is not None and not in_flight and self._stream_side is None and not self._watches:
            self._backend.release(request)

    def _leak_message(self) -> str:
        return (f"a {self.op.value} Transfer to rank {self.peer} was garbage-collected without close(); "
                "call close() or use 'with comm.prepare(...)'")

    def __repr__(self) -> str:
        state = "closed" if self.closed else (self.shared.state.name if self.shared.state else "prepared")
        return (f"Transfer({self.op.value}, peer={self.peer}, nbytes={self.nbytes}, transport={self.transport!r}, "
                f"{state})")
