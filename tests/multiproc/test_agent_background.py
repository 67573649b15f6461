"""NIXL's agent is made on a thread of its own while ``init`` returns: a joining process does its own work
meanwhile; ``register`` waits for the agent; a failure to make it is a typed error at first use, not a hang.

The agent's making is slowed (or failed) in the rank by wrapping ``make_agent``, so the order of events is
forced, not timed."""

from __future__ import annotations

import importlib
import os
import threading
import time

import tensorwire as tw
from tensorwire.testing.data import assert_equal, rank_values, sentinel
from tensorwire.testing.suite import INIT_TIMEOUT, WAIT, launch

nixl_backend = importlib.import_module("tensorwire.backends.nixl")  # ``tw.backends`` is a function
SLOW_S = 4.0  # how long the slowed rank's agent takes: far longer than init and a barrier on this machine


def _slow_agent(done: threading.Event):
    original = nixl_backend.make_agent

    def make(*args, **kwargs):
        time.sleep(SLOW_S)
        agent = original(*args, **kwargs)
        done.set()
        return agent
    nixl_backend.make_agent = make


def _failing_agent():
    def make(*args, **kwargs):
        raise RuntimeError("NIXL_ERR_BACKEND: UCX found no transport (made up by the test)")
    nixl_backend.make_agent = make


# --- rank functions --------------------------------------------------------------------------------
def _join_before_the_agent_then_serve():
    """Rank 1's agent is slow: its init returns first, its register waits, rank 0 reads its bytes."""
    made = threading.Event()
    if os.environ["RANK"] == "1":
        _slow_agent(made)
    comm = tw.init(timeout=INIT_TIMEOUT)
    returned_first = not made.is_set() if comm.rank == 1 else True
    n = 4096
    src, dst = rank_values(comm.rank, n), sentinel(n)
    reg = comm.register([src, dst])  # rank 1: blocks until its agent exists
    comm.publish("src", reg.descs[0])
    peer = 1 - comm.rank
    comm.read(dst, comm.lookup("src", peer, timeout=WAIT), timeout=WAIT)
    assert_equal(dst, rank_values(peer, n), f"rank {comm.rank}: READ from rank {peer}")
    comm.barrier(timeout=WAIT)
    comm.close()
    return returned_first


def _agent_fails():
    _failing_agent()
    comm = tw.init(timeout=INIT_TIMEOUT)
    try:
        comm.register(sentinel(16))
    except tw.BackendUnavailableError as e:
        message = str(e)
    else:
        raise AssertionError("register succeeded although NIXL's agent could not be made")
    comm.close()
    return message, comm.closed


def _close_while_the_agent_is_made():
    made = threading.Event()
    _slow_agent(made)
    comm = tw.init(timeout=INIT_TIMEOUT)
    busy = not made.is_set()
    comm.close()
    return busy, comm.closed


# --- tests -----------------------------------------------------------------------------------------
def test_init_returns_before_the_agent_and_the_member_serves_once_it_exists():
    returned_first = launch(_join_before_the_agent_then_serve, 2)
    assert returned_first == [True, True]


def test_an_agent_that_cannot_be_made_is_a_typed_error_at_first_use():
    for message, closed in launch(_agent_fails, 1):
        assert "UCX found no transport" in message and "tensorwire doctor" in message, message
        assert closed


def test_close_while_the_agent_is_being_made():
    for busy, closed in launch(_close_while_the_agent_is_made, 2):
        assert busy and closed
