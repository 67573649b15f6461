"""Stream completion of CPU-driven transfers (``nixl``, ``shm``): where a GPU stream and the progress thread meet.

Each such transfer has three pinned host words (``cuda.HostWords``) that the CPU stores and a stream waits on
or writes (``cuStreamWaitValue32`` / ``cuStreamWriteValue32``):

* ``done_seq`` (``DoneSeq``): a CPU post's sequence number, stored once that post completed; the stream of
  ``wait(stream=)`` waits for ``done_seq >= k`` (cyclically). It only moves forward.
* ``doorbell`` and ``done_flag`` (``Doorbell``): ``post(stream=)`` makes the stream store 1 into ``doorbell``;
  the progress thread sees it, clears it, posts, and stores 1 into ``done_flag`` on completion; ``wait(stream=)``
  waits for ``done_flag >= 1`` and stores 0 back. Fixed values: the sequence can be captured in a CUDA graph
  and replayed, each replay moving the bytes that are in the buffers then.

A stream is never left waiting past its timeout: the deadline thread (``Deadlines``) stores the value it waits
for, keeps the error for the next call on the transfer and warns; it makes host stores only, so it fires even
while the progress thread is held inside a backend call. Both classes belong to one ``Transfer`` (``owner``,
named in messages) and act on its ``TransferState`` (``shared``: post count, state, kept errors, failed for
good); their stores are serialised with ``shared.lock``. The owner hands them what else they use (the runtime,
its request's status, its progress-thread watch).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from . import cuda
from .backends.base import Op, Status
from .deadlines import warn_from_progress_thread
from .errors import InvalidArgumentError, PeerLostError, TransferError, WaitTimeoutError

if TYPE_CHECKING:
    from .backends.base import Backend
    from .runtime import Runtime
    from .transfer_state import TransferState

__all__ = ["StreamSide", "DoneSeq", "Doorbell", "DOORBELL", "DONE_FLAG", "DONE_SEQ"]

DOORBELL, DONE_FLAG, DONE_SEQ = 0, 1, 2  # word indices in a transfer's words
_MASK = 0xFFFFFFFF  # counters wrap at 2**32, as the GPU compares
_RING_CHECK_MIN_S = 0.02  # the shortest period of a doorbell's check for rings nobody picked up


class Described(Protocol):
    """What the words' owner (a ``Transfer``) tells about itself in messages."""

    op: Op
    nbytes: int
    peer: int
    transport: str


def timed_out(owner: Described, call: str, timeout_s: float, fix: str = "") -> WaitTimeoutError:
    """The error of a stream released by a timeout (its caller also warns: a replayed graph calls no Python)."""
    return WaitTimeoutError(
        f"{call}: the {owner.op.value} of {owner.nbytes} bytes with rank {owner.peer} over {owner.transport} was "
        f"not done after {timeout_s:.3g}s; the stream was released and what it read since is not valid. "
        f"Check the peer, or pass a larger timeout= to wait(stream=){fix}")


class StreamSide:
    """Where streams meet one transfer of a CPU-driven transport: its pinned words (taken once from the runtime's
    slabs), the ``DoneSeq`` of its CPU posts and the ``Doorbell`` of its stream posts. Registered with the runtime,
    which releases every stream still waiting when the communicator closes (``release_stream_waits``)."""

    def __init__(self, owner: Described, shared: TransferState, runtime: Runtime, backend: Backend, request: Any,
                 notify: bytes | None, watch: Callable[[Callable[[], bool]], None],
                 peer_lost_or: Callable[[Exception, str], Exception]) -> None:
        self._shared = shared
        self.words = runtime.transfer_words.take()
        self.done_seq = DoneSeq(owner, shared, self.words, runtime, functools.partial(backend.status, request),
                                watch, peer_lost_or)
        self.doorbell = Doorbell(owner, shared, self.words, runtime, backend, request, notify, watch)
        runtime.stream_waiters.add(self)  # a weak set: it lives as long as its transfer

    def release_stream_waits(self) -> int:
        """Store the values every GPU wait on this transfer is waiting for (the communicator closes); 1 if one was
        still pending, else 0."""
        values, sequence = self.words.values, self._shared.posts & _MASK
        pending = values[DONE_SEQ] != sequence or values[DOORBELL] != 0
        values[DOORBELL], values[DONE_SEQ], values[DONE_FLAG] = 0, sequence, 1
        return int(pending)


class DoneSeq:
    """The CPU posts of one transfer, completed on streams through ``done_seq``.

    Inactive until the first ``wait_on``; from then on every CPU post publishes its own completion (at once,
    or from the progress thread), so a later ``wait(stream=)`` only enqueues the wait."""

    def __init__(self, owner: Described, shared: TransferState, words: cuda.HostWords, runtime: Runtime,
                 status: Callable[[], Status], watch: Callable[[Callable[[], bool]], None],
                 peer_lost_or: Callable[[Exception, str], Exception]) -> None:
        self._owner = owner
        self._shared = shared
        self._words = words
        self._runtime = runtime
        self._status = status  # the request's status (polls the backend)
        self._watch = watch  # has the progress thread poll a function; its failure is kept in ``shared``
        self._peer_lost_or = peer_lost_or  # PeerLostError instead of a failure when the peer is gone
        self.active = False

    def wait_on(self, stream: Any, timeout_s: float) -> None:
        """Make ``stream`` wait for the owner's last CPU post; released by the deadline thread after
        ``timeout_s``. Returns at once."""
        sequence = self._shared.posts & _MASK  # the GPU compares cyclically: (int32)(word - value) >= 0
        self._arm_deadline(sequence, timeout_s)
        cuda.stream_wait_value(stream, self._words.addr(DONE_SEQ), sequence)
        if not self.active:
            # The first stream wait of this handle: publish this post's completion (the wait is enqueued
            # first, so the call does not compete with the woken thread); later posts publish their own.
            self.active = True
            self._watch(self._publisher(sequence))

    def after_post(self) -> None:
        """A CPU post was made: publish its completion now if it is complete, else from the progress thread."""
        sequence = self._shared.posts & _MASK
        if self._shared.state is Status.IN_PROGRESS:
            self._watch(self._publisher(sequence))
        else:
            self.advance(sequence)

    def advance(self, sequence: int) -> None:
        """``done_seq = sequence`` unless it is already there or past it (cyclically). The publisher of post k
        may run after post k + 1 completed and was published (both see the one request), and the word must
        never move back: a stream waiting for k + 1 would then wait forever."""
        with self._shared.lock:
            if not self.published(sequence):
                self._words.values[DONE_SEQ] = sequence
        self._runtime.deadlines.disarm((self, sequence))

    def published(self, sequence: int) -> bool:
        """``done_seq`` has reached ``sequence`` (cyclically)."""
        return (int(self._words.values[DONE_SEQ]) - sequence) & _MASK < 0x80000000

    def _publisher(self, sequence: int):
        """A progress-thread poll that stores ``sequence`` into ``done_seq`` when the request is no longer in
        flight, also when it failed (the error reaches the next call on the owner). A wait that outlives its
        timeout is released by ``_release_late`` instead."""
        owner, shared, status, peer_lost = self._owner, self._shared, self._status, self._runtime.peer_lost

        def publish() -> bool:
            if shared.posts & _MASK != sequence:  # a later CPU post exists, so this one completed (a CPU post is
                self.advance(sequence)  # refused while one is in flight): the request is its now, and its state
                return True  # no longer says anything about this post
            state = status()
            if state is Status.IN_PROGRESS:
                reason = peer_lost(owner.peer)
                if reason is None:
                    return False
                self.advance(sequence)  # it will not complete: release the stream now
                raise PeerLostError(f"wait(stream=): the {owner.op.value} to rank {owner.peer} over {owner.transport} "
                                    f"did not complete: rank {owner.peer} is gone ({reason}); the stream was released "
                                    "and what it read since is not valid")
            self.advance(sequence)
            if state is Status.ERROR:
                raise self._peer_lost_or(TransferError(
                    f"wait(stream=): the {owner.op.value} to rank {owner.peer} over {owner.transport} failed; the "
                    "peer may have exited or deregistered the memory"), "wait(stream=)")
            return True

        return publish

    def _arm_deadline(self, sequence: int, timeout_s: float) -> None:
        """Have the deadline thread release the stream wait for CPU post ``sequence`` after ``timeout_s``.
        Armed first, then disarmed if the post was published already (its publisher may have disarmed it
        just before it was armed): only waits in flight stay in the table."""
        deadlines = self._runtime.deadlines
        key = (self, sequence)
        deadlines.arm(key, time.monotonic() + timeout_s, functools.partial(self._release_late, sequence, timeout_s))
        if self.published(sequence):
            deadlines.disarm(key)

    def _release_late(self, sequence: int, timeout_s: float) -> None:
        """The deadline of the ``wait(stream=)`` of CPU post ``sequence``: if ``done_seq`` has not reached it,
        store it (the stream must not hang) and keep a ``WaitTimeoutError`` for the next call. Runs on the
        deadline thread: host stores only, so it fires even while the progress thread is stuck in NIXL."""
        shared = self._shared
        with shared.lock:
            if self.published(sequence):
                return  # in time
            # Known complete (a later post exists, or this thread saw it done) but not published yet: the
            # progress thread is late, the bytes are right.
            if shared.posts & _MASK != sequence or shared.state is Status.DONE:
                self._words.values[DONE_SEQ] = sequence
                return
            error = timed_out(self._owner, "wait(stream=)", timeout_s)
            shared.fail(error)  # kept before the release
            self._words.values[DONE_SEQ] = sequence
        warn_from_progress_thread(str(error))


class Doorbell:
    """The stream posts of one transfer: rung by a stream, served by the progress thread.

    One ``wait_on`` follows each ``ring`` (one done flag serves each pair). ``timeout_s`` bounds each ring's
    post: the owner's last ``wait(stream=, timeout=)``, the communicator's until then. A ring that times out
    fails the owner for good (``shared.fail_for_good``): every later ring is released at once, moving nothing."""

    def __init__(self, owner: Described, shared: TransferState, words: cuda.HostWords, runtime: Runtime,
                 backend: Backend, request: Any, notify: bytes | None,
                 watch: Callable[[Callable[[], bool]], None]) -> None:
        self._owner = owner
        self._shared = shared
        # Bound now: rings are served after the owner's close() (until the GPU work that rings has run),
        # which clears the owner's request.
        self._backend, self._request, self._notify = backend, request, notify
        self._words = words
        self._runtime = runtime
        self._watch = watch  # has the progress thread poll a function; its failure is kept in ``shared``
        self.timeout_s = runtime.timeout_s
        self.unwaited = False  # rung, and its wait_on not enqueued yet
        self._watching = False
        self._in_flight = False  # the progress thread posted a ring's request and it has not completed
        self._rings_served = 0
        self._unpicked_at_last_check: int | None = None  # rings served then, if a ring was waiting unpicked

    def ring(self, stream: Any) -> None:
        """Make ``stream`` ring when it gets here (the owner's request is posted then). Returns at once."""
        if self.unwaited:
            owner = self._owner
            raise InvalidArgumentError(
                f"post(stream=): the previous post(stream=) of this {owner.op.value} over {owner.transport} was not "
                "waited; call wait(stream=) between two stream posts (one done flag serves each pair)")
        self.unwaited = True
        if not self._watching:
            self._watching = True
            self._watch(self._serve_until_drained)
            self._arm_check()
        cuda.stream_write_value(stream, self._words.addr(DOORBELL), 1)

    def wait_on(self, stream: Any, timeout_s: float) -> None:
        """Make ``stream`` wait for the last ring's completion (and consume its done flag). Returns at once."""
        if not self.unwaited:
            owner = self._owner
            raise InvalidArgumentError(
                f"wait(stream=): the last post(stream=) of this {owner.op.value} over {owner.transport} was already "
                "waited on (its done flag is consumed by that wait); make another stream follow that one instead: "
                "s2.wait_stream(s1)")
        self.unwaited = False
        self.timeout_s = timeout_s
        self._arm_check()  # the new timeout's period, if shorter
        cuda.stream_wait_value(stream, self._words.addr(DONE_FLAG), 1)
        cuda.stream_write_value(stream, self._words.addr(DONE_FLAG), 0)

    def _serve_until_drained(self) -> bool:
        """The progress thread's watch: serve rings until the owner is closed and the GPU work that could still
        ring has run."""
        if not self._in_flight and self._words.values[DOORBELL] == 0 and self._shared.drained():
            return True
        return self._serve()

    def _serve(self) -> bool:
        owner, shared, words = self._owner, self._shared, self._words
        if shared.stuck is not None:  # timed out or revoked: release every stream that rings (and the ring in
            # flight, if any: a revocation waits for it to finish), post nothing more (every call on the handle
            # raises ``shared.stuck``: close it and prepare a new one)
            with shared.lock:
                if words.values[DOORBELL] or self._in_flight:
                    self._in_flight = False
                    words.values[DOORBELL] = 0
                    words.values[DONE_FLAG] = 1
            return shared.drained()
        failure_kept = False
        if self._in_flight:
            state = self._backend.status(self._request)
        elif self._pick_up():
            state = self._post()
            failure_kept = state is Status.ERROR
        else:
            return False
        if state is Status.IN_PROGRESS:
            reason = self._runtime.peer_lost(owner.peer)
            if reason is None:
                return False
            shared.fail(PeerLostError(  # it will not complete: release the stream now
                f"post(stream=): the {owner.op.value} to rank {owner.peer} over {owner.transport} did not complete: "
                f"rank {owner.peer} is gone ({reason}); the bytes that stream consumed are not valid"))
            state, failure_kept = Status.ERROR, True
        return self._complete(state, failure_kept)

    def _pick_up(self) -> bool:
        """Take a pending ring (clear the doorbell) and arm its deadline; False if none is pending."""
        shared = self._shared
        with shared.lock:  # against _release_stuck
            if self._words.values[DOORBELL] == 0 or shared.stuck is not None:
                return False
            self._words.values[DOORBELL] = 0
            self._in_flight = True
            ring = self._rings_served
        self._runtime.deadlines.arm((self, ring), time.monotonic() + self.timeout_s,
                                    functools.partial(self._release_stuck, ring))
        return True

    def _post(self) -> Status:
        """Post the ring's request; a failure is kept for the next call (ERROR)."""
        try:
            return self._backend.post(self._request, self._notify)
        except Exception as e:  # noqa: BLE001 - release the stream: an error must not hang the GPU
            self._shared.fail(e)
            return Status.ERROR

    def _complete(self, state: Status, failure_kept: bool) -> bool:
        """The ring's request completed (or failed): raise the done flag, keep a failure for the next call
        unless one was kept for this ring already."""
        owner, shared = self._owner, self._shared
        with shared.lock:
            if shared.stuck is not None:  # its deadline released the stream already: never release twice
                return shared.drained()
            self._in_flight = False
            ring = self._rings_served
            self._rings_served += 1
            self._words.values[DONE_FLAG] = 1
        self._runtime.deadlines.disarm((self, ring))
        if state is Status.ERROR and not failure_kept:  # kept for the next CPU call on the owner
            shared.fail(TransferError(
                f"post(stream=): the {owner.op.value} to rank {owner.peer} over {owner.transport} failed; the bytes "
                "that stream consumed are not valid"))
        return shared.drained()  # otherwise keep serving future rings (graph replays)

    def _release_stuck(self, ring: int) -> None:
        """The deadline thread, at a ring's deadline: if it was not served, fail the owner for good and release
        the stream. Host stores only."""
        shared = self._shared
        with shared.lock:
            if self._rings_served != ring or shared.stuck is not None:
                return  # served in time
            error = timed_out(self._owner, "post(stream=)", self.timeout_s,
                              "; this transfer is failed now: close it and prepare a new one")
            shared.fail_for_good(error)  # before the release
            self._in_flight = False  # released here: the stuck handle never polls that request again
            self._words.values[DOORBELL] = 0
            self._words.values[DONE_FLAG] = 1
        warn_from_progress_thread(str(error))

    def _arm_check(self) -> None:
        """(Re)arm the unpicked-ring check half the timeout from now, at least ``_RING_CHECK_MIN_S`` (a tiny
        timeout must not turn the check into a spin that takes the GIL from the threads it checks on); an
        earlier check already armed stays."""
        period = max(self.timeout_s / 2, _RING_CHECK_MIN_S)
        self._runtime.deadlines.arm((self, "check"), time.monotonic() + period, self._check_unpicked)

    def _check_unpicked(self) -> None:
        """The deadline thread, every half timeout while rings are served: a ring that waited unpicked at two
        checks in a row (the progress thread is held elsewhere) is released as timed out."""
        if not self._runtime.engine.still_watched([self._serve_until_drained]):
            return
        ring = self._rings_served
        unpicked = self._words.values[DOORBELL] != 0 and not self._in_flight
        if unpicked and self._unpicked_at_last_check == ring:
            self._release_stuck(ring)
        self._unpicked_at_last_check = ring if unpicked else None
        self._arm_check()

    def disarm(self) -> None:
        """No ring can come any more (the owner closed with nothing in flight)."""
        self._runtime.deadlines.disarm((self, "check"))
