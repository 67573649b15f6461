"""The plug-in contract as the registry states it, and the lifetime rule of ``__del__``, without ranks.

* Every registered transport (test ones included) is a class with ``name``, ``capabilities`` and ``create``, in a
  module with ``info()``; each capability that promises methods comes with them (``base.py``'s Protocols).
* ``Closeable.__del__`` warns and releases local resources only: it never calls ``close()`` (which may wait for a
  transfer in flight or talk to peers).
* A ``Runtime.channel`` refuses to send what its prefix would not route back to it.
"""

from __future__ import annotations

import gc
import warnings

import pytest

from tensorwire.backends import registry
from tensorwire.backends.base import Capabilities
from tensorwire.errors import InvalidArgumentError
from tensorwire.lifetime import Closeable
from tensorwire.progress import Inbox
from tensorwire.runtime import Channel

# capability -> the methods a backend declaring it must have (backends/base.py's Protocols)
PROMISES = {
    "message_channel": ("send_notification", "notifications", "loaded_peers"),
    "stream_ordered": ("completion_event",),
    "first_touch": ("touch", "status", "release"),
    "peer_pointers": ("pointer",),
}
EVERY_BACKEND_HAS = ("create", "register", "deregister", "metadata", "load_peer", "reaches", "prepare", "post",
                     "status", "release", "prepare_blocks", "bind_blocks", "close")


@pytest.mark.parametrize("entry", registry.TRANSPORTS + registry.TEST_TRANSPORTS, ids=lambda t: t.name)
def test_a_registered_transport_keeps_the_contract(entry):
    cls = entry.backend_class()
    assert cls.name == entry.name
    assert isinstance(cls.capabilities, Capabilities)
    missing = [m for m in EVERY_BACKEND_HAS if not callable(getattr(cls, m, None))]
    for capability, methods in PROMISES.items():
        if getattr(cls.capabilities, capability):
            missing += [f"{m} ({capability})" for m in methods if not callable(getattr(cls, m, None))]
    assert not missing, f"{entry.name}: {cls.__name__} lacks {missing}"
    assert entry.info().name == entry.name


def test_the_transports_carry_one_remote_message_channel_at_least():
    channels = [t.name for t in registry.TRANSPORTS if t.capabilities.message_channel and t.capabilities.remote]
    assert channels, "no registered transport can carry notifications, revocations and map confirmations"


class _Handle(Closeable):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = False

    def close(self) -> None:
        self.calls.append("close")
        self.closed = True

    def _release_local(self) -> None:
        self.calls.append("release_local")


def test_del_of_an_open_handle_warns_and_releases_locally_without_closing():
    handle = _Handle()
    calls = handle.calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del handle
        gc.collect()
    assert calls == ["release_local"], calls
    assert any(issubclass(w.category, ResourceWarning) and "garbage-collected" in str(w.message) for w in caught)


def test_del_of_a_closed_handle_is_silent():
    handle = _Handle()
    handle.close()
    calls = handle.calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del handle
        gc.collect()
    assert calls == ["close"] and not caught


def test_a_channel_sends_only_what_comes_back_to_it():
    sent = []
    arrivals = [[(3, b"ext:one"), (3, b"user")]]
    inbox = Inbox(lambda: arrivals.pop() if arrivals else [])
    inbox.open_channel(b"ext:")
    channel = Channel(b"ext:", inbox, lambda peer, message: sent.append((peer, message)))
    channel.send(3, b"ext:two")
    with pytest.raises(InvalidArgumentError, match="prefix"):
        channel.send(3, b"two")
    assert sent == [(3, b"ext:two")]
    assert channel.try_pop(3) == b"ext:one"
    assert channel.try_pop(3) is None  # the user's message stays in the default channel
    assert inbox.try_pop(3) == b"user"
